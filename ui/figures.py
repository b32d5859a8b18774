"""Plotly figures drawn from the engine's own records (pure functions: no Streamlit here).

- journey_figure: one swimlane per request on a real millisecond axis
- schedule_figure: per step, the tokens each request got (prefill vs decode) under the token budget
- kv_grid_figure: the KV blocks of one snapshot, coloured by owner
- kv_usage_figure: KV usage (%) over the steps

Each figure is first built as a plain dict in plotly's JSON shape (journey_spec, schedule_spec,
kv_grid_spec, kv_usage_spec); the *_figure functions wrap that in a validated go.Figure. The lab
redraws its views on every click, so it sends the dicts as they are (prebuilt(spec)): building and
validating go.Figure objects cost more CPU than the engine step they show (issue 12). A
JourneyBuilder keeps each request's finished journey segments between clicks, so a step only
scans the events that step added.
"""

from __future__ import annotations

import math

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
    "preempted": "선점됨 (KV 반납, 나중에 재계산)",
    "static_batch_in_progress": "정적 배치 진행 중 (다음 배치를 기다림)",
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


def _layout_spec(title: str, height: int = 320, barmode: str = "overlay", **extra) -> dict:
    return dict(
        margin=dict(l=10, r=10, t=40, b=10),
        legend=dict(font=dict(size=11), yanchor="top", y=1.0, x=1.01),
        title=dict(text=title),
        height=height,
        barmode=barmode,
        **extra,
    )


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
        self.incremental = first_arrival is None
        self.consumed = 0  # events of request.journey scanned so far
        self.last_time = -math.inf  # of the last scanned event (on self.clock)
        self.last_ms = None
        self.bars: list[dict] = []
        self.markers: list[dict] = []
        self.queued = None  # (ms, kind) while the request waits for the scheduler
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
            if kind == "arrival" and self.first_arrival is None:
                self.first_arrival = t
            if kind in _MARKER_KINDS:
                info = str(e.detail.get("reason", "")) if kind == "finished" else ""
                self.markers.append(
                    dict(lane=lane, rid=rid, t=t, kind=_MARKER_KINDS[kind], step=e.step, info=info)
                )
            if kind == "tokenized":
                if self.first_arrival is None and self.incremental:
                    self.incremental = False  # an arrival may come later: only a full scan knows
                start = self.first_arrival if self.first_arrival is not None else t
                info = f"{e.detail.get('num_prompt_tokens', '')} 토큰"
                self._bar(start, t, "tokenize", None, info)
                self.queued = (t, "대기열")
            elif kind == "scheduled":
                if self.queued is not None:
                    self._bar(self.queued[0], t, self.queued[1], e.step)
                    self.queued = None
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
    by_kind = {}
    for m in markers:
        by_kind.setdefault(m["kind"], []).append(m)
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
    axis = "엔진 시계" if clock == "engine" else "벽시계"
    layout = _layout_spec(
        "요청 여정 (스윔레인)",
        height=max(280, 100 + 40 * len(lanes)),
        yaxis=dict(categoryorder="array", categoryarray=list(reversed(lanes))),
        xaxis=dict(title=dict(text=f"시간 (ms, {axis}, 첫 요청 도착 기준)")),
    )
    return dict(data=data, layout=layout)


def journey_figure(
    requests: list[Request], t0: float | None = None, clock: str = "wall"
) -> go.Figure:
    """Swimlanes: one row per request, segments on a real ms axis (horizontal bars with base=).
    Long request ids are drawn as short names (req-0 …); the full id is in the hover text."""
    return go.Figure(journey_spec(requests, t0, clock))


# -- scheduler decisions -----------------------------------------------------------------------


def schedule_spec(records: list[StepRecord]) -> dict:
    """schedule_figure as a plain dict."""
    groups: dict[tuple[str, str], tuple[list, list, list]] = {}
    scheduled_ids = []
    for r in records:
        for s in r.scheduled:
            scheduled_ids.append(s.request_id)
            group = groups.get((s.request_id, s.phase))
            if group is None:
                group = groups[(s.request_id, s.phase)] = ([], [], [])
            group[0].append(r.step)
            group[1].append(s.num_tokens)
            group[2].append([s.num_computed_tokens, s.num_prefix_hit_tokens])
    names = short_names(scheduled_ids + [rid for r in records for rid in r.unscheduled])
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
    if records:
        data.append(
            dict(
                hovertemplate="토큰 예산 %{y}<extra></extra>",
                line=dict(color="#d62728", dash="dash", shape="hvh"),
                mode="lines",
                name="토큰 예산",
                x=[r.step for r in records],
                y=[r.token_budget for r in records],
                type="scatter",
            )
        )
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
    xaxis = dict(title=dict(text="스텝"))
    if len(records) <= 30:
        xaxis["dtick"] = 1
    layout = _layout_spec(
        "스케줄러 결정: 스텝별 요청당 토큰 수",
        barmode="stack",
        xaxis=xaxis,
        yaxis=dict(title=dict(text="이번 스텝에 처리한 토큰 수")),
    )
    return dict(data=data, layout=layout)


def schedule_figure(records: list[StepRecord]) -> go.Figure:
    """Per step: each request's scheduled tokens stacked, coloured prefill vs decode; budget
    line."""
    return go.Figure(schedule_spec(records))


# -- KV cache ----------------------------------------------------------------------------------


def kv_grid_spec(snapshot: KVSnapshot, columns: int = 16) -> dict:
    """kv_grid_figure as a plain dict."""
    n = snapshot.num_blocks
    columns = max(1, min(columns, n))
    rows = math.ceil(n / columns)
    owners = []
    for b in snapshot.blocks:
        for o in b.owners:
            if o not in owners:
                owners.append(o)
    # Categories: 0 free, 1 cached-free, 2.. owners. A stepped colorscale maps each integer to one
    # colour.
    kv_names = short_names(owners)
    owner_code = {o: 2 + i for i, o in enumerate(owners)}
    colors = [FREE_COLOR, CACHED_COLOR] + [
        OWNER_COLORS[i % len(OWNER_COLORS)] for i in range(len(owners))
    ]
    k = len(colors)
    colorscale = []
    for i, c in enumerate(colors):
        colorscale += [[i / k, c], [(i + 1) / k, c]]
    z = [[math.nan] * columns for _ in range(rows)]
    text = [[""] * columns for _ in range(rows)]
    hover = [[""] * columns for _ in range(rows)]
    status_ko = {"used": "사용 중", "free": "빈 블록", "cached": "빈 블록 (prefix 캐시 보관)"}
    for b in snapshot.blocks:
        r, c = divmod(b.block_id, columns)
        if b.status == "used" and b.owners:
            z[r][c] = owner_code[b.owners[0]]
            text[r][c] = kv_names[b.owners[0]].replace("req-", "")
        elif b.status == "cached":
            z[r][c] = 1
            text[r][c] = "·"
        else:
            z[r][c] = 0
        hover[r][c] = (
            f"블록 #{b.block_id}<br>{status_ko.get(b.status, b.status)}"
            f"<br>소유: {', '.join(b.owners) or '없음'}<br>ref_cnt {b.ref_cnt}"
        )
    data = [
        dict(
            colorscale=colorscale,
            customdata=hover,
            hoverongaps=False,
            hovertemplate="%{customdata}<extra></extra>",
            showscale=False,
            text=text,
            textfont=dict(size=9),
            texttemplate="%{text}",
            xgap=2,
            ygap=2,
            z=z,
            zmax=k - 0.5,
            zmin=-0.5,
            type="heatmap",
        )
    ]
    # Legend entries (invisible points) so that colours are readable without hovering.
    legend = [("빈 블록", FREE_COLOR), ("prefix 캐시 보관(빈 블록)", CACHED_COLOR)]
    legend += [(kv_names[o], colors[2 + i]) for i, o in enumerate(owners)]
    for name, c in legend:
        data.append(
            dict(
                marker=dict(color=c, line=dict(color="#999", width=1), size=12, symbol="square"),
                mode="markers",
                name=name,
                x=[None],
                y=[None],
                type="scatter",
            )
        )
    title = (
        f"KV 캐시 블록 격자: 사용 {snapshot.num_used}/{n} ({100 * snapshot.usage:.0f}%),"
        f" 캐시 보관 {snapshot.num_cached_free}, 블록당 {snapshot.block_size} 토큰"
    )
    axis = dict(showticklabels=False, showgrid=False, zeroline=False)
    layout = _layout_spec(
        title,
        height=max(200, 110 + 30 * rows),
        yaxis=dict(autorange="reversed", **axis),
        xaxis=dict(axis),
        plot_bgcolor="white",
    )
    return dict(data=data, layout=layout)


def kv_grid_figure(snapshot: KVSnapshot, columns: int = 16) -> go.Figure:
    """KV blocks as a grid: colour = owner request, grey = free, green = cached-free (reusable)."""
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
            name="사용 중 블록 (%)",
            x=steps,
            y=[100 * r.kv.usage for r in records],
            type="scatter",
        ),
        dict(
            hovertemplate="스텝 %{x}: %{y:.1f}%<extra></extra>",
            line=dict(color="#2ca02c", dash="dot", shape="hv"),
            mode="lines",
            name="prefix 캐시 보관 (%)",
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
        height=260,
        yaxis=dict(title=dict(text="KV 블록 (%)"), range=[0, 105]),
        xaxis=dict(title=dict(text="스텝")),
    )
    return dict(data=data, layout=layout)


def kv_usage_figure(records: list[StepRecord]) -> go.Figure:
    """KV usage over steps: used blocks (%) and cached-free blocks (%)."""
    return go.Figure(kv_usage_spec(records))
