"""A click costs its step, not a rebuild of the lab's figures (issue 12; ui/figures.py, ui/lab.py).

- The journey builder the lab keeps between clicks gives exactly the figure a fresh build gives,
  at every step of a run with chunked prefills, prefix hits and preemptions, and on a step it
  scans only the events that step added.
- The plain dicts the lab sends (figures.prebuilt) are what go.Figure would send: nothing is lost
  or changed by skipping plotly's validation.
- In the app, a click reuses the session's journey builder (a reset starts a new one).
- Only the open tab of the lab's views is built and sent: the journey at first; opening "KV 캐시"
  draws the KV grid and occupancy instead, and a step click keeps that tab open and updates it."""

from __future__ import annotations

import json
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
import pytest
from _apptest import charts, open_tab

from engine.sampling_params import SamplingParams
from ui import figures

ROOT = Path(__file__).resolve().parent.parent


def _busy_engine(make_engine):
    """A tight KV cache (preemptions), a small token budget (chunked prefills), prefix caching
    (one prompt repeated)."""
    engine = make_engine(
        num_kv_blocks=8,
        block_size=16,
        max_model_len=96,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(prompt_token_ids=[100 + i] * 20, sampling_params=params)
    return engine, params


def _events(engine) -> int:
    return sum(len(r.journey) for r in engine.all_requests())


def test_the_kept_journey_equals_a_fresh_build_and_scans_only_new_events(make_engine):
    engine, params = _busy_engine(make_engine)
    builder = figures.JourneyBuilder()
    seen = 0
    records = []
    while engine.has_unfinished_requests() and len(records) < 300:
        records.append(engine.step())
        if len(records) == 3:  # a late arrival with a cached prefix joins the run
            engine.add_request(prompt_token_ids=[100] * 20, sampling_params=params)
        requests = engine.all_requests()
        for clock in ("engine", "wall"):
            fresh = figures.journey_spec(requests, clock=clock)
            if clock == "engine":
                kept = figures.journey_spec(requests, clock=clock, builder=builder)
                assert kept == fresh, f"step {len(records)}: the kept journey differs"
                total = _events(engine)
                assert builder.scanned == total - seen, (len(records), builder.scanned)
                seen = total
    assert any(r.preempted for r in records), "the tight cache should force a preemption"
    assert any(s.phase == "chunked_prefill" for r in records for s in r.scheduled)
    assert any(s.num_prefix_hit_tokens for r in records for s in r.scheduled)
    # The last step scanned a handful of events out of hundreds.
    assert 0 < builder.scanned < seen // 10
    kinds = {t["name"] for t in fresh["data"]}
    assert {"tokenize", "prefill", "decode", "선점", "대기열(선점 후)", "완료"} <= kinds
    # Another time origin moves every bar: the builder rescans everything once.
    figures.journey_spec(engine.all_requests(), t0=-1.0, clock="engine", builder=builder)
    assert builder.scanned == seen


def test_an_open_segment_is_drawn_to_the_next_event_until_its_token_arrives(make_engine):
    engine, _ = _busy_engine(make_engine)
    builder = figures.JourneyBuilder()
    engine.step()
    requests = engine.all_requests()
    bars, _ = builder.segments(requests, clock="engine")
    fresh, _ = figures.journey_segments(requests, clock="engine")
    assert bars == fresh
    # Every scheduled segment of a finished step ends after it starts (closed by its token or by
    # the next event), never at None.
    assert all(b["end"] is not None and b["end"] >= b["start"] for b in bars)


def _json(fig_or_dict) -> dict:
    return json.loads(pio.to_json(fig_or_dict, validate=False))


def test_prebuilt_dicts_are_what_go_figure_sends(make_engine):
    engine, _ = _busy_engine(make_engine)
    records = [engine.step() for _ in range(6)]
    busy = max(records, key=lambda r: r.kv.num_used)
    specs = {
        "journey": (
            figures.journey_spec(engine.all_requests(), clock="engine"),
            figures.journey_figure(engine.all_requests(), clock="engine"),
        ),
        "schedule": (figures.schedule_spec(records), figures.schedule_figure(records)),
        "kvgrid": (figures.kv_grid_spec(busy.kv), figures.kv_grid_figure(busy.kv)),
        "kvusage": (figures.kv_usage_spec(records), figures.kv_usage_figure(records)),
        "empty schedule": (figures.schedule_spec([]), figures.schedule_figure([])),
    }
    for name, (spec, figure) in specs.items():
        sent = figures.prebuilt(spec).to_dict()  # what st.plotly_chart serialises
        assert isinstance(figure, go.Figure)
        assert _json(sent) == _json(go.Figure(spec).to_dict()) == _json(figure.to_dict()), name
        assert sent["layout"]["template"] == figure.to_dict()["layout"]["template"], name
    # Anything beyond to_dict still works: the prebuilt figure builds the real one on demand.
    grid = figures.prebuilt(specs["kvgrid"][0])
    assert grid.data[0].type == "heatmap" and grid.layout.height == specs["kvgrid"][1].layout.height


def _fragment_app(model_dir):
    """tests/classroom_fragment_app.py (chapter 00's lab alone) under AppTest on `model_dir`."""
    from streamlit.testing.v1 import AppTest

    from ui.session import SETTINGS_KEY, EngineSettings

    at = AppTest.from_file(str(ROOT / "tests" / "classroom_fragment_app.py"), default_timeout=240)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(model_dir), device="cpu")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_click_reuses_the_sessions_journey_builder(tiny_model_dir):
    at = _fragment_app(tiny_model_dir)
    at.button(key="main_add_preset").click().run()
    at.button(key="main_step").click().run()
    at.button(key="main_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    engine = at.session_state["_engines"]["main"]["engine"]
    engine_id, builder = at.session_state["_lab_journeys"]["main"]
    assert engine_id == id(engine)
    before = _events(engine)
    at.button(key="main_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["_lab_journeys"]["main"][1] is builder  # kept across the click
    assert 0 < builder.scanned == _events(engine) - before < before  # only the new step's events
    chart = next(c for c in at.get("plotly_chart") if "main_journey" in c.proto.id)
    spec = json.loads(chart.proto.spec)
    assert spec["data"] and "template" in spec["layout"]
    at.button(key="main_reset").click().run()
    assert at.session_state["_lab_journeys"]["main"][1] is not builder  # a new engine, a new one


def _lab_charts(at) -> dict[str, dict]:
    """The lab's view charts now drawn: "journey", "schedule", "kvgrid", "kvusage" → spec."""
    names = ("journey", "schedule", "kvgrid", "kvusage")
    return {n: spec for i, spec in charts(at).items() for n in names if f"main_{n}" in i}


def _decision_tables(at) -> list:
    return [df for df in at.dataframe if "요청" in df.value.columns]


def test_only_the_open_tab_is_built_and_sent(tiny_model_dir):
    at = _fragment_app(tiny_model_dir)
    at.button(key="main_add_preset").click().run()
    at.button(key="main_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["main_tabs"] == "요청 여정"  # the default open tab
    assert [t.label for t in at.tabs] == ["요청 여정", "스케줄러 결정", "KV 캐시"]
    assert list(_lab_charts(at)) == ["journey"]
    assert not _decision_tables(at)  # the decision table belongs to the scheduler tab

    open_tab(at, "main", "KV 캐시")
    drawn = _lab_charts(at)
    assert sorted(drawn) == ["kvgrid", "kvusage"]
    assert len(drawn["kvusage"]["data"][0]["x"]) == 1  # one step so far

    at.button(key="main_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["main_tabs"] == "KV 캐시"  # a step keeps the open tab
    drawn = _lab_charts(at)
    assert sorted(drawn) == ["kvgrid", "kvusage"]
    assert len(drawn["kvusage"]["data"][0]["x"]) == 2  # and redraws it with the new step

    open_tab(at, "main", "스케줄러 결정")
    assert list(_lab_charts(at)) == ["schedule"]
    assert _decision_tables(at)
    open_tab(at, "main", "요청 여정")
    assert list(_lab_charts(at)) == ["journey"]


@pytest.mark.parametrize("clock", ["engine", "wall"])
def test_out_of_order_events_fall_back_to_a_sorted_scan(make_engine, clock):
    engine, _ = _busy_engine(make_engine)
    for _ in range(4):
        engine.step()
    requests = engine.all_requests()
    expected = figures.journey_spec(requests, clock=clock)
    r = requests[0]
    r.journey.insert(1, r.journey.pop())  # the journey's last event now sits out of time order
    builder = figures.JourneyBuilder()
    shuffled = figures.journey_spec(requests, clock=clock, builder=builder)
    assert shuffled == figures.journey_spec(requests, clock=clock)
    r.journey[:] = sorted(r.journey, key=lambda e: figures._event_time(e, clock))
    assert figures.journey_spec(requests, clock=clock, builder=builder) == expected
