"""Take a run home: a run's step records and request journeys as a Chrome / Perfetto trace (the
Trace Event Format) and as pandas-ready tables (CSV and JSON records). docs/traces.md documents
every event, span and column.

Every time is on the ENGINE clock (engine/clock.py): a learner's pause between two steps is not in
the trace, and a simulated run shows its computed step times. Trace timestamps are microseconds
(the format's unit), so `ts / 1e6` is the engine time in seconds.

A run is `(label, records, requests)`; several runs (a comparison) go into one trace, one process
(pid) per run, named by its label.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.request import Request
from engine.trace import StepRecord

Run = tuple[str, list[StepRecord], list[Request]]

US_PER_S = 1e6
# Track ids of run `pid`: pid * TID_STRIDE (its scheduler), + 1, 2, … (its requests). Never 0
# (Perfetto's idle "swapper" thread), never equal to a pid (a process's main thread), and unique
# across the runs of one file.
TID_STRIDE = 100_000
REQUEST_SPAN = "request"  # the root span of a request's track: arrival → finish
SPAN_NAMES = ("queued", "prefill", "decode", "preempted")
# A scheduled span (prefill / decode) ends at the first of these journey events after it.
_CLOSING_KINDS = frozenset(("scheduled", "preempted", "finished"))
_TOKEN_KINDS = frozenset(("first_token", "token"))


# -- spans of one request ----------------------------------------------------------------------


@dataclass
class Span:
    """A named interval on a request's track, engine seconds."""

    name: str
    start: float
    end: float | None = None
    args: dict = field(default_factory=dict)
    last_step: int | None = None  # of a scheduled span: the last step it covers
    last_token: float | None = None  # of a scheduled span: its last token's time, if any


def _span_name(phase: str) -> str:
    return "decode" if phase == "decode" else "prefill"


class _SpanBuilder:
    """A request's journey → its spans, event by event (events in engine-time order).

    queued: arrival → first scheduling. prefill / decode: the steps that ran the request in that
    phase back to back (consecutive step numbers) are one span, from the first one's scheduling to
    its last token, or to the last step's end when no token came (a prefill chunk). preempted: the
    preemption → the next scheduling."""

    def __init__(self, step_ends: dict[int, float]):
        self.step_ends = step_ends
        self.spans: list[Span] = []
        self.open: Span | None = None
        self.first_token: float | None = None

    def feed(self, kind: str, t: float, step: int | None, detail: dict) -> None:
        if kind in _TOKEN_KINDS:
            self._token(kind, t)
        elif kind == "scheduled":
            self._scheduled(t, step, detail)
        elif kind == "preempted":
            self.close(t)
            self.open = Span("preempted", t, args={"step": step, "mode": detail.get("mode")})
        elif kind == "finished":
            self.close(t)

    def _token(self, kind: str, t: float) -> None:
        if self.open is None or self.open.name not in ("prefill", "decode"):
            return
        self.open.last_token = t
        self.open.args["num_output_tokens"] = self.open.args.get("num_output_tokens", 0) + 1
        if kind == "first_token":
            self.first_token = t
            self.open.args["first_token"] = True

    def _scheduled(self, t: float, step: int | None, detail: dict) -> None:
        name = _span_name(detail.get("phase", "decode"))
        span = self.open
        contiguous = (
            span is not None
            and span.name == name
            and step is not None
            and span.last_step is not None
            and step == span.last_step + 1
        )
        if not contiguous:
            self.close(t)
            span = self.open = Span(name, t, args={"first_step": step, "num_steps": 0})
            span.args["phases"] = []
        span.last_step = step
        span.args["last_step"] = step
        span.args["num_steps"] += 1
        span.args["num_scheduled_tokens"] = span.args.get("num_scheduled_tokens", 0) + int(
            detail.get("num_tokens", 0)
        )
        phase = detail.get("phase", "decode")
        if phase not in span.args["phases"]:
            span.args["phases"].append(phase)
        if detail.get("num_draft_tokens"):
            drafts = span.args.get("num_draft_tokens", 0)
            span.args["num_draft_tokens"] = drafts + detail["num_draft_tokens"]

    def close(self, t: float) -> None:
        """End the open span by an event at engine time t (never after it)."""
        span, self.open = self.open, None
        if span is None:
            return
        if span.name in ("prefill", "decode"):
            if span.last_token is not None:
                t = min(t, span.last_token)
            elif span.last_step in self.step_ends:
                t = min(t, self.step_ends[span.last_step])
        span.end = max(t, span.start)
        self.spans.append(span)


def _journey(request: Request) -> list:
    """The request's journey events that carry an engine time, in engine-time order."""
    events = [e for e in request.journey if e.engine_time is not None]
    return sorted(events, key=lambda e: e.engine_time)


def request_spans(
    request: Request, step_ends: dict[int, float], run_end: float
) -> tuple[Span, list[Span]]:
    """(root span arrival → finish, its child spans queued / prefill / decode / preempted) on the
    engine clock. A request still live at run_end keeps its open span and root up to then."""
    events = _journey(request)
    arrival = next((e.engine_time for e in events if e.kind == "arrival"), None)
    if arrival is None:
        arrival = events[0].engine_time if events else run_end
    builder = _SpanBuilder(step_ends)
    builder.open = Span("queued", arrival)
    finish = None
    for e in events:
        if e.kind == "arrival":
            continue
        t = max(e.engine_time, arrival)
        builder.feed(e.kind, t, e.step, e.detail)
        if e.kind == "finished" and finish is None:
            finish = t
    end = finish if finish is not None else max(run_end, arrival)
    builder.close(end)
    root_args = {
        "request_id": request.request_id,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_output_tokens": request.num_output_tokens,
        "num_preemptions": request.num_preemptions,
        "finished": finish is not None,
        "finish_reason": request.finish_reason,
    }
    return Span(REQUEST_SPAN, arrival, end, root_args), builder.spans


# -- Trace Event Format ------------------------------------------------------------------------


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _us(seconds: float) -> float:
    """Microseconds on a whole-nanosecond grid. Perfetto reads ts and dur as nanoseconds, each
    rounded on its own: spans that meet or nest in seconds still meet or nest after that only if
    both ends already sit on the grid (a child would otherwise overhang its parent by 1 ns and be
    moved to an overlap track)."""
    return _ns(seconds) / 1000


def scheduler_tid(pid: int) -> int:
    return pid * TID_STRIDE


def _complete(name: str, start: float, end: float, pid: int, tid: int, args: dict) -> dict:
    return {
        "name": name,
        "cat": "scheduler" if tid == scheduler_tid(pid) else "request",
        "ph": "X",
        "ts": _us(start),
        "dur": max(_ns(end) - _ns(start), 0) / 1000,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _metadata(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def step_ends(records: list[StepRecord]) -> dict[int, float]:
    """Each step's end on the engine clock."""
    return {r.step: r.engine_start_time + r.engine_duration for r in records}


def run_end(records: list[StepRecord], requests: list[Request]) -> float:
    """Where the run stands on the engine clock: the latest step end or journey event."""
    times = [r.engine_start_time + r.engine_duration for r in records]
    times += [e.engine_time for q in requests for e in q.journey if e.engine_time is not None]
    return max(times, default=0.0)


_SCHEDULED_IF_NONZERO = (
    "num_prefix_hit_tokens",
    "num_recomputed_tokens",
    "num_draft_tokens",
    "num_accepted_tokens",
)


def _scheduled_args(s) -> dict:
    """One scheduled request in a step slice's args; the counts that are usually 0 only when not
    (a step slice lists every request it ran: this is most of a large trace's bytes)."""
    args = {
        "request_id": s.request_id,
        "phase": s.phase,
        "num_tokens": s.num_tokens,
        "num_computed_tokens": s.num_computed_tokens,
    }
    args.update({k: getattr(s, k) for k in _SCHEDULED_IF_NONZERO if getattr(s, k)})
    return args


def _decision_args(record: StepRecord) -> dict:
    """What the scheduler decided in a step, as the scheduler slice's args."""
    return {
        "step": record.step,
        "scheduled": [_scheduled_args(s) for s in record.scheduled],
        "unscheduled": dict(record.unscheduled),
        "preempted": list(record.preempted),
        "finished": dict(record.finished),
        "token_budget": record.token_budget,
        "num_scheduled_tokens": record.total_tokens,
        "max_num_seqs": record.max_num_seqs,
        "num_running": record.num_running,
        "num_waiting": record.num_waiting,
        "wall_duration_ms": 1000.0 * record.duration,
    }


def scheduler_events(records: list[StepRecord], pid: int) -> list[dict]:
    """One slice per step on the scheduler track, and the counter tracks at each step's end:
    KV blocks and running / waiting requests after the step."""
    events = []
    for r in records:
        end = r.engine_start_time + r.engine_duration
        name = f"step {r.step}"
        events.append(
            _complete(name, r.engine_start_time, end, pid, scheduler_tid(pid), _decision_args(r))
        )
        kv = {"used": r.kv.num_used, "cached_free": r.kv.num_cached_free}
        queues = {"running": r.num_running, "waiting": r.num_waiting}
        for counter, ts, args in (
            ("KV blocks", end, kv),
            ("requests", end, queues),
        ):
            events.append(
                {
                    "name": counter,
                    "ph": "C",
                    "ts": _us(ts),
                    "pid": pid,
                    "tid": scheduler_tid(pid),
                    "args": args,
                }
            )
    return events


def _request_track(request: Request, tid: int, pid: int, ends: dict, end: float) -> list[dict]:
    root, spans = request_spans(request, ends, end)
    events = [_complete(REQUEST_SPAN, root.start, root.end, pid, tid, root.args)]
    # A wait of no time (scheduled on arrival, resumed in the step that preempted it) is left out:
    # drawn, it would sit inside the span that starts at the same time.
    events += [
        _complete(s.name, s.start, s.end, pid, tid, s.args)
        for s in spans
        if _ns(s.end) > _ns(s.start) or s.name not in ("queued", "preempted")
    ]
    return events


def run_events(run: Run, pid: int) -> list[dict]:
    """One run's process: its name, the scheduler track, one track per request (by arrival)."""
    label, records, requests = run
    requests = [q for q in requests if any(e.engine_time is not None for e in q.journey)]
    requests.sort(key=lambda q: _journey(q)[0].engine_time)
    ends, end = step_ends(records), run_end(records, requests)
    tid0 = scheduler_tid(pid)
    events = [
        _metadata("process_name", pid, tid0, {"name": label}),
        _metadata("process_sort_index", pid, tid0, {"sort_index": pid}),
        _metadata("thread_name", pid, tid0, {"name": "scheduler"}),
        _metadata("thread_sort_index", pid, tid0, {"sort_index": 0}),
    ]
    events += scheduler_events(records, pid)
    for i, request in enumerate(requests, start=1):
        tid = tid0 + i
        events.append(_metadata("thread_name", pid, tid, {"name": request.request_id}))
        events.append(_metadata("thread_sort_index", pid, tid, {"sort_index": i}))
        events += _request_track(request, tid, pid, ends, end)
    return events


def chrome_trace(runs: list[Run]) -> dict:
    """The runs as one Trace Event Format object (ui.perfetto.dev, chrome://tracing). Events
    are sorted by time, a parent span before the spans it contains."""
    events = [e for pid, run in enumerate(runs, start=1) for e in run_events(run, pid)]
    events.sort(key=lambda e: (e["ph"] != "M", e["ts"], -e.get("dur", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "clock": "engine seconds since the engine started (a pause between steps is not in it)",
            "runs": [label for label, _, _ in runs],
            "docs": "docs/traces.md",
        },
    }


def trace_json(runs: list[Run]) -> str:
    """chrome_trace as compact JSON text (what a file holds)."""
    return json.dumps(chrome_trace(runs), separators=(",", ":"), ensure_ascii=False)


def write_trace(path: str | Path, runs: list[Run]) -> Path:
    """Write the runs' trace as JSON; returns the path."""
    path = Path(path)
    path.write_text(trace_json(runs), encoding="utf-8")
    return path


def read_trace_metrics(trace_json: dict | str, pid: int | None = None) -> dict[str, dict]:
    """Read a trace's request spans back: {request_id: {"ttft": s, "e2e": s}} (None where the
    request had no first token / had not finished). TTFT = the end of the span that brought the
    first token − the request span's start; E2E = the request span's duration. `pid`: one run of
    a several-run trace (request ids may repeat across runs: reading them together is refused)."""
    trace = json.loads(trace_json) if isinstance(trace_json, str) else trace_json
    roots: dict[tuple[int, int], dict] = {}
    first_tokens: dict[tuple[int, int], float] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") != "request" or pid not in (None, e["pid"]):
            continue
        track = (e["pid"], e["tid"])
        if e["name"] == REQUEST_SPAN:
            roots[track] = e
        elif e.get("args", {}).get("first_token"):
            first_tokens[track] = e["ts"] + e["dur"]
    metrics: dict[str, dict] = {}
    for track, root in roots.items():
        request_id = root["args"]["request_id"]
        if request_id in metrics:
            raise ValueError(f"request {request_id!r} is in several runs: pass pid=")
        first = first_tokens.get(track)
        metrics[request_id] = {
            "ttft": None if first is None else (first - root["ts"]) / US_PER_S,
            "e2e": root["dur"] / US_PER_S if root["args"].get("finished") else None,
        }
    return metrics


# -- tables ------------------------------------------------------------------------------------

STEP_COLUMNS = (
    "run",
    "step",
    "engine_start_s",
    "engine_duration_s",
    "wall_duration_s",
    "token_budget",
    "num_scheduled_tokens",
    "max_num_seqs",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_cached_free",
    "kv_blocks_free",
    "kv_usage",
    "decision",
    "request_id",
    "phase",
    "num_tokens",
    "num_computed_tokens",
    "num_prompt_tokens",
    "num_prefix_hit_tokens",
    "num_recomputed_tokens",
    "num_draft_tokens",
    "num_accepted_tokens",
    "reason",
    "finish_reason",
)
JOURNEY_COLUMNS = (
    "run",
    "request_id",
    "seq",
    "kind",
    "step",
    "engine_time_s",
    "wall_time_s",
    "phase",
    "num_tokens",
    "token_id",
    "reason",
    "detail",
)
REQUEST_COLUMNS = (
    "run",
    "request_id",
    "status",
    "finish_reason",
    "arrival_s",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "queue_time_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "mean_itl_s",
    "max_itl_s",
    "num_prompt_tokens",
    "num_output_tokens",
    "num_cached_tokens",
    "num_preemptions",
)


def _step_fields(label: str, r: StepRecord) -> dict:
    return {
        "run": label,
        "step": r.step,
        "engine_start_s": r.engine_start_time,
        "engine_duration_s": r.engine_duration,
        "wall_duration_s": r.duration,
        "token_budget": r.token_budget,
        "num_scheduled_tokens": r.total_tokens,
        "max_num_seqs": r.max_num_seqs,
        "num_running": r.num_running,
        "num_waiting": r.num_waiting,
        "kv_blocks_used": r.kv.num_used,
        "kv_blocks_cached_free": r.kv.num_cached_free,
        "kv_blocks_free": r.kv.num_free,
        "kv_usage": r.kv.usage,
    }


def _decision_rows(r: StepRecord) -> list[dict]:
    """The step's decision per request: scheduled (with its tokens), unscheduled or preempted
    (with the scheduler's reason)."""
    rows = [
        {
            "decision": "scheduled",
            "request_id": s.request_id,
            "phase": s.phase,
            "num_tokens": s.num_tokens,
            "num_computed_tokens": s.num_computed_tokens,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_prefix_hit_tokens": s.num_prefix_hit_tokens,
            "num_recomputed_tokens": s.num_recomputed_tokens,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
        }
        for s in r.scheduled
    ]
    for request_id, reason in r.unscheduled.items():
        decision = "preempted" if reason == "preempted" else "unscheduled"
        rows.append({"decision": decision, "request_id": request_id, "reason": reason})
    listed = {row["request_id"] for row in rows}
    rows += [
        {"decision": "preempted", "request_id": rid, "reason": "preempted"}
        for rid in r.preempted
        if rid not in listed
    ]
    for row in rows:
        row["finish_reason"] = r.finished.get(row["request_id"])
    return rows


def step_rows(records: list[StepRecord], label: str = "engine") -> list[dict]:
    """One row per (step, request the step decided about); a step that decided about no
    request has one row with the step's columns only. Columns: STEP_COLUMNS."""
    rows = []
    for r in records:
        step = _step_fields(label, r)
        decisions = _decision_rows(r) or [{}]
        rows += [_fill(STEP_COLUMNS, {**step, **d}) for d in decisions]
    return rows


def _fill(columns: tuple[str, ...], row: dict) -> dict:
    return {c: row.get(c) for c in columns}


def journey_rows(requests: list[Request], label: str = "engine") -> list[dict]:
    """One row per journey event of each request. wall_time_s counts from the earliest wall time
    among the requests (perf_counter has no meaningful origin). Columns: JOURNEY_COLUMNS."""
    wall0 = min((e.time for q in requests for e in q.journey), default=0.0)
    rows = []
    for q in requests:
        for seq, e in enumerate(q.journey):
            d = e.detail
            row = {
                "run": label,
                "request_id": q.request_id,
                "seq": seq,
                "kind": e.kind,
                "step": e.step,
                "engine_time_s": e.engine_time,
                "wall_time_s": e.time - wall0,
                "phase": d.get("phase"),
                "num_tokens": d.get("num_tokens"),
                "token_id": d.get("token_id"),
                "reason": d.get("reason"),
                "detail": json.dumps(d, sort_keys=True, default=str),
            }
            rows.append(row)
    return rows


def request_rows(requests: list[Request], label: str = "engine") -> list[dict]:
    """One row per request: RequestMetrics on the engine clock. Columns: REQUEST_COLUMNS."""
    rows = []
    for q in requests:
        m = q.metrics(clock="engine")
        itl = m.itl
        row = {
            "run": label,
            "request_id": q.request_id,
            "status": q.status.value,
            "finish_reason": q.finish_reason,
            "arrival_s": m.arrival_time,
            "first_scheduled_s": m.first_scheduled_time,
            "first_token_s": m.first_token_time,
            "finish_s": m.finish_time,
            "queue_time_s": m.queue_time,
            "ttft_s": m.ttft,
            "tpot_s": m.tpot,
            "e2e_s": m.e2e,
            "mean_itl_s": sum(itl) / len(itl) if itl else None,
            "max_itl_s": max(itl) if itl else None,
            "num_prompt_tokens": m.num_prompt_tokens,
            "num_output_tokens": m.num_output_tokens,
            "num_cached_tokens": m.num_cached_tokens,
            "num_preemptions": m.num_preemptions,
        }
        rows.append(row)
    return rows


TABLES = {"steps": STEP_COLUMNS, "journeys": JOURNEY_COLUMNS, "requests": REQUEST_COLUMNS}


def trace_tables(runs: list[Run]) -> dict[str, list[dict]]:
    """The runs as three tables (TABLES): steps, journeys, requests; a `run` column tells the
    runs apart."""
    tables: dict[str, list[dict]] = {name: [] for name in TABLES}
    for label, records, requests in runs:
        tables["steps"] += step_rows(records, label)
        tables["journeys"] += journey_rows(requests, label)
        tables["requests"] += request_rows(requests, label)
    return tables


def to_csv(rows: list[dict], columns: tuple[str, ...]) -> str:
    """Rows as CSV text with a header (an empty cell for None)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def tables_json(runs: list[Run]) -> str:
    """Everything as one JSON object: {"steps": [...], "journeys": [...], "requests": [...],
    "columns": {...}} (records: pandas.DataFrame(data["steps"]) reads a table)."""
    data: dict = dict(trace_tables(runs))
    data["columns"] = {name: list(columns) for name, columns in TABLES.items()}
    data["clock"] = "engine seconds (see docs/traces.md)"
    return json.dumps(data, ensure_ascii=False, default=str)
