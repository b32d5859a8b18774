"""The engine's trace as DataFrames for the app's tables and plots (pandas lives here, on the UI
side, so `import engine.core` never loads it)."""

from __future__ import annotations

import pandas as pd

from engine.tools import trace_export
from engine.trace import StepRecord


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


def export_frames(runs: list[trace_export.Run]) -> dict[str, pd.DataFrame]:
    """The exported tables (steps, journeys, requests; columns documented in docs/traces.md) as
    DataFrames, the same rows the CSV downloads hold."""
    tables = trace_export.trace_tables(runs)
    return {
        name: pd.DataFrame(tables[name], columns=list(columns))
        for name, columns in trace_export.TABLES.items()
    }
