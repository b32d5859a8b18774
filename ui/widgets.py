"""The lab widgets every chapter reuses: request controls, the three plots, the decision table,
streamed texts, evidence labels, the quiz and the "방금 실행된 코드" panel."""

from __future__ import annotations

import datetime as _dt
import inspect
import json
import re
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.trace import StepRecord
from ui import figures
from ui.session import current_engine, get_engine, get_records, get_texts, reset_engine, run_step, run_to_end

LESSONS_DIR = Path(__file__).resolve().parent.parent / "lessons"

PRESETS = {
    "한국어 자기소개": "한국어로 자기소개를 해 주세요.",
    "서울 관광지": "서울에서 가 볼 만한 곳 세 군데를 추천해 주세요.",
    "KV 캐시 설명": "KV 캐시가 무엇인지 한 문장으로 설명해 주세요.",
    "프랑스의 수도 (영어)": "What is the capital of France?",
    "피보나치 (코드)": "Write a Python function that returns the n-th Fibonacci number.",
    "옛날 옛적에 (긴 프롬프트)": "Once upon a time, in a small village by the sea, " * 8 + "there lived",
}

REASON_KO = {
    "token_budget": "토큰 예산 소진",
    "no_free_kv_blocks": "빈 KV 블록 없음",
    "max_num_seqs": "최대 동시 요청 수 도달",
    "preempted": "선점됨 (KV 반납, 나중에 재계산)",
    "static_batch_in_progress": "정적 배치 진행 중 (다음 배치를 기다림)",
}
PHASE_KO = {"prefill": "prefill", "chunked_prefill": "chunked prefill (조각)", "decode": "decode"}

EVIDENCE_KINDS = {
    "측정값": ("blue", "measured"),
    "계산값": ("green", "derived"),
    "보고값": ("orange", "reported"),
}


# -- adding requests and stepping --------------------------------------------------------------

def _playing_key(key: str) -> str:
    return f"_playing_{key}"


def is_playing(key: str = "main") -> bool:
    return bool(st.session_state.get(_playing_key(key)))


def add_request(key: str, prompt: str, max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                seed: int | None = None, chat: bool = True, ignore_eos: bool = False):
    """Queue one request on this session's engine (chat template applied if asked). Returns it or None."""
    engine = current_engine(key)
    text = prompt
    if chat and engine.tokenizer.chat_template:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    try:
        params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                                seed=seed, ignore_eos=ignore_eos)
        request = engine.add_request(text, params)
    except InvalidRequestError as exc:
        st.error(f"요청이 거절되었습니다 ({exc.param}): {exc}")
        return None
    request.display_prompt = prompt  # what the learner typed, for the stream panel
    return request


def request_controls(key: str = "main", default_max_tokens: int = 32, show_custom: bool = True) -> None:
    """Add preset or custom prompts, and the buttons 다음 스텝 / 끝까지 / 재생·일시정지 / 리셋."""
    engine = current_engine(key)
    with st.container(border=True):
        st.markdown("**요청 넣기**")
        c1, c2, c3, c4 = st.columns(4)
        max_tokens = c1.number_input("max_tokens", 1, 512, default_max_tokens, key=f"{key}_max_tokens")
        temperature = c2.slider("temperature", 0.0, 2.0, 0.0, 0.1, key=f"{key}_temperature",
                                help="0이면 greedy (결정적)")
        top_p = c3.slider("top_p", 0.05, 1.0, 1.0, 0.05, key=f"{key}_top_p")
        seed = c4.number_input("seed (0 = 없음)", 0, 2**31 - 1, 0, key=f"{key}_seed")
        sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=int(seed) or None)
        c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
        preset = c1.selectbox("예시 프롬프트", list(PRESETS), key=f"{key}_preset")
        if c2.button("예시 요청 추가", key=f"{key}_add_preset", width="stretch"):
            add_request(key, PRESETS[preset], **sampling)
        if show_custom:
            custom = st.text_area("직접 쓴 프롬프트", key=f"{key}_custom", height=68,
                                  placeholder="예: 부산에 대해 짧게 소개해 주세요.")
            c1, c2 = st.columns([1, 3])
            chat = c2.checkbox("채팅 템플릿 적용", value=True, key=f"{key}_chat")
            if c1.button("요청 추가", key=f"{key}_add_custom", width="stretch"):
                if custom.strip():
                    add_request(key, custom.strip(), chat=chat, **sampling)
                else:
                    st.warning("프롬프트를 입력하세요.")

    c1, c2, c3, c4, c5 = st.columns([1, 1, 1, 1.4, 1])
    if c1.button("다음 스텝", key=f"{key}_step", type="primary", width="stretch"):
        if run_step(key) is None:
            st.toast("처리할 요청이 없습니다. 먼저 요청을 추가하세요.")
    if c2.button("끝까지", key=f"{key}_to_end", width="stretch"):
        run_to_end(key)
        st.session_state[_playing_key(key)] = False
    playing = is_playing(key)
    if c3.button("일시정지" if playing else "재생", key=f"{key}_play", width="stretch"):
        st.session_state[_playing_key(key)] = not playing
        st.rerun()
    c4.select_slider("재생 속도 (초/스텝)", [0.25, 0.5, 1.0, 2.0], value=0.5, key=f"{key}_speed",
                     label_visibility="collapsed")
    if c5.button("리셋", key=f"{key}_reset", width="stretch"):
        st.session_state[_playing_key(key)] = False
        reset_engine(key)
        get_engine(key, **_overrides(key))
    n_live = len(engine.live_requests)
    st.caption(f"재생 속도 {st.session_state.get(f'{key}_speed', 0.5)}초/스텝 · 진행 중 요청 {n_live}개 · "
               f"지금까지 스텝 {len(get_records(key))}개")


def _overrides(key: str) -> dict:
    from ui.session import engine_overrides

    return engine_overrides(key)


# -- the plots -----------------------------------------------------------------------------------

def decision_table(record: StepRecord | None) -> pd.DataFrame:
    """The scheduler's decision of one step: who got how many tokens, and why the others did not."""
    rows = []
    if record is not None:
        for s in record.scheduled:
            rows.append({"요청": s.request_id, "결정": "배정", "국면": PHASE_KO.get(s.phase, s.phase),
                         "토큰 수": s.num_tokens, "이미 계산된 토큰": s.num_computed_tokens,
                         "prefix 히트": s.num_prefix_hit_tokens, "이유": ""})
        for rid, reason in record.unscheduled.items():
            rows.append({"요청": rid, "결정": "선점" if reason == "preempted" else "대기", "국면": "",
                         "토큰 수": 0, "이미 계산된 토큰": None, "prefix 히트": None,
                         "이유": REASON_KO.get(reason, reason)})
        for rid in record.finished:
            for row in rows:
                if row["요청"] == rid:
                    row["결정"] += f" → 완료({record.finished[rid]})"
    return pd.DataFrame(rows, columns=["요청", "결정", "국면", "토큰 수", "이미 계산된 토큰", "prefix 히트", "이유"])


def show_decision(record: StepRecord | None) -> None:
    if record is None:
        st.caption("아직 실행된 스텝이 없습니다.")
        return
    st.markdown(f"**스텝 {record.step}의 결정** — 토큰 {record.total_tokens}/{record.token_budget} 사용, "
                f"실행 {record.num_running} · 대기 {record.num_waiting}, 걸린 시간 {1000 * record.duration:.0f} ms")
    st.dataframe(decision_table(record), hide_index=True, width="stretch")


def stream_texts(key: str = "main") -> None:
    """Each request's text as it grows (what the API server would stream)."""
    engine = st.session_state.get("_engines", {}).get(key, {}).get("engine")
    if engine is None:
        return
    texts = get_texts(key)
    requests = engine.all_requests()
    if not requests:
        st.caption("요청을 추가하면 여기에 생성된 글이 자라납니다.")
        return
    for r in sorted(requests, key=lambda r: r.arrival_time):
        prompt = getattr(r, "display_prompt", None) or r.prompt or ""
        text = texts.get(r.request_id, "")
        state = ("✅ 완료 (" + str(r.finish_reason) + ")") if r.is_finished else (
            "⏳ 대기" if r.status.value in ("waiting", "preempted") else "▶️ 생성 중")
        with st.container(border=True):
            st.markdown(f"**{r.request_id}** · {state} · 프롬프트 {r.num_prompt_tokens} 토큰 → 출력 "
                        f"{r.num_output_tokens} 토큰")
            st.caption(f"프롬프트: {prompt[:200]}")
            st.text(text or "…")


def _lab_body(key: str, show_code_panel: bool) -> None:
    engine = st.session_state.get("_engines", {}).get(key, {}).get("engine")
    records = get_records(key)
    requests = engine.all_requests() if engine is not None else []
    tab1, tab2, tab3 = st.tabs(["요청 여정", "스케줄러 결정", "KV 캐시"])
    with tab1:
        st.plotly_chart(figures.journey_figure(requests), width="stretch", key=f"{key}_journey")
    with tab2:
        st.plotly_chart(figures.schedule_figure(records), width="stretch", key=f"{key}_schedule")
        show_decision(records[-1] if records else None)
    with tab3:
        snapshot = records[-1].kv if records else (engine.kv_cache_manager.snapshot() if engine else None)
        if snapshot is not None:
            st.plotly_chart(figures.kv_grid_figure(snapshot), width="stretch", key=f"{key}_kvgrid")
        if records:
            st.plotly_chart(figures.kv_usage_figure(records), width="stretch", key=f"{key}_kvusage")
    if records and engine is not None:
        last = records[-1]
        from ui.session import conditions_of

        evidence("측정값", f"마지막 스텝 {last.step}: {1000 * last.duration:.1f} ms "
                 f"(forward {1000 * last.timings.get('forward', 0):.1f} ms), 토큰 {last.total_tokens}개",
                 **conditions_of(engine, 배치=f"{len(last.scheduled)}개 요청"))
    st.markdown("**스트리밍된 글**")
    stream_texts(key)
    if show_code_panel:
        from engine.core import EngineCore

        show_code(EngineCore.step)


def lab_plots(key: str = "main", show_code_panel: bool = True) -> None:
    """The three figures (journey, scheduler decisions, KV grid + usage), the current decision table
    and the streamed texts. While 재생 is on, a fragment steps the engine every few tenths of a second."""
    playing = is_playing(key)
    interval = float(st.session_state.get(f"{key}_speed", 0.5)) if playing else None

    @st.fragment(run_every=interval)
    def _live():
        if is_playing(key):
            record = run_step(key)
            if record is None:  # everything finished: stop the timer with a full rerun
                st.session_state[_playing_key(key)] = False
                st.rerun(scope="app")
        _lab_body(key, show_code_panel)

    _live()


# -- evidence, quiz, code ----------------------------------------------------------------------

def evidence(kind: str, text: str, **conditions) -> None:
    """A number with its evidence label: 측정값 (conditions), 계산값 (formula=...), 보고값 (source=...)."""
    if kind not in EVIDENCE_KINDS:
        raise ValueError(f"evidence kind must be one of {list(EVIDENCE_KINDS)}, got {kind!r}")
    color, english = EVIDENCE_KINDS[kind]
    if kind == "측정값":
        conditions.setdefault("날짜", _dt.date.today().isoformat())
    extra = ""
    if kind == "계산값" and "formula" in conditions:
        extra = f" · 공식: `{conditions.pop('formula')}`"
    if kind == "보고값" and "source" in conditions:
        extra = f" · 출처: {conditions.pop('source')}"
    cond = " · ".join(f"{k}={v}" for k, v in conditions.items())
    st.markdown(f":{color}-badge[{kind} ({english})] {text}{extra}" + (f"  \n:gray[조건: {cond}]" if cond else ""))


def _chapter_file(chapter_id: str) -> str:
    digits = re.sub(r"\D", "", str(chapter_id))
    return f"ch{int(digits):02d}"


def load_quiz(chapter_id: str) -> list[dict]:
    path = LESSONS_DIR / f"{_chapter_file(chapter_id)}_quiz.json"
    if not path.is_file():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def _normalize(text: str) -> str:
    return re.sub(r"\s+", "", text).lower()


def check_short_answer(answer: str, accept: list[str]) -> bool:
    given = _normalize(answer)
    return bool(given) and any(_normalize(a) in given or given == _normalize(a) for a in accept)


def quiz(chapter_id: str) -> None:
    """The chapter's questions (lessons/chNN_quiz.json): choice and short answer, with feedback."""
    questions = load_quiz(chapter_id)
    if not questions:
        st.caption("이 장의 확인 문제는 준비 중입니다.")
        return
    cid = _chapter_file(chapter_id)
    for i, q in enumerate(questions, 1):
        with st.container(border=True):
            st.markdown(f"**문제 {i}.** {q['question']}")
            if q.get("kind") == "choice":
                choice = st.radio("답 고르기", q["options"], index=None, key=f"quiz_{cid}_{i}",
                                  label_visibility="collapsed")
                if choice is not None:
                    if q["options"].index(choice) == q["answer"]:
                        st.success("정답입니다. " + q.get("explanation", ""))
                    else:
                        st.error("다시 생각해 보세요. 정답: " + q["options"][q["answer"]] + " — "
                                 + q.get("explanation", ""))
            else:
                answer = st.text_input("답 쓰기", key=f"quiz_{cid}_{i}", label_visibility="collapsed",
                                       placeholder="답을 쓰고 Enter")
                if answer.strip():
                    if check_short_answer(answer, q.get("accept", [])):
                        st.success("정답입니다. " + q.get("explanation", ""))
                    else:
                        st.error("다시 생각해 보세요. 예시 답: " + ", ".join(q.get("accept", [])[:3]) + " — "
                                 + q.get("explanation", ""))


def show_code(obj, title: str = "방금 실행된 코드") -> None:
    """The real source of the engine function just exercised (inspect.getsource)."""
    try:
        source = inspect.getsource(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
        line = inspect.getsourcelines(obj)[1]
        try:
            where = str(path.relative_to(Path(__file__).resolve().parent.parent))
        except ValueError:
            where = str(path)
    except (OSError, TypeError) as exc:
        st.caption(f"소스를 찾을 수 없습니다: {exc}")
        return
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", str(obj)))
    with st.expander(f"🧾 {title}: `{name}` ({where}:{line})"):
        st.code(source, language="python", line_numbers=True)


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call, timed with perf_counter."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start
