"""The one workload: seeded requests, Poisson arrivals and latency percentiles.

The benchmark, the simulator, the calibration and the labs draw their requests and summarize
their latencies here, so "Poisson at 4 requests/s" and "TTFT p90" mean the same thing
everywhere. `run_workload` feeds such a workload to an engine (simulated or real) as its clock
reaches each arrival.

    items = make_workload(100, prompt_len=(32, 512), output_len=(16, 256), seed=0, vocab_size=V)
    offsets = poisson_arrivals(len(items), rate=4.0, seed=1)  # seconds from the first arrival
    percentiles([0.12, 0.30, 0.18])            # {"p50": 0.18, "p90": ..., "p99": ...}
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.request import Request


@dataclass
class WorkItem:
    """One request of a workload: its prompt and how many tokens it should generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass
class SimRequest:
    """A workload item with its arrival (engine seconds); what the simulator feeds an engine."""

    prompt_token_ids: list[int]
    output_len: int  # target length: EOS after this many tokens
    arrival: float = 0.0
    max_tokens: int | None = None  # None: output_len (the request then ends by length)
    ignore_eos: bool = False


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    vocab_size: int,
    special_ids: Iterable[int] = (),
) -> list[WorkItem]:
    """Seeded random prompts (token ids drawn uniformly, specials excluded) with mixed lengths."""
    rng = random.Random(seed)
    low = max(special_ids, default=-1) + 1
    items = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        items.append(
            WorkItem([rng.randrange(low, vocab_size) for _ in range(n)], rng.randint(*output_len))
        )
    return items


def poisson_arrivals(
    count: int,
    rate: float | None,
    seed: int,
    *,
    first_at_zero: bool = True,
    until_s: float | None = None,
) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process of `rate` requests/s: exponential gaps drawn
    from `random.Random(seed)`, so the same seed gives the same times. The first arrival is at 0
    (or after one gap with `first_at_zero=False`); at most `count` of them, all before `until_s`
    when given. `rate` None: everyone arrives at 0."""
    rng, t, out = random.Random(seed), 0.0, []
    while len(out) < count:
        if rate is not None and (out or not first_at_zero):
            t += rng.expovariate(rate)
        if until_s is not None and t >= until_s:
            break
        out.append(t)
    return out


def poisson_workload(
    num_requests: int,
    rate: float | None,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    special_ids: Iterable[int] = (),
) -> list[SimRequest]:
    """Seeded random prompts and target lengths (uniform in the ranges) with Poisson arrivals at
    `rate` requests/s (None: all at time 0). max_tokens is the range's maximum, so EOS ends them."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be MIN MAX with 1 ≤ MIN ≤ MAX, got {lo} {hi}")
    items = make_workload(num_requests, prompt_len, output_len, seed, vocab_size, special_ids)
    arrivals = poisson_arrivals(len(items), rate, seed + 1)
    return [
        SimRequest(item.prompt_token_ids, item.output_len, t, max_tokens=output_len[1])
        for item, t in zip(items, arrivals)
    ]


def run_workload(
    engine, workload: list[SimRequest], keep_outputs: bool = False
) -> tuple[list, list[Request]]:
    """Feed requests as the engine clock reaches their arrival; step until all finish. Works for
    a real engine too (arrivals then wait for the measured steps). Returns (records, requests).
    Without `keep_outputs` the engine makes no per-step RequestOutput (the bulk of a step's
    bookkeeping in simulation); records, journeys and metrics are the same either way."""
    pending = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
    requests: list[Request | None] = [None] * len(workload)
    emitted_before, engine.emit_outputs = engine.emit_outputs, keep_outputs
    records, start, i = [], engine.clock.now(), 0
    try:
        while i < len(pending) or engine.has_unfinished_requests():
            while i < len(pending) and start + workload[pending[i]].arrival <= engine.clock.now():
                w = workload[pending[i]]
                params = SamplingParams(
                    max_tokens=w.max_tokens or w.output_len,
                    temperature=0.0,
                    ignore_eos=w.ignore_eos,
                )
                requests[pending[i]] = engine.add_request(
                    prompt_token_ids=w.prompt_token_ids,
                    sampling_params=params,
                    request_id=f"sim-{pending[i]}",
                    engine_arrival_time=start + w.arrival,
                )
                i += 1
            if not engine.has_unfinished_requests():
                # idle until the next arrival
                engine.clock.advance_to(start + workload[pending[i]].arrival)
                continue
            records.append(engine.step())
    finally:
        engine.emit_outputs = emitted_before
    return records, requests


def percentile(values: Iterable[float], p: float) -> float | None:
    """The p-th percentile with linear interpolation between the closest ranks (numpy's default
    method); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def percentiles(values: Iterable[float], ps=(50, 90, 99)) -> dict[str, float | None]:
    """{"p50": ..., "p90": ..., "p99": ...} of the values (linear interpolation; None if empty)."""
    xs = sorted(values)
    return {f"p{p}": percentile(xs, p) for p in ps}
