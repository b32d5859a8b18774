"""Chapter 14 · the API server under load (no Streamlit here), in five modules by concern:

    ch14.py         prefill fairness on the engine clock: a long prompt first in line with short
                    requests behind it, `long_prefill_token_threshold` 0 (off) vs a cap, under the
                    same token budget; and `direction`, the lab's predicted-vs-measured wording
    ch14_server.py  the learner's own OpenAIServer in a background thread on 127.0.0.1, and its
                    /metrics (Prometheus text) scraped and parsed
    ch14_client.py  one simulated user: a /v1/completions request over real HTTP (httpx), its
                    chunks timed on the client's clock
    ch14_load.py    many users with Poisson arrivals, /metrics polled while they run, latency
                    against load (the knee)
    ch14_stream.py  streamed vs whole answers, and a live stream the learner disconnects

Every time in the live-server modules is wall-clock (time.perf_counter) on the client side, from
the moment a request was sent; every measurement is bounded by a duration cap and a drain cap, and
requests still open at the cap are cut (their connections closed, so the server aborts them and
frees their blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from ui.experiments.common import (
    ConfigLike,
    RequestSpec,
    RunResult,
    Workload,
    _r,
    make_config,
    run_workload,
)

LONG_NAME = "긴-프롬프트"
# The fairness lab's defaults: a 320-token prompt first in line, 3 short requests behind it, a
# token budget of 64, at most 4 running, the threshold 32 on one side and 0 (off) on the other.
FAIR_LONG, FAIR_SHORT, FAIR_BUDGET, FAIR_THRESHOLD, FAIR_SEQS = 320, 3, 64, 32, 4


def fairness_workload(
    long_prompt_len: int = 320,
    num_short: int = 3,
    short_prompt_len: int = 8,
    short_max_tokens: int = 8,
    short_arrival_ms: float = 0.0,
    long_max_tokens: int = 4,
) -> Workload:
    """A long prompt first in line, short requests right behind it (same or later arrival)."""
    specs = [RequestSpec(long_prompt_len, long_max_tokens, 0.0, LONG_NAME)]
    specs += [
        RequestSpec(short_prompt_len, short_max_tokens, short_arrival_ms, f"짧은-{i}")
        for i in range(num_short)
    ]
    return Workload(specs)


def fairness_label(threshold: int) -> str:
    return "임계값 끔 (0)" if threshold <= 0 else f"임계값 {threshold}"


def fairness_base(config: ConfigLike | None):
    """The sidebar's config with room for the longest prompt the lab offers (1,024 tokens)."""
    cfg = make_config(config)
    blocks = max(cfg.num_kv_blocks or 0, 1024 // cfg.block_size)
    return make_config(cfg, max_model_len=1024, num_kv_blocks=blocks)


def fairness_config(config: ConfigLike | None, threshold: int, budget: int, max_num_seqs: int):
    """One side's engine config: chunked prefill on, the same budget, the threshold varied. Each
    side sets its threshold explicitly: the off side's 0 is not the engine's default (64)."""
    return make_config(
        config,
        enable_chunked_prefill=True,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        long_prefill_token_threshold=max(int(threshold), 0),
    )


@dataclass
class FairnessComparison:
    runs: dict[str, RunResult]
    summary: pd.DataFrame


def first_short_step(res: RunResult, long_name: str = LONG_NAME) -> int | None:
    """The first step (1-based within the run) that scheduled any short request."""
    for n, rec in enumerate(res.records, start=1):
        if any(s.request_id != long_name for s in rec.scheduled):
            return n
    return None


def fairness_summary(runs: dict[str, RunResult], long_name: str = LONG_NAME) -> pd.DataFrame:
    """Per run (engine clock): the short requests' TTFT, the long one's TTFT and prefill steps,
    the first step a short request ran in, the largest prefill chunk of the long prompt."""
    rows = []
    for label, res in runs.items():
        t = res.request_table()
        is_long = t["request_id"] == long_name
        chunks = [
            s.num_tokens
            for rec in res.records
            for s in rec.scheduled
            if s.request_id == long_name and s.phase != "decode"
        ]
        rows.append(
            {
                "실행": label,
                "임계값 (long_prefill_token_threshold)": res.config.long_prefill_token_threshold,
                "토큰 예산": res.config.max_num_batched_tokens,
                "짧은 요청 TTFT 평균 (ms)": _r(t.loc[~is_long, "ttft_ms"].mean()),
                "짧은 요청 TTFT 최대 (ms)": _r(t.loc[~is_long, "ttft_ms"].max()),
                "짧은 요청이 처음 들어간 스텝": first_short_step(res, long_name),
                "긴 요청 TTFT (ms)": _r(t.loc[is_long, "ttft_ms"].max()) if is_long.any() else None,
                "긴 요청 prefill 스텝 수": len(chunks),
                "긴 요청 최대 조각 (토큰)": max(chunks) if chunks else 0,
                "전체 시간 (s)": round(res.elapsed_s, 3),
            }
        )
    return pd.DataFrame(rows)


def compare_fairness(
    config: ConfigLike | None,
    workload: Workload,
    budget: int,
    max_num_seqs: int,
    thresholds: Sequence[int] = (0, 32),
    engine_factory=None,
) -> FairnessComparison:
    """Run the workload once per threshold, all under the same token budget."""
    runs = {
        fairness_label(th): run_workload(
            fairness_config(config, th, budget, max_num_seqs),
            workload,
            fairness_label(th),
            engine_factory=engine_factory,
        )
        for th in thresholds
    }
    return FairnessComparison(runs, fairness_summary(runs))


CHOICES = ["줄어든다", "비슷하다", "늘어난다"]


def direction(new: float | None, old: float | None, tol: float = 0.2) -> str | None:
    """'줄어든다' / '비슷하다' / '늘어난다' for new relative to old (within ±tol: similar)."""
    if new is None or old is None:
        return None
    if old <= 0:
        return CHOICES[1] if new <= 0 else CHOICES[2]
    ratio = new / old
    if ratio < 1 - tol:
        return CHOICES[0]
    if ratio > 1 + tol:
        return CHOICES[2]
    return CHOICES[1]
