"""02 · 토큰화, prefill, decode: token boundaries, prefill vs decode timing, TTFT vs TPOT."""

import streamlit as st

from ui.labs.ch02 import timing_lab, tokenize_lab, ttft_lab
from ui.lesson import render_chapter
from ui.session import get_engine


def lab() -> None:
    engine = get_engine("ch02")
    tokenize_lab(engine.tokenizer, engine.model_dir)
    st.divider()
    timing_lab()
    st.divider()
    ttft_lab()


render_chapter(
    "02",
    lab,
    claim=(
        "512토큰 프롬프트의 prefill 한 스텝은 decode 한 스텝보다 엔진 시간이 여러 배 더 "
        "듭니다(TTFT ≫ TPOT). 그래도 토큰 하나당으로 나누면 prefill이 decode보다 훨씬 쌉니다."
    ),
)
