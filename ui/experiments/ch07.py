"""Chapter 07 · 배칭 기초: one workload sequentially, in static batches and continuously."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ui.experiments.common import (
    ConfigLike,
    RequestSpec,
    RunResult,
    Workload,
    _r,
    make_config,
    run_lockstep,
    run_workload,
)

# Output lengths that differ a lot: each batch of 4 holds one long request and short ones, so a
# static batch runs as long as its longest while continuous batching refills the short ones'
# slots. The last two requests come late (one of them long). The prompts are short, so the
# decode steps the modes differ in, not the prefills they share, take most of the time: with
# prompts of 16-40 tokens continuous batching was 1.47-1.53x static batching's throughput on a
# Zen 4 VM (one thread, 2026-12-07), with these 1.54-1.59x.
OUTPUT_LENS = [48, 4, 6, 8, 44, 5, 40, 6]
PROMPT_LENS = [12, 6, 16, 8, 10, 14, 7, 15]
DEFAULT_REQUESTS = 6
DEFAULT_BATCH = 4
# The late arrivals' gap in decode steps (not ms): a step lasts ~60 ms on this CPU and ~8 ms on a
# simulated H100, so a gap in ms that shows head-of-line blocking on one would land after the
# whole run on the other. The page turns steps into ms with the engine's own decode step time.
DEFAULT_LATE_STEPS = 4


def batching_workload(num_requests: int = DEFAULT_REQUESTS, late_ms: float = 0.0) -> Workload:
    """OUTPUT_LENS/PROMPT_LENS for `num_requests` requests; all but the last two arrive at 0, the
    last two at late_ms and 2 × late_ms (late_arrival_ms turns a gap in steps into ms)."""
    specs = []
    for i, (p, o) in enumerate(zip(PROMPT_LENS[:num_requests], OUTPUT_LENS[:num_requests])):
        arrival = 0.0 if i < max(num_requests - 2, 1) else late_ms * (i - num_requests + 3)
        specs.append(RequestSpec(p, o, arrival))
    return Workload(specs)


def late_arrival_ms(late_steps: int, step_ms: float) -> float:
    """The late requests' gap on the engine clock: `late_steps` decode steps of `step_ms`."""
    return late_steps * step_ms


def decode_step_ms(config: ConfigLike | None, batch_size: int, engine_factory=None) -> float:
    """How long one decode step of `batch_size` requests takes on this engine (ms, engine
    clock): a short run on a fresh engine, the median of its decode-only steps. Measured on a
    real engine, computed by the cost model on a simulated one."""
    probe = Workload.uniform(max(batch_size, 1), 16, 6)
    result = run_workload(config, probe, "probe", engine_factory=engine_factory)
    decodes = [
        r.engine_duration
        for r in result.records
        if r.scheduled and all(s.phase == "decode" for s in r.scheduled)
    ]
    return 1000 * float(np.median(decodes)) if decodes else 0.0


BATCHING_MODES = {
    "순차 실행": dict(max_num_seqs=1, scheduling_policy="fcfs"),
    "정적 배칭": dict(scheduling_policy="static"),
    "continuous batching": dict(scheduling_policy="fcfs"),
}


def batch_waste(result: RunResult) -> dict:
    """Slots held idle, from the step records (계산값).

    idle slots = max_num_seqs × steps − Σ scheduled requests per step
    static padding = Σ over batches (batch size × batch steps) − Σ (request, step) pairs that did
      work,
      a batch being the steps between two moments with nothing running. Only static batching holds a
      finished request's slot until its batch ends; sequential and continuous runs reuse it
      (padding 0).
    """
    slots = result.config.max_num_seqs
    worked = sum(len(r.scheduled) for r in result.records)
    idle = slots * len(result.records) - worked
    padding = 0
    batches: list[set[str]] = []
    current: set[str] = set()
    steps_in_batch = 0
    worked_in_batch = 0
    for rec in result.records:
        current |= {s.request_id for s in rec.scheduled}
        steps_in_batch += 1
        worked_in_batch += len(rec.scheduled)
        if rec.num_running == 0:
            padding += len(current) * steps_in_batch - worked_in_batch
            batches.append(current)
            current, steps_in_batch, worked_in_batch = set(), 0, 0
    if current:
        padding += len(current) * steps_in_batch - worked_in_batch
        batches.append(current)
    if result.config.scheduling_policy != "static":
        padding = 0
    hol_steps = sum(
        1
        for r in result.records
        for reason in r.unscheduled.values()
        if reason in ("static_batch_in_progress", "max_num_seqs")
    )
    return {
        "idle_slot_steps": idle,
        "padding_slot_steps": padding,
        "num_batches": len(batches),
        "blocked_request_steps": hol_steps,
        "worked_request_steps": worked,
    }


def batching_config(config: ConfigLike | None, mode: str, batch_size: int):
    """The engine config of one batching mode (BATCHING_MODES) with `batch_size` slots."""
    overrides = dict(BATCHING_MODES[mode])
    overrides.setdefault("max_num_seqs", batch_size)
    return make_config(config, **overrides)


def compare_batching(
    config: ConfigLike | None,
    workload: Workload,
    batch_size: int = DEFAULT_BATCH,
    engine_factory=None,
) -> dict[str, RunResult]:
    """The same workload under each mode of BATCHING_MODES, one fresh engine each, in lockstep."""
    configs = {label: batching_config(config, label, batch_size) for label in BATCHING_MODES}
    return run_lockstep(configs, workload, engine_factory)


def batching_summary(results: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for label, res in results.items():
        row = res.summary()
        waste = batch_waste(res)
        t = res.request_table()
        row.update(
            {
                "대기 최대 (ms)": _r(t["queue_ms"].max()),
                "빈 자리 (슬롯·스텝)": waste["idle_slot_steps"],
                "패딩 낭비 (슬롯·스텝)": waste["padding_slot_steps"],
                "막힌 대기 (요청·스텝)": waste["blocked_request_steps"],
                "평균 스텝 (ms)": (
                    _r(1000 * np.mean([r.engine_duration for r in res.records]))
                    if res.records
                    else None
                ),
            }
        )
        rows.append(row)
    return pd.DataFrame(rows)
