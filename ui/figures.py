"""Plotly figures drawn from the engine's own records (pure functions: no Streamlit here).

- journey_figure: one swimlane per request on a real millisecond axis
- schedule_figure: per step, the tokens each request got (prefill vs decode) under the token budget
- kv_grid_figure: the KV blocks of one snapshot, coloured by owner
- kv_usage_figure: KV usage (%) over the steps
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from engine.kv_cache import KVSnapshot
from engine.request import Request
from engine.trace import StepRecord, steps_dataframe

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


def _layout(fig: go.Figure, title: str, height: int = 320) -> go.Figure:
    fig.update_layout(
        title=title,
        height=height,
        margin=dict(l=10, r=10, t=40, b=10),
        legend=dict(yanchor="top", y=1.0, x=1.01, font=dict(size=11)),
        barmode="overlay",
    )
    return fig


def short_names(request_ids) -> dict[str, str]:
    """Short display names for long request ids (e.g. a 38-character chatcmpl-… id → req-0);
    ids of up to 12 characters keep their own name. The full id stays in the hover text."""
    ids = list(dict.fromkeys(request_ids))
    return {rid: (rid if len(rid) <= 12 else f"req-{i}") for i, rid in enumerate(ids)}


def _event_time(e, clock: str) -> float:
    if clock == "engine" and e.engine_time is not None:
        return e.engine_time
    return e.time


def journey_segments(
    requests: list[Request], t0: float | None = None, clock: str = "wall"
) -> tuple[list[dict], list[dict]]:
    """(bars, markers) of each request's journey, times in ms since t0 (default: earliest arrival)
    on the given clock ("wall" or "engine": the engine clock leaves out pauses between steps).

    Bars: tokenize (arrival → tokenized), 대기열 (→ first scheduling), each prefill chunk and each
    decode step (scheduled → its token or the next event), waiting again after a preemption.
    Markers: API 수신, 첫 토큰, 스트리밍, 선점, 완료.
    """

    def arrival(r: Request) -> float:
        first = next((e for e in r.journey if e.kind == "arrival"), None)
        return _event_time(first, clock) if first is not None else r.arrival_time

    if t0 is None:
        t0 = min((arrival(r) for r in requests), default=0.0)
    names = short_names(r.request_id for r in requests)
    bars, markers = [], []
    for r in requests:
        events = sorted(r.journey, key=lambda e: _event_time(e, clock))
        times = {id(e): _event_time(e, clock) for e in events}

        def ms(e, _times=times) -> float:
            return 1000.0 * (_times[id(e)] - t0)

        lane, rid = names[r.request_id], r.request_id

        def bar(start, end, kind, step, info="", _lane=lane, _rid=rid) -> None:
            bars.append(
                dict(lane=_lane, rid=_rid, start=start, end=end, kind=kind, step=step, info=info)
            )

        def mark(t, kind, step, info="", _lane=lane, _rid=rid) -> None:
            markers.append(dict(lane=_lane, rid=_rid, t=t, kind=kind, step=step, info=info))

        queued_since = None
        for i, e in enumerate(events):
            nxt = events[i + 1] if i + 1 < len(events) else None
            if e.kind == "arrival":
                mark(ms(e), "API 수신", e.step)
            elif e.kind == "tokenized":
                start = next((x for x in events if x.kind == "arrival"), e)
                bar(
                    ms(start),
                    ms(e),
                    "tokenize",
                    None,
                    f"{e.detail.get('num_prompt_tokens', '')} 토큰",
                )
                queued_since = (e, "대기열")
            elif e.kind == "scheduled":
                if queued_since is not None:
                    bar(ms(queued_since[0]), ms(e), queued_since[1], e.step)
                    queued_since = None
                phase = e.detail.get("phase", "decode")
                ends = ("first_token", "token", "scheduled", "preempted", "finished")
                end = next((x for x in events[i + 1 :] if x.kind in ends), nxt if nxt else e)
                bar(
                    ms(e),
                    ms(end),
                    PHASE_LABELS.get(phase, phase),
                    e.step,
                    f"{e.detail.get('num_tokens', '')} 토큰",
                )
            elif e.kind == "preempted":
                mark(ms(e), "선점", e.step)
                queued_since = (e, "대기열(선점 후)")
            elif e.kind == "first_token":
                mark(ms(e), "첫 토큰", e.step)
            elif e.kind == "streamed":
                mark(ms(e), "스트리밍", e.step)
            elif e.kind == "finished":
                mark(ms(e), "완료", e.step, str(e.detail.get("reason", "")))
        if queued_since is not None and not r.is_finished:  # still waiting: up to its last event
            last = events[-1] if events else queued_since[0]
            start = ms(queued_since[0])
            bar(start, max(ms(last), start + 0.5), queued_since[1], None, "대기 중")
    return bars, markers


MARKER_STYLE = {
    "API 수신": dict(symbol="triangle-right", color="#2ca02c", size=10),
    "첫 토큰": dict(symbol="star", color="#e377c2", size=11),
    "스트리밍": dict(symbol="line-ns-open", color="#555555", size=8),
    "선점": dict(symbol="x", color="#d62728", size=13),
    "완료": dict(symbol="square", color="#000000", size=9),
}


def journey_figure(
    requests: list[Request], t0: float | None = None, clock: str = "wall"
) -> go.Figure:
    """Swimlanes: one row per request, segments on a real ms axis (horizontal bars with base=).
    Long request ids are drawn as short names (req-0 …); the full id is in the hover text."""
    bars, markers = journey_segments(requests, t0, clock)
    fig = go.Figure()
    names = short_names(r.request_id for r in requests)
    lanes = [names[r.request_id] for r in requests]
    for kind, color in SEGMENT_COLORS.items():
        rows = [b for b in bars if b["kind"] == kind]
        if not rows:
            continue
        fig.add_trace(
            go.Bar(
                name=kind,
                orientation="h",
                y=[b["lane"] for b in rows],
                x=[max(b["end"] - b["start"], 0.05) for b in rows],
                base=[b["start"] for b in rows],
                marker=dict(color=color, line=dict(color="white", width=0.5)),
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
            )
        )
    for kind, style in MARKER_STYLE.items():
        rows = [m for m in markers if m["kind"] == kind]
        if not rows:
            continue
        fig.add_trace(
            go.Scatter(
                name=kind,
                mode="markers",
                y=[m["lane"] for m in rows],
                x=[m["t"] for m in rows],
                marker=dict(
                    symbol=style["symbol"],
                    color=style["color"],
                    size=style["size"],
                    line=dict(width=1.5, color=style["color"]),
                ),
                customdata=[
                    [m["step"] if m["step"] is not None else "-", m.get("info", ""), m["rid"]]
                    for m in rows
                ],
                hovertemplate=(
                    "%{customdata[2]} · "
                    + kind
                    + "<br>%{x:.1f} ms · 스텝 %{customdata[0]} %{customdata[1]}<extra></extra>"
                ),
            )
        )
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), title=None)
    axis = "엔진 시계" if clock == "engine" else "벽시계"
    fig.update_xaxes(title=f"시간 (ms, {axis}, 첫 요청 도착 기준)")
    return _layout(fig, "요청 여정 (스윔레인)", height=max(280, 100 + 40 * len(lanes)))


def schedule_figure(records: list[StepRecord]) -> go.Figure:
    """Per step: each request's scheduled tokens stacked, coloured prefill vs decode; budget
    line."""
    df = steps_dataframe(records)
    names = short_names(list(df["request_id"]) + [rid for r in records for rid in r.unscheduled])
    fig = go.Figure()
    shown = set()
    for (rid, phase), rows in df.groupby(["request_id", "phase"], sort=False):
        label = PHASE_LABELS.get(phase, phase)
        fig.add_trace(
            go.Bar(
                name=label,
                legendgroup=label,
                showlegend=label not in shown,
                x=rows["step"],
                y=rows["num_tokens"],
                marker=dict(
                    color=PHASE_COLORS.get(phase, "#999"), line=dict(color="white", width=1)
                ),
                text=[names.get(rid, rid)] * len(rows),
                textposition="inside",
                insidetextanchor="middle",
                customdata=rows[["num_computed_tokens", "num_prefix_hit_tokens"]].to_numpy(),
                hovertemplate=(
                    f"스텝 %{{x}} · {rid} · {label}<br>%{{y}} 토큰 (이미 계산: %{{customdata[0]}},"
                    " prefix 히트: %{customdata[1]})<extra></extra>"
                ),
            )
        )
        shown.add(label)
    if records:
        steps = [r.step for r in records]
        fig.add_trace(
            go.Scatter(
                name="토큰 예산",
                x=steps,
                y=[r.token_budget for r in records],
                mode="lines",
                line=dict(color="#d62728", dash="dash", shape="hvh"),
                hovertemplate="토큰 예산 %{y}<extra></extra>",
            )
        )
        waiting = [r for r in records if r.unscheduled]
        if waiting:
            fig.add_trace(
                go.Scatter(
                    name="못 받은 요청",
                    mode="markers",
                    x=[r.step for r in waiting],
                    y=[r.total_tokens for r in waiting],
                    marker=dict(symbol="x", color="#444", size=9),
                    text=[
                        "<br>".join(
                            f"{names.get(rid, rid)}: {REASON_KO.get(reason, reason)}"
                            for rid, reason in r.unscheduled.items()
                        )
                        for r in waiting
                    ],
                    hovertemplate="스텝 %{x}<br>%{text}<extra></extra>",
                )
            )
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="스텝", dtick=1 if len(records) <= 30 else None)
    fig.update_yaxes(title="이번 스텝에 처리한 토큰 수")
    _layout(fig, "스케줄러 결정: 스텝별 요청당 토큰 수")
    fig.update_layout(barmode="stack")
    return fig


def kv_grid_figure(snapshot: KVSnapshot, columns: int = 16) -> go.Figure:
    """KV blocks as a grid: colour = owner request, grey = free, green = cached-free (reusable)."""
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
            z[r][c] = 2 + owners.index(b.owners[0])
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
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            customdata=hover,
            texttemplate="%{text}",
            textfont=dict(size=9),
            colorscale=colorscale,
            zmin=-0.5,
            zmax=k - 0.5,
            showscale=False,
            xgap=2,
            ygap=2,
            hovertemplate="%{customdata}<extra></extra>",
            hoverongaps=False,
        )
    )
    # Legend entries (invisible points) so that colours are readable without hovering.
    legend = [("빈 블록", FREE_COLOR), ("prefix 캐시 보관(빈 블록)", CACHED_COLOR)]
    legend += [(kv_names[o], colors[2 + i]) for i, o in enumerate(owners)]
    for name, c in legend:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=name,
                marker=dict(symbol="square", size=12, color=c, line=dict(color="#999", width=1)),
            )
        )
    fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False)
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    title = (
        f"KV 캐시 블록 격자: 사용 {snapshot.num_used}/{n} ({100 * snapshot.usage:.0f}%),"
        f" 캐시 보관 {snapshot.num_cached_free}, 블록당 {snapshot.block_size} 토큰"
    )
    fig.update_layout(plot_bgcolor="white")
    return _layout(fig, title, height=max(200, 110 + 30 * rows))


def kv_usage_figure(records: list[StepRecord]) -> go.Figure:
    """KV usage over steps: used blocks (%) and cached-free blocks (%)."""
    steps = [r.step for r in records]
    used = [100 * r.kv.usage for r in records]
    cached = [
        100 * r.kv.num_cached_free / r.kv.num_blocks if r.kv.num_blocks else 0 for r in records
    ]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            name="사용 중 블록 (%)",
            x=steps,
            y=used,
            mode="lines+markers",
            line=dict(color="#1f77b4", shape="hv"),
            customdata=[[r.kv.num_used, r.kv.num_blocks] for r in records],
            hovertemplate=(
                "스텝 %{x}: %{y:.1f}% (%{customdata[0]}/%{customdata[1]} 블록)<extra></extra>"
            ),
        )
    )
    fig.add_trace(
        go.Scatter(
            name="prefix 캐시 보관 (%)",
            x=steps,
            y=cached,
            mode="lines",
            line=dict(color="#2ca02c", dash="dot", shape="hv"),
            hovertemplate="스텝 %{x}: %{y:.1f}%<extra></extra>",
        )
    )
    fig.update_yaxes(title="KV 블록 (%)", range=[0, 105])
    fig.update_xaxes(title="스텝")
    return _layout(fig, "KV 캐시 사용률 (스텝별)", height=260)
