"""Chapter 08 · continuous batching: a long prompt among decoding requests, chunked or not."""

from __future__ import annotations

from dataclasses import dataclass

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


def long_prompt_workload(
    long_prompt_len: int = 420,
    num_short: int = 3,
    short_prompt_len: int = 16,
    short_max_tokens: int = 40,
    long_arrival_ms: float = 250.0,
    long_max_tokens: int = 8,
) -> Workload:
    specs = [
        RequestSpec(short_prompt_len, short_max_tokens, 0.0, f"짧은-{i}") for i in range(num_short)
    ]
    specs.append(RequestSpec(long_prompt_len, long_max_tokens, long_arrival_ms, "긴-프롬프트"))
    return Workload(specs)


@dataclass
class ChunkedComparison:
    runs: dict[str, RunResult]
    summary: pd.DataFrame


CHUNKED_MODES = {"chunked prefill 켬": True, "chunked prefill 끔": False}


def chunked_config(config: ConfigLike | None, chunked: bool, budget: int, max_num_seqs: int):
    """The engine config of one side. The budget is never raised: without chunking a request is
    prefilled (or recomputed after a preemption) in one step, so the engine requires
    max_num_batched_tokens >= max_model_len; that side gets max_model_len = the budget instead,
    and a request longer than that is refused (the page says so)."""
    cfg = make_config(
        config,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
    )
    if not chunked and (cfg.max_model_len is None or cfg.max_model_len > budget):
        cfg = make_config(cfg, max_model_len=budget)
    return cfg


def chunked_summary(runs: dict[str, RunResult], long_name: str = "긴-프롬프트") -> pd.DataFrame:
    """Per run (engine-clock times): long request TTFT and prefill steps; the other requests' ITL
    and TTFT; the largest step; requests refused or left out for the token budget."""
    rows = []
    for label, res in runs.items():
        t = res.request_table()
        is_long = t["request_id"] == long_name
        others = res.itl_samples_ms()
        others = others[others["request_id"].isin(t.loc[~is_long, "request_id"])]
        steps = res.step_table()
        budget_waits = sum(
            1
            for rec in res.records
            for reason in rec.unscheduled.values()
            if reason == "token_budget"
        )
        rows.append(
            {
                "실행": label,
                "토큰 예산": res.config.max_num_batched_tokens,
                "최대 길이 (max_model_len)": res.max_model_len,
                "최대 동시 요청": res.config.max_num_seqs,
                "긴 요청 TTFT (ms)": _r(t.loc[is_long, "ttft_ms"].max()) if is_long.any() else None,
                "긴 요청 prefill 스텝 수": int(
                    sum(
                        1
                        for rec in res.records
                        for s in rec.scheduled
                        if s.phase != "decode" and s.request_id == long_name
                    )
                ),
                "다른 요청 ITL 평균 (ms)": _r(others["itl_ms"].mean()) if len(others) else None,
                "다른 요청 ITL 최대 (ms)": _r(others["itl_ms"].max()) if len(others) else None,
                "다른 요청 TTFT 최대 (ms)": _r(t.loc[~is_long, "ttft_ms"].max()),
                "최대 스텝 토큰": int(steps["num_tokens"].max()) if len(steps) else 0,
                "최대 스텝 시간 (ms)": _r(steps["duration_ms"].max()) if len(steps) else None,
                "토큰 예산 때문에 기다린 (요청·스텝)": budget_waits,
                "거절된 요청": ", ".join(res.rejected) or "없음",
                "전체 시간 (s)": round(res.elapsed_s, 3),
            }
        )
    return pd.DataFrame(rows)


def compare_chunked_prefill(
    config: ConfigLike | None,
    workload: Workload,
    budget: int,
    max_num_seqs: int,
    engine_factory=None,
) -> ChunkedComparison:
    """Run the workload with chunked prefill on and off, both under the same token budget."""
    runs = {
        label: run_workload(
            chunked_config(config, chunked, budget, max_num_seqs),
            workload,
            label,
            engine_factory=engine_factory,
        )
        for label, chunked in CHUNKED_MODES.items()
    }
    return ChunkedComparison(runs, chunked_summary(runs))


# -- at scale: the token-budget trade-off on a simulated GPU ------------------------------------

SWEEP_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)


def budget_sweep(
    model_preset: str,
    hardware: str,
    rate: float,
    budgets=SWEEP_BUDGETS,
    num_requests: int = 80,
    prompt_len: tuple[int, int] = (256, 4096),
    output_len: tuple[int, int] = (32, 256),
    seed: int = 0,
    tensor_parallel_size: int = 1,
    progress=None,
) -> pd.DataFrame:
    """TTFT and ITL percentiles (ms, engine clock, 계산값) of the same Poisson workload on a
    simulated engine, one run per max_num_batched_tokens: the chunked-prefill trade-off at
    8B/70B scale. A small budget cuts long prompts into many chunks (ITL of the others stays
    low, TTFT of the long ones grows); a large one does the reverse."""
    from engine.bench import percentiles
    from engine.simulator import simulate

    rows = []
    for i, budget in enumerate(budgets):
        result = simulate(
            model_preset,
            hardware,
            rate=rate,
            num_requests=num_requests,
            prompt_len=prompt_len,
            output_len=output_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=True,
        )
        itl = percentiles([x for m in result.metrics for x in m.itl])
        ttft = result.summary["ttft_s"]
        rows.append(
            {
                "토큰 예산": budget,
                "TTFT p50 (ms)": _r(1000 * ttft["p50"]),
                "TTFT p90 (ms)": _r(1000 * ttft["p90"]),
                "ITL p50 (ms)": _r(1000 * itl["p50"]),
                "ITL p99 (ms)": _r(1000 * itl["p99"]),
                "처리량 (토큰/s)": _r(result.summary["output_tokens_per_s"], 0),
                "선점": result.summary["preemptions"],
                "스텝": result.summary["steps"],
            }
        )
        if progress is not None:
            progress(i + 1, len(budgets))
    return pd.DataFrame(rows)
