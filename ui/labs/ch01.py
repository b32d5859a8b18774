"""Chapter 01's lab parts (Streamlit): the artifact inspector (tokenizer, parameters, bytes by
dtype) and one real HTTP request to the learner's own server, traced through the engine (its
response chunks, its journey, the step views). The page composes them; what they compute is in
ui/experiments/ch01.py."""

import dataclasses
import json

import pandas as pd
import plotly.express as px
import streamlit as st

from engine.artifact import DTYPE_BYTES, inspect_artifact
from ui import figures
from ui.experiments.ch01 import (
    HTTP_MAX_TOKENS,
    HTTP_PROMPT,
    HttpResult,
    derived_param_count,
    send_http_request,
)
from ui.lab import input_notes, number_field, show_decision
from ui.predict import compare, predict
from ui.session import build_engine, conditions_of, current_settings
from ui.widgets import evidence, show_code

STAGE_MODULE = {
    "arrival": ("API 수신", "engine/entrypoints/server/app.py"),
    "tokenized": ("tokenize (채팅 템플릿 → 토큰 id)", "engine/tokenizer.py, engine/core.py"),
    "queued": (
        "대기열 (엔진 스레드가 받아 줄 세움)",
        "engine/entrypoints/llm.py (AsyncLLM) → engine/scheduler.py",
    ),
    "scheduled": ("스케줄링 (토큰 예산, KV 블록)", "engine/scheduler.py, engine/kv_cache.py"),
    "first_token": (
        "첫 토큰 (forward + 샘플링)",
        "engine/executor/abstract.py → worker.py → model_runner.py → models/llama.py, sampler.py",
    ),
    "token": (
        "토큰 (decode forward + 샘플링)",
        "engine/worker/model_runner.py, engine/sample/sampler.py",
    ),
    "streamed": ("detokenize → 스트림 조각", "engine/output.py, engine/tokenizer.py"),
    "preempted": ("선점", "engine/scheduler.py"),
    "resumed": ("재개", "engine/scheduler.py"),
    "finished": ("완료 (블록 반납)", "engine/core.py, engine/kv_cache.py"),
}


@st.cache_data(show_spinner=False)
def _artifact(model: str):
    return inspect_artifact(model or None)


def artifact_inspector() -> None:
    st.subheader("① 아티팩트 검사기")
    info = _artifact(current_settings().model)
    c = info.config
    st.caption(f"경로: `{info.path}`")
    cols = st.columns(5)
    for col, (label, value) in zip(
        cols,
        [
            ("층 수", info.num_layers),
            ("hidden", c["hidden_size"]),
            ("query heads", c["num_attention_heads"]),
            ("KV heads", info.num_kv_heads),
            ("head_dim", info.head_dim),
        ],
    ):
        col.metric(label, value)
    cols = st.columns(4)
    cols[0].metric("어휘 크기", f"{info.vocab_size:,}")
    cols[1].metric("intermediate", c.get("intermediate_size"))
    cols[2].metric("최대 위치", c.get("max_position_embeddings"))
    cols[3].metric("임베딩 공유(tied)", "예" if c.get("tie_word_embeddings") else "아니오")
    st.caption("위 숫자는 config.json에서 그대로 읽은 값입니다 (아티팩트의 선언).")
    _tokenizer_summary(info)
    _parameters(info)
    _bytes_by_dtype(info)
    show_code(inspect_artifact, "방금 실행된 코드 (아티팩트 검사)")


def _tokenizer_summary(info) -> None:
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(info.path)
    special = [
        {"역할": k, "토큰": v, "id": tok.token_to_id(v)} for k, v in info.special_tokens.items()
    ]
    st.markdown(
        f"**tokenizer**: 어휘 {tok.vocab_size:,}개, 채팅 템플릿 "
        f"{'있음' if tok.chat_template else '없음'}, 특수 토큰:"
    )
    st.dataframe(pd.DataFrame(special), hide_index=True)


def _parameters(info) -> None:
    """Parameters by kind: counted in the weights file beside derived from config.json alone."""
    derived = derived_param_count(info.config)
    rows = []
    for kind, counted in info.params_by_kind.items():
        rows.append(
            {
                "종류": kind,
                "파일에서 센 수": counted,
                "config로 계산한 수": derived.get(kind, 0),
                "비율(%)": round(100 * counted / info.num_params, 1),
            }
        )
    df = pd.DataFrame(rows)
    c1, c2 = st.columns([3, 2])
    c1.dataframe(df, hide_index=True, width="stretch")
    fig = px.pie(df, names="종류", values="파일에서 센 수", title="종류별 파라미터", hole=0.4)
    fig.update_layout(height=260, margin=dict(l=0, r=0, t=40, b=0))
    c2.plotly_chart(fig, key="ch01_params_pie")
    evidence(
        "측정값",
        f"파라미터 {info.num_params:,}개 (model.safetensors 헤더의 텐서 모양을 곱해 더함)",
        파일="model.safetensors",
        모델=info.path.name,
    )
    evidence(
        "계산값",
        f"config만으로 {sum(derived.values()):,}개",
        formula="V·h (임베딩, tied) + L·(h·n_q·d + 2·h·n_kv·d + n_q·d·h) + L·3·h·i + (2L+1)·h",
    )


def _bytes_by_dtype(info) -> None:
    """Weight bytes per dtype (계산값) and the files on disk (측정값)."""
    rows = [
        {
            "dtype": d,
            "바이트/파라미터": b,
            "가중치 바이트": info.bytes_at(d),
            "MiB": round(info.bytes_at(d) / 2**20, 1),
        }
        for d, b in DTYPE_BYTES.items()
    ]
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    evidence(
        "계산값",
        f"fp32 {info.bytes_at('float32') / 2**20:,.1f} MiB · bf16 "
        f"{info.bytes_at('bfloat16') / 2**20:,.1f} MiB",
        formula="가중치 바이트 = 파라미터 수 × dtype 바이트",
    )
    disk = info.file_sizes
    st.dataframe(pd.DataFrame([{"파일": k, "바이트": v} for k, v in disk.items()]), hide_index=True)
    evidence(
        "측정값",
        f"디스크 위 아티팩트 {info.bytes_on_disk:,} B ({info.bytes_on_disk / 2**20:,.1f} MiB), "
        f"저장 dtype {'/'.join(info.stored_dtypes)}",
        측정="파일 크기 (os.stat)",
        경로=str(info.path),
    )


# -- one real HTTP request -------------------------------------------------------------------------


def _server():
    """This session's in-process API server with its own engine (started on first use)."""
    state = st.session_state.get("_ch01_server")
    if state is not None and state["handle"].thread.is_alive():
        return state
    try:
        from engine.entrypoints.llm import AsyncLLM
        from engine.entrypoints.server.app import start_server_in_thread
    except ImportError as exc:  # the server module is not there (yet)
        st.warning(f"API 서버 모듈(engine/entrypoints/server/)을 불러올 수 없습니다: {exc}")
        return None
    with st.spinner("인프로세스 API 서버를 시작하는 중… (127.0.0.1, 빈 포트)"):
        engine = build_engine(current_settings())
        records = []
        async_llm = AsyncLLM(engine)
        async_llm.step_listeners.append(records.append)
        handle = start_server_in_thread(async_llm, host="127.0.0.1", port=0)
    state = {"handle": handle, "engine": engine, "records": records, "async_llm": async_llm}
    st.session_state["_ch01_server"] = state
    return state


def http_lab() -> None:
    st.subheader("② 실제 HTTP 요청 하나, 모든 컴포넌트를 지나며")
    st.caption(
        "같은 프로세스 안에서 OpenAI 호환 서버(engine/entrypoints/server/)가 127.0.0.1의 빈 "
        "포트로 뜹니다. "
        "서버는 이 세션 전용 엔진을 따로 가집니다."
    )
    c1, c2 = st.columns([3, 1])
    prompt = c1.text_input("보낼 메시지", HTTP_PROMPT, key="ch01_prompt")
    max_tokens = number_field(c2, "max_tokens", "ch01_max_tokens", HTTP_MAX_TOKENS, 1, 128)
    input_notes("ch01_max_tokens")
    predict(
        "ch01_ttft", "이 요청의 서버 안 TTFT(도착 → 첫 토큰)는 몇 ms일까요?", unit="ms", step=10.0
    )
    if st.button("HTTP 요청 보내기 (stream=True)", key="ch01_send", type="primary"):
        state = _server()
        if state is not None:
            with st.spinner("요청을 보내고 SSE 조각을 받는 중…"):
                try:
                    sent = send_http_request(state["handle"].url, prompt, int(max_tokens))
                    st.session_state["_ch01_result"] = dataclasses.asdict(sent)
                except Exception as exc:  # noqa: BLE001 - show any transport error to the learner
                    st.error(f"HTTP 요청 실패: {exc!r}")
    stored = st.session_state.get("_ch01_result")  # a plain dict of HttpResult's fields
    state = st.session_state.get("_ch01_server")
    if not stored or not state:
        st.info("버튼을 누르면 실제 HTTP 요청이 서버로 가고, 그 여정이 아래에 그려집니다.")
        return
    result = HttpResult(**stored)
    _show_response(result, state["handle"].url)
    engine = state["engine"]
    request = engine.get_request(result.request_id) if result.request_id else None
    if request is None:
        st.warning("서버 엔진에서 이 요청의 기록을 찾지 못했습니다.")
        return
    _show_journey(request, engine)
    _show_views(request, engine, state["records"])
    if st.button("서버 멈추기", key="ch01_stop"):
        state["handle"].stop()
        state["async_llm"].shutdown()
        st.session_state.pop("_ch01_server", None)
        st.session_state.pop("_ch01_result", None)
        st.rerun()


def _chunk_rows(result: HttpResult) -> list[dict]:
    """One row per SSE chunk: when it arrived (ms after sending) and its text delta."""
    rows = []
    for c in result.chunks:
        data = c["data"]
        delta = ""
        if data != "[DONE]":
            ch = (json.loads(data).get("choices") or [{}])[0]
            delta = ch.get("delta", {}).get("content") or (
                f"finish_reason={ch.get('finish_reason')}" if ch.get("finish_reason") else ""
            )
        rows.append(
            {"받은 시각 (ms)": round(1000 * (c["t"] - result.start), 1), "조각": delta or data[:40]}
        )
    return rows


def _show_response(result: HttpResult, url: str) -> None:
    """What the client got: the status, the joined text, every SSE chunk."""
    st.markdown(
        f"`POST {url}/v1/chat/completions` → HTTP **{result.status}**, "
        f"SSE 조각 **{len(result.chunks)}개**, 요청 id `{result.request_id}`"
    )
    st.markdown("**클라이언트가 받은 글 (스트리밍 조각을 이어 붙임)**")
    st.text(result.text or "(빈 응답)")
    with st.expander(f"HTTP 응답 조각 {len(result.chunks)}개 (data: …)", expanded=False):
        st.dataframe(pd.DataFrame(_chunk_rows(result)), hide_index=True, width="stretch")


def _show_journey(request, engine) -> None:
    """The server engine's journey events of the request, its TTFT and the prediction."""
    t0 = request.arrival_time
    journey = [
        {
            "시각 (ms)": round(1000 * (e.time - t0), 2),
            "이벤트": e.kind,
            "단계": STAGE_MODULE.get(e.kind, (e.kind, ""))[0],
            "스텝": e.step,
            "처리한 모듈": STAGE_MODULE.get(e.kind, ("", "?"))[1],
            "세부": ", ".join(f"{k}={v}" for k, v in e.detail.items()),
        }
        for e in request.journey
    ]
    st.markdown("**서버 엔진이 남긴 이 요청의 여정** (`engine/trace.py`의 여정 이벤트)")
    st.dataframe(pd.DataFrame(journey), hide_index=True, width="stretch", height=260)
    m = request.metrics(clock="wall")  # a server request: wall time is what its client waited
    ttft = 1000 * m.ttft if m.ttft is not None else float("nan")
    e2e = 1000 * m.e2e if m.e2e is not None else float("nan")
    evidence(
        "측정값",
        f"서버 안 TTFT {ttft:.0f} ms, E2E {e2e:.0f} ms (벽시계, 도착 = HTTP 수신 시각부터), "
        f"프롬프트 {m.num_prompt_tokens} 토큰 → 출력 {m.num_output_tokens} 토큰",
        **conditions_of(engine, 배치="요청 1개", 경로="HTTP 127.0.0.1", 시계="벽시계"),
    )
    compare("ch01_ttft", ttft, "ms", fmt="{:,.0f}")


def _show_views(request, engine, records) -> None:
    """The lab's three views for this one request, from the server engine's step records."""
    request_id = request.request_id
    st.caption(
        f"요청 id `{request_id}`는 그림과 표에서 짧은 이름(req-0)으로 보입니다. 전체 id는 그림의 "
        "말풍선(hover)에 있습니다."
    )
    own = [
        r for r in records if request_id in r.num_scheduled_tokens or request_id in r.unscheduled
    ]
    tab1, tab2, tab3 = st.tabs(["요청 여정", "스케줄러 결정", "KV 캐시"])
    with tab1:
        st.plotly_chart(figures.journey_figure([request]), key="ch01_journey")
    with tab2:
        st.plotly_chart(figures.schedule_figure(own), key="ch01_schedule")
        if own:
            show_decision(own[0], figures.short_names([request_id]))
    with tab3:
        snap = own[-2].kv if len(own) >= 2 else engine.kv_cache_manager.snapshot()
        st.caption("마지막 스텝 직전의 KV 블록 (요청이 끝나면 블록은 반납됩니다)")
        st.plotly_chart(figures.kv_grid_figure(snap), key="ch01_kvgrid")
        st.plotly_chart(figures.kv_usage_figure(own), key="ch01_kvusage")
    from engine.core import EngineCore

    show_code(EngineCore.step)
