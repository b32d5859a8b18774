"""Traces out (engine/tools/trace_export.py): the Chrome / Perfetto trace validates against the
Trace Event Format, sits on the engine clock, and round-trips each request's TTFT and E2E; the
tables carry the documented columns; `simulate --trace` writes the same trace."""

from __future__ import annotations

import contextlib
import io
import json
import random
import time
from pathlib import Path

import pandas as pd
import pytest

from engine.sampling_params import SamplingParams
from engine.tools import simulator
from engine.tools import trace_export as te
from engine.tools.workload import SimRequest

REPO = Path(__file__).resolve().parent.parent
EPS_US = 1e-3  # 1 ns: times sit on the trace's nanosecond grid
PHASES_REQUIRING_TID = {"X", "B", "E", "i", "C", "M"}


def perfetto_ns(us: float) -> int:
    """How Perfetto's JSON importer turns a µs value into nanoseconds (json_trace_tokenizer.cc,
    CoerceToTs): ts and dur each on their own."""
    return int(us) * 1000 if us == int(us) else round(us * 1000)


def validate_trace(trace: dict) -> None:
    """The Trace Event Format's rules this exporter relies on: the object form with traceEvents
    and displayTimeUnit; every event with ph, ts (µs, a number), pid, tid; B/E balanced per
    track; X with dur ≥ 0; C with numeric args; spans on one track nested, never crossing, as
    Perfetto's importer reads them (integer ns, intervals closed on the left and open on the
    right); on a request's track every span inside its `request` span."""
    spans: dict[tuple, list[tuple[int, int, str]]] = {}
    open_b: dict[tuple, list[dict]] = {}
    pids_of_tid: dict[int, int] = {}
    assert set(trace) >= {"traceEvents", "displayTimeUnit"} and trace["displayTimeUnit"] == "ms"
    for e in trace["traceEvents"]:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert e["ph"] in PHASES_REQUIRING_TID, e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        track, ts = (e["pid"], e["tid"]), perfetto_ns(e["ts"])
        # tid 0 is Perfetto's idle thread, tid == pid a main thread; a tid lives in one pid
        assert (
            e["tid"] not in (0, e["pid"]) and pids_of_tid.setdefault(e["tid"], e["pid"]) == e["pid"]
        )
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            spans.setdefault(track, []).append((ts, ts + perfetto_ns(e["dur"]), e["name"]))
        elif e["ph"] == "B":
            open_b.setdefault(track, []).append(e)
        elif e["ph"] == "E":
            begin = open_b[track].pop()
            spans.setdefault(track, []).append((perfetto_ns(begin["ts"]), ts, begin["name"]))
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
    assert all(not stack for stack in open_b.values()), "unclosed B events"
    for (pid, tid), intervals in spans.items():
        depths = assert_nested((pid, tid), intervals)
        if tid != te.scheduler_tid(pid):
            assert all(d == (n != te.REQUEST_SPAN) for n, d in depths), (pid, tid, depths)
        else:
            assert {d for _, d in depths} == {0}


def assert_nested(track, intervals: list[tuple[int, int, str]]) -> list[tuple[str, int]]:
    """Perfetto's slice stack (slice_tracker.cc, MaybeCloseStack): sorted by start, a longer span
    first; a span that ended by the new one's start is closed; the new one must end inside the
    span still open. Returns each span's (name, depth)."""
    stack: list[tuple[int, int]] = []
    depths = []
    for start, end, name in sorted(intervals, key=lambda s: (s[0], -(s[1] - s[0]))):
        while stack and (
            stack[-1][1] < start or (stack[-1][1] == start and not (stack[-1][0] == start == end))
        ):
            stack.pop()
        if stack:
            assert end <= stack[-1][1], f"{track}: {name} {start, end} crosses {stack[-1]}"
        depths.append((name, len(stack)))
        stack.append((start, end))
    return depths


def assert_round_trip(trace: dict, requests, pid: int | None = None) -> None:
    """The spans read back give each request's TTFT and E2E (engine clock) within 1 µs."""
    back = te.read_trace_metrics(json.dumps(trace), pid=pid)
    assert set(back) == {q.request_id for q in requests}
    for q in requests:
        m = q.metrics(clock="engine")
        for name, want in (("ttft", m.ttft), ("e2e", m.e2e)):
            got = back[q.request_id][name]
            assert (got is None) == (want is None), (q.request_id, name)
            if want is not None:
                assert abs(got - want) < 1e-6, (q.request_id, name, got, want)


def spans_named(trace: dict, name: str, pid: int = 1) -> list[dict]:
    return [
        e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == name and e["pid"] == pid
    ]


def small_workload(n: int = 12, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    return [
        SimRequest(
            [rng.randrange(100, 1000) for _ in range(rng.randrange(20, 200))],
            rng.randrange(5, 40),
            arrival=0.002 * i,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def simulated():
    """A simulated run with chunked prefill (64-token cap) and preemption (24 KV blocks)."""
    return simulator.simulate(
        "smollm2-135m-instruct",
        "h100-sxm",
        workload=small_workload(),
        num_kv_blocks=24,
        max_num_seqs=8,
        long_prefill_token_threshold=64,
        max_model_len=384,
    )


def test_simulated_trace_validates_round_trips_and_shows_every_span(simulated):
    records, requests = simulated.records, simulated.requests
    trace = te.chrome_trace([("simulated", records, requests)])
    validate_trace(json.loads(json.dumps(trace)))
    assert_round_trip(trace, requests)
    # one track per request (thread_name), named spans, one scheduler slice per step
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"scheduler"} | {q.request_id for q in requests}
    assert len(spans_named(trace, te.REQUEST_SPAN)) == len(requests)
    for name in te.SPAN_NAMES:
        assert spans_named(trace, name), name
    assert any(s["args"]["num_steps"] > 1 for s in spans_named(trace, "prefill")), "no chunks"
    preempted = spans_named(trace, "preempted")
    assert len(preempted) == sum(q.num_preemptions for q in requests) > 0
    # the scheduler slices sit on the engine clock, in µs, with the decision as args
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "scheduler"]
    assert len(steps) == len(records)
    for e, r in zip(sorted(steps, key=lambda e: e["ts"]), records):
        assert e["ts"] == pytest.approx(r.engine_start_time * 1e6, abs=EPS_US)
        assert e["dur"] == pytest.approx(r.engine_duration * 1e6, abs=EPS_US)
        assert [s["request_id"] for s in e["args"]["scheduled"]] == [
            s.request_id for s in r.scheduled
        ]
        assert (
            e["args"]["unscheduled"] == r.unscheduled
            and e["args"]["token_budget"] == r.token_budget
        )
    reasons = {why for e in steps for why in e["args"]["unscheduled"].values()}
    assert "preempted" in reasons
    counters = {e["name"] for e in trace["traceEvents"] if e["ph"] == "C"}
    assert counters == {"KV blocks", "requests"}


def test_real_engine_trace_leaves_out_a_pause_and_exports_mid_run(make_engine):
    """The tiny model on the measured engine clock: chunked prefill, preemption, a pause between
    two steps that the trace does not show, and an export while requests are still running."""
    engine = make_engine(
        num_kv_blocks=8, max_model_len=96, max_num_batched_tokens=40, max_num_seqs=3
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((45, 30, 12, 43)):
        engine.add_request(
            request_id=f"r{i}",
            prompt_token_ids=list(range(1000 + i, 1000 + i + n)),
            sampling_params=params,
        )
    records = [engine.step() for _ in range(3)]
    mid = te.chrome_trace([("tiny", records, engine.all_requests())])
    validate_trace(mid)
    assert_round_trip(mid, engine.all_requests())
    assert any(v["e2e"] is None for v in te.read_trace_metrics(mid).values())
    time.sleep(0.3)  # a learner's pause
    while engine.has_unfinished_requests():
        records.append(engine.step())
    requests = engine.all_requests()
    trace = te.chrome_trace([("tiny", records, requests)])
    validate_trace(trace)
    assert_round_trip(trace, requests)
    assert spans_named(trace, "preempted") and spans_named(trace, "decode")
    wall_e2e = max(q.metrics("wall").e2e for q in requests)
    engine_e2e = max(q.metrics("engine").e2e for q in requests)
    assert wall_e2e - engine_e2e > 0.25  # the pause is on the wall clock only
    end_us = max(e["ts"] + e.get("dur", 0) for e in trace["traceEvents"])
    assert end_us <= 1e6 * (records[-1].engine_start_time + records[-1].engine_duration) + EPS_US


def test_several_runs_share_one_trace_one_process_each(simulated):
    other = simulator.simulate(
        "smollm2-135m-instruct", "h100-sxm", workload=small_workload(6, seed=1), max_model_len=384
    )
    runs = [("A", simulated.records, simulated.requests), ("B", other.records, other.requests)]
    trace = te.chrome_trace(runs)
    validate_trace(trace)
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {1: "A", 2: "B"}
    assert_round_trip(trace, simulated.requests, pid=1)
    assert_round_trip(trace, other.requests, pid=2)
    with pytest.raises(ValueError, match="pid="):
        te.read_trace_metrics(trace)  # sim-0 is in both runs


def documented_columns() -> str:
    return (REPO / "docs" / "traces.md").read_text(encoding="utf-8")


def test_tables_are_pandas_ready_and_documented(simulated):
    runs = [("simulated", simulated.records, simulated.requests)]
    tables = te.trace_tables(runs)
    steps = pd.read_csv(io.StringIO(te.to_csv(tables["steps"], te.STEP_COLUMNS)))
    assert list(steps.columns) == list(te.STEP_COLUMNS)
    assert steps["step"].nunique() == len(simulated.records)
    scheduled = steps[steps["decision"] == "scheduled"]
    assert len(scheduled) == sum(len(r.scheduled) for r in simulated.records)
    assert (steps["decision"] == "preempted").sum() == sum(
        len(r.preempted) for r in simulated.records
    )
    journeys = pd.read_csv(io.StringIO(te.to_csv(tables["journeys"], te.JOURNEY_COLUMNS)))
    assert len(journeys) == sum(len(q.journey) for q in simulated.requests)
    data = json.loads(te.tables_json(runs))
    requests = pd.DataFrame(data["requests"])
    assert list(requests.columns) == list(te.REQUEST_COLUMNS)
    by_id = requests.set_index("request_id")
    for q in simulated.requests:
        m = q.metrics("engine")
        assert by_id.loc[q.request_id, "ttft_s"] == pytest.approx(m.ttft)
        assert by_id.loc[q.request_id, "e2e_s"] == pytest.approx(m.e2e)
    docs = documented_columns()
    missing = [c for cols in te.TABLES.values() for c in cols if f"`{c}`" not in docs]
    assert missing == []


def test_simulate_cli_writes_the_trace(tmp_path):
    from engine.__main__ import main

    path = tmp_path / "sim.trace.json"
    argv = [
        "simulate",
        "--model-preset",
        "smollm2-135m-instruct",
        "--num-requests",
        "8",
        "--rate",
        "50",
    ]
    argv += ["--output-len", "4", "16", "--prompt-len", "16", "64", "--trace", str(path)]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(argv) == 0
    assert str(path) in out.getvalue()
    trace = json.loads(path.read_text())
    validate_trace(trace)
    back = te.read_trace_metrics(trace)
    assert len(back) == 8 and all(v["e2e"] is not None for v in back.values())


def test_lab_export_files_put_a_comparison_in_one_trace():
    """ui/export.py's files for two engines (a lab comparison), without Streamlit running."""
    from engine.tools.workload import run_workload
    from ui.export import export_files
    from ui.trace_frames import export_frames

    runs = []
    for label, budget in (("예산 512", 512), ("예산 64", 64)):
        engine = simulator.make_simulated_engine(
            "smollm2-135m-instruct", max_model_len=384, max_num_batched_tokens=budget
        )
        records, _ = run_workload(engine, small_workload(5))
        runs.append((label, engine, records))
    files = {f.label: f for f in export_files("ch08 lab", runs)}
    assert list(files) == [
        "Perfetto 트레이스 (JSON)",
        "스텝 기록 (CSV)",
        "요청 여정 (CSV)",
        "요청 지표 (CSV)",
        "전체 (JSON)",
    ]
    assert files["Perfetto 트레이스 (JSON)"].file_name == "ch08-lab-trace.json"
    trace = json.loads(files["Perfetto 트레이스 (JSON)"].make())
    validate_trace(trace)
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {1: "예산 512", 2: "예산 64"}
    for pid, (_, engine, _) in enumerate(runs, start=1):
        assert_round_trip(trace, engine.all_requests(), pid=pid)
    steps = pd.read_csv(io.StringIO(files["스텝 기록 (CSV)"].make()))
    assert set(steps["run"]) == {"예산 512", "예산 64"}
    assert steps.groupby("run")["step"].nunique().to_dict() == {
        label: len(records) for label, _, records in runs
    }
    everything = json.loads(files["전체 (JSON)"].make())
    frames = export_frames([(label, records, e.all_requests()) for label, e, records in runs])
    for name, frame in frames.items():
        assert len(frame) == len(everything[name])
        assert list(frame.columns) == everything["columns"][name]


def test_generate_and_bench_offline_write_their_traces(tiny_model_dir, tmp_path):
    """`generate --trace` (in-process, the tiny model) and the bench's offline section with a
    trace path: each file validates and holds its run's requests (not the bench's warm-up)."""
    from engine.__main__ import main
    from engine.tools.bench.config import BenchConfig
    from engine.tools.bench.run import BenchRun, open_engine, run_offline

    path = tmp_path / "generate.json"
    argv = ["generate", "Hello", "--model", str(tiny_model_dir), "--device", "cpu"]
    argv += ["--max-tokens", "6", "--trace", str(path)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    trace = json.loads(path.read_text())
    validate_trace(trace)
    (only,) = te.read_trace_metrics(trace).values()
    assert 0 < only["ttft"] <= only["e2e"]
    bench_path = tmp_path / "bench.json"
    config = BenchConfig(
        model=str(tiny_model_dir), device="cpu", num_requests=4, prompt_len=(8, 24),
        output_len=(4, 8), skip_transformers=True, trace=str(bench_path),
    )  # fmt: skip
    llm, model_dir = open_engine(config)
    try:
        run = BenchRun(config, llm, model_dir, lambda _: None, ["offline"])
        run_offline(run)
    finally:
        llm.shutdown()
    trace = json.loads(bench_path.read_text())
    validate_trace(trace)
    assert len(te.read_trace_metrics(trace)) == 4
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "scheduler"]
    assert len(steps) == len(llm.step_records)
