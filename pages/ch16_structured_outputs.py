"""16 · structured outputs: one request under a grammar and the same request free, stepped side
by side on the real engine; at every step the tokens the mask allows, the top tokens before and
after it, the probability it removed and its time; then the parse rate with and without it."""

import streamlit as st

from engine.structured_output.grammar import StructuredOutputRequest
from engine.worker.model_runner import mask_report
from ui.experiments.ch16 import DEFAULT_MAX_TOKENS, KINDS, presets_of
from ui.lab import LabContext
from ui.lab import lab as engine_lab
from ui.labs.ch16 import KEY, chapter_view, parse_section, predict_allowed, run_button, sides
from ui.lesson import render_chapter
from ui.widgets import show_code

CLAIM = (
    "기본 제약(사람 객체)에서 제약 있는 쪽의 출력은 스키마대로 파싱되고, 제약 없는 쪽은 같은 "
    "부탁을 받고도 코드 울타리(백틱 세 개)와 설명을 붙여 그대로는 파싱되지 않습니다. 마스크는 "
    "스텝마다 어휘 49,152개 중 일부만 허용하고, 모델이 가장 원한 토큰을 지운 스텝에서는 지운 "
    "확률이 눈에 띄게 큽니다."
)


def lab() -> None:
    st.subheader("같은 요청, 문법 제약 있음·없음")
    c1, c2 = st.columns([2, 3])
    kind_label = c1.radio("제약 종류", list(KINDS), horizontal=True, key=f"{KEY}_kind")
    options = presets_of(KINDS[kind_label])
    label = c2.selectbox("제약", list(options), key=f"{KEY}_constraint")
    preset = options[label]
    st.caption(
        "두 엔진은 같은 설정이고, 왼쪽 엔진의 요청에만 제약(문법)이 걸립니다. 프롬프트는 양쪽이 "
        "같고, 말로도 형식을 부탁합니다. 한 번의 **다음 스텝**이 두 엔진을 함께 한 스텝씩 "
        "진행합니다."
    )

    def before(ctx: LabContext) -> None:
        predict_allowed(ctx, ctx.engines[sides(preset)[0].key].model_config.vocab_size)
        run_button(ctx, preset)

    engine_lab(
        KEY,
        sides(preset),
        presets={label: preset.prompt},
        default_max_tokens=DEFAULT_MAX_TOKENS,
        before=before,
        chapter_view=lambda ctx: chapter_view(ctx, preset),
        show_code_panel=False,
    )
    show_code(StructuredOutputRequest.fill_bitmask, "방금 실행된 코드 (문법 → 토큰 마스크)")
    show_code(mask_report, "방금 실행된 코드 (마스크 전후의 상위 토큰과 지운 확률)")
    parse_section(label)


render_chapter("16", lab, claim=CLAIM)
