"""00 · 코스 안내: the journey map, what is real, and a first lab with the standard widgets."""

import pandas as pd
import streamlit as st

from ui.lab import LabContext, first_finished, steps_of
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import get_engine
from ui.widgets import evidence

JOURNEY = [
    ("1", "API 서버", "HTTP 수신, 인증, SSE 스트리밍", "engine/server.py"),
    ("2", "tokenizer", "텍스트 → 토큰 id (채팅 템플릿 포함)", "engine/tokenizer.py"),
    ("3", "엔진 코어", "요청 등록, step() = 스케줄 → 실행 → 갱신", "engine/core.py"),
    ("4", "스케줄러", "이번 스텝에 누구에게 토큰 몇 개, 못 받은 요청은 왜", "engine/scheduler.py"),
    ("5", "KV 캐시 관리자", "블록 배정표, prefix 캐시", "engine/kv_cache.py"),
    (
        "6",
        "실행자 → 워커",
        "스텝을 장치의 워커에 넘김, 가중치·KV 메모리 보유",
        "engine/executor.py, engine/worker.py",
    ),
    (
        "7",
        "모델 러너 → 모델",
        "배치를 텐서로 펼쳐 forward (KV 읽기/쓰기)",
        "engine/model_runner.py, engine/models/llama.py",
    ),
    ("8", "샘플러", "다음 토큰 하나 고르기", "engine/sampler.py"),
    ("9", "출력 처리", "detokenize, 종료 조건", "engine/output.py"),
    ("10", "기록", "여정 이벤트, 스텝 기록 → 이 앱의 그림", "engine/trace.py"),
]


def lab() -> None:
    st.subheader("요청 여정 지도 → 우리 엔진의 파일")
    st.dataframe(
        pd.DataFrame(JOURNEY, columns=["순서", "역할", "하는 일", "모듈"]),
        hide_index=True,
        width="stretch",
    )
    engine = get_engine("main")
    snap = engine.kv_cache_manager.snapshot()
    st.subheader("지금 이 세션의 엔진")
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("장치", str(engine.device))
    c2.metric("dtype", str(engine.dtype).replace("torch.", ""))
    c3.metric("KV 블록", f"{snap.num_used}/{snap.num_blocks}")
    c4.metric("토큰 예산/스텝", engine.config.max_num_batched_tokens)
    cfg = engine.model_config
    evidence(
        "계산값",
        f"KV 캐시 전체 = {snap.num_blocks} 블록 × {snap.block_size} 토큰 = "
        f"{snap.num_blocks * snap.block_size:,} 토큰분",
        formula="블록 수 × 블록 크기",
    )
    st.caption(
        f"모델: {engine.model_dir.name} · {cfg.num_layers}층 · hidden {cfg.hidden_size} · "
        f"KV head {cfg.num_kv_heads} (config.json에서 읽음)"
    )
    st.subheader("첫 실험: 요청 하나를 한 스텝씩")
    st.caption(
        "예측을 적고, 예시 요청을 추가한 뒤 **다음 스텝**을 눌러 보세요. 세 그림이 스텝마다 "
        "갱신됩니다. **N 스텝**, **재생**, **끝까지**, **리셋**도 같은 엔진을 움직입니다."
    )
    engine_lab("main", default_max_tokens=24, before=_predict, chapter_view=_compare)


def _predict(ctx: LabContext) -> None:
    max_tokens = st.session_state.get("main_max_tokens", 24)
    predict(
        "ch00_steps",
        f"max_tokens={max_tokens}인 요청 하나가 혼자 끝나려면 엔진 스텝이 몇 번 필요할까요?",
        unit="스텝",
        locked=ctx.started,
        step=1.0,
    )


def _compare(ctx: LabContext) -> None:
    request = first_finished(ctx.engines["main"])
    if request is None:
        return
    measured = steps_of(ctx.records("main"), request.request_id)
    compare("ch00_steps", measured, "스텝", fmt="{:,.0f}")
    evidence(
        "측정값",
        f"첫 요청이 배정된 스텝 {measured}개 = prefill 스텝 + decode 스텝 "
        f"(출력 {request.num_output_tokens} 토큰)",
        모델=ctx.engines["main"].model_dir.name,
        근거="StepRecord.scheduled",
    )


render_chapter("00", lab)
