"""The one lab component every chapter uses.

    lab("ch07", sides=[Side("ch07_seq", "순차 실행", {...}), ...], workload=..., chapter_view=...)

- add requests (preset or typed, or a chapter's workload whose arrivals sit on the engine clock),
- 다음 스텝 / N 스텝 / 재생 (with a speed) / 끝까지 / 리셋,
- the same three live views for every engine: journey swimlanes, scheduler decisions (token bars
  + the decision table with Korean reasons), KV block grid + occupancy over the steps,
- two or three engines side by side in lockstep (one 다음 스텝 advances each),
- a slot for the chapter's own view and its predict → run → compare box.

The component runs inside st.fragment: a step reruns the lab only, not the lesson around it; of
the three views only the open tab is drawn, its figures sent as plain dicts with the journey kept
between clicks (views()).
Engine errors become Korean messages (ui.errors); the page stays usable.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import streamlit as st

from engine.core import EngineCore
from engine.trace import StepRecord
from ui import figures
from ui.errors import show_error
from ui.registry import apply_step_threads
from ui.experiments.common import Workload, WorkloadFeeder
from ui.session import (
    conditions_of,
    engine_status,
    get_engine,
    get_records,
    get_texts,
    record_step,
    reset_engine,
)

ACTIVE_KEY = "_active_engine_key"  # the engine the sidebar's 엔진 상태 shows (the page's lab)
_FEEDERS = "_lab_feeders"  # engine key → WorkloadFeeder
_PLAYING = "_playing_{}"
_JOURNEYS = "_lab_journeys"  # engine key → (id of its engine, figures.JourneyBuilder)
SPEEDS = [0.25, 0.5, 1.0, 2.0]
MAX_STEPS = 2000

# English prompts first: the 135M default model answers them sensibly (its Korean is poor, as
# chapter 00 says); the Korean ones are there to watch the tokenizer and the mechanics.
PRESETS = {
    "프랑스의 수도 (영어)": "What is the capital of France?",
    "피보나치 (코드)": "Write a Python function that returns the n-th Fibonacci number.",
    "한국어 자기소개": "한국어로 자기소개를 해 주세요.",
    "서울 관광지": "서울에서 가 볼 만한 곳 세 군데를 추천해 주세요.",
    "KV 캐시 설명": "KV 캐시가 무엇인지 한 문장으로 설명해 주세요.",
    "옛날 옛적에 (긴 프롬프트)": "Once upon a time, in a small village by the sea, " * 8
    + "there lived",
}


@dataclass
class Side:
    """One engine of a lab: its session key, its label in a comparison, its config overrides."""

    key: str
    label: str = ""
    overrides: dict = field(default_factory=dict)


@dataclass
class LabContext:
    """What a chapter's own view gets: the engines, their records and workload feeders."""

    key: str
    sides: list[Side]
    engines: dict[str, EngineCore]
    feeders: dict[str, WorkloadFeeder | None]

    def records(self, side: Side | str) -> list[StepRecord]:
        return get_records(side if isinstance(side, str) else side.key)

    @property
    def started(self) -> bool:
        return any(self.records(s) for s in self.sides)

    @property
    def finished(self) -> bool:
        """Every engine ran and has nothing left (its workload fully fed)."""
        return self.started and all(
            not has_work(self.engines[s.key], self.feeders.get(s.key)) for s in self.sides
        )


# -- stepping (no widgets) ---------------------------------------------------------------------


def has_work(engine: EngineCore, feeder: WorkloadFeeder | None) -> bool:
    return engine.has_unfinished_requests() or bool(feeder and feeder.pending)


def step_once(key: str, engine: EngineCore, feeder: WorkloadFeeder | None) -> StepRecord | None:
    """One step of one engine (through its workload feeder if it has one); recorded."""
    apply_step_threads()  # one thread per step while several learners click (ui/registry.py)
    if feeder is not None:
        record = feeder.step()
    elif engine.has_unfinished_requests():
        record = engine.step()
    else:
        record = None
    if record is not None:
        record_step(key, record)
    return record


def step_all(ctx: LabContext) -> int:
    """One 다음 스텝 for every engine that has work (lockstep). Returns how many stepped."""
    stepped = 0
    for side in ctx.sides:
        if step_once(side.key, ctx.engines[side.key], ctx.feeders.get(side.key)) is not None:
            stepped += 1
    return stepped


def expected_steps(engine: EngineCore, feeder: WorkloadFeeder | None = None) -> int:
    """About how many steps are left (for the progress bar): the longest request's own steps, or
    the total work spread over the token budget and the running slots, whichever is more."""
    budget = max(engine.config.max_num_batched_tokens, 1)
    seqs = max(engine.config.max_num_seqs, 1)
    work = [
        (
            max(r.num_prompt_tokens - r.num_computed_tokens, 0),
            max(r.sampling_params.max_tokens - r.num_output_tokens, 0),
        )
        for r in engine.live_requests.values()
    ]
    if feeder is not None:
        work += [(feeder.specs[i].prompt_len, feeder.specs[i].max_tokens) for i in feeder.pending]
    if not work:
        return 0
    longest = max(math.ceil(p / budget) + o for p, o in work)
    spread = math.ceil(sum(p for p, _ in work) / budget) + math.ceil(sum(o for _, o in work) / seqs)
    return max(longest, spread, 1)


# -- state -------------------------------------------------------------------------------------


def is_playing(key: str) -> bool:
    return bool(st.session_state.get(_PLAYING.format(key)))


def set_playing(key: str, value: bool) -> None:
    st.session_state[_PLAYING.format(key)] = value


def _feeders() -> dict:
    return st.session_state.setdefault(_FEEDERS, {})


def _context(key: str, sides: list[Side]) -> LabContext | None:
    engines = {}
    for side in sides:
        try:
            engines[side.key] = get_engine(side.key, **side.overrides)
        except Exception as exc:  # noqa: BLE001 - any engine error becomes a Korean message
            show_error(exc, f"엔진을 만들 수 없습니다{f' ({side.label})' if side.label else ''}")
            return None
    feeders = {}
    for side in sides:
        feeder = _feeders().get(side.key)
        fresh = feeder is not None and feeder.engine is engines[side.key]
        feeders[side.key] = feeder if fresh else None
    return LabContext(key, sides, engines, feeders)


def reset_lab(ctx: LabContext, workload: Workload | None = None) -> LabContext:
    """Fresh engines for every side (records cleared); with a workload, fed from step 0."""
    for side in ctx.sides:
        reset_engine(side.key)
        _feeders().pop(side.key, None)
        engine = get_engine(side.key, **side.overrides)
        ctx.engines[side.key] = engine
        ctx.feeders[side.key] = None
        if workload is not None:
            ctx.feeders[side.key] = _feeders()[side.key] = WorkloadFeeder(engine, workload)
    return ctx


# -- adding requests ---------------------------------------------------------------------------


def add_prompt(
    ctx: LabContext,
    prompt: str,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat: bool = True,
) -> list:
    """Queue the same prompt on every engine of the lab (chat template applied if asked)."""
    from engine.sampling_params import InvalidRequestError, SamplingParams

    added = []
    for side in ctx.sides:
        engine = ctx.engines[side.key]
        text = prompt
        if chat and engine.tokenizer.chat_template:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        try:
            params = SamplingParams(
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                top_p=float(top_p),
                seed=seed,
            )
            request = engine.add_request(text, params)
        except (InvalidRequestError, ValueError) as exc:
            show_error(exc, "요청을 넣지 못했습니다")
            return added
        request.display_prompt = prompt  # what the learner typed, for the stream panel
        added.append(request)
    return added


def _request_panel(
    ctx: LabContext,
    default_max_tokens: int,
    show_custom: bool,
    presets: dict[str, str] | None,
    workload: Workload | None,
    workload_note: str,
) -> None:
    key = ctx.key
    with st.container(border=True):
        st.markdown("**요청 넣기**")
        if workload is not None:
            c1, c2 = st.columns([3, 1], vertical_alignment="center")
            c1.caption(workload_note or ("워크로드: " + workload.describe()))
            if c2.button(
                "워크로드 넣기",
                key=f"{key}_load",
                width="stretch",
                help="엔진을 새로 만들고 워크로드의 요청을 도착 시각(엔진 시계)에 맞춰 넣습니다",
            ):
                set_playing(key, False)
                reset_lab(ctx, workload)
        if not presets:
            return
        c1, c2, c3, c4 = st.columns(4)
        max_tokens = c1.number_input(
            "max_tokens", 1, 512, default_max_tokens, key=f"{key}_max_tokens"
        )
        temperature = c2.slider(
            "temperature",
            0.0,
            2.0,
            0.0,
            0.1,
            key=f"{key}_temperature",
            help="0이면 greedy (결정적)",
        )
        top_p = c3.slider("top_p", 0.05, 1.0, 1.0, 0.05, key=f"{key}_top_p")
        seed = c4.number_input("seed (0 = 없음)", 0, 2**31 - 1, 0, key=f"{key}_seed")
        sampling = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=int(seed) or None
        )
        c1, c2 = st.columns([3, 1], vertical_alignment="bottom")
        preset = c1.selectbox("예시 프롬프트", list(presets), key=f"{key}_preset")
        if c2.button("예시 요청 추가", key=f"{key}_add_preset", width="stretch"):
            add_prompt(ctx, presets[preset], **sampling)
        if show_custom:
            custom = st.text_area(
                "직접 쓴 프롬프트",
                key=f"{key}_custom",
                height=68,
                placeholder="예: 부산에 대해 짧게 소개해 주세요.",
            )
            c1, c2 = st.columns([1, 3])
            chat = c2.checkbox("채팅 템플릿 적용", value=True, key=f"{key}_chat")
            if c1.button("요청 추가", key=f"{key}_add_custom", width="stretch"):
                if custom.strip():
                    add_prompt(ctx, custom.strip(), chat=chat, **sampling)
                else:
                    st.warning("프롬프트를 입력하세요.")


# -- progress ----------------------------------------------------------------------------------


class Progress:
    """A progress bar for a long run: items done / expected and the time left (never only a
    spinner). Call it once per item (it fits run_workload's on_step); close() removes it."""

    def __init__(self, total: int, what: str = "스텝"):
        self.total = max(int(total), 1)
        self.what = what
        self.done = 0
        self.start = time.perf_counter()
        self.bar = st.progress(0.0, text=f"{what} 0/{self.total} (예상)")

    def __call__(self, *_args) -> None:
        self.done += 1
        shown = max(self.total, self.done)
        per_item = (time.perf_counter() - self.start) / self.done
        left = per_item * (shown - self.done)
        self.bar.progress(
            min(self.done / shown, 1.0),
            text=f"{self.what} {self.done}/{shown} (예상) · 남은 시간 약 {left:.1f} s",
        )

    def close(self) -> None:
        self.bar.empty()


# -- stepping controls -------------------------------------------------------------------------


def run_steps(ctx: LabContext, limit: int | None) -> int:
    """Step every engine in lockstep until done (limit None) or `limit` times, with a progress bar
    (steps done / expected, time left). Returns the number of lockstep steps."""
    expected = max(expected_steps(ctx.engines[s.key], ctx.feeders.get(s.key)) for s in ctx.sides)
    total = min(limit, expected) if limit is not None else expected
    bar = Progress(total) if total > 1 else None
    done = 0
    for _ in range(limit if limit is not None else MAX_STEPS):
        if not step_all(ctx):
            break
        done += 1
        if bar is not None:
            bar()
    if bar is not None:
        bar.close()
    return done


def _controls(ctx: LabContext) -> None:
    key = ctx.key
    c1, c2, c3, c4, c5, c6, c7 = st.columns(
        [1.1, 0.7, 1, 1, 1.3, 1, 0.9], vertical_alignment="bottom"
    )
    if c1.button("다음 스텝", key=f"{key}_step", type="primary", width="stretch"):
        if not step_all(ctx):
            st.toast("처리할 요청이 없습니다. 먼저 요청을 추가하세요.")
    n = c2.number_input(
        "N", 1, 500, 5, key=f"{key}_step_count", help="N 스텝에서 한 번에 진행할 스텝 수"
    )
    if c3.button("N 스텝", key=f"{key}_nsteps", width="stretch"):
        if not run_steps(ctx, int(n)):
            st.toast("처리할 요청이 없습니다. 먼저 요청을 추가하세요.")
    playing = is_playing(key)
    if c4.button("일시정지" if playing else "재생", key=f"{key}_play", width="stretch"):
        set_playing(key, not playing)
        st.rerun()  # a full rerun: the fragment's timer (run_every) starts or stops
    c5.select_slider("재생 속도 (초/스텝)", SPEEDS, value=0.5, key=f"{key}_speed")
    if c6.button("끝까지", key=f"{key}_to_end", width="stretch"):
        set_playing(key, False)
        run_steps(ctx, None)
    if c7.button("리셋", key=f"{key}_reset", width="stretch"):
        set_playing(key, False)
        reset_lab(ctx)


def _counters(ctx: LabContext) -> None:
    cols = st.columns(len(ctx.sides))
    for col, side in zip(cols, ctx.sides):
        engine = ctx.engines[side.key]
        snap = engine.kv_cache_manager.snapshot()
        feeder = ctx.feeders.get(side.key)
        pending = len(feeder.pending) if feeder else 0
        name = f"**{side.label}** · " if side.label else ""
        col.markdown(
            f"{name}스텝 **{len(get_records(side.key))}** · "
            f"KV 블록 **{snap.num_used}/{snap.num_blocks}**"
            f" · 실행 {len(engine.scheduler.running)} · 대기 {len(engine.scheduler.waiting)}"
            + (f" · 도착 전 {pending}" if pending else "")
            + f" · 엔진 시계 {1000 * engine.clock.now():,.0f} ms"
        )


# -- the three views ---------------------------------------------------------------------------


def decision_table(record: StepRecord | None):
    from ui.widgets import decision_table as table

    return table(record)


def show_decision(record: StepRecord | None, names: dict[str, str] | None = None) -> None:
    if record is None:
        st.caption("아직 실행된 스텝이 없습니다.")
        return
    st.markdown(
        f"**스텝 {record.step}의 결정** — 토큰 {record.total_tokens}/{record.token_budget} 사용, "
        f"실행 {record.num_running} · 대기 {record.num_waiting}, "
        f"걸린 시간 {1000 * record.engine_duration:.0f} ms (엔진 시계)"
    )
    from ui.widgets import show_frame

    table = decision_table(record)
    if names:
        table["요청"] = [names.get(r, r) for r in table["요청"]]
    show_frame(table, width="stretch")


def journey_builder(key: str, engine: EngineCore) -> figures.JourneyBuilder:
    """This engine's journey segments, kept in the session between clicks (a new engine, e.g.
    after 리셋, starts a new one): a step scans only the events it added."""
    builders = st.session_state.setdefault(_JOURNEYS, {})
    entry = builders.get(key)
    if entry is None or entry[0] != id(engine):
        entry = builders[key] = (id(engine), figures.JourneyBuilder())
    return entry[1]


VIEW_TABS = ["요청 여정", "스케줄러 결정", "KV 캐시"]


def views(key: str, engine: EngineCore, records: list[StepRecord]) -> None:
    """Journey swimlanes, scheduler decisions, KV grid + occupancy of one engine, in three tabs
    (plot keys f"{key}_journey", f"{key}_schedule", f"{key}_kvgrid", f"{key}_kvusage").

    Only the open tab is drawn: the tabs track which one is open (on_change="rerun", its label in
    st.session_state[f"{key}_tabs"], "요청 여정" at first), so a click builds and sends that
    tab's figures only, and opening another tab reruns the lab (its fragment) to draw that one.
    The figures go to Streamlit as plain dicts (figures.prebuilt): the same charts as
    figures.*_figure without building and validating plotly objects."""
    journey_tab, schedule_tab, kv_tab = st.tabs(VIEW_TABS, key=f"{key}_tabs", on_change="rerun")
    if journey_tab.open:
        with journey_tab:
            builder = journey_builder(key, engine)
            journey = figures.journey_spec(engine.all_requests(), clock="engine", builder=builder)
            st.plotly_chart(figures.prebuilt(journey), width="stretch", key=f"{key}_journey")
    if schedule_tab.open:
        with schedule_tab:
            schedule = figures.schedule_spec(records)
            st.plotly_chart(figures.prebuilt(schedule), width="stretch", key=f"{key}_schedule")
            names = figures.short_names(r.request_id for r in engine.all_requests())
            show_decision(records[-1] if records else None, names)
    if kv_tab.open:
        with kv_tab:
            snapshot = records[-1].kv if records else engine.kv_cache_manager.snapshot()
            grid = figures.kv_grid_spec(snapshot)
            st.plotly_chart(figures.prebuilt(grid), width="stretch", key=f"{key}_kvgrid")
            usage = figures.kv_usage_spec(records)
            st.plotly_chart(figures.prebuilt(usage), width="stretch", key=f"{key}_kvusage")


def stream_texts(key: str, engine: EngineCore) -> None:
    """Each request's text as it grows (what the API server would stream)."""
    texts = get_texts(key)
    requests = engine.all_requests()
    if not requests:
        st.caption("요청을 추가하면 여기에 생성된 글이 자라납니다.")
        return
    names = figures.short_names(r.request_id for r in requests)
    for r in sorted(requests, key=lambda r: r.arrival_time):
        prompt = getattr(r, "display_prompt", None) or r.prompt or ""
        text = texts.get(r.request_id, "")
        if r.is_finished:
            from ui.widgets import FINISH_KO

            state = f"상태: 완료 ({FINISH_KO.get(r.finish_reason, r.finish_reason)})"
        elif r.status.value in ("waiting", "preempted"):
            state = "상태: 대기 중"
        else:
            state = "상태: 생성 중"
        with st.container(border=True):
            st.markdown(
                f"**{names[r.request_id]}** · {state} · 프롬프트 {r.num_prompt_tokens} 토큰 → "
                f"출력 {r.num_output_tokens} 토큰"
            )
            if prompt:
                st.caption(f"프롬프트: {prompt[:200]}")
            st.text(text or "…")


def evidence_kind(engine: EngineCore) -> str:
    """측정값 for a real engine's timings, 계산값 for a simulated one's (ui/simulation.py)."""
    from ui.simulation import is_simulated

    return "계산값" if is_simulated(engine) else "측정값"


def _last_step_evidence(ctx: LabContext) -> None:
    from ui.widgets import evidence

    for side in ctx.sides:
        records = get_records(side.key)
        if not records:
            continue
        last = records[-1]
        name = f"{side.label}: " if side.label else ""
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{name}마지막 스텝 {last.step}: {1000 * last.engine_duration:.1f} ms "
            f"(forward {1000 * last.timings.get('forward', 0):.1f} ms), "
            f"토큰 {last.total_tokens}개",
            **conditions_of(
                ctx.engines[side.key], 배치=f"{len(last.scheduled)}개 요청", 시계="엔진 시계"
            ),
        )


# -- the component -----------------------------------------------------------------------------


def lab(
    key: str,
    sides: list[Side] | None = None,
    *,
    presets: dict[str, str] | None = PRESETS,
    workload: Workload | None = None,
    workload_note: str = "",
    default_max_tokens: int = 32,
    show_custom: bool = True,
    before: Callable[[LabContext], None] | None = None,
    chapter_view: Callable[[LabContext], None] | None = None,
    show_streams: bool = True,
    show_code_panel: bool = True,
) -> None:
    """Draw the lab (inside st.fragment). `sides` default: one engine under `key`.

    before(ctx): drawn above the controls (e.g. the prediction box);
    chapter_view(ctx): the chapter's own view below the three views (summaries, comparisons)."""
    sides = sides or [Side(key)]
    st.session_state[ACTIVE_KEY] = sides[0].key
    interval = float(st.session_state.get(f"{key}_speed", 0.5)) if is_playing(key) else None

    @st.fragment(run_every=interval)
    def _lab() -> None:
        ctx = _context(key, sides)
        if ctx is None:
            set_playing(key, False)
            return
        try:
            if is_playing(key) and not step_all(ctx):
                set_playing(key, False)  # everything finished: stop the timer with a full rerun
                st.rerun(scope="app")
            top = st.container()  # drawn after the controls ran, so it shows this run's state
            _request_panel(ctx, default_max_tokens, show_custom, presets, workload, workload_note)
            _controls(ctx)
            if before is not None:
                with top:
                    before(ctx)
        except Exception as exc:  # noqa: BLE001 - an engine error must not end the page
            set_playing(key, False)
            show_error(exc, "스텝을 실행하지 못했습니다")
        _counters(ctx)
        if len(sides) == 1:
            side = sides[0]
            views(side.key, ctx.engines[side.key], get_records(side.key))
        else:
            cols = st.columns(len(sides))
            for col, side in zip(cols, sides):
                with col:
                    st.markdown(f"#### {side.label}")
                    views(side.key, ctx.engines[side.key], get_records(side.key))
        _last_step_evidence(ctx)
        if chapter_view is not None:
            try:
                chapter_view(ctx)
            except Exception as exc:  # noqa: BLE001
                show_error(exc, "이 장의 그림을 그리지 못했습니다")
        if show_streams:
            if len(sides) == 1:
                st.markdown("**스트리밍된 글**")
                stream_texts(sides[0].key, ctx.engines[sides[0].key])
            else:
                with st.expander("스트리밍된 글 (엔진별)"):
                    for side in sides:
                        st.markdown(f"**{side.label}**")
                        stream_texts(side.key, ctx.engines[side.key])
        if show_code_panel:
            from ui.widgets import show_code

            show_code(EngineCore.step)

    _lab()


def sidebar_status() -> None:
    """The sidebar's 엔진 상태 for the engine of the page being viewed. While a lab plays, it
    refreshes at the play speed (a fragment of its own), so its counters follow each step."""
    key = st.session_state.get(ACTIVE_KEY) or "main"
    lab_key = next(
        (
            k
            for k in list(st.session_state.keys())
            if isinstance(k, str) and k.startswith("_playing_") and st.session_state[k]
        ),
        None,
    )
    interval = None
    if lab_key is not None:
        interval = float(st.session_state.get(f"{lab_key.removeprefix('_playing_')}_speed", 0.5))

    @st.fragment(run_every=interval)
    def _status() -> None:
        engine_status(st.session_state.get(ACTIVE_KEY) or key)

    _status()


def steps_of(records: list[StepRecord], request_id: str) -> int:
    """How many steps scheduled this request (its prefill chunks and decode steps)."""
    return sum(1 for r in records if any(s.request_id == request_id for s in r.scheduled))


def first_finished(engine: EngineCore):
    """The earliest-arriving finished request of this engine, or None."""
    done = [r for r in engine.all_requests() if r.is_finished]
    return min(done, key=lambda r: r.arrival_time) if done else None


def run_workload_button(
    ctx: LabContext, workload: Workload, label: str = "실행", help: str | None = None
) -> bool:
    """A button that puts the workload on every engine and runs them all to the end (with the
    progress bar). True when it ran."""
    if not st.button(
        label,
        key=f"{ctx.key}_run",
        type="primary",
        help=help
        or "워크로드를 넣고 끝까지 실행합니다 (한 스텝씩 보려면 워크로드 넣기 → 다음 스텝)",
    ):
        return False
    set_playing(ctx.key, False)
    reset_lab(ctx, workload)
    run_steps(ctx, None)
    return True


def run_results(ctx: LabContext, cache_key: str, wrap: Callable[[dict], object] | None = None):
    """{side label: RunResult} (or wrap(that)) once every engine has finished its workload, kept in
    st.session_state[cache_key]: the same object on later reruns (recomputed only when the runs
    changed). None before that."""
    from ui.experiments.common import result_of

    if not ctx.finished or any(ctx.feeders.get(s.key) is None for s in ctx.sides):
        return None
    signature = tuple((id(ctx.engines[s.key]), len(ctx.records(s))) for s in ctx.sides)
    cached = st.session_state.get(f"_{cache_key}_signature")
    if cached == signature and st.session_state.get(cache_key) is not None:
        return st.session_state[cache_key]
    results = {
        s.label or s.key: result_of(ctx.feeders[s.key], ctx.records(s), s.label) for s in ctx.sides
    }
    value = wrap(results) if wrap is not None else results
    st.session_state[f"_{cache_key}_signature"] = signature
    st.session_state[cache_key] = value
    return value
