"""14 · API 서버와 스트리밍: prefill fairness stepped side by side on the real engine, then the
learner's own OpenAI-compatible server (engine/entrypoints/server/) on 127.0.0.1 driven by
simulated users over real HTTP, read through its own /metrics (the lab's parts: ui/labs/ch14.py)."""

import streamlit as st

from ui.labs.ch14 import fairness_lab, server_lab
from ui.lesson import render_chapter

CLAIM = (
    "긴 프롬프트가 먼저 줄을 서도, long_prefill_token_threshold(32)를 켜면 짧은 요청들이 긴 "
    "프롬프트의 prefill 조각과 같은 스텝에 실립니다. 그래서 짧은 요청들의 TTFT 평균이 임계값을 "
    "끈 엔진보다 크게 줄어듭니다 (엔진 시계)."
)


def lab() -> None:
    fairness_lab()
    st.divider()
    server_lab()


render_chapter("14", lab, claim=CLAIM)
