"""The one lab component every chapter uses.

    lab("ch07", sides=[Side("ch07_seq", "순차 실행", {...}), ...], workload=..., chapter_view=...)

- add requests (preset or typed, or a chapter's workload whose arrivals sit on the engine clock),
- 다음 스텝 / N 스텝 / 재생 (with a speed) / 끝까지 / 리셋, and 정지 while a run goes on,
- the same three live views for every engine: journey swimlanes, scheduler decisions (token bars
  + the decision table with Korean reasons), KV block grid + occupancy over the steps,
- two or three engines side by side in lockstep (one 다음 스텝 advances each), their journeys on
  one shared engine-clock axis,
- a slot for the chapter's own view and its predict → run → compare box.

The component runs inside st.fragment: a step reruns the lab only, not the lesson around it; of
the three views only the open tab is drawn, its figures sent as plain dicts with the journey kept
between clicks (views()). The fragment also draws the sidebar's 엔진 상태 (into a sidebar
container app.py made), so the sidebar shows the step every view shows.

끝까지 and N 스텝 are runs that advance in short slices, one slice per fragment rerun on a fast
timer (LabRun): a learner's 정지 or 리셋 is taken between two steps, never after the whole run.
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
from ui import figures, fork
from ui.errors import show_error
from ui.experiments.common import Workload, WorkloadFeeder
from ui.registry import apply_step_threads, is_served
from ui.session import (
    adopted_engine,
    conditions_of,
    engine_status,
    get_engine,
    get_records,
    get_texts,
    persist_key,
    record_step,
    reset_engine,
)
from ui.share import fork_param, share_panel, take_pending_step

ACTIVE_KEY = "_active_engine_key"  # the engine the sidebar's 엔진 상태 shows (the page's lab)
_FEEDERS = "_lab_feeders"  # engine key → WorkloadFeeder
_PLAYING = "_playing_{}"
_RUN = "_lab_run_{}"  # lab key → LabRun while 끝까지 or N 스텝 goes on
_JOURNEYS = "_lab_journeys"  # engine key → (id of its engine, figures.JourneyBuilder)
_NOTE = "_lab_input_note_{}"  # widget key → the Korean note on a value brought into range
_STATUS_SLOT = "_sidebar_status_slot"  # the sidebar container app.py made for 엔진 상태
_STATUS_DRAWN = "_sidebar_status_drawn"  # whether a lab drew it in this script run
persist_key(_FEEDERS)  # a reload of the page keeps them with the engines (ui/session.py)
persist_key(_JOURNEYS)
SPEEDS = [0.25, 0.5, 1.0, 2.0]
MAX_STEPS = 2000
MAX_N = 500  # N 스텝 at most
SLICE_S = 0.3  # served: one fragment rerun of a run steps at least this long, then redraws
MAX_SLICE_S = 2.0  # ... and at most this long (a slice is twice the redraw between two slices)
RUN_TICK_S = 0.1  # the fragment's timer while a run goes on (the reruns then follow each other)

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
    # SamplingParams fields for every request this side gets (chapter 16: one side's requests
    # under a grammar, the other's free)
    request_params: dict = field(default_factory=dict)


@dataclass
class LabContext:
    """What a chapter's own view gets: the engines, their records and workload feeders.
    `progress` is where a run's bar and 정지 button go; `advanced` says a run already took its
    slice in this script run."""

    key: str
    sides: list[Side]
    engines: dict[str, EngineCore]
    feeders: dict[str, WorkloadFeeder | None]
    progress: object | None = None
    advanced: bool = False
    branches: list = field(default_factory=list)  # forks of its engines (ui/fork.py)
    # (ctx, workload) → {side key: feeder} when the sides' engines share their work (chapter
    # 15's prefill → decode pair); None: one WorkloadFeeder per side
    make_feeders: Callable[[LabContext, Workload], dict] | None = None

    @property
    def stepped(self) -> list[tuple[str, str]]:
        """(key, label) of every engine a step advances: the sides, then the branches."""
        return [(s.key, s.label) for s in self.sides] + [(b.key, b.label) for b in self.branches]

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
    for key, _ in ctx.stepped:
        if step_once(key, ctx.engines[key], ctx.feeders.get(key)) is not None:
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


def stop_lab(key: str) -> None:
    """Stop 재생 and any run of this lab. As a button's on_click it runs before the lab does, so
    the rerun that the click starts takes no further step."""
    set_playing(key, False)
    st.session_state.pop(_RUN.format(key), None)


def timer_interval(key: str) -> float | None:
    """The lab fragment's timer: fast while a run goes on, the play speed while playing."""
    if active_run(key) is not None:
        return RUN_TICK_S
    if is_playing(key):
        return float(st.session_state.get(f"{key}_speed", 0.5))
    return None


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
    branches = fork.live_branches(key, engines)
    for branch in branches:
        engines[branch.key] = adopted_engine(branch.key)
        feeders[branch.key] = _feeders().get(branch.key)
    return LabContext(key, sides, engines, feeders, branches=branches)


def attach_workload(ctx: LabContext, side_key: str, workload: Workload) -> None:
    """Feed `workload` to the side's current engine from its next step (kept across reruns)."""
    feeder = WorkloadFeeder(ctx.engines[side_key], workload)
    ctx.feeders[side_key] = _feeders()[side_key] = feeder


def reset_lab(ctx: LabContext, workload: Workload | None = None) -> LabContext:
    """Fresh engines for every side (records cleared, branches dropped); with a workload, fed
    from step 0."""
    fork.drop_branches(ctx.key)
    ctx.branches = []
    for side in ctx.sides:
        reset_engine(side.key)
        _feeders().pop(side.key, None)
        engine = get_engine(side.key, **side.overrides)
        ctx.engines[side.key] = engine
        ctx.feeders[side.key] = None
        if workload is not None and ctx.make_feeders is None:
            attach_workload(ctx, side.key, workload)
    if workload is not None and ctx.make_feeders is not None:
        for key, feeder in ctx.make_feeders(ctx, workload).items():
            ctx.feeders[key] = _feeders()[key] = feeder
    return ctx


# -- inputs that show the value they use ---------------------------------------------------------


def clamp_input(widget_key: str, low: int, high: int, label: str) -> None:
    """A number input's on_change: bring its value into [low, high] in the box itself (so what the
    box shows is what is used) and keep a Korean note on what changed."""
    value = st.session_state.get(widget_key)
    fixed = low if value is None else min(max(int(value), low), high)
    if value is None or fixed != value:
        st.session_state[widget_key] = fixed
        shown = "빈 칸" if value is None else f"{value:,}"
        st.session_state[_NOTE.format(widget_key)] = (
            f"{label} {shown}은(는) 쓸 수 있는 범위({low:,}–{high:,}) 밖이라 {fixed:,}(으)로 "
            "맞췄습니다."
        )
    else:
        st.session_state.pop(_NOTE.format(widget_key), None)


def number_field(
    container, label: str, widget_key: str, default: int, low: int, high: int, **kwargs
) -> int:
    """A number input without browser-side bounds (an out-of-range number would stay in the box
    with a red mark and never be sent): clamp_input brings it into range instead."""
    st.session_state.setdefault(widget_key, default)
    value = container.number_input(
        label,
        step=1,
        key=widget_key,
        on_change=clamp_input,
        args=(widget_key, low, high, label),
        **kwargs,
    )
    return min(max(int(value if value is not None else low), low), high)


def input_notes(*widget_keys: str) -> None:
    """The notes of inputs whose value was brought into range (clamp_input), small and orange."""
    for widget_key in widget_keys:
        note = st.session_state.get(_NOTE.format(widget_key))
        if note:
            st.caption(f":orange[{note}]")


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
                **side.request_params,
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
    if workload is None and not presets:
        return  # the page feeds this lab itself (ch12's start buttons): no empty box
    with st.container(border=True):
        st.markdown("**요청 넣기**")
        if workload is not None:
            c1, c2 = st.columns([3, 1], vertical_alignment="center")
            c1.caption(workload_note or ("워크로드: " + workload.describe()))
            if c2.button(
                "워크로드 넣기",
                key=f"{key}_load",
                width="stretch",
                on_click=stop_lab,
                args=(key,),
                help="엔진을 새로 만들고 워크로드의 요청을 도착 시각(엔진 시계)에 맞춰 넣습니다",
            ):
                reset_lab(ctx, workload)
        if not presets:
            return
        sampling = _sampling_inputs(ctx, default_max_tokens)
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


def _sampling_inputs(ctx: LabContext, default_max_tokens: int) -> dict:
    """max_tokens, temperature, top_p and seed of the requests the panel adds. max_tokens goes up
    to what the smallest engine's max_model_len leaves for a one-token prompt."""
    key = ctx.key
    longest = max(1, min(e.max_model_len for e in ctx.engines.values()) - 1)
    c1, c2, c3, c4 = st.columns(4)
    max_tokens = number_field(
        c1,
        "max_tokens",
        f"{key}_max_tokens",
        min(default_max_tokens, longest),
        1,
        longest,
        help=f"1–{longest:,} (이 엔진의 최대 길이 {longest + 1:,}토큰에서 프롬프트 몫을 뺀 만큼)",
    )
    temperature = c2.slider(
        "temperature", 0.0, 2.0, 0.0, 0.1, key=f"{key}_temperature", help="0이면 greedy (결정적)"
    )
    top_p = c3.slider("top_p", 0.05, 1.0, 1.0, 0.05, key=f"{key}_top_p")
    seed = number_field(c4, "seed (0 = 없음)", f"{key}_seed", 0, 0, 2**31 - 1)
    input_notes(f"{key}_max_tokens", f"{key}_seed")
    return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed or None)


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


# -- runs of many steps: 끝까지 and N 스텝 -------------------------------------------------------


@dataclass
class LabRun:
    """A run of up to `limit` lockstep steps. It advances one slice per script run (a fragment
    rerun on the lab's fast timer), so a click between two slices is taken before the next step,
    and within a slice a waiting click ends it after the step in progress."""

    limit: int
    total: int  # expected steps (the progress bar's 100 %)
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    slice_end: float | None = None  # when the last slice ended (the redraw came after it)

    def budget(self, floor_s: float | None) -> float | None:
        """This slice's seconds: at least `floor_s`, and twice the time the last redraw took
        (the gap since the last slice), so that stepping, not redrawing three engines' views,
        takes most of a run's time; at most MAX_SLICE_S. A waiting click ends any slice after
        its step in progress (click_pending), so a longer slice never delays 정지."""
        if floor_s is None or self.slice_end is None:
            return floor_s
        redraw = time.perf_counter() - self.slice_end
        return min(max(floor_s, 2 * redraw), MAX_SLICE_S)

    def label(self) -> str:
        shown = max(self.total, self.done)
        text = f"스텝 {self.done}/{shown} (예상)"
        if self.done:
            left = (time.perf_counter() - self.started) / self.done * (shown - self.done)
            text += f" · 남은 시간 약 {left:.1f} s"
        return text

    def fraction(self) -> float:
        return min(self.done / max(self.total, self.done, 1), 1.0)


def active_run(key: str) -> LabRun | None:
    return st.session_state.get(_RUN.format(key))


def slice_budget() -> float | None:
    """Seconds one script run steps a run at least (LabRun.budget): SLICE_S in the served app; no
    limit under AppTest, where no timer fires (the whole run then happens in the click's own
    script run)."""
    return SLICE_S if is_served() else None


def click_pending() -> bool:
    """Whether a button click of this session waits while the lab steps (served app). Streamlit
    queues a click that comes during a fragment run until the run ends; a run of steps looks
    at the queue after each step and ends its slice, so 정지 and 리셋 act within one step."""
    try:
        from streamlit.runtime.scriptrunner_utils.script_requests import ScriptRequestType
        from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

        requests = get_script_run_ctx(suppress_warning=True).script_requests
        if requests is None or requests._state != ScriptRequestType.RERUN:
            return False
        states = requests._rerun_data.widget_states
        return states is not None and any(
            w.WhichOneof("value") == "trigger_value" and w.trigger_value for w in states.widgets
        )
    except Exception:  # noqa: BLE001 - Streamlit internals moved: the slice's time limit holds
        return False


def _run_bar(ctx: LabContext, run: LabRun):
    """The run's progress bar with its 정지 button, in the lab's progress slot. Returns the slot
    (emptied when the run ends, so no 정지 is left behind by a run that ended within this script
    run) and the bar."""
    with ctx.progress if ctx.progress is not None else st.container():
        holder = st.empty()
        row = holder.container(horizontal=True, vertical_alignment="center")
        bar = row.progress(run.fraction(), text=run.label())
        row.button(
            "정지",
            key=f"{ctx.key}_stop",
            icon=":material/stop:",
            on_click=stop_lab,
            args=(ctx.key,),
            help="진행 중인 실행을 지금 스텝에서 멈춥니다 (엔진과 기록은 그대로)",
        )
    return holder, bar


def advance_run(
    ctx: LabContext, budget_s: float | None, stop: Callable[[], bool] = click_pending
) -> int:
    """One slice of the lab's run: lockstep steps until the run is done, `budget_s` seconds have
    passed or stop() says a click waits (checked after every step). Returns the steps taken."""
    run = active_run(ctx.key)
    ctx.advanced = True
    if run is None:
        return 0
    holder, bar = _run_bar(ctx, run)
    budget_s = run.budget(budget_s)
    start, stepped, finished = time.perf_counter(), 0, False
    while run.done < run.limit:
        if not step_all(ctx):
            finished = True
            break
        run.done += 1
        stepped += 1
        bar.progress(run.fraction(), text=run.label())
        if stop() or (budget_s is not None and time.perf_counter() - start >= budget_s):
            break
    run.slice_end = time.perf_counter()
    if finished or run.done >= run.limit:
        st.session_state.pop(_RUN.format(ctx.key), None)
        holder.empty()
    return stepped


def start_run(ctx: LabContext, limit: int | None) -> LabRun:
    """A run of `limit` steps (None: to the end) for this lab; 재생 stops."""
    expected = max(expected_steps(ctx.engines[s.key], ctx.feeders.get(s.key)) for s in ctx.sides)
    steps = MAX_STEPS if limit is None else int(limit)
    run = LabRun(steps, max(min(steps, expected), 1))
    set_playing(ctx.key, False)
    st.session_state[_RUN.format(ctx.key)] = run
    return run


def run_steps(ctx: LabContext, limit: int | None) -> int:
    """Step every engine in lockstep until done (limit None) or `limit` times, with a progress bar
    (steps done / expected, time left) and a 정지 button. The first slice runs now; in the served
    app the rest follows on the lab's timer. Returns the steps taken now (0: nothing to do)."""
    start_run(ctx, limit)
    return advance_run(ctx, slice_budget())


def _tick(ctx: LabContext) -> None:
    """What the lab's timer does: the run's next slice, or one 재생 step."""
    if active_run(ctx.key) is not None:
        if not ctx.advanced:
            advance_run(ctx, slice_budget())
    elif is_playing(ctx.key) and not step_all(ctx):
        set_playing(ctx.key, False)  # everything finished: the timer stops (timer_interval)


# -- stepping controls -------------------------------------------------------------------------


def _toggle_play(key: str) -> None:
    playing = is_playing(key)
    stop_lab(key)
    set_playing(key, not playing)


def _controls(ctx: LabContext) -> None:
    """One row that wraps onto a second line where the page is narrow (a 1280-pixel screen, 150 %
    zoom): every button keeps its whole label."""
    key = ctx.key
    row = st.container(horizontal=True, vertical_alignment="bottom", gap="small")
    stop = dict(on_click=stop_lab, args=(key,))
    if row.button("다음 스텝", key=f"{key}_step", type="primary", **stop):
        if not step_all(ctx):
            st.toast("처리할 요청이 없습니다. 먼저 요청을 추가하세요.")
    n = number_field(
        row,
        "N",
        f"{key}_step_count",
        5,
        1,
        MAX_N,
        width=110,
        help=f"N 스텝에서 한 번에 진행할 스텝 수 (1–{MAX_N})",
    )
    if row.button("N 스텝", key=f"{key}_nsteps", **stop):
        if not run_steps(ctx, n):
            st.toast("처리할 요청이 없습니다. 먼저 요청을 추가하세요.")
    playing = is_playing(key)
    row.button(
        "일시정지" if playing else "재생", key=f"{key}_play", on_click=_toggle_play, args=(key,)
    )
    row.select_slider("재생 속도 (초/스텝)", SPEEDS, value=0.5, key=f"{key}_speed", width=180)
    if row.button("끝까지", key=f"{key}_to_end", **stop):
        run_steps(ctx, None)
    if row.button("리셋", key=f"{key}_reset", **stop):
        reset_lab(ctx)
    input_notes(f"{key}_step_count")


def _counters(ctx: LabContext) -> None:
    cols = st.columns(len(ctx.stepped))
    for col, (key, label) in zip(cols, ctx.stepped):
        engine = ctx.engines[key]
        snap = engine.kv_cache_manager.snapshot()
        feeder = ctx.feeders.get(key)
        pending = len(feeder.pending) if feeder else 0
        name = f"**{label}** · " if label else ""
        col.markdown(
            f"{name}스텝 **{len(get_records(key))}** · "
            f"KV 블록 **{snap.num_used}/{snap.num_blocks}**"
            f" · 실행 {len(engine.scheduler.running)} · 대기 {len(engine.scheduler.waiting)}"
            + (f" · 도착 전 {pending}" if pending else "")
            + f" · 엔진 시계 {1000 * engine.clock.now():,.0f} ms"
        )


# -- the three views ---------------------------------------------------------------------------


def show_decision(record: StepRecord | None, names: dict[str, str] | None = None) -> None:
    if record is None:
        st.caption("아직 실행된 스텝이 없습니다.")
        return
    st.markdown(
        f"**스텝 {record.step}의 결정** — 토큰 {record.total_tokens}/{record.token_budget} 사용, "
        f"실행 {record.num_running} · 대기 {record.num_waiting}, "
        f"걸린 시간 {1000 * record.engine_duration:.0f} ms (엔진 시계)"
    )
    from ui.widgets import decision_table, show_frame

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


def journey_spec(key: str, engine: EngineCore) -> dict:
    """The journey swimlanes of one engine on the engine clock (its kept builder)."""
    builder = journey_builder(key, engine)
    return figures.journey_spec(engine.all_requests(), clock="engine", builder=builder)


def journey_end_ms(spec: dict) -> float:
    """Where the last segment or marker of a journey spec ends (ms after the first arrival)."""
    end = 0.0
    for trace in spec.get("data", []):
        xs = trace.get("x") or []
        bases = trace.get("base") if trace.get("type") == "bar" else None
        ends = [b + x for b, x in zip(bases, xs)] if bases is not None else xs
        end = max([end, *ends])
    return end


def share_x_range(specs: list[dict]) -> None:
    """Put every journey of a comparison on one x range, 0 → the latest end among them: the
    same millisecond sits at the same place on each side."""
    end = max((journey_end_ms(spec) for spec in specs), default=0.0)
    if end <= 0:
        return
    for spec in specs:
        axis = spec["layout"].setdefault("xaxis", {})
        axis.update(range=[0, end * 1.03], autorange=False)


def _tab_open(key: str, label: str) -> bool:
    return st.session_state.get(f"{key}_tabs", VIEW_TABS[0]) == label


def shared_journeys(ctx: LabContext) -> dict[str, dict]:
    """The journey specs of the sides whose journey tab is open, on one shared x range."""
    specs = {
        s.key: journey_spec(s.key, ctx.engines[s.key])
        for s in ctx.sides
        if _tab_open(s.key, VIEW_TABS[0])
    }
    share_x_range(list(specs.values()))
    return specs


def views(
    key: str, engine: EngineCore, records: list[StepRecord], journey: dict | None = None
) -> None:
    """Journey swimlanes, scheduler decisions, KV grid + occupancy of one engine, in three tabs
    (plot keys f"{key}_journey", f"{key}_schedule", f"{key}_kvgrid", f"{key}_kvusage").

    Only the open tab is drawn: the tabs track which one is open (on_change="rerun", its label in
    st.session_state[f"{key}_tabs"], "요청 여정" at first), so a click builds and sends that
    tab's figures only, and opening another tab reruns the lab (its fragment) to draw that one.
    The figures go to Streamlit as plain dicts (figures.prebuilt): the same charts as
    figures.*_figure without building and validating plotly objects. `journey`: the journey
    spec already built (a comparison's, on the shared x range)."""
    journey_tab, schedule_tab, kv_tab = st.tabs(VIEW_TABS, key=f"{key}_tabs", on_change="rerun")
    if journey_tab.open:
        with journey_tab:
            spec = journey if journey is not None else journey_spec(key, engine)
            st.plotly_chart(figures.prebuilt(spec), width="stretch", key=f"{key}_journey")
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


def _all_views(ctx: LabContext) -> None:
    if len(ctx.sides) == 1:
        side = ctx.sides[0]
        views(side.key, ctx.engines[side.key], get_records(side.key))
        return
    journeys = shared_journeys(ctx)
    for col, side in zip(st.columns(len(ctx.sides)), ctx.sides):
        with col:
            st.markdown(f"#### {side.label}")
            engine = ctx.engines[side.key]
            views(side.key, engine, get_records(side.key), journeys.get(side.key))


# -- the streamed text ----------------------------------------------------------------------------


def request_text(engine: EngineCore, request, text: str) -> tuple[str, bool]:
    """The text a request produced so far, from its tokens' bytes: an incomplete character is held
    back while it generates; bytes that are no character are shown as bytes, never as U+FFFD
    (ui/tokens.py). Returns (text, whether such bytes are shown). `text` (the engine's own) is
    used where a stop string cut it, or where the tokenizer has no bytes (a simulated engine)."""
    from ui.tokens import token_text

    tokenizer = engine.tokenizer
    if request.sampling_params.stop or not hasattr(tokenizer, "token_bytes"):
        return text, False
    return token_text(tokenizer, list(request.output_token_ids), final=request.is_finished)


def prompt_text(engine: EngineCore, request) -> tuple[str, bool]:
    """What the learner typed, else the request's text, else its prompt tokens as text (a
    workload's prompt is token ids)."""
    from ui.tokens import token_text

    typed = getattr(request, "display_prompt", None) or request.prompt
    if typed:
        return typed, False
    if not hasattr(engine.tokenizer, "token_bytes"):
        return "", False
    return token_text(engine.tokenizer, list(request.prompt_token_ids))


def stream_texts(key: str, engine: EngineCore) -> None:
    """Each request's text as it grows (what the API server would stream)."""
    from ui.tokens import BYTES_NOTE, INCOMPLETE_NOTE
    from ui.widgets import FINISH_KO

    texts = get_texts(key)
    requests = engine.all_requests()
    if not requests:
        st.caption("요청을 추가하면 여기에 생성된 글이 자라납니다.")
        return
    names = figures.short_names(r.request_id for r in requests)
    for r in sorted(requests, key=lambda r: r.arrival_time):
        if r.is_finished:
            state = f"상태: 완료 ({FINISH_KO.get(r.finish_reason, r.finish_reason)})"
        elif r.status.value in ("waiting", "preempted"):
            state = "상태: 대기 중"
        else:
            state = "상태: 생성 중"
        prompt, prompt_bytes = prompt_text(engine, r)
        text, text_bytes = request_text(engine, r, texts.get(r.request_id, ""))
        with st.container(border=True):
            st.markdown(
                f"**{names[r.request_id]}** · {state} · 프롬프트 {r.num_prompt_tokens} 토큰 → "
                f"출력 {r.num_output_tokens} 토큰"
            )
            if prompt:
                st.caption(f"프롬프트: {prompt[:200]}")
            st.text(text or "…")
            if text_bytes:
                st.caption(
                    f":orange[모델이 완전한 글자가 아닌 바이트를 냈습니다.] {INCOMPLETE_NOTE}"
                )
            if prompt_bytes:
                st.caption(
                    f":orange[프롬프트에 완전한 글자가 아닌 바이트가 있습니다.] {BYTES_NOTE}"
                )


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
    make_feeders: Callable[[LabContext, Workload], dict] | None = None,
) -> None:
    """Draw the lab (inside st.fragment). `sides` default: one engine under `key`.

    before(ctx): drawn above the controls (e.g. the prediction box);
    chapter_view(ctx): the chapter's own view below the three views (summaries, comparisons);
    make_feeders(ctx, workload): the sides' feeders when their engines share work (LabContext)."""
    sides = sides or [Side(key)]
    st.session_state[ACTIVE_KEY] = sides[0].key
    interval = timer_interval(key)  # the timer this full run gives the fragment
    slot = st.session_state.get(_STATUS_SLOT)

    @st.fragment(run_every=interval)
    def _lab() -> None:
        ctx = _context(key, sides)
        if ctx is None:
            stop_lab(key)
            draw_status(slot, sides)
            return
        ctx.make_feeders = make_feeders
        try:
            _drive(ctx, before, default_max_tokens, show_custom, presets, workload, workload_note)
        except Exception as exc:  # noqa: BLE001 - an engine error must not end the page
            stop_lab(key)
            show_error(exc, "스텝을 실행하지 못했습니다")
        if timer_interval(key) != interval:
            st.rerun(scope="app")  # the fragment's timer starts, changes or stops
        _counters(ctx)
        _all_views(ctx)
        fork.fork_section(ctx, views, _feeders(), stream_texts)
        _exports(ctx)
        _last_step_evidence(ctx)
        _below_views(ctx, chapter_view, show_streams, show_code_panel)
        draw_status(slot, sides)

    _lab()


def _drive(
    ctx: LabContext,
    before: Callable[[LabContext], None] | None,
    default_max_tokens: int,
    show_custom: bool,
    presets: dict[str, str] | None,
    workload: Workload | None,
    workload_note: str,
) -> None:
    """The lab's inputs and controls, then what its timer does (a run's slice, a 재생 step)."""
    top = st.container()  # filled after the controls ran, so it shows this run's state
    _request_panel(ctx, default_max_tokens, show_custom, presets, workload, workload_note)
    controls = st.container()
    ctx.progress = st.container()  # a run's bar and 정지 button, right under the controls
    with controls:
        _controls(ctx)
    if before is not None:
        with top:
            before(ctx)
    open_shared_step(ctx, workload, presets)
    _tick(ctx)
    with controls:  # after this run's steps, so the link names the step the views show
        share_panel(ctx.key, len(get_records(ctx.sides[0].key)))


def open_shared_step(
    ctx: LabContext, workload: Workload | None, presets: dict[str, str] | None
) -> None:
    """A shared link's step (ui/share.py), once: the lab's workload attached (워크로드 넣기), or
    its chosen example prompt added, then that many lockstep steps as N 스텝 takes them, then
    재생 at the lab's speed if the link says play=1."""
    pending = take_pending_step(ctx.key)
    if pending is None:
        return
    steps, play = pending
    if workload is not None:
        reset_lab(ctx, workload)
    elif presets:
        chosen = st.session_state.get(f"{ctx.key}_preset")
        add_prompt(ctx, presets.get(chosen) or next(iter(presets.values())))
    forks = fork_param()
    if forks:  # the link's branches, each made at its step (the lab stepped there first)
        for note in fork.open_shared_branches(ctx, forks, step_all, _feeders(), steps):
            st.caption(f":orange[{note}]")
    steps -= len(get_records(ctx.sides[0].key))
    if steps > 0:
        run_steps(ctx, steps)
    if play:
        set_playing(ctx.key, True)  # after the run of `steps`, the timer steps at the speed


def _exports(ctx: LabContext) -> None:
    """Take the run home: its Perfetto trace and tables, every engine and branch in one file."""
    if not ctx.started:
        return
    from ui.export import export_buttons

    runs = [(label or "엔진", ctx.engines[key], get_records(key)) for key, label in ctx.stepped]
    with st.expander("이 실행 가져가기 — Perfetto 트레이스와 CSV"):
        export_buttons(ctx.key, runs)


def _below_views(
    ctx: LabContext,
    chapter_view: Callable[[LabContext], None] | None,
    show_streams: bool,
    show_code_panel: bool,
) -> None:
    if chapter_view is not None:
        try:
            chapter_view(ctx)
        except Exception as exc:  # noqa: BLE001
            show_error(exc, "이 장의 그림을 그리지 못했습니다")
    if show_streams:
        if len(ctx.sides) == 1:
            st.markdown("**스트리밍된 글**")
            stream_texts(ctx.sides[0].key, ctx.engines[ctx.sides[0].key])
        else:
            with st.expander("스트리밍된 글 (엔진별)"):
                for side in ctx.sides:
                    st.markdown(f"**{side.label}**")
                    stream_texts(side.key, ctx.engines[side.key])
    if show_code_panel:
        from ui.widgets import show_code

        show_code(EngineCore.step)


# -- the sidebar's 엔진 상태 ----------------------------------------------------------------------


def sidebar_status_slot():
    """The sidebar container for 엔진 상태 (app.py, before the page runs). The page's lab draws
    the status into it at the end of each of its runs, full or fragment (Streamlit lets a fragment
    write into a container made outside it, once it wrote there on the full run), so the sidebar
    shows the same step as the lab after every click and every tick; sidebar_status() draws it
    for a page without a lab."""
    slot = st.sidebar.container()
    st.session_state[_STATUS_SLOT] = slot
    st.session_state[_STATUS_DRAWN] = False
    return slot


def draw_status(slot, sides: list[Side]) -> None:
    """엔진 상태 of a lab's engines into the sidebar slot (the first engine in full, the others of a
    comparison in a line each)."""
    from streamlit.errors import StreamlitAPIException

    st.session_state[_STATUS_DRAWN] = True
    if slot is None:  # a lab outside app.py (e.g. tests/classroom_fragment_app.py)
        return
    try:
        with slot:
            engine_status(sides[0].key, others=[(s.label or s.key, s.key) for s in sides[1:]])
    except StreamlitAPIException:  # the full run did not reach the slot: it draws on the next
        pass


def sidebar_status() -> None:
    """The sidebar's 엔진 상태 for a page whose lab did not draw it in this run (after the page)."""
    if st.session_state.get(_STATUS_DRAWN):
        return
    slot = st.session_state.get(_STATUS_SLOT) or st.sidebar
    with slot:
        engine_status(st.session_state.get(ACTIVE_KEY) or "main")


def first_finished(engine: EngineCore):
    """The earliest-arriving finished request of this engine, or None."""
    done = [r for r in engine.all_requests() if r.is_finished]
    return min(done, key=lambda r: r.arrival_time) if done else None


def run_workload_button(
    ctx: LabContext, workload: Workload, label: str = "실행", help: str | None = None
) -> bool:
    """A button that puts the workload on every engine and runs them all to the end (with the
    progress bar and 정지, run_steps). True when it was pressed."""
    if not st.button(
        label,
        key=f"{ctx.key}_run",
        type="primary",
        on_click=stop_lab,
        args=(ctx.key,),
        help=help
        or "워크로드를 넣고 끝까지 실행합니다 (한 스텝씩 보려면 워크로드 넣기 → 다음 스텝)",
    ):
        return False
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
