"""08 · continuous batching과 토큰 단위 스케줄링: a long prompt arriving while others decode, with
chunked prefill on and off under the same token budget, stepped side by side on the real engine."""

import streamlit as st

from engine.scheduler import Scheduler
from ui.experiments.ch08 import ITL_CHOICES, long_prompt_workload
from ui.lab import LabContext, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch08 import budget_sweep_view, lab_settings, lab_sides, off_note, summary_view
from ui.lesson import render_chapter
from ui.predict import predict
from ui.simulation import DEFAULT_HARDWARE, DEFAULT_MODEL_PRESET, simulation_picker
from ui.widgets import show_code


def lab() -> None:
    st.subheader("긴 프롬프트가 decode 중인 요청들 사이에 끼어들 때")
    spec = simulation_picker("ch08")
    budget, seqs, long_len, arrival, labels = lab_settings(spec)
    workload = long_prompt_workload(long_len, long_arrival_ms=float(arrival))
    st.caption(
        f"워크로드: 짧은 요청 3개(프롬프트 16, 출력 40)가 먼저 오고, {arrival} ms 뒤(엔진 시계) "
        f"{long_len}토큰 프롬프트 하나(출력 {workload.requests[-1].max_tokens})가 도착합니다."
    )
    sides = lab_sides(labels, budget, seqs, spec)
    off_note(sides, budget)

    def before(ctx: LabContext) -> None:
        predict(
            "ch08_itl",
            "chunked prefill을 켜면, 끌 때에 비해 짧은 요청들의 ITL 최대(가장 긴 토큰 간격)는?",
            options=ITL_CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch08",
        sides,
        presets=None,
        workload=workload,
        before=before,
        chapter_view=summary_view,
        show_code_panel=False,
    )
    # the sweep runs the simulator whatever the lab above runs (its presets, or the defaults)
    budget_sweep_view(spec or {"model_preset": DEFAULT_MODEL_PRESET, "hardware": DEFAULT_HARDWARE})
    show_code(Scheduler.schedule, "방금 실행된 코드 (스케줄러의 결정)")


CLAIM = (
    "짧은 요청 셋이 decode하는 사이에 긴 프롬프트가 들어오면, chunked prefill을 켠 엔진은 그 "
    "프롬프트를 예산 크기로 나눠 넣어 짧은 요청들의 가장 긴 토큰 간격(ITL 최대)을 끈 엔진보다 "
    "크게 줄입니다."
)


render_chapter("08", lab, claim=CLAIM)
