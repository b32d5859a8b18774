"""Real traces in: public production-trace formats as the simulator's and the engine's workload.

Two formats, both published with their papers:

- Mooncake (github.com/kvcache-ai/Mooncake, its traces folder): JSON lines with `timestamp`
  (milliseconds), `input_length`, `output_length` and `hash_ids`, one id per `block_size`
  (512) tokens of the prompt. The trace has no text: two requests with the same hash id share
  that block's tokens. So each block's token ids are drawn from a random generator seeded with
  its hash id: equal hash-id prefixes give equal token prefixes, and prefix caching sees the
  trace's real sharing. The last block may be partial (input_length says how long).
- Azure LLM inference traces (github.com/Azure/AzurePublicDataset, AzureLLMInferenceDataset2023
  and 2024): CSV with `TIMESTAMP` (a datetime string such as "2023-11-16 18:15:46.6805900", or
  plain seconds), `ContextTokens` and `GeneratedTokens`. No sharing is recorded: each prompt's
  ids are drawn from a generator seeded with its line.

Both give the workload the simulator and the benchmark already run (SimRequest, arrivals in
seconds from the first request), plus the conditions the replay rests on: the file, how many
requests it has and how many were used, the time compression and the length caps, with how many
requests each cap shortened. A bad line raises one TraceError naming the file, the line and the
problem; nothing is dropped silently.

    trace = read_trace("mooncake_trace.jsonl", vocab_size=49152, time_scale=10, max_requests=100)
    trace.requests        # [SimRequest, ...] for simulate(workload=...) or run_workload
    print(describe(trace))
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from engine.tools.workload import SimRequest

FORMATS = ("mooncake", "azure")
MOONCAKE_BLOCK_SIZE = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read as its format says: which file, which line, what."""

    def __init__(self, path: str | Path, line: int | None, problem: str):
        where = f"{path}, line {line}" if line is not None else str(path)
        super().__init__(f"trace {where}: {problem}")
        self.path, self.line, self.problem = str(path), line, problem


@dataclass
class TraceRow:
    """One request as the file has it: arrival (seconds from the first), lengths, block ids."""

    line: int
    arrival: float
    input_length: int
    output_length: int
    hash_ids: list[int] | None = None  # Mooncake only


@dataclass
class TraceWorkload:
    """A trace read and scaled: the requests to run and what was done to get them."""

    requests: list[SimRequest]
    conditions: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Parsing


def _length(path, line: int, record: dict, name: str) -> int:
    if name not in record:
        raise TraceError(path, line, f"missing field {name!r}")
    value = record[name]
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TraceError(path, line, f"{name} is not an integer: {value!r}") from None
    if isinstance(value, float) and number != value or isinstance(value, bool):
        raise TraceError(path, line, f"{name} is not an integer: {value!r}")
    if number < 0:
        raise TraceError(path, line, f"{name} is negative: {number}")
    return number


def _check_order(path, line: int, t: float, previous: float | None) -> None:
    if not math.isfinite(t):
        raise TraceError(path, line, f"timestamp is not a finite number: {t}")
    if previous is not None and t < previous:
        raise TraceError(
            path, line, f"timestamp goes back in time ({t:g} after {previous:g}); "
            "a trace must be sorted by arrival"
        )  # fmt: skip


def _mooncake_rows(path: Path, block_size: int) -> Iterator[TraceRow]:
    previous = None
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise TraceError(path, line, f"not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(path, line, "not a JSON object")
            if "timestamp" not in record:
                raise TraceError(path, line, "missing field 'timestamp'")
            stamp = record["timestamp"]
            if not isinstance(stamp, (int, float)) or isinstance(stamp, bool):
                raise TraceError(path, line, f"timestamp is not a number of ms: {stamp!r}")
            _check_order(path, line, float(stamp), previous)
            previous = float(stamp)
            n_in = _length(path, line, record, "input_length")
            n_out = _length(path, line, record, "output_length")
            hash_ids = record.get("hash_ids")
            if not isinstance(hash_ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
            ):
                raise TraceError(path, line, "missing or malformed 'hash_ids' (a list of integers)")
            if len(hash_ids) != math.ceil(n_in / block_size):
                raise TraceError(
                    path, line, f"{len(hash_ids)} hash_ids for input_length {n_in}: expected "
                    f"ceil({n_in} / {block_size}) = {math.ceil(n_in / block_size)}"
                )  # fmt: skip
            yield TraceRow(line, float(stamp) / 1000.0, n_in, n_out, hash_ids)


_DATETIME = re.compile(r"^(.*?\d\d:\d\d:\d\d)(?:\.(\d+))?(.*)$")  # date time, fraction, zone


def parse_timestamp(text: str) -> float:
    """Seconds: a plain number, or a datetime string (the Azure files' "2023-11-16
    18:15:46.6805900", with or without a zone such as "+00:00"; fractional digits beyond
    microseconds are cut, not rounded; no zone reads as UTC)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    match = _DATETIME.match(text)
    if match is None:
        raise ValueError(f"not a datetime: {text!r}")
    date, fraction, zone = match.groups()
    stamp = datetime.datetime.fromisoformat(date + (f".{fraction[:6]}" if fraction else "") + zone)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return stamp.timestamp()


def _azure_rows(path: Path) -> Iterator[TraceRow]:
    previous = None
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(path, 1, f"header lacks column(s) {', '.join(missing)}")
        for record in reader:
            line = reader.line_num
            if None in record or any(record[c] is None for c in AZURE_COLUMNS):
                raise TraceError(path, line, f"expected {len(reader.fieldnames)} columns")
            try:
                t = parse_timestamp(record["TIMESTAMP"])
            except ValueError:
                raise TraceError(
                    path, line, f"TIMESTAMP is not a datetime or seconds: {record['TIMESTAMP']!r}"
                ) from None
            _check_order(path, line, t, previous)
            previous = t
            n_in = _length(path, line, record, "ContextTokens")
            n_out = _length(path, line, record, "GeneratedTokens")
            yield TraceRow(line, t, n_in, n_out)


def detect_format(path: str | Path) -> str:
    """ "mooncake" for JSON lines, "azure" for a CSV whose header names TIMESTAMP."""
    with open(path, encoding="utf-8") as f:
        first = next((text for text in f if text.strip()), "")
    if first.lstrip().startswith("{"):
        return "mooncake"
    if "TIMESTAMP" in first:
        return "azure"
    raise TraceError(
        path, 1, "neither Mooncake JSON lines nor an Azure CSV (a header with TIMESTAMP)"
    )


def read_rows(path: str | Path, fmt: str = "auto", block_size: int = MOONCAKE_BLOCK_SIZE):
    """Every row of the file, checked, arrivals made relative to the first; and the format."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(path, None, "no such file")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    try:  # a binary or otherwise unreadable file (an upload in the app) is a bad trace, too
        fmt = detect_format(path) if fmt == "auto" else fmt
        if fmt not in FORMATS:
            raise ValueError(f"unknown trace format {fmt!r}; known: auto, {', '.join(FORMATS)}")
        rows = list(_mooncake_rows(path, block_size) if fmt == "mooncake" else _azure_rows(path))
    except UnicodeDecodeError as error:
        raise TraceError(path, None, f"not UTF-8 text ({error.reason})") from None
    except csv.Error as error:
        raise TraceError(path, None, f"not a readable CSV ({error})") from None
    if not rows:
        raise TraceError(path, None, "no requests in the file")
    for row in rows:
        if row.input_length < 1:
            raise TraceError(path, row.line, "a prompt of 0 tokens cannot be run")
    start = rows[0].arrival
    for row in rows:
        row.arrival -= start
    return rows, fmt


# ---------------------------------------------------------------------------------------------
# Token ids and scaling


def _token_range(vocab_size: int, special_ids: Iterable[int]) -> tuple[int, int]:
    low = max(special_ids, default=-1) + 1
    if low >= vocab_size:
        raise ValueError(f"no ordinary token ids in a vocabulary of {vocab_size}")
    return low, vocab_size


def _block_tokens(key: str, n: int, low: int, high: int) -> list[int]:
    rng = random.Random(key)  # a str seed is hashed with SHA-512: the same on every run
    return rng.choices(range(low, high), k=n)


def prompt_tokens(row: TraceRow, length: int, block_size: int, low: int, high: int, cache: dict):
    """The first `length` prompt ids of a row: per Mooncake block, ids seeded by its hash id (the
    same block, the same ids); an Azure row's ids are seeded by its line."""
    if row.hash_ids is None:
        return _block_tokens(f"azure-line-{row.line}", length, low, high)
    ids: list[int] = []
    for hash_id in row.hash_ids:
        if len(ids) >= length:
            break
        if hash_id not in cache:
            cache[hash_id] = _block_tokens(f"mooncake-block-{hash_id}", block_size, low, high)
        ids.extend(cache[hash_id][: length - len(ids)])
    return ids


@dataclass
class Scaling:
    """How a trace is fitted to an engine: arrivals ÷ time_scale, the first max_requests only,
    prompts cut to max_input_len (a cut keeps the prefix, so sharing survives it), outputs to
    max_output_len, and prompt + output to max_total_len (a context limit; the prompt is cut)."""

    time_scale: float = 1.0
    max_requests: int | None = None
    max_input_len: int | None = None
    max_output_len: int | None = None
    max_total_len: int | None = None

    def check(self) -> None:
        if not (isinstance(self.time_scale, (int, float)) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale!r}")
        for name in ("max_requests", "max_input_len", "max_output_len", "max_total_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_total_len is not None and self.max_total_len < 2:
            raise ValueError("max_total_len must leave room for a prompt token and an output one")


def _scaled_lengths(row: TraceRow, s: Scaling, counts: dict) -> tuple[int, int]:
    n_in, n_out = row.input_length, row.output_length
    if n_out < 1:
        n_out, counts["output_raised_to_1"] = 1, counts["output_raised_to_1"] + 1
    if s.max_output_len is not None and n_out > s.max_output_len:
        n_out, counts["capped_output"] = s.max_output_len, counts["capped_output"] + 1
    if s.max_total_len is not None and n_out >= s.max_total_len:
        n_out = s.max_total_len - 1
        counts["capped_output"] += 1
    if s.max_input_len is not None and n_in > s.max_input_len:
        n_in, counts["capped_input"] = s.max_input_len, counts["capped_input"] + 1
    if s.max_total_len is not None and n_in + n_out > s.max_total_len:
        n_in, counts["capped_to_context"] = s.max_total_len - n_out, counts["capped_to_context"] + 1
    return n_in, n_out


def build_workload(
    path: str | Path,
    rows: list[TraceRow],
    fmt: str,
    vocab_size: int,
    scaling: Scaling,
    special_ids: Iterable[int] = (),
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> TraceWorkload:
    """The rows as SimRequests under `scaling`: each runs to exactly its trace output length
    (ignore_eos, max_tokens = the length), since the trace says how long each answer was."""
    scaling.check()
    low, high = _token_range(vocab_size, special_ids)
    used = rows[: scaling.max_requests] if scaling.max_requests else rows
    counts = dict.fromkeys(("capped_input", "capped_output", "capped_to_context"), 0)
    counts["output_raised_to_1"] = 0
    cache: dict[int, list[int]] = {}
    requests = []
    for row in used:
        n_in, n_out = _scaled_lengths(row, scaling, counts)
        ids = prompt_tokens(row, n_in, block_size, low, high, cache)
        requests.append(SimRequest(ids, n_out, row.arrival / scaling.time_scale, n_out, True))
    conditions = {
        "trace_file": str(path),
        "trace_format": fmt,
        "requests_in_file": len(rows),
        "requests": len(requests),
        "span_in_file_s": rows[-1].arrival,
        "span_replayed_s": requests[-1].arrival,
        **{k: getattr(scaling, k) for k in Scaling.__dataclass_fields__},
        **counts,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "sampling": "each request runs to its trace output length (ignore_eos)",
    }
    if fmt == "mooncake":
        conditions["block_size"] = block_size
        # the blocks the (possibly cut) prompts still reach
        reached = [
            r.hash_ids[: math.ceil(len(q.prompt_token_ids) / block_size)]
            for r, q in zip(used, requests)
        ]
        conditions["distinct_blocks"] = len({h for ids in reached for h in ids})
        conditions["blocks"] = sum(len(ids) for ids in reached)
    conditions["arrivals"] = f"from the trace, ÷ {scaling.time_scale:g}"
    return TraceWorkload(requests, conditions)


def read_trace(
    path: str | Path,
    vocab_size: int,
    fmt: str = "auto",
    *,
    special_ids: Iterable[int] = (),
    block_size: int = MOONCAKE_BLOCK_SIZE,
    **scaling,
) -> TraceWorkload:
    """Read, check and scale a trace file. `scaling`: Scaling's fields (time_scale,
    max_requests, max_input_len, max_output_len, max_total_len)."""
    rows, fmt = read_rows(path, fmt, block_size)
    return build_workload(path, rows, fmt, vocab_size, Scaling(**scaling), special_ids, block_size)


def read_mooncake(path: str | Path, vocab_size: int, **options) -> TraceWorkload:
    """Mooncake's JSON lines (see the module doc); options as read_trace's."""
    return read_trace(path, vocab_size, "mooncake", **options)


def read_azure(path: str | Path, vocab_size: int, **options) -> TraceWorkload:
    """The Azure LLM inference trace CSV (see the module doc); options as read_trace's."""
    return read_trace(path, vocab_size, "azure", **options)


def describe(trace: TraceWorkload) -> str:
    """What was replayed, in two or three lines: file, requests, compression, caps applied."""
    c = trace.conditions
    caps = [
        f"{name} {c[key]} (shortened {c[count]})"
        for name, key, count in (
            ("prompt ≤", "max_input_len", "capped_input"),
            ("output ≤", "max_output_len", "capped_output"),
            ("prompt + output ≤", "max_total_len", "capped_to_context"),
        )
        if c[key] is not None
    ]
    if c["output_raised_to_1"]:
        caps.append(f"{c['output_raised_to_1']} outputs of 0 tokens run as 1")
    lines = [
        f"trace: {c['trace_file']} ({c['trace_format']}), {c['requests']} of "
        f"{c['requests_in_file']} requests, span {c['span_in_file_s']:.1f} s in the file",
        f"  time compression ÷{c['time_scale']:.3g}: replayed over {c['span_replayed_s']:.1f} s; "
        f"length caps: {', '.join(caps) if caps else 'none'}",
    ]
    if c["trace_format"] == "mooncake":
        lines.append(
            f"  prefix sharing: {c['distinct_blocks']} distinct of {c['blocks']} "
            f"{c['block_size']}-token blocks (equal hash ids → equal tokens)"
        )
    return "\n".join(lines)
