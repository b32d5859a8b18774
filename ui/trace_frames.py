"""The engine's trace as DataFrames for the app's tables and plots (pandas lives here, on the UI
side, so `import engine.core` never loads it)."""

from __future__ import annotations

import pandas as pd

from engine.request import Request
from engine.trace import PHASES, StepRecord


def steps_dataframe(records: list[StepRecord]) -> pd.DataFrame:
    """One row per (step, scheduled request): what the scheduler-decision plot stacks."""
    rows = [
        {
            "step": r.step,
            "request_id": s.request_id,
            "phase": s.phase,
            "num_tokens": s.num_tokens,
            "num_computed_tokens": s.num_computed_tokens,
            "num_prefix_hit_tokens": s.num_prefix_hit_tokens,
            "token_budget": r.token_budget,
        }
        for r in records
        for s in r.scheduled
    ]
    return pd.DataFrame(
        rows,
        columns=[
            "step",
            "request_id",
            "phase",
            "num_tokens",
            "num_computed_tokens",
            "num_prefix_hit_tokens",
            "token_budget",
        ],
    )


def spec_decode_dataframe(records: list[StepRecord]) -> pd.DataFrame:
    """One row per (step, request that verified drafts): proposed, accepted, the model's token."""
    rows = [
        {
            "step": r.step,
            "request_id": s.request_id,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "bonus_token_id": s.bonus_token_id,
            "draft_token_ids": list(s.draft_token_ids),
        }
        for r in records
        for s in r.scheduled
        if s.draft_token_ids
    ]
    return pd.DataFrame(
        rows,
        columns=[
            "step",
            "request_id",
            "num_draft_tokens",
            "num_accepted_tokens",
            "bonus_token_id",
            "draft_token_ids",
        ],
    )


def unscheduled_dataframe(records: list[StepRecord]) -> pd.DataFrame:
    rows = [
        {"step": r.step, "request_id": rid, "reason": reason}
        for r in records
        for rid, reason in r.unscheduled.items()
    ]
    return pd.DataFrame(rows, columns=["step", "request_id", "reason"])


def timings_dataframe(records: list[StepRecord]) -> pd.DataFrame:
    """One row per step: phase timings (ms), tokens, batch size, KV usage."""
    rows = []
    for r in records:
        row = {
            "step": r.step,
            "num_tokens": r.total_tokens,
            "num_requests": len(r.scheduled),
            "num_running": r.num_running,
            "num_waiting": r.num_waiting,
            "kv_usage": r.kv.usage,
            "kv_used_blocks": r.kv.num_used,
            "kv_cached_blocks": r.kv.num_cached_free,
            "num_preempted": len(r.preempted),
        }
        row.update({f"{phase}_ms": 1000 * r.timings.get(phase, 0.0) for phase in PHASES})
        row["total_ms"] = 1000 * r.duration
        rows.append(row)
    return pd.DataFrame(rows)


def kv_blocks_dataframe(record: StepRecord) -> pd.DataFrame:
    """One row per KV block of a step's snapshot (owner, status)."""
    return pd.DataFrame(
        [
            {
                "block_id": b.block_id,
                "status": b.status,
                "owner": ",".join(b.owners) or None,
                "ref_cnt": b.ref_cnt,
            }
            for b in record.kv.blocks
        ]
    )


def journey_dataframe(requests: list[Request], t0: float | None = None) -> pd.DataFrame:
    """One row per journey event, times in ms since `t0` (default: the earliest arrival)."""
    if t0 is None:
        t0 = min((r.arrival_time for r in requests), default=0.0)
    rows = []
    for r in requests:
        for e in r.journey:
            rows.append(
                {
                    "request_id": r.request_id,
                    "event": e.kind,
                    "time_ms": 1000 * (e.time - t0),
                    "step": e.step,
                    **{f"detail_{k}": v for k, v in e.detail.items()},
                }
            )
    return pd.DataFrame(rows)
