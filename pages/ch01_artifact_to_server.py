"""01 · 학습된 모델에서 추론 서버까지: the artifact inspector and one real HTTP request traced."""

import streamlit as st

from ui.labs.ch01 import artifact_inspector, http_lab
from ui.lesson import render_chapter


def lab() -> None:
    artifact_inspector()
    st.divider()
    http_lab()


render_chapter(
    "01",
    lab,
    claim=(
        "디스크의 가중치 파일에서 센 파라미터 수는 config.json의 숫자만으로 계산한 수와 "
        "같습니다. HTTP 요청 하나는 서버 수신 → tokenize → 대기열 → 스케줄링 → 첫 토큰 → "
        "완료를 차례로 지나고, 그 여정이 엔진 기록에 순서대로 남습니다."
    ),
)
