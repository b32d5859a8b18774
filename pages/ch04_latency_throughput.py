"""04 · 지연 시간과 처리량: a workload on the real engine, TTFT/TPOT/ITL/E2E per request and as
percentiles, throughput, the conditions of the measurement, and the latest bench JSON if any."""

import streamlit as st

from ui.experiments import ch04
from ui.experiments.common import run_workload
from ui.lab import LabContext, Side, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch04 import RUNS, bench_section, whole_run
from ui.lesson import render_chapter
from ui.predict import predict
from ui.widgets import show_code


def lab() -> None:
    st.subheader("① 워크로드를 실행하고 지연 시간을 재기")
    c1, c2, c3 = st.columns(3)
    n = c1.slider("요청 수", 2, 8, ch04.DEFAULT_REQUESTS, key="ch04_n")
    prompt_len = c2.select_slider(
        "프롬프트 길이 (토큰)", [16, 32, 64, 128], value=ch04.DEFAULT_PROMPT_LEN, key="ch04_prompt"
    )
    out_len = c3.slider("출력 길이 (토큰)", 8, 48, ch04.DEFAULT_OUTPUT_LEN, step=4, key="ch04_out")
    c1, c2 = st.columns(2)
    seqs = c1.slider("최대 동시 요청 수", 1, 8, ch04.DEFAULT_MAX_NUM_SEQS, key="ch04_seqs")
    gap = c2.slider(
        "요청 사이 도착 간격 (ms)", 0, 500, ch04.DEFAULT_GAP_MS, step=50, key="ch04_gap"
    )
    workload = ch04.lab_workload(n, prompt_len, out_len, gap)
    side = Side("ch04", f"동시 {seqs}", ch04.engine_overrides(seqs))

    def before(ctx: LabContext) -> None:
        predict(
            "ch04_tput",
            "이 설정의 출력 토큰 처리량은 몇 토큰/s일까요?",
            unit="토큰/s",
            locked=ctx.started and not ctx.finished,
            step=10.0,
        )
        b1, b2 = st.columns([1, 1])
        with b1:
            run_workload_button(ctx, workload)
        if b2.button("기록 지우기", key="ch04_clear"):
            st.session_state[RUNS] = []

    engine_lab(
        "ch04",
        [side],
        presets=None,
        workload=workload,
        before=before,
        chapter_view=lambda ctx: whole_run(ctx, gap),
        show_code_panel=False,
    )
    show_code(run_workload, "방금 실행된 코드 (워크로드 실행)")
    bench_section(st.session_state.get(RUNS, []))


render_chapter("04", lab, claim=ch04.CLAIM)
