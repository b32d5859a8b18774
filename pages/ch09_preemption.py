"""09 · 선점과 스케줄링 정책: a burst that does not fit a small KV cache (who is preempted, where it
waits, what the recompute costs), recompute vs swap on the same arrivals, and FCFS vs priority vs
static batching with a per-priority view of the waiting times; all on the real engine."""

import streamlit as st

from ui.experiments.ch09 import DEFAULT_BLOCKS, PREEMPTION_CODE
from ui.lab import LabContext, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch09 import (
    EXP_BURST,
    EXP_POLICY,
    EXP_SWAP,
    EXPERIMENTS,
    burst_setup,
    burst_view,
    fit_evidence,
    policy_setup,
    policy_view,
    predict_box,
    swap_view,
)
from ui.lesson import render_chapter
from ui.session import current_settings
from ui.simulation import simulation_overrides, simulation_picker
from ui.widgets import show_code


def lab() -> None:
    st.subheader("KV 캐시가 모자랄 때, 누가 양보하나")
    exp = st.radio("실험", EXPERIMENTS, horizontal=True, key="ch09_exp")
    # 시뮬레이션: the same scenario (the same small KV cache) with a large model's computed step
    # times; not for ② (the simulator has no cost for swap copies)
    spec = simulation_picker("ch09") if exp != EXP_SWAP else None
    base = current_settings().to_config()
    c1, c2, c3 = st.columns(3)
    blocks = c1.slider("KV 블록 수", 4, 16, DEFAULT_BLOCKS, key="ch09_blocks")
    sim = simulation_overrides(spec and {**spec, "num_kv_blocks": blocks})
    if exp == EXP_POLICY:
        sides, workload, note = policy_setup(base, blocks, sim, c2, c3)
    else:
        sides, workload, note = burst_setup(exp, base, blocks, sim, c2, c3)
    st.caption(
        note + " 토큰 예산은 128, prefix caching은 꺼 두었습니다(재계산 비용이 가려지지 않도록)."
    )
    fit_evidence(workload, blocks)

    def before(ctx: LabContext) -> None:
        predict_box(exp, workload, ctx.started)
        run_workload_button(ctx, workload)

    views = {EXP_BURST: burst_view, EXP_SWAP: swap_view, EXP_POLICY: policy_view}
    engine_lab(
        "ch09",
        sides,
        presets=None,
        workload=workload,
        workload_note=note,
        before=before,
        chapter_view=views[exp],
        show_code_panel=False,
    )
    for title, function in PREEMPTION_CODE.items():
        show_code(function, f"방금 실행된 코드 ({title})")


CLAIM = (
    "KV 블록 8개(128토큰)에 블록 15개가 필요한 요청 다섯(A–E)이 한꺼번에 오면 선점이 "
    "일어납니다. 스케줄러는 가장 나중에 실행을 시작한 D부터 밀어내고, 밀려난 요청은 K/V를 "
    "다시 계산하느라 유용한 토큰 말고도 토큰을 더 씁니다."
)

render_chapter("09", lab, claim=CLAIM)
