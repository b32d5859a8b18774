"""07 · 배칭 기초: one workload on three engines in lockstep (sequential, static batches,
continuous batching); latency, padding waste, idle slots, head-of-line blocking, throughput."""

import streamlit as st

from ui.experiments.ch07 import (
    BATCHING_MODES,
    DEFAULT_BATCH,
    DEFAULT_LATE_STEPS,
    DEFAULT_REQUESTS,
    batching_workload,
    compare_batching,
    late_arrival_ms,
)
from ui.lab import LabContext, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch07 import lab_sides, lab_step_ms, summary_view, workload_note
from ui.lesson import render_chapter
from ui.predict import predict
from ui.simulation import simulation_picker
from ui.widgets import show_code


def lab() -> None:
    st.subheader("같은 워크로드, 세 가지 방식을 나란히")
    spec = simulation_picker("ch07")
    c1, c2, c3 = st.columns(3)
    n = c1.slider("요청 수", 3, 8, DEFAULT_REQUESTS, key="ch07_n")
    batch = c2.slider("배치 크기 (최대 동시 요청 수)", 2, 6, DEFAULT_BATCH, key="ch07_batch")
    late = c3.slider(
        "늦게 오는 요청의 도착 간격 (스텝)", 0, 20, DEFAULT_LATE_STEPS, key="ch07_late_steps"
    )
    step_ms = lab_step_ms(batch, spec) if late else 0.0
    workload = batching_workload(n, late_arrival_ms(late, step_ms or 0.0))
    workload_note(workload, late, step_ms, spec)

    def before(ctx: LabContext) -> None:
        predict(
            "ch07_best",
            "세 방식 중 처리량(토큰/s)이 가장 높은 것은?",
            options=list(BATCHING_MODES),
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch07",
        lab_sides(batch, spec),
        presets=None,
        workload=workload,
        workload_note=workload.describe() + " (도착 시각은 위에)",
        before=before,
        chapter_view=summary_view,
        show_code_panel=False,
    )
    show_code(compare_batching, "방금 실행된 코드 (세 방식 비교, 한 번에 돌리는 판)")


CLAIM = (
    "출력 길이가 크게 다른 요청들을 배치 4로 돌리면, continuous batching은 끝난 요청의 자리를 "
    "다음 스텝에 채워 정적 배칭보다 훨씬 적은 스텝에 끝내고, 세 방식 중 처리량(토큰/s)이 가장 "
    "높습니다."
)


render_chapter("07", lab, claim=CLAIM)
