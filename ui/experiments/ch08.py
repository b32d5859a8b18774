"""Chapter 08 · continuous batching: a long prompt among decoding requests, chunked or not."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from ui import figures
from ui.experiments.common import (
    ConfigLike,
    RequestSpec,
    RunResult,
    Workload,
    _r,
    make_config,
    run_lockstep,
)

LONG_NAME = "긴-프롬프트"


@dataclass(frozen=True)
class LabDefaults:
    """The lab's default sliders in one mode (the page and the claim tests read these)."""

    budget: int  # max_num_batched_tokens of the chunked side
    long_prompt_len: int
    max_model_len: int  # also the unchunked side's budget (chunked_config)
    max_num_seqs: int = 4
    long_arrival_ms: float = 250.0  # the short requests are still decoding then, in both modes


REAL_DEFAULTS = LabDefaults(budget=64, long_prompt_len=420, max_model_len=1024)
SIM_DEFAULTS = LabDefaults(budget=512, long_prompt_len=6000, max_model_len=8192)


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
    specs.append(RequestSpec(long_prompt_len, long_max_tokens, long_arrival_ms, LONG_NAME))
    return Workload(specs)


@dataclass
class ChunkedComparison:
    runs: dict[str, RunResult]
    summary: pd.DataFrame


CHUNKED_MODES = {"chunked prefill 켬": True, "chunked prefill 끔": False}
ON, OFF = CHUNKED_MODES
# The lab's question: with chunked prefill on, the running decodes' worst ITL compared with off.
ITL_CHOICES = ["줄어든다", "비슷하다", "늘어난다"]
WORST_ITL = "다른 요청 ITL 최대 (ms)"


def chunked_config(config: ConfigLike | None, chunked: bool, budget: int, max_num_seqs: int):
    """The engine config of one side.

    With chunked prefill the budget is the learner's. Without it a prompt (or a preempted
    request's recompute) must go through one step whole, so vLLM requires
    max_num_batched_tokens >= max_model_len and, when chunking is off, raises the budget to
    max_model_len by default. The off side follows that rule: its budget becomes
    max(budget, max_model_len), so both sides accept the same requests and the comparison is
    chunking itself, not a refused prompt (the page says so).

    Both sides run with `long_prefill_token_threshold` 0 (no cap), not the engine's default
    (64): here the budget alone sets the chunk size, so the budget slider means what it says;
    the cap is chapter 14's comparison (the page says so too)."""
    cfg = make_config(
        config,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        long_prefill_token_threshold=0,
    )
    if not chunked and cfg.max_model_len is not None:
        cfg = make_config(cfg, max_num_batched_tokens=max(budget, cfg.max_model_len))
    return cfg


def chunked_summary(runs: dict[str, RunResult], long_name: str = LONG_NAME) -> pd.DataFrame:
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


def worst_itl(summary: pd.DataFrame) -> tuple[float | None, float | None]:
    """(on, off): the decoding requests' worst inter-token gap (ms, engine clock) per side."""
    s = summary.set_index("실행")
    on, off = (s.loc[label, WORST_ITL] if label in s.index else None for label in (ON, OFF))
    return on, off


def itl_change(on: float, off: float) -> str:
    """The answer to the lab's question (ITL_CHOICES) as measured: on below 0.8 × off is
    "줄어든다", above 1.25 × off "늘어난다", otherwise "비슷하다"."""
    if on < 0.8 * off:
        return ITL_CHOICES[0]
    return ITL_CHOICES[2] if on > 1.25 * off else ITL_CHOICES[1]


def compare_chunked_prefill(
    config: ConfigLike | None,
    workload: Workload,
    budget: int,
    max_num_seqs: int,
    engine_factory=None,
) -> ChunkedComparison:
    """Run the workload with chunked prefill on and off (the off side with vLLM's budget,
    chunked_config), stepped in lockstep as the lab does."""
    configs = {
        label: chunked_config(config, chunked, budget, max_num_seqs)
        for label, chunked in CHUNKED_MODES.items()
    }
    runs = run_lockstep(configs, workload, engine_factory)
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
    low, TTFT of the long ones grows); a large one does the reverse. No per-request cap
    (`long_prefill_token_threshold` 0, as in chunked_config): the budget alone sets the chunks."""
    from engine.tools.simulator import simulate
    from engine.tools.workload import percentiles

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
            long_prefill_token_threshold=0,
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


# -- figures -------------------------------------------------------------------------------------

_MARGIN = dict(l=10, r=10, t=40, b=10)
# Legends sit in a row under the plot, clear of the data and of every axis's ticks.


def step_time_figure(runs: dict[str, RunResult]) -> go.Figure:
    """Each side's step durations over the engine clock (zero-based: a magnitude)."""
    fig = go.Figure()
    for label, res in runs.items():
        steps = res.step_table()
        fig.add_trace(
            go.Scatter(
                x=steps["start_ms"],
                y=steps["duration_ms"],
                mode="lines+markers",
                name=f"{label} 스텝 시간",
                customdata=steps[["step", "num_tokens"]],
                hovertemplate=(
                    "스텝 %{customdata[0]} · 토큰 %{customdata[1]}<br>%{y:.1f} ms<extra></extra>"
                ),
            )
        )
    fig.update_layout(
        height=340,
        title="스텝 시간 (ms) — 긴 프롬프트가 든 스텝이 튀는지",
        xaxis=dict(title="시작 시각 (ms, 엔진 시계)", rangemode="tozero"),
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=figures.LEGEND_BELOW,
        margin=dict(_MARGIN, b=70),
    )
    return fig


def itl_figure(runs: dict[str, RunResult], long_name: str = LONG_NAME) -> go.Figure:
    """Every inter-token gap of the decoding (short) requests, per side (zero-based)."""
    fig = go.Figure()
    for label, res in runs.items():
        itl = res.itl_samples_ms()
        others = itl[itl["request_id"] != long_name]
        fig.add_trace(
            go.Scatter(
                x=others["time_ms"],
                y=others["itl_ms"],
                mode="markers",
                name=f"{label}: 짧은 요청 ITL",
                text=others["request_id"],
            )
        )
    fig.update_layout(
        height=340,
        title="짧은 요청들의 ITL (토큰 사이 간격)",
        xaxis=dict(title="시각 (ms, 엔진 시계)", rangemode="tozero"),
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=figures.LEGEND_BELOW,
        margin=dict(_MARGIN, b=70),
    )
    return fig


def budget_sweep_figure(table: pd.DataFrame) -> go.Figure:
    """TTFT (left axis) and ITL (right axis) against the token budget. Both scales start at 0
    (they are magnitudes) and the legend sits under the plot, so no tick hides behind it."""
    fig = go.Figure()
    for col, dash in (("TTFT p50 (ms)", "solid"), ("TTFT p90 (ms)", "dot")):
        fig.add_trace(go.Scatter(x=table["토큰 예산"], y=table[col], name=col, line_dash=dash))
    for col, dash in (("ITL p50 (ms)", "solid"), ("ITL p99 (ms)", "dot")):
        fig.add_trace(
            go.Scatter(x=table["토큰 예산"], y=table[col], name=col, line_dash=dash, yaxis="y2")
        )
    budgets = [int(b) for b in table["토큰 예산"]]
    fig.update_layout(
        height=380,
        title="예산이 크면 TTFT는 줄고 ITL 꼬리는 길어진다",
        xaxis=dict(
            title="max_num_batched_tokens",
            type="log",
            tickvals=budgets,
            ticktext=[f"{b:,}" for b in budgets],
        ),
        yaxis=dict(title="TTFT (ms)", rangemode="tozero"),
        yaxis2=dict(title="ITL (ms)", overlaying="y", side="right", rangemode="tozero"),
        legend=dict(figures.LEGEND_BELOW, y=-0.3),
        margin=dict(_MARGIN, b=90),
    )
    return fig
