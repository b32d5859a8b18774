"""Sections 3 and 4: decode at batch 1 and the engine's overhead, read from step records of
probe requests run alone (batch 1) or together (full batch)."""

from __future__ import annotations

import statistics
import time

from engine.tools.bench.config import BenchConfig
from engine.tools.bench.offline import greedy_params
from engine.tools.workload import WorkItem, make_workload


def run_steps(engine, workload: list[WorkItem]) -> list[tuple[float, object]]:
    """Queue the requests, step until all finish; (wall seconds, StepRecord) for every step."""
    for w in workload:
        engine.add_request(prompt_token_ids=w.prompt_token_ids, sampling_params=greedy_params(w))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        record = engine.step()
        steps.append((time.perf_counter() - start, record))
    return steps


def step_breakdown(steps: list[tuple[float, object]], batch: int) -> dict:
    """Per-phase medians (ms) over the steps where exactly `batch` requests decode, and the median
    share of wall time outside the forward. 'untimed' is wall time the record's phases miss."""
    from engine.trace import PHASES

    decode_steps = [
        (wall, r)
        for wall, r in steps
        if len(r.scheduled) == batch and all(s.phase == "decode" for s in r.scheduled)
    ]
    if not decode_steps:
        return {"batch": batch, "steps": 0}
    phases = {
        p: statistics.median(r.timings.get(p, 0.0) for _, r in decode_steps) * 1e3 for p in PHASES
    }
    phases["untimed"] = statistics.median(wall - r.duration for wall, r in decode_steps) * 1e3
    wall = statistics.median(w for w, _ in decode_steps)
    return {
        "batch": batch,
        "steps": len(decode_steps),
        "step_ms": wall * 1e3,
        "phase_ms": phases,
        "overhead_share": statistics.median(1 - r.timings["forward"] / w for w, r in decode_steps),
        "tokens_per_s": batch / wall,
    }


def probe_workload(
    batch: int, prompt_len: int, output_len: int, seed: int, vocab_size: int, special_ids
):
    return make_workload(
        batch, (prompt_len, prompt_len), (output_len, output_len), seed, vocab_size, special_ids
    )


def batch1_probes(config: BenchConfig, vocab: int, specials) -> list[WorkItem]:
    """The batch-1 probe: `probe_repeats` single requests, each run alone (seeded)."""
    return [
        probe_workload(
            1,
            config.probe_prompt_len,
            config.probe_output_len,
            config.seed + 100 + i,
            vocab,
            specials,
        )[0]
        for i in range(config.probe_repeats)
    ]


def batch1_steps(engine, config: BenchConfig, vocab: int, specials) -> list:
    """The step records of the batch-1 probe's requests, one after another (decode at batch 1)."""
    steps = []
    for item in batch1_probes(config, vocab, specials):
        steps += run_steps(engine, [item])
    return steps


def batch1_under_bandwidth(
    engine, config: BenchConfig, vocab: int, specials, sample_bandwidth, weight_bytes_per_step
) -> tuple[dict, dict]:
    """The batch-1 decode between two read-bandwidth samples (`sample_bandwidth()`, GB/s): its
    step breakdown, and its roofline at the better sample, the ceiling it ran under (on a shared
    VM the bandwidth can swing 30 ↔ 66 GB/s within minutes, docs/performance.md 2026-12-05)."""
    samples = [sample_bandwidth()]
    b1 = step_breakdown(batch1_steps(engine, config, vocab, specials), 1)
    samples.append(sample_bandwidth())
    roof = max(samples) * 1e9 / weight_bytes_per_step
    tokens_per_s = b1.get("tokens_per_s") if b1.get("steps") else None
    return b1, {
        "bandwidth_gb_s": max(samples),
        "bandwidth_samples_gb_s": samples,
        "roofline_tokens_per_s": roof,
        "fraction_of_roofline": tokens_per_s / roof if tokens_per_s else None,
    }


def decode_rate_batch1(engine, workload: list[WorkItem]) -> dict:
    """One request at a time: tokens/s over the steps after its first token (decode only)."""
    tokens, seconds = 0, 0.0
    for item in workload:
        for wall, record in run_steps(engine, [item])[1:]:  # the first step is the prefill
            seconds += wall
            tokens += sum(len(t) for t in record.new_tokens.values())
    rate = tokens / seconds if seconds else None
    return {"tokens_per_s": rate, "tokens": tokens, "seconds": seconds}
