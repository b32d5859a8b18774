"""00 · 코스 안내: the journey map, what is real, and a first lab with the standard widgets."""

import pandas as pd
import streamlit as st

from ui.experiments.ch00 import (
    FIRST_MAX_TOKENS,
    FIRST_PROMPT,
    first_workload,
    predicted_steps,
    step_count,
)
from ui.lab import LabContext, first_finished
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import get_engine
from ui.widgets import FINISH_KO, evidence

JOURNEY = [
    ("1", "API 서버", "HTTP 수신, 인증, SSE 스트리밍", "engine/entrypoints/server/"),
    ("2", "tokenizer", "텍스트 → 토큰 id (채팅 템플릿 포함)", "engine/tokenizer.py"),
    ("3", "엔진 코어", "요청 등록, step() = 스케줄 → 실행 → 갱신", "engine/core.py"),
    ("4", "스케줄러", "이번 스텝에 누구에게 토큰 몇 개, 못 받은 요청은 왜", "engine/scheduler.py"),
    ("5", "KV 캐시 관리자", "블록 배정표, prefix 캐시", "engine/kv_cache.py"),
    (
        "6",
        "실행자 → 워커",
        "스텝을 장치의 워커에 넘김, 가중치·KV 메모리 보유",
        "engine/executor/abstract.py, engine/worker/worker.py",
    ),
    (
        "7",
        "모델 러너 → 모델",
        "배치를 텐서로 펼쳐 forward (KV 읽기/쓰기)",
        "engine/worker/model_runner.py, engine/models/llama.py",
    ),
    ("8", "샘플러", "다음 토큰 하나 고르기", "engine/sample/sampler.py"),
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
        "예측을 적고 **워크로드 넣기**로 요청 하나를 넣은 뒤 **다음 스텝**을 눌러 보세요. 세 "
        "그림이 스텝마다 갱신됩니다. **N 스텝**, **재생**, **끝까지**, **리셋**도 같은 엔진을 "
        "움직입니다. 예시 프롬프트로 요청을 더 넣어 볼 수도 있습니다."
    )
    max_tokens = int(st.session_state.get("main_max_tokens", FIRST_MAX_TOKENS))
    engine_lab(
        "main",
        default_max_tokens=FIRST_MAX_TOKENS,
        workload=first_workload(engine, max_tokens),
        workload_note=(
            f"워크로드: '{FIRST_PROMPT}' 요청 하나 (채팅 템플릿 포함), 출력 정확히 "
            f"{max_tokens} 토큰 (종료 토큰이 나와도 멈추지 않음, ignore_eos; 출력 수는 아래 "
            "max_tokens 칸을 따름)"
        ),
        before=_predict,
        chapter_view=_compare,
    )


def _predict(ctx: LabContext) -> None:
    max_tokens = st.session_state.get("main_max_tokens", FIRST_MAX_TOKENS)
    predict(
        "ch00_steps",
        f"max_tokens={max_tokens}인 요청 하나가 혼자 끝나려면 엔진 스텝이 몇 번 필요할까요? "
        "(워크로드의 요청은 종료 토큰을 무시하고 max_tokens까지 갑니다)",
        unit="스텝",
        locked=ctx.started,
        step=1.0,
    )


def _compare(ctx: LabContext) -> None:
    engine = ctx.engines["main"]
    request = first_finished(engine)
    if request is None:
        return
    count = step_count(ctx.records("main"), request)
    compare("ch00_steps", count.steps, "스텝", fmt="{:,.0f}")
    if count.stopped_early:
        st.info(
            f"이 요청은 {count.output_tokens}번째 토큰으로 종료 토큰(EOS)을 내어 "
            f"max_tokens={count.max_tokens}보다 일찍 끝났습니다. 그래서 스텝도 "
            f"{count.steps}번입니다. max_tokens까지 갔다면 {count.full_length_steps} 스텝이었을 "
            "것입니다 (계산값: prefill 스텝 + max_tokens − 1). 정확히 max_tokens개를 보려면 "
            "**워크로드 넣기**로 종료 토큰을 무시하는 요청을 넣으세요.",
            icon=":material/info:",
        )
    reason = FINISH_KO.get(count.finish_reason, count.finish_reason)
    budget = engine.config.max_num_batched_tokens
    rule = predicted_steps(count.num_prompt_tokens, count.output_tokens, budget)
    evidence(
        "측정값",
        f"첫 요청이 배정된 스텝 {count.steps}개 = prefill {count.prefill_steps} 스텝 + decode "
        f"{count.decode_steps} 스텝 (프롬프트 {count.num_prompt_tokens} 토큰, 출력 "
        f"{count.output_tokens} 토큰, 종료 이유: {reason})",
        모델=engine.model_dir.name,
        근거="StepRecord.scheduled",
    )
    evidence(
        "계산값",
        f"규칙 (요청이 혼자일 때): ⌈{count.num_prompt_tokens} ÷ {budget}⌉ + "
        f"{count.output_tokens} − 1 = {rule} 스텝",
        formula="⌈프롬프트 토큰 ÷ 토큰 예산⌉ (prefill, 첫 토큰까지) + 출력 토큰 − 1 (decode)",
    )


render_chapter(
    "00",
    lab,
    claim=(
        f"종료 토큰을 무시하는 max_tokens={FIRST_MAX_TOKENS} 요청 하나는 정확히 "
        f"{FIRST_MAX_TOKENS} 스텝을 받습니다: prefill 한 스텝이 프롬프트를 계산하며 첫 토큰을 "
        "내고, decode 스텝마다 토큰이 하나씩 더해집니다."
    ),
)
