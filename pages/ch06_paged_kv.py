"""06 · 블록 단위 KV 관리: the block grid and block tables of live requests (standard lab), and the
same workload under a contiguous max-length reservation vs the engine's paged blocks."""

import streamlit as st

from ui.labs.ch06 import compare_lab, live_lab
from ui.lesson import render_chapter


def lab() -> None:
    live_lab()
    st.divider()
    compare_lab()


render_chapter(
    "06",
    lab,
    claim=(
        "같은 워크로드에서 블록 방식은 실제 토큰이 든 칸의 비율(사용량/예약량)이 요청마다 "
        "max_model_len을 통째로 잡아 두는 연속 예약보다 몇 배 높습니다. 블록은 토큰이 찰 "
        "때마다 16칸씩만 받기 때문입니다."
    ),
)
