"""The shared figures (ui/figures.py) as plotly dicts: what a learner can read off them.

- Legends sit in a band of their own above the plot (horizontal, y > 1), with the top margin
  reserved for them: they cover no data and no ticks, even with many entries in a narrow column.
- Magnitudes (time, tokens, KV usage) start at 0; categories (request names) sit on a categorical
  axis. The dual-axis helper keeps both of its magnitudes zero-based.
- A KV block in several requests' block tables (prefix caching, ref_cnt > 1) is drawn as shared:
  its own colour, and a hover naming every owner.
- The decision table puts the reason third and carries its column widths to show_frame."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import pytest

from engine.kv_cache import KVSnapshot
from engine.sampling_params import SamplingParams
from ui import figures
from ui.widgets import DECISION_COLUMNS, decision_table, show_frame


def _run(engine, max_steps: int = 200) -> list:
    records = []
    while engine.has_unfinished_requests() and len(records) < max_steps:
        records.append(engine.step())
    return records


@pytest.fixture(scope="module")
def busy(make_engine):
    """A run with waits, chunked prefills and preemptions: (engine, records)."""
    engine = make_engine(
        num_kv_blocks=8, max_model_len=96, max_num_batched_tokens=24, max_num_seqs=8
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(prompt_token_ids=[100 + i] * 20, sampling_params=params)
    return engine, _run(engine, 300)


def _specs(engine, records) -> dict[str, dict]:
    busiest = max(records, key=lambda r: r.kv.num_used)
    return {
        "journey": figures.journey_spec(engine.all_requests(), clock="engine"),
        "schedule": figures.schedule_spec(records),
        "kvgrid": figures.kv_grid_spec(busiest.kv),
        "kvusage": figures.kv_usage_spec(records),
    }


def _legend_labels(spec: dict) -> list[str]:
    return [t["name"] for t in spec["data"] if t.get("name") and t.get("showlegend", True)]


def assert_legend_clear_of_the_plot(spec: dict) -> None:
    layout = spec["layout"]
    labels = _legend_labels(spec)
    assert labels, "the figure has legend entries"
    legend = layout["legend"]
    assert legend["orientation"] == "h"
    assert legend["y"] > 1 and legend["yanchor"] == "bottom"  # above the plot area
    assert legend["x"] == 0 and legend["xanchor"] == "left"
    rows = figures.legend_rows(labels)
    assert rows >= 1
    assert layout["margin"]["t"] >= figures.TITLE_PX + rows * figures.LEGEND_ROW_PX
    assert layout["title"]["yref"] == "container" and layout["title"]["yanchor"] == "top"


def test_every_lab_view_puts_its_legend_above_the_plot(busy):
    for spec in _specs(*busy).values():
        assert_legend_clear_of_the_plot(spec)
        go.Figure(spec)  # a valid plotly figure


def test_a_longer_legend_reserves_more_rows():
    short = figures.chart_layout("t", ["a", "b"])
    many = [f"요청 {i}번" for i in range(12)]
    long = figures.chart_layout("t", many)
    assert figures.legend_rows(many) > figures.legend_rows(["a", "b"]) == 1
    assert long["margin"]["t"] > short["margin"]["t"]
    assert long["height"] - long["margin"]["t"] == short["height"] - short["margin"]["t"]
    assert "legend" not in figures.chart_layout("t") and not figures.chart_layout("t")["showlegend"]
    # the journey's eight entries wrap into three columns of the widest entry at 380 px (as
    # Chromium drew them); the estimate must not fall short of that
    journey = ["tokenize", "대기열", "prefill", "decode", "API 수신", "첫 토큰", "스트리밍", "완료"]
    assert figures.legend_rows(journey) >= 3


def test_magnitudes_start_at_zero_and_lanes_are_categories(busy):
    specs = _specs(*busy)
    journey = specs["journey"]["layout"]
    assert journey["yaxis"]["type"] == "category"
    lanes = {y for t in specs["journey"]["data"] for y in t["y"]}
    assert set(journey["yaxis"]["categoryarray"]) == lanes
    assert journey["xaxis"]["rangemode"] == "tozero" and journey["xaxis"]["type"] == "linear"
    schedule = specs["schedule"]["layout"]
    assert schedule["yaxis"]["rangemode"] == "tozero" and schedule["yaxis"]["type"] == "linear"
    usage = specs["kvusage"]["layout"]["yaxis"]
    assert usage["range"][0] == 0 and usage["rangemode"] == "tozero"
    # every bar of the journey starts at or after the first arrival (t = 0)
    assert all(b >= 0 for t in specs["journey"]["data"] if t["type"] == "bar" for b in t["base"])


def test_dual_axis_keeps_both_magnitudes_zero_based():
    left = figures.AxisSeries("처리량", [120.0, 180.0], "토큰/s", "#1f77b4", "bar")
    right = figures.AxisSeries("TPOT", [40.0, 55.0], "ms", "#ff7f0e", "lines+markers")
    spec = figures.dual_axis_spec(["#1 · 동시 4", "#2 · 동시 8"], left, right, "실행 기록", "실행")
    layout = spec["layout"]
    assert layout["xaxis"]["type"] == "category"
    for axis in ("yaxis", "yaxis2"):
        assert layout[axis]["rangemode"] == "tozero" and layout[axis]["type"] == "linear"
    assert layout["yaxis2"]["overlaying"] == "y" and layout["yaxis2"]["side"] == "right"
    assert layout["yaxis"]["title"]["text"] == "토큰/s"
    assert layout["yaxis2"]["title"]["font"]["color"] == "#ff7f0e"
    bar, line = spec["data"]
    assert (bar["type"], bar["yaxis"], bar["y"]) == ("bar", "y", [120.0, 180.0])
    assert (line["type"], line["yaxis"], line["mode"]) == ("scatter", "y2", "lines+markers")
    assert_legend_clear_of_the_plot(spec)
    fig = figures.dual_axis_figure(["a", "b"], left, right, "t")
    assert fig.layout.yaxis2.rangemode == "tozero" and fig.layout.barmode == "group"
    # two bar series stand side by side, not on top of each other
    both = figures.dual_axis_spec(["a", "b"], left, figures.AxisSeries("b", [1, 2], "개"), "t")
    assert both["data"][0]["offsetgroup"] != both["data"][1]["offsetgroup"]


# -- shared KV blocks ------------------------------------------------------------------------------


def _cells(spec: dict) -> dict[int, tuple[float, str, str]]:
    """block id → (category, text, hover) of the grid (16 columns)."""
    heat = spec["data"][0]
    columns = len(heat["z"][0])
    out = {}
    for r, row in enumerate(heat["z"]):
        for c, z in enumerate(row):
            if not (isinstance(z, float) and math.isnan(z)):
                out[r * columns + c] = (z, heat["text"][r][c], heat["customdata"][r][c])
    return out


def _colour_of(spec: dict, category: int) -> str:
    """The colour the stepped colorscale gives a category (two stops per category)."""
    return spec["data"][0]["colorscale"][2 * category][1]


def test_a_hand_made_snapshot_draws_shared_blocks_with_every_owner():
    snap = KVSnapshot(
        num_blocks=8,
        block_size=16,
        block_tables={"req-0": [0, 1, 2], "req-1": [0, 1, 3]},
        cached_free_ids=(4,),
        num_used=4,
        num_cached_free=1,
        num_free=3,
        usage=0.5,
        prefix_cache_queries=32,
        prefix_cache_hits=32,
    )
    spec = figures.kv_grid_spec(snap)
    cells = _cells(spec)
    for block in (0, 1):
        z, text, hover = cells[block]
        assert z == figures.SHARED
        assert "req-0" in hover and "req-1" in hover and "ref_cnt 2" in hover and "공유" in hover
        assert text == "0+1"
    assert cells[2][0] != cells[3][0] and figures.SHARED not in (cells[2][0], cells[3][0])
    assert cells[4][0] == figures.CACHED and cells[5][0] == figures.FREE
    assert _colour_of(spec, figures.SHARED) == figures.SHARED_COLOR
    legend = {t["name"]: t["marker"]["color"] for t in spec["data"][1:]}
    assert legend["공유 (여러 요청)"] == figures.SHARED_COLOR
    assert "공유 2" in spec["layout"]["title"]["subtitle"]["text"]
    go.Figure(spec)


def test_two_requests_sharing_a_prefix_are_drawn_sharing_it(make_engine):
    """The real KV manager: B arrives after A's prompt is cached and hits its two full blocks."""
    engine = make_engine(num_kv_blocks=16, enable_prefix_caching=True, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefix = list(range(200, 232))  # two full blocks of 16
    a = engine.add_request(prompt_token_ids=prefix + [7, 8, 9], sampling_params=params)
    engine.step()
    b = engine.add_request(prompt_token_ids=prefix + [10, 11], sampling_params=params)
    record = engine.step()
    assert any(s.num_prefix_hit_tokens == 32 for s in record.scheduled)
    tables = record.kv.block_tables
    shared = set(tables[a.request_id]) & set(tables[b.request_id])
    assert len(shared) == 2
    cells = _cells(figures.kv_grid_spec(record.kv))
    for block in shared:
        z, _text, hover = cells[block]
        assert z == figures.SHARED, block
        assert a.request_id in hover and b.request_id in hover
    own = set(tables[a.request_id]) - shared
    assert own and all(cells[block][0] >= 3 for block in own)  # A's own blocks keep A's colour
    assert {cells[block][0] for block in own}.isdisjoint({cells[block][0] for block in shared})
    _run(engine)


# -- the decision table ----------------------------------------------------------------------------


class _Sink:
    def __init__(self):
        self.calls = []

    def dataframe(self, df, **kwargs):
        self.calls.append((df, kwargs))


def test_the_decision_table_reads_in_a_narrow_column(busy):
    _engine, records = busy
    waiting = next(r for r in records if r.unscheduled)
    table = decision_table(waiting)
    assert list(table.columns) == DECISION_COLUMNS and DECISION_COLUMNS[2] == "이유"
    reasons = set(table["이유"]) - {""}
    assert reasons and reasons <= set(figures.REASON_KO.values())
    assert max(len(r) for r in figures.REASON_KO.values()) <= 16  # fits its column unclipped
    sink = _Sink()
    show_frame(table, sink, width="stretch")
    _df, kwargs = sink.calls[0]
    config = kwargs["column_config"]
    assert config["이유"]["width"] == "medium" and config["요청"]["pinned"]
    assert all(config[c]["width"] == "small" for c in DECISION_COLUMNS if c != "이유")
    # a caller's own column_config wins; a frame without one gets none
    show_frame(table, sink, column_config={"요청": None})
    assert sink.calls[-1][1]["column_config"] == {"요청": None}
    show_frame(pd.DataFrame({"a": [1]}), sink)
    assert "column_config" not in sink.calls[-1][1]
