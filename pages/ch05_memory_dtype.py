"""05 · 메모리 예산과 dtype: a weights + KV + headroom calculator over real model configs and GPU
memory sizes (계산값, sizes 보고값), and our model loaded in fp32/bf16/fp16 here (측정값)."""

import streamlit as st

from ui.labs.ch05 import calculator, capacity_simulation, measurement
from ui.lesson import render_chapter


def lab() -> None:
    chosen = calculator()
    st.divider()
    capacity_simulation(*chosen)
    st.divider()
    measurement()


render_chapter(
    "05",
    lab,
    claim=(
        "bf16·fp16으로 올린 우리 모델의 가중치 텐서는 fp32의 정확히 절반 바이트입니다(측정). "
        "계산기가 말한 동시 요청 수보다 많은 요청을 한꺼번에 넣으면, 스케줄러는 그보다 많이 "
        "받아들였다가 요청들이 자라며 KV가 모자라 선점합니다(시뮬레이션)."
    ),
)
