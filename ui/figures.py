"""Plotly figures drawn from the engine's own records (pure functions: no Streamlit here).

- journey_figure: one swimlane per request on a real millisecond axis
- schedule_figure: per step, the tokens each request got (prefill vs decode) under the token budget
- kv_grid_figure: the KV blocks of one snapshot, coloured by owner (shared blocks: their own look)
- kv_usage_figure: KV usage (%) over the steps
- dual_axis_figure: two magnitudes over one x on two zero-based y axes (for chapter charts)

Every chart's frame comes from chart_layout: the title on top, the legend in its own band just
above the plot (never over data or ticks, also in a narrow column); magnitudes use zero_axis
(from 0), categories category_axis.

Each figure is first built as a plain dict in plotly's JSON shape (journey_spec, schedule_spec,
kv_grid_spec, kv_usage_spec); the *_figure functions wrap that in a validated go.Figure. The lab
redraws its views on every click, so it sends the dicts as they are (prebuilt(spec)): building and
validating go.Figure objects cost more CPU than the engine step they show (issue 12). A
JourneyBuilder keeps each request's finished journey segments between clicks, so a step only
scans the events that step added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import plotly.io as pio

from engine.kv_cache import KVSnapshot
from engine.request import Request
from engine.trace import StepRecord

# Colours of the journey segments (legend order = the journey's order).
SEGMENT_COLORS = {
    "tokenize": "#9467bd",
    "대기열": "#bcbd22",
    "prefill": "#1f77b4",
    "chunked prefill": "#6baed6",
    "decode": "#ff7f0e",
    "대기열(선점 후)": "#d62728",
}
PHASE_COLORS = {"prefill": "#1f77b4", "chunked_prefill": "#6baed6", "decode": "#ff7f0e"}
REASON_KO = {
    "token_budget": "토큰 예산 소진",
    "no_free_kv_blocks": "빈 KV 블록 없음",
    "max_num_seqs": "최대 동시 요청 수 도달",
    "preempted": "선점됨 (KV 반납·재계산)",
    "static_batch_in_progress": "정적 배치 진행 중",
}
PHASE_LABELS = {"prefill": "prefill", "chunked_prefill": "chunked prefill", "decode": "decode"}
OWNER_COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#393b79",
    "#637939",
    "#8c6d31",
    "#843c39",
    "#7b4173",
    "#3182bd",
]
FREE_COLOR = "#eeeeee"
CACHED_COLOR = "#c7e9c0"
SHARED_COLOR = "#3d3d3d"  # a block several requests' tables list (prefix caching, ref_cnt > 1)


# -- plain figure dicts ------------------------------------------------------------------------

_TEMPLATES: dict = {}  # template name → its JSON (what go.Figure().to_dict() puts in the layout)


def _template_json(name) -> dict | None:
    if name not in _TEMPLATES:
        _TEMPLATES[name] = go.Figure().to_dict()["layout"].get("template")
    return _TEMPLATES[name]


class _Prebuilt(go.Figure):
    """A figure that already is plotly's JSON: st.plotly_chart turns a go.Figure into its dict
    (to_dict) and serialises that; this one hands over the dict it was built from, so nothing is
    validated or copied again. Any other use builds the real go.Figure once, on first touch."""

    def __init__(self, spec: dict):  # no go.Figure.__init__: that is the validation we skip
        self._spec = spec
        self._real = None

    def to_dict(self) -> dict:
        layout = self._spec.get("layout", {})
        template = _template_json(pio.templates.default)
        if template is not None and "template" not in layout:
            layout = {**layout, "template": template}
        return {"data": self._spec.get("data", []), "layout": layout}

    def __getattr__(self, name):  # everything else: the validated figure
        if name in ("_spec", "_real"):
            raise AttributeError(name)
        if self._real is None:
            self._real = go.Figure(self._spec)
        return getattr(self._real, name)


def prebuilt(spec: dict) -> go.Figure:
    """A figure for st.plotly_chart from one of the *_spec dicts below, sent without building or
    validating plotly objects (what the learner sees is the same as go.Figure(spec))."""
    return _Prebuilt(spec)


# Chart frames: a title at the top, the legend in a band of its own between the title and the plot
# (horizontal, wrapping), so that it covers no data and no ticks even in a narrow column (three
# engines side by side). The band's height is reserved in the top margin from an estimate of how
# many rows the legend wraps into at NARROW_PX.
NARROW_PX = 340  # a plot's width in one of three columns on a wide screen
TITLE_PX = 34
SUBTITLE_PX = 18
LEGEND_ROW_PX = 20
LEGEND_FONT = 11
# The other frame: a horizontal legend under the plot (pass it as layout legend=...).
LEGEND_BELOW = dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0)


def _legend_item_px(label) -> float:
    """An entry's width as plotly lays it out: symbol and gaps (about 45 px) plus its text, Hangul
    about twice as wide as a Latin letter (generous: an estimate must not fall short)."""
    units = sum(2 if ord(ch) >= 0x1100 else 1 for ch in str(label))
    return 50 + 0.64 * LEGEND_FONT * units


def legend_rows(labels, width_px: int = NARROW_PX) -> int:
    """How many rows a horizontal legend with these labels takes at `width_px`. Plotly puts the
    entries in one row when they fit; otherwise in columns as wide as the widest entry."""
    widths = [_legend_item_px(label) for label in labels]
    if not widths:
        return 0
    if sum(widths) <= width_px:
        return 1
    per_row = max(1, int(width_px // max(widths)))
    return math.ceil(len(widths) / per_row)


def chart_layout(
    title: str,
    legend_labels=(),
    height: int = 320,
    subtitle: str | None = None,
    **extra,
) -> dict:
    """A layout dict: the title (and subtitle) at the top, a horizontal legend just above the plot
    area (y > 1, in a top margin reserved for it), `height` px for the plot itself plus that band.
    Pass every legend entry's label (a figure with no legend passes none)."""
    rows = legend_rows(legend_labels)
    top = TITLE_PX + (SUBTITLE_PX if subtitle else 0) + rows * LEGEND_ROW_PX + (6 if rows else 0)
    title_spec = dict(
        text=title,
        x=0.01,
        xanchor="left",
        xref="container",
        y=1.0,
        yanchor="top",
        yref="container",
        pad=dict(t=8),
        font=dict(size=14),
    )
    if subtitle:
        title_spec["subtitle"] = dict(text=subtitle, font=dict(size=11, color="#555"))
    layout = dict(
        margin=dict(l=10, r=10, t=top, b=10),
        title=title_spec,
        height=height + top - TITLE_PX,
        showlegend=rows > 0,
        **extra,
    )
    if rows:
        layout["legend"] = dict(
            orientation="h",
            x=0,
            xanchor="left",
            y=1.02,
            yanchor="bottom",
            font=dict(size=LEGEND_FONT),
            itemwidth=30,
            tracegroupgap=0,
        )
    return layout


def _layout_spec(
    title: str, legend_labels=(), height: int = 320, barmode: str = "overlay", **extra
) -> dict:
    return chart_layout(title, legend_labels, height, barmode=barmode, **extra)


def zero_axis(title: str | None = None, color: str | None = None, **extra) -> dict:
    """A linear axis for a magnitude: it starts at 0 (never at the data's minimum). `color`
    colours its title (the series it belongs to, on a two-axis chart)."""
    axis = dict(rangemode="tozero", type="linear", **extra)
    if title:
        axis["title"] = dict(text=title)
        if color:
            axis["title"]["font"] = dict(color=color)
    return axis


def category_axis(title: str | None = None, order: list | None = None, **extra) -> dict:
    """An axis for categories (request names, settings): each one a slot, in `order` if given."""
    axis = dict(type="category", **extra)
    if order is not None:
        axis.update(categoryorder="array", categoryarray=list(order))
    if title:
        axis["title"] = dict(text=title)
    return axis


def short_names(request_ids) -> dict[str, str]:
    """Short display names for long request ids (e.g. a 38-character chatcmpl-… id → req-0);
    ids of up to 12 characters keep their own name. The full id stays in the hover text."""
    ids = list(dict.fromkeys(request_ids))
    return {rid: (rid if len(rid) <= 12 else f"req-{i}") for i, rid in enumerate(ids)}


def _event_time(e, clock: str) -> float:
    if clock == "engine" and e.engine_time is not None:
        return e.engine_time
    return e.time


def _arrival(r: Request, clock: str) -> float:
    first = next((e for e in r.journey if e.kind == "arrival"), None)
    return _event_time(first, clock) if first is not None else r.arrival_time


# -- the journey (swimlanes) -------------------------------------------------------------------

# A scheduled segment ends at the first later event of these kinds (its token, or what stopped it).
_SEGMENT_ENDS = frozenset(("first_token", "token", "scheduled", "preempted", "finished"))
_MARKER_KINDS = {
    "arrival": "API 수신",
    "first_token": "첫 토큰",
    "streamed": "스트리밍",
    "preempted": "선점",
    "finished": "완료",
}


class _Lane:
    """One request's journey, scanned event by event in time order. Bars and markers that later
    events cannot change are kept; a scheduled segment stays open until the event that ends it
    (its token, the next step, a preemption), and is drawn provisionally until then."""

    def __init__(self, request: Request, lane: str, t0: float, clock: str, first_arrival=None):
        self.request, self.lane, self.t0, self.clock = request, lane, t0, clock
        self.first_arrival = first_arrival  # ms; known up front only for an out-of-order scan
        self.arrival_wall = None  # perf_counter seconds of the arrival (tokenize time's origin)
        self.incremental = first_arrival is None
        self.consumed = 0  # events of request.journey scanned so far
        self.last_time = -math.inf  # of the last scanned event (on self.clock)
        self.last_ms = None
        self.bars: list[dict] = []
        self.markers: list[dict] = []
        self.queued = None  # (ms, kind) while the request waits for the scheduler
        self.tokenize_bar = None  # index in self.bars of the tokenize segment
        self.open_bar = None  # index in self.bars of the scheduled segment without an end yet
        self.open_next = None  # ms of the event right after it (its end if nothing ends it)

    def feed(self, events) -> int:
        rid, lane = self.request.request_id, self.lane
        n = 0
        for e in events:
            n += 1
            t = 1000.0 * (_event_time(e, self.clock) - self.t0)
            kind = e.kind
            if self.open_bar is not None:
                if self.open_next is None:
                    self.open_next = t
                if kind in _SEGMENT_ENDS:
                    self.bars[self.open_bar]["end"] = t
                    self.open_bar = self.open_next = None
            if kind == "arrival":
                if self.first_arrival is None:
                    self.first_arrival = t
                if self.arrival_wall is None:
                    self.arrival_wall = e.time
            if kind in _MARKER_KINDS:
                info = str(e.detail.get("reason", "")) if kind == "finished" else ""
                self.markers.append(
                    dict(lane=lane, rid=rid, t=t, kind=_MARKER_KINDS[kind], step=e.step, info=info)
                )
            if kind == "tokenized":
                self._tokenized(e, t)
            elif kind == "scheduled":
                if self.queued is not None:
                    self._queue_bar(t, e.step)
                phase = e.detail.get("phase", "decode")
                info = f"{e.detail.get('num_tokens', '')} 토큰"
                self._bar(t, None, PHASE_LABELS.get(phase, phase), e.step, info)
                self.open_bar = len(self.bars) - 1
            elif kind == "preempted":
                self.queued = (t, "대기열(선점 후)")
            self.last_ms = t
            self.last_time = _event_time(e, self.clock)
        self.consumed += n
        return n

    def _tokenized(self, e, t: float) -> None:
        """The tokenize segment: arrival → arrival + the tokenizer's own (wall) time. On the engine
        clock the tokenized event sits where the request was admitted, which may be a whole step
        after its arrival (an arrival a step passed): that time is waiting, not tokenizing."""
        if self.first_arrival is None and self.incremental:
            self.incremental = False  # an arrival may come later: only a full scan knows
        start = self.first_arrival if self.first_arrival is not None else t
        took = t - start
        if self.arrival_wall is not None:
            took = max(1000.0 * (e.time - self.arrival_wall), 0.0)
        end = start + took  # on the wall clock: the tokenized event's own time
        info = f"{e.detail.get('num_prompt_tokens', '')} 토큰 · {end - start:.2f} ms"
        self.tokenize_bar = len(self.bars)
        self._bar(start, end, "tokenize", None, info)
        self.queued = (end, "대기열")

    def _queue_bar(self, t: float, step) -> None:
        """The wait that ends at this scheduling. The first one spans tokenized → first scheduled,
        so tokenize + 대기열 = arrival → first scheduled: RequestMetrics.queue_time, the table's
        대기 (a tokenize segment longer than that interval is cut at the scheduling)."""
        start, kind = self.queued
        self.queued = None
        info = ""
        if kind == "대기열":
            if start > t and self.tokenize_bar is not None:
                tok = self.bars[self.tokenize_bar]
                self.bars[self.tokenize_bar] = {**tok, "end": max(tok["start"], t)}
                start = t
            if self.first_arrival is not None:
                info = f"도착→첫 스케줄 {t - self.first_arrival:.1f} ms (토큰화 포함)"
        self._bar(start, t, kind, step, info)

    def _bar(self, start, end, kind, step, info="") -> None:
        rid, lane = self.request.request_id, self.lane
        self.bars.append(
            dict(lane=lane, rid=rid, start=start, end=end, kind=kind, step=step, info=info)
        )

    def output(self) -> list[dict]:
        """The bars as of now: the open segment ends at the next event (or where it starts), a
        request still waiting gets a bar up to its last event."""
        bars = self.bars
        if self.open_bar is not None:
            bars = bars.copy()
            open_bar = bars[self.open_bar]
            end = self.open_next if self.open_next is not None else open_bar["start"]
            bars[self.open_bar] = {**open_bar, "end": end}
        if self.queued is not None and not self.request.is_finished:
            start = self.queued[0]
            end = max(self.last_ms, start + 0.5)
            waiting = dict(
                lane=self.lane,
                rid=self.request.request_id,
                start=start,
                end=end,
                kind=self.queued[1],
                step=None,
                info="대기 중",
            )
            bars = [*bars, waiting]
        return bars


class JourneyBuilder:
    """Journey segments kept between clicks for one engine's requests. A request's lane is
    rescanned from its first event only when something it depends on changed (the time origin,
    its short name, an event out of time order); otherwise only its new events are scanned.
    `scanned` counts the events the last call looked at."""

    def __init__(self):
        self._lanes: dict[str, _Lane] = {}
        self.scanned = 0

    def segments(
        self, requests: list[Request], t0: float | None = None, clock: str = "wall"
    ) -> tuple[list[dict], list[dict]]:
        requests = list(requests)
        if t0 is None:
            t0 = min((_arrival(r, clock) for r in requests), default=0.0)
        names = short_names(r.request_id for r in requests)
        self.scanned = 0
        lanes, bars, markers = {}, [], []
        for r in requests:
            lane = self._lanes.get(r.request_id)
            if not self._extend(lane, r, names[r.request_id], t0, clock):
                lane = self._scan(r, names[r.request_id], t0, clock)
            lanes[r.request_id] = lane
            bars += lane.output()
            markers += lane.markers
        self._lanes = lanes
        return bars, markers

    def _extend(self, lane: _Lane | None, r: Request, name: str, t0: float, clock: str) -> bool:
        """Scan only the request's new events, if its lane can be kept."""
        if (
            lane is None
            or not lane.incremental
            or lane.request is not r
            or (lane.lane, lane.t0, lane.clock) != (name, t0, clock)
            or len(r.journey) < lane.consumed
        ):
            return False
        new = r.journey[lane.consumed :]
        last = lane.last_time
        for e in new:
            t = _event_time(e, clock)
            if t < last:
                return False  # out of time order: the sorted scan decides
            last = t
        self.scanned += lane.feed(new)
        return lane.incremental

    def _scan(self, r: Request, name: str, t0: float, clock: str) -> _Lane:
        """A lane from the request's first event (in time order, as the swimlane draws it)."""
        events = r.journey
        ordered = all(
            _event_time(a, clock) <= _event_time(b, clock) for a, b in zip(events, events[1:])
        )
        if ordered:
            lane = _Lane(r, name, t0, clock)
            self.scanned += lane.feed(events)
            if lane.incremental:
                return lane
        events = sorted(events, key=lambda e: _event_time(e, clock))
        first = next((e for e in events if e.kind == "arrival"), None)
        start = None if first is None else 1000.0 * (_event_time(first, clock) - t0)
        lane = _Lane(r, name, t0, clock, first_arrival=start)
        lane.incremental = False
        self.scanned += lane.feed(events)
        return lane


def journey_segments(
    requests: list[Request], t0: float | None = None, clock: str = "wall"
) -> tuple[list[dict], list[dict]]:
    """(bars, markers) of each request's journey, times in ms since t0 (default: earliest arrival)
    on the given clock ("wall" or "engine": the engine clock leaves out pauses between steps).

    Bars: tokenize (arrival → tokenized), 대기열 (→ first scheduling), each prefill chunk and each
    decode step (scheduled → its token or the next event), waiting again after a preemption.
    Markers: API 수신, 첫 토큰, 스트리밍, 선점, 완료.
    """
    return JourneyBuilder().segments(requests, t0, clock)


MARKER_STYLE = {
    "API 수신": dict(symbol="triangle-right", color="#2ca02c", size=10),
    "첫 토큰": dict(symbol="star", color="#e377c2", size=11),
    "스트리밍": dict(symbol="line-ns-open", color="#555555", size=8),
    "선점": dict(symbol="x", color="#d62728", size=13),
    "완료": dict(symbol="square", color="#000000", size=9),
}


def _segment_traces(bars: list[dict]) -> list[dict]:
    """One horizontal bar trace per segment kind (legend order = the journey's order)."""
    by_kind: dict[str, list] = {}
    for b in bars:
        by_kind.setdefault(b["kind"], []).append(b)
    data = []
    for kind, color in SEGMENT_COLORS.items():
        rows = by_kind.get(kind)
        if not rows:
            continue
        data.append(
            dict(
                base=[b["start"] for b in rows],
                customdata=[
                    [
                        b["start"],
                        b["end"],
                        b["step"] if b["step"] is not None else "-",
                        b["info"],
                        b["rid"],
                    ]
                    for b in rows
                ],
                hovertemplate=(
                    "%{customdata[4]} · "
                    + kind
                    + "<br>%{customdata[0]:.1f} → %{customdata[1]:.1f} ms"
                    "<br>스텝 %{customdata[2]} · %{customdata[3]}<extra></extra>"
                ),
                marker=dict(color=color, line=dict(color="white", width=0.5)),
                name=kind,
                orientation="h",
                x=[max(b["end"] - b["start"], 0.05) for b in rows],
                y=[b["lane"] for b in rows],
                type="bar",
            )
        )
    return data


def _marker_traces(markers: list[dict]) -> list[dict]:
    """One scatter trace per marker kind (API 수신, 첫 토큰, …)."""
    by_kind: dict[str, list] = {}
    for m in markers:
        by_kind.setdefault(m["kind"], []).append(m)
    data = []
    for kind, style in MARKER_STYLE.items():
        rows = by_kind.get(kind)
        if not rows:
            continue
        data.append(
            dict(
                customdata=[
                    [m["step"] if m["step"] is not None else "-", m["info"], m["rid"]] for m in rows
                ],
                hovertemplate=(
                    "%{customdata[2]} · "
                    + kind
                    + "<br>%{x:.1f} ms · 스텝 %{customdata[0]} %{customdata[1]}<extra></extra>"
                ),
                marker=dict(
                    color=style["color"],
                    line=dict(color=style["color"], width=1.5),
                    size=style["size"],
                    symbol=style["symbol"],
                ),
                mode="markers",
                name=kind,
                x=[m["t"] for m in rows],
                y=[m["lane"] for m in rows],
                type="scatter",
            )
        )
    return data


def _legend_names(data: list[dict]) -> list[str]:
    return [t["name"] for t in data if t.get("name") and t.get("showlegend", True)]


def journey_spec(
    requests: list[Request],
    t0: float | None = None,
    clock: str = "wall",
    builder: JourneyBuilder | None = None,
) -> dict:
    """journey_figure as a plain dict. With a builder (kept between calls for the same engine),
    only the events added since its last call are scanned."""
    requests = list(requests)
    bars, markers = (builder or JourneyBuilder()).segments(requests, t0, clock)
    names = short_names(r.request_id for r in requests)
    lanes = [names[r.request_id] for r in requests]
    data = _segment_traces(bars) + _marker_traces(markers)
    axis = "엔진 시계" if clock == "engine" else "벽시계"
    layout = _layout_spec(
        "요청 여정 (스윔레인)",
        _legend_names(data),
        height=max(280, 100 + 40 * len(lanes)),
        yaxis=category_axis(order=list(reversed(lanes))),
        xaxis=zero_axis(f"시간 (ms, {axis}, 첫 요청 도착 기준)"),
    )
    return dict(data=data, layout=layout)


def journey_figure(
    requests: list[Request], t0: float | None = None, clock: str = "wall"
) -> go.Figure:
    """Swimlanes: one row per request, segments on a real ms axis (horizontal bars with base=).
    Long request ids are drawn as short names (req-0 …); the full id is in the hover text."""
    return go.Figure(journey_spec(requests, t0, clock))


# -- scheduler decisions -----------------------------------------------------------------------


def _schedule_bars(records: list[StepRecord], names: dict[str, str]) -> list[dict]:
    """Per (request, phase): its tokens in each step, stacked; one legend entry per phase."""
    groups: dict[tuple[str, str], tuple[list, list, list]] = {}
    for r in records:
        for s in r.scheduled:
            group = groups.get((s.request_id, s.phase))
            if group is None:
                group = groups[(s.request_id, s.phase)] = ([], [], [])
            group[0].append(r.step)
            group[1].append(s.num_tokens)
            group[2].append([s.num_computed_tokens, s.num_prefix_hit_tokens])
    data, shown = [], set()
    for (rid, phase), (steps, tokens, computed) in groups.items():
        label = PHASE_LABELS.get(phase, phase)
        data.append(
            dict(
                customdata=computed,
                hovertemplate=(
                    f"스텝 %{{x}} · {rid} · {label}<br>%{{y}} 토큰 (이미 계산: %{{customdata[0]}},"
                    " prefix 히트: %{customdata[1]})<extra></extra>"
                ),
                insidetextanchor="middle",
                legendgroup=label,
                marker=dict(
                    color=PHASE_COLORS.get(phase, "#999"), line=dict(color="white", width=1)
                ),
                name=label,
                showlegend=label not in shown,
                text=[names.get(rid, rid)] * len(steps),
                textposition="inside",
                x=steps,
                y=tokens,
                type="bar",
            )
        )
        shown.add(label)
    return data


def _schedule_lines(records: list[StepRecord], names: dict[str, str]) -> list[dict]:
    """The token budget of each step, and an ✕ where some request got nothing (with why)."""
    if not records:
        return []
    data = [
        dict(
            hovertemplate="토큰 예산 %{y}<extra></extra>",
            line=dict(color="#d62728", dash="dash", shape="hvh"),
            mode="lines",
            name="토큰 예산",
            x=[r.step for r in records],
            y=[r.token_budget for r in records],
            type="scatter",
        )
    ]
    waiting = [r for r in records if r.unscheduled]
    if waiting:
        data.append(
            dict(
                hovertemplate="스텝 %{x}<br>%{text}<extra></extra>",
                marker=dict(color="#444", size=9, symbol="x"),
                mode="markers",
                name="못 받은 요청",
                text=[
                    "<br>".join(
                        f"{names.get(rid, rid)}: {REASON_KO.get(reason, reason)}"
                        for rid, reason in r.unscheduled.items()
                    )
                    for r in waiting
                ],
                x=[r.step for r in waiting],
                y=[r.total_tokens for r in waiting],
                type="scatter",
            )
        )
    return data


def schedule_spec(records: list[StepRecord]) -> dict:
    """schedule_figure as a plain dict."""
    ids = [s.request_id for r in records for s in r.scheduled]
    names = short_names(ids + [rid for r in records for rid in r.unscheduled])
    data = _schedule_bars(records, names) + _schedule_lines(records, names)
    # Steps are an ordered count (a linear axis with integer ticks); tokens a magnitude from 0.
    xaxis = dict(type="linear", title=dict(text="스텝"))
    if len(records) <= 30:
        xaxis["dtick"] = 1
    layout = _layout_spec(
        "스케줄러 결정: 스텝별 요청당 토큰 수",
        _legend_names(data),
        barmode="stack",
        xaxis=xaxis,
        yaxis=zero_axis("이번 스텝에 처리한 토큰 수"),
    )
    return dict(data=data, layout=layout)


def schedule_figure(records: list[StepRecord]) -> go.Figure:
    """Per step: each request's scheduled tokens stacked, coloured prefill vs decode; budget
    line."""
    return go.Figure(schedule_spec(records))


# -- KV cache ----------------------------------------------------------------------------------


_STATUS_KO = {"used": "사용 중", "free": "빈 블록", "cached": "빈 블록 (prefix 캐시 보관)"}
# Heatmap categories: 0 free, 1 cached-free, 2 shared (several owners), 3.. one owner each.
FREE, CACHED, SHARED = 0, 1, 2


def _kv_owners(snapshot: KVSnapshot) -> list[str]:
    owners: list[str] = []
    for b in snapshot.blocks:
        for o in b.owners:
            if o not in owners:
                owners.append(o)
    return owners


def _kv_cell(b, names: dict[str, str], code: dict[str, int]) -> tuple[int, str, str]:
    """(category, text, hover) of one block. A block in several block tables (a prefix-cache hit,
    ref_cnt > 1) is drawn as shared, its text the owners' short names (or ×n), its hover naming
    every owner."""
    owners = list(b.owners)
    if b.status == "used" and len(owners) > 1:
        short = "+".join(names[o].replace("req-", "") for o in owners)
        text = short if len(short) <= 5 else f"×{len(owners)}"
        who = ", ".join(names[o] if names[o] == o else f"{names[o]} ({o})" for o in owners)
        hover = f"블록 #{b.block_id}<br>공유: 요청 {len(owners)}개가 함께 씀<br>소유: {who}"
        return SHARED, text, f"{hover}<br>ref_cnt {b.ref_cnt}"
    if b.status == "used" and owners:
        z, text = code[owners[0]], names[owners[0]].replace("req-", "")
    elif b.status == "cached":
        z, text = CACHED, "·"
    else:
        z, text = FREE, ""
    hover = (
        f"블록 #{b.block_id}<br>{_STATUS_KO.get(b.status, b.status)}"
        f"<br>소유: {', '.join(owners) or '없음'}<br>ref_cnt {b.ref_cnt}"
    )
    return z, text, hover


def _stepped_colorscale(colors: list[str]) -> list:
    """Each integer category 0..k-1 its own colour (with zmin -0.5, zmax k - 0.5)."""
    k = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / k, c], [(i + 1) / k, c]]
    return scale


def kv_grid_spec(snapshot: KVSnapshot, columns: int = 16) -> dict:
    """kv_grid_figure as a plain dict."""
    n = snapshot.num_blocks
    columns = max(1, min(columns, n))
    rows = math.ceil(n / columns)
    owners = _kv_owners(snapshot)
    kv_names = short_names(owners)
    owner_code = {o: 3 + i for i, o in enumerate(owners)}
    colors = [FREE_COLOR, CACHED_COLOR, SHARED_COLOR] + [
        OWNER_COLORS[i % len(OWNER_COLORS)] for i in range(len(owners))
    ]
    z = [[math.nan] * columns for _ in range(rows)]
    text = [[""] * columns for _ in range(rows)]
    hover = [[""] * columns for _ in range(rows)]
    num_shared = 0
    for b in snapshot.blocks:
        r, c = divmod(b.block_id, columns)
        z[r][c], text[r][c], hover[r][c] = _kv_cell(b, kv_names, owner_code)
        num_shared += z[r][c] == SHARED
    data = [
        dict(
            colorscale=_stepped_colorscale(colors),
            customdata=hover,
            hoverongaps=False,
            hovertemplate="%{customdata}<extra></extra>",
            showlegend=False,
            showscale=False,
            text=text,
            textfont=dict(size=9),
            texttemplate="%{text}",
            xgap=2,
            ygap=2,
            z=z,
            zmax=len(colors) - 0.5,
            zmin=-0.5,
            type="heatmap",
        )
    ]
    # Legend entries (invisible points) so that colours are readable without hovering.
    legend = [("빈 블록", FREE_COLOR), ("캐시 보관", CACHED_COLOR)]
    if num_shared:
        legend.append(("공유 (여러 요청)", SHARED_COLOR))
    legend += [(kv_names[o], colors[3 + i]) for i, o in enumerate(owners)]
    data += [_legend_square(name, c) for name, c in legend]
    shared = f" · 공유 {num_shared}" if num_shared else ""
    subtitle = (
        f"사용 {snapshot.num_used}/{n} ({100 * snapshot.usage:.0f}%){shared}"
        f" · 캐시 보관 {snapshot.num_cached_free} · 블록당 {snapshot.block_size} 토큰"
    )
    axis = dict(showticklabels=False, showgrid=False, zeroline=False)
    layout = chart_layout(
        "KV 캐시 블록 격자",
        [name for name, _ in legend],
        height=max(200, 110 + 30 * rows),
        subtitle=subtitle,
        yaxis=dict(autorange="reversed", **axis),
        xaxis=dict(axis),
        plot_bgcolor="white",
    )
    return dict(data=data, layout=layout)


def _legend_square(name: str, color: str) -> dict:
    return dict(
        marker=dict(color=color, line=dict(color="#999", width=1), size=12, symbol="square"),
        mode="markers",
        name=name,
        x=[None],
        y=[None],
        type="scatter",
    )


def kv_grid_figure(snapshot: KVSnapshot, columns: int = 16) -> go.Figure:
    """KV blocks as a grid: colour = owner request, dark = shared by several requests, light grey =
    free, green = cached-free (reusable)."""
    return go.Figure(kv_grid_spec(snapshot, columns))


def kv_usage_spec(records: list[StepRecord]) -> dict:
    """kv_usage_figure as a plain dict."""
    steps = [r.step for r in records]
    data = [
        dict(
            customdata=[[r.kv.num_used, r.kv.num_blocks] for r in records],
            hovertemplate=(
                "스텝 %{x}: %{y:.1f}% (%{customdata[0]}/%{customdata[1]} 블록)<extra></extra>"
            ),
            line=dict(color="#1f77b4", shape="hv"),
            mode="lines+markers",
            name="사용 중 (%)",
            x=steps,
            y=[100 * r.kv.usage for r in records],
            type="scatter",
        ),
        dict(
            hovertemplate="스텝 %{x}: %{y:.1f}%<extra></extra>",
            line=dict(color="#2ca02c", dash="dot", shape="hv"),
            mode="lines",
            name="캐시 보관 (%)",
            x=steps,
            y=[
                100 * r.kv.num_cached_free / r.kv.num_blocks if r.kv.num_blocks else 0
                for r in records
            ],
            type="scatter",
        ),
    ]
    layout = _layout_spec(
        "KV 캐시 사용률 (스텝별)",
        _legend_names(data),
        height=260,
        yaxis=zero_axis("KV 블록 (%)", range=[0, 105]),
        xaxis=dict(type="linear", title=dict(text="스텝")),
    )
    return dict(data=data, layout=layout)


BRANCH_COLORS = ["#1f77b4", "#d62728", "#9467bd", "#ff7f0e"]


def kv_usage_compare_spec(series: list[tuple[str, list[StepRecord]]], fork_step: int) -> dict:
    """KV blocks in use per step of an engine and its forks on one chart; a dashed line where
    they parted (EngineCore.fork)."""
    data = [
        dict(
            hovertemplate=f"{label} · 스텝 %{{x}}: %{{y}} 블록<extra></extra>",
            line=dict(color=BRANCH_COLORS[i % len(BRANCH_COLORS)], shape="hv"),
            mode="lines",
            name=label,
            x=[r.step for r in records],
            y=[r.kv.num_used for r in records],
            type="scatter",
        )
        for i, (label, records) in enumerate(series)
    ]
    layout = _layout_spec(
        "KV 블록 사용 (원래 엔진과 갈래)",
        _legend_names(data),
        height=260,
        yaxis=zero_axis("사용 중인 KV 블록"),
        xaxis=dict(type="linear", title=dict(text="스텝")),
        shapes=[
            dict(
                type="line", x0=fork_step, x1=fork_step, y0=0, y1=1, yref="paper",
                line=dict(color="#7f7f7f", dash="dash"),
            )
        ],
    )  # fmt: skip
    return dict(data=data, layout=layout)


def kv_usage_figure(records: list[StepRecord]) -> go.Figure:
    """KV usage over steps: used blocks (%) and cached-free blocks (%)."""
    return go.Figure(kv_usage_spec(records))


# -- two magnitudes on two y axes --------------------------------------------------------------


@dataclass
class AxisSeries:
    """One magnitude of a dual-axis chart: its values, the unit on its axis, how it is drawn."""

    name: str  # legend label (short: the legend sits above the plot)
    values: list
    unit: str  # the axis title, e.g. "토큰/s" or "ms"
    color: str = "#1f77b4"
    kind: str = "bar"  # "bar", or a scatter mode: "markers", "lines+markers", ...
    text: list | None = None  # drawn on/above each point (e.g. run labels)
    hover: str = "%{y:.1f}"  # the value's hover format


def _series_trace(series: AxisSeries, x: list, axis: str) -> dict:
    trace = dict(
        hovertemplate=f"%{{x}}<br>{series.name}: {series.hover} {series.unit}<extra></extra>",
        name=series.name,
        x=list(x),
        y=list(series.values),
        yaxis=axis,
    )
    if series.kind == "bar":
        trace.update(type="bar", marker=dict(color=series.color), offsetgroup=axis)
        if series.text is not None:
            trace.update(text=list(series.text), textposition="outside")
        return trace
    trace.update(
        type="scatter",
        mode=series.kind,
        marker=dict(color=series.color, size=9, symbol="diamond"),
        line=dict(color=series.color),
    )
    if series.text is not None:
        trace.update(text=list(series.text), textposition="top center")
        trace["mode"] = series.kind + "+text" if "text" not in series.kind else series.kind
    return trace


def dual_axis_spec(
    x: list,
    left: AxisSeries,
    right: AxisSeries,
    title: str,
    x_title: str = "",
    categorical_x: bool = True,
    height: int = 300,
) -> dict:
    """Two magnitudes over the same x (e.g. throughput and TPOT per run), each on its own y axis
    (left, right), both starting at 0 so neither axis exaggerates a change; axis titles in their
    series' colours, the legend above the plot, clear of both axes' ticks. Bars of the two series
    stand side by side (offset groups), never on top of each other."""
    data = [_series_trace(left, x, "y"), _series_trace(right, x, "y2")]
    xaxis = category_axis(x_title or None) if categorical_x else zero_axis(x_title or None)
    layout = chart_layout(
        title,
        [left.name, right.name],
        height=height,
        barmode="group",
        xaxis=xaxis,
        yaxis=zero_axis(left.unit, left.color),
        yaxis2=zero_axis(
            right.unit,
            right.color,
            overlaying="y",
            side="right",
            showgrid=False,
        ),
    )
    return dict(data=data, layout=layout)


def dual_axis_figure(*args, **kwargs) -> go.Figure:
    """dual_axis_spec as a go.Figure (same arguments)."""
    return go.Figure(dual_axis_spec(*args, **kwargs))
