"""11 · 양자화와 dtype: the same request on float32, bfloat16, int8 and int4 engines stepped side
by side (bytes read per decode step, measured step time, greedy agreement), the quality measured
against float32, and where quantization visibly loses."""

import streamlit as st

from engine.kernels.quant import quantize_int4, quantize_int8
from ui.experiments.ch11 import (
    DEFAULT_BATCH,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT_LEN,
    DEFAULT_SIDES,
    VARIANTS,
    decode_workload,
)
from ui.lab import LabContext, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch11 import CHOICES, bench_sections, has_gguf, quality_section, sides, summary_view
from ui.lesson import render_chapter
from ui.predict import predict
from ui.widgets import show_code

CLAIM = (
    "동시 요청 1개에서 int8과 int4 엔진은 float32가 읽는 가중치 바이트의 약 1/4과 1/5만 "
    "읽습니다. 토큰이 float32와 갈라지는 곳은 float32 자신이 망설이는(1·2순위 로짓 차가 아주 "
    "작은) 위치이고, int4(그룹 32)의 선형층 가중치는 float32와 똑같습니다: 이 모델의 float32가 "
    "원래 그 4비트 격자에서 왔기 때문입니다."
)


def lab() -> None:
    st.subheader("같은 요청, 다른 숫자: float32 · bfloat16 · int8 · int4")
    options = list(VARIANTS) if has_gguf() else [v for v in VARIANTS if "gguf" not in v]
    c1, c2, c3 = st.columns([2, 1, 1])
    labels = c1.multiselect(
        "비교할 엔진 (최대 3개)",
        options,
        default=list(DEFAULT_SIDES),
        max_selections=3,
        key="ch11_sides",
    )
    batch = c2.slider("동시 요청 수", 1, 8, DEFAULT_BATCH, key="ch11_batch")
    max_tokens = c3.slider("출력 토큰 수", 8, 64, DEFAULT_MAX_TOKENS, step=8, key="ch11_tokens")
    if not labels:
        st.info("비교할 엔진을 하나 이상 고르세요.")
        return
    workload = decode_workload(DEFAULT_PROMPT_LEN, max_tokens, batch)
    st.caption(
        f"워크로드: {DEFAULT_PROMPT_LEN}토큰 프롬프트 {batch}개가 함께 도착, 각각 "
        f"{max_tokens}토큰을 greedy로 생성합니다. 한 스텝에 모든 엔진이 한 번씩 실행됩니다."
    )

    def before(ctx: LabContext) -> None:
        predict(
            "ch11_speed",
            f"동시 요청 {batch}개일 때, int8 엔진의 decode 스텝은 float32 엔진과 비교해 어떨까?",
            options=CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch11",
        sides(labels),
        presets=None,
        workload=workload,
        before=before,
        chapter_view=summary_view,
        show_code_panel=False,
    )
    show_code(quantize_int8, "int8 양자화: 행마다 scale 하나")
    show_code(quantize_int4, "int4 양자화: 묶음마다 scale과 min")
    quality_section()
    bench_sections()


render_chapter("11", lab, claim=CLAIM)
