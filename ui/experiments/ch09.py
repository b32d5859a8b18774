"""Chapter 09 · preemption and scheduling policies: a burst that does not fit the KV cache, who is
preempted, what it costs (recomputed tokens, or swap copies), and FCFS vs priority vs static on
the same arrivals. Plain functions and plotly figure builders; no Streamlit here."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from engine.core import EngineCore
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.trace import StepRecord
from ui.experiments.common import (
    ConfigLike,
    RequestSpec,
    RunResult,
    Workload,
    _r,
    make_config,
    run_workload,
)

PROMPT_LEN = 24  # every burst request's prompt (tokens)
# The lab's defaults (the page's sliders and the claim tests read these): 5 requests of 24 + 24
# tokens need 15 blocks of 16, the cache has 8, so the default run preempts.
DEFAULT_BLOCKS = 8
DEFAULT_REQUESTS = 5
DEFAULT_MAX_TOKENS = 24
DEFAULT_POLICY_SEQS = 3
BUDGET = 128  # the token budget of every engine in this chapter
NAMES = "ABCDEFGH"
NOBODY = "아무도 선점되지 않는다"

PREEMPTION_MODES = {"재계산 (recompute)": "recompute", "스왑 (swap)": "swap"}
POLICIES = {"FCFS": "fcfs", "우선순위 (priority)": "priority", "정적 배칭 (static)": "static"}
# The policy workload: arrival order A..F, priority (lower = more important) least important
# first, so FCFS serves the important ones last.
POLICY_PRIORITIES = [2, 1, 0, 2, 1, 0]
PRIORITY_KO = {0: "0 (가장 중요)", 1: "1", 2: "2 (가장 덜 중요)"}

# The scheduler code the page shows under the lab ("방금 실행된 코드"): making room for a running
# request's next tokens, and preempting the victim. Named here so that the page itself reaches
# no private engine name.
PREEMPTION_CODE = {
    "블록 확보 (모자라면 희생자를 고름)": Scheduler._make_room,
    "선점 (블록 회수, 대기열 맨 앞으로)": Scheduler._preempt,
}

# EngineConfig fields a lab Side carries (its overrides).
FIELDS = (
    "num_kv_blocks",
    "block_size",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "preemption_mode",
    "num_swap_blocks",
    "scheduling_policy",
)


# -- workloads and configs -----------------------------------------------------------------------


def burst_workload(
    num_requests: int = 5, max_tokens: int = 24, prompt_len: int = PROMPT_LEN
) -> Workload:
    """`num_requests` requests A, B, C, ... all arriving at 0 ms (in that order): the scheduler's
    decisions do not depend on how fast this machine is."""
    return Workload(
        [RequestSpec(prompt_len, max_tokens, 0.0, NAMES[i]) for i in range(num_requests)]
    )


def policy_workload(
    max_tokens: int = 16, prompt_len: int = 16, priorities: list[int] | None = None
) -> Workload:
    """Six requests at 0 ms, named with their priority (A-p2, B-p1, C-p0, ...): the least
    important arrive first."""
    priorities = POLICY_PRIORITIES if priorities is None else priorities
    return Workload(
        [
            RequestSpec(prompt_len, max_tokens, 0.0, f"{NAMES[i]}-p{p}", priority=p)
            for i, p in enumerate(priorities)
        ]
    )


def preemption_config(
    config: ConfigLike | None,
    num_kv_blocks: int,
    mode: str = "recompute",
    policy: str = "fcfs",
    max_num_seqs: int = 8,
    num_swap_blocks: int | None = None,
    block_size: int = 16,
):
    """A small KV cache (num_kv_blocks × block_size tokens, which is also the longest request),
    prefix caching off (so a preempted request's blocks cannot come back as cache hits and the
    recompute cost shows in full), the chapter's token budget."""
    return make_config(
        config,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_model_len=num_kv_blocks * block_size,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        preemption_mode=mode,
        num_swap_blocks=(num_swap_blocks if mode == "swap" else None),
        scheduling_policy=policy,
    )


def overrides_of(config) -> dict:
    return {f: getattr(config, f) for f in FIELDS}


def blocks_needed(workload: Workload, block_size: int = 16) -> int:
    """KV blocks the workload would hold at once if every request ran to its end together
    (계산값: Σ ⌈(prompt + output − 1) / block size⌉; the last token's K/V is never written)."""
    return sum(-(-(s.prompt_len + s.max_tokens - 1) // block_size) for s in workload.requests)


# -- reading a run ---------------------------------------------------------------------------


def first_victim(records: list[StepRecord]) -> str | None:
    """The first request preempted (the first one of the first step that preempted)."""
    return next((r.preempted[0] for r in records if r.preempted), None)


def preemption_events(records: list[StepRecord]) -> pd.DataFrame:
    """One row per preemption: step, victim, mode (swap if blocks were copied out that step)."""
    rows = []
    for r in records:
        for rid in r.preempted:
            rows.append(
                {
                    "스텝": r.step,
                    "선점된 요청": rid,
                    "방식": "스왑" if r.num_swapped_out_blocks else "재계산",
                    "그 스텝의 실행 요청": ", ".join(s.request_id for s in r.scheduled) or "—",
                }
            )
    return pd.DataFrame(rows, columns=["스텝", "선점된 요청", "방식", "그 스텝의 실행 요청"])


def waiting_queue(engine: EngineCore) -> pd.DataFrame:
    """The scheduler's waiting queue now, head first: who it is and why it waits."""
    rows = []
    for i, r in enumerate(engine.scheduler.waiting, 1):
        preempted = r.status == RequestStatus.PREEMPTED
        rows.append(
            {
                "순서": i,
                "요청": r.request_id,
                "우선순위": r.priority,
                "상태": ("선점됨 → 재개 대기" if preempted else "새 요청"),
                "선점 횟수": r.num_preemptions,
                "K/V 보관": (
                    "스왑 공간" if r.is_swapped_out else ("없음 (재계산)" if preempted else "—")
                ),
            }
        )
    return pd.DataFrame(rows, columns=["순서", "요청", "우선순위", "상태", "선점 횟수", "K/V 보관"])


def _token_counts(records: list[StepRecord]) -> tuple[int, int]:
    total = sum(r.total_tokens for r in records)
    recomputed = sum(r.num_recomputed_tokens for r in records)
    return total - recomputed, recomputed


def recompute_seconds(records: list[StepRecord]) -> float:
    """The share of step time spent on recomputed tokens (계산값: Σ step time × recomputed tokens
    / tokens of that step; the step times are measured)."""
    return sum(
        r.engine_duration * r.num_recomputed_tokens / r.total_tokens
        for r in records
        if r.total_tokens and r.num_recomputed_tokens
    )


def cost_summary(runs: dict[str, RunResult]) -> pd.DataFrame:
    """Per run: preemptions, useful vs recomputed tokens, swap copies and their measured time, the
    recompute time (derived), E2E of the victims and of everyone."""
    rows = []
    for label, res in runs.items():
        useful, recomputed = _token_counts(res.records)
        t = res.request_table()
        victims = t[t["preemptions"] > 0]
        swap_s = sum(r.swap_seconds for r in res.records)
        rows.append(
            {
                "실행": label,
                "KV 블록": res.num_blocks,
                "선점 횟수": int(sum(len(r.preempted) for r in res.records)),
                "유용한 토큰": useful,
                "재계산 토큰": recomputed,
                "재계산 / 유용한 토큰 (%)": round(100 * recomputed / useful, 1) if useful else 0.0,
                "스왑 아웃 블록": int(sum(r.num_swapped_out_blocks for r in res.records)),
                "스왑 인 블록": int(sum(r.num_swapped_in_blocks for r in res.records)),
                "스왑 복사 시간 (ms)": round(1000 * swap_s, 2),
                "재계산 시간 (ms, 추정)": round(1000 * recompute_seconds(res.records), 1),
                "선점된 요청 E2E 최대 (ms)": _r(victims["e2e_ms"].max()) if len(victims) else None,
                "E2E 최대 (ms)": _r(t["e2e_ms"].max()),
                "스텝 수": len(res.records),
                "전체 시간 (s)": round(res.elapsed_s, 3),
            }
        )
    return pd.DataFrame(rows)


def swap_cost_per_block(runs: dict[str, RunResult]) -> dict[str, dict]:
    """Per run: measured copy ms per block moved, and derived recompute ms per recomputed token."""
    out = {}
    for label, res in runs.items():
        blocks = sum(r.num_swapped_out_blocks + r.num_swapped_in_blocks for r in res.records)
        swap_s = sum(r.swap_seconds for r in res.records)
        _, recomputed = _token_counts(res.records)
        out[label] = {
            "copy_ms_per_block": 1000 * swap_s / blocks if blocks else None,
            "recompute_ms_per_token": (
                1000 * recompute_seconds(res.records) / recomputed if recomputed else None
            ),
        }
    return out


def _waits(request: Request) -> float:
    """Engine seconds the request spent in the waiting queue: arrival → first scheduling, plus
    every preemption → its next scheduling."""
    total, since = 0.0, None
    for e in sorted(request.journey, key=lambda e: e.engine_time or 0.0):
        if e.kind in ("arrival", "preempted"):
            since = e.engine_time
        elif e.kind == "scheduled" and since is not None:
            total += e.engine_time - since
            since = None
    return total


def request_waits(res: RunResult) -> pd.DataFrame:
    """Per request: priority, total waiting time (queue + after preemptions), TTFT, E2E (ms)."""
    t = res.request_table().set_index("request_id")
    rows = []
    for spec, r in zip(res.specs, res.requests):
        rows.append(
            {
                "정책": res.label,
                "요청": r.request_id,
                "우선순위": spec.priority,
                "대기 시간 (ms)": 1000 * _waits(r),
                "TTFT (ms)": t.loc[r.request_id, "ttft_ms"],
                "E2E (ms)": t.loc[r.request_id, "e2e_ms"],
                "선점 횟수": int(t.loc[r.request_id, "preemptions"]),
            }
        )
    return pd.DataFrame(rows)


def policy_summary(runs: dict[str, RunResult]) -> pd.DataFrame:
    """Per policy: mean waiting time per priority class, E2E max, preemptions, total time."""
    rows = []
    for label, res in runs.items():
        w = request_waits(res)
        row = {"정책": label}
        for p in sorted(w["우선순위"].unique()):
            row[f"우선순위 {p} 대기 평균 (ms)"] = _r(
                w.loc[w["우선순위"] == p, "대기 시간 (ms)"].mean()
            )
        row["E2E 최대 (ms)"] = _r(w["E2E (ms)"].max())
        row["선점 횟수"] = int(w["선점 횟수"].sum())
        row["전체 시간 (s)"] = round(res.elapsed_s, 3)
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass
class PreemptionRun:
    """What the page keeps once a lab's engines have all finished."""

    runs: dict[str, RunResult]
    costs: pd.DataFrame


def wrap_costs(runs: dict[str, RunResult]) -> PreemptionRun:
    return PreemptionRun(runs, cost_summary(runs))


@dataclass
class PolicyRun:
    runs: dict[str, RunResult]
    waits: pd.DataFrame  # request_waits of every run, stacked
    summary: pd.DataFrame


def wrap_policies(runs: dict[str, RunResult]) -> PolicyRun:
    waits = pd.concat([request_waits(r) for r in runs.values()], ignore_index=True)
    return PolicyRun(runs, waits, policy_summary(runs))


def run_burst(
    config: ConfigLike | None,
    num_kv_blocks: int,
    num_requests: int = 5,
    max_tokens: int = 24,
    modes: dict[str, str] | None = None,
    num_swap_blocks: int | None = None,
    engine_factory=None,
) -> PreemptionRun:
    """The burst on a small KV cache, once per preemption mode (without Streamlit)."""
    modes = modes or PREEMPTION_MODES
    workload = burst_workload(num_requests, max_tokens)
    runs = {
        label: run_workload(
            preemption_config(config, num_kv_blocks, mode, num_swap_blocks=num_swap_blocks),
            workload,
            label,
            engine_factory=engine_factory,
        )
        for label, mode in modes.items()
    }
    return wrap_costs(runs)


def run_policies(
    config: ConfigLike | None,
    num_kv_blocks: int,
    max_num_seqs: int = 3,
    max_tokens: int = 16,
    policies: dict[str, str] | None = None,
    engine_factory=None,
) -> PolicyRun:
    """The policy workload under each policy, same arrivals (without Streamlit)."""
    policies = policies or POLICIES
    workload = policy_workload(max_tokens)
    runs = {
        label: run_workload(
            preemption_config(config, num_kv_blocks, policy=policy, max_num_seqs=max_num_seqs),
            workload,
            label,
            engine_factory=engine_factory,
        )
        for label, policy in policies.items()
    }
    return wrap_policies(runs)


# -- figures -----------------------------------------------------------------------------------


def _layout(fig: go.Figure, title: str, height: int = 320, **axes) -> go.Figure:
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=40, b=10), **axes)
    return fig


def token_cost_figure(costs: pd.DataFrame) -> go.Figure:
    """Per run, stacked: useful tokens and recomputed tokens (the cost of preemption), with the
    ratio written on the bar."""
    fig = go.Figure()
    fig.add_trace(
        go.Bar(name="유용한 토큰", x=costs["실행"], y=costs["유용한 토큰"], marker_color="#1f77b4")
    )
    fig.add_trace(
        go.Bar(
            name="재계산 토큰",
            x=costs["실행"],
            y=costs["재계산 토큰"],
            marker_color="#d62728",
            text=[f"{p:.1f}%" for p in costs["재계산 / 유용한 토큰 (%)"]],
            textposition="outside",
        )
    )
    return _layout(
        fig,
        "계산한 토큰: 유용한 것 vs 선점 때문에 다시 한 것 (막대 위: 재계산 / 유용한 토큰)",
        barmode="stack",
        yaxis_title="토큰 수",
    )


def thrash_figure(history: pd.DataFrame) -> go.Figure:
    """The learner's runs: recomputed / useful tokens (%) against KV blocks, one point a run."""
    fig = go.Figure()
    for (n, tokens), group in history.groupby(["요청 수", "출력 토큰"]):
        group = group.drop_duplicates("KV 블록", keep="last").sort_values("KV 블록")
        fig.add_trace(
            go.Scatter(
                x=group["KV 블록"],
                y=group["재계산 / 유용한 토큰 (%)"],
                mode="lines+markers",
                name=f"요청 {n}개 · 출력 {tokens}토큰",
                customdata=group[["선점 횟수", "출력 토큰"]],
                hovertemplate=(
                    "KV 블록 %{x} · 재계산 %{y:.1f}%<br>선점 %{customdata[0]}회 · "
                    "출력 %{customdata[1]} 토큰<extra></extra>"
                ),
            )
        )
    return _layout(
        fig,
        "KV 블록이 줄면 재계산이 얼마나 늘어나나 (실행할 때마다 한 점)",
        xaxis_title="KV 블록 수",
        yaxis_title="재계산 / 유용한 토큰 (%)",
    )


def swap_vs_recompute_figure(costs: pd.DataFrame) -> go.Figure:
    """Per run: measured swap copy time and the (derived) time spent recomputing, in ms."""
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            name="스왑 복사 시간 (측정값)",
            x=costs["실행"],
            y=costs["스왑 복사 시간 (ms)"],
            marker_color="#9467bd",
        )
    )
    fig.add_trace(
        go.Bar(
            name="재계산 시간 (계산값: 스텝 시간 × 재계산 비율)",
            x=costs["실행"],
            y=costs["재계산 시간 (ms, 추정)"],
            marker_color="#d62728",
        )
    )
    return _layout(
        fig,
        "선점의 비용: 스왑 복사 vs 재계산 (ms, 엔진 시계)",
        barmode="group",
        yaxis_title="ms",
    )


def fairness_figure(waits: pd.DataFrame) -> go.Figure:
    """Waiting time per priority class, one box (with every request's point) per policy."""
    fig = go.Figure()
    for policy, group in waits.groupby("정책", sort=False):
        fig.add_trace(
            go.Box(
                x=[PRIORITY_KO.get(p, str(p)) for p in group["우선순위"]],
                y=group["대기 시간 (ms)"],
                name=policy,
                boxpoints="all",
                pointpos=0,
                text=group["요청"],
                hovertemplate="%{text} · 대기 %{y:.0f} ms<extra>" + policy + "</extra>",
            )
        )
    order = [PRIORITY_KO.get(p, str(p)) for p in sorted(waits["우선순위"].unique())]
    fig.update_xaxes(categoryorder="array", categoryarray=order)
    return _layout(
        fig,
        "우선순위별 대기 시간 (대기열 + 선점 후 대기, 엔진 시계)",
        boxmode="group",
        xaxis_title="우선순위 (낮을수록 중요)",
        yaxis_title="ms",
    )


def policy_latency_figure(waits: pd.DataFrame, metric: str = "E2E (ms)") -> go.Figure:
    """Per request (named with its priority), the metric under each policy."""
    fig = go.Figure()
    for policy, group in waits.groupby("정책", sort=False):
        fig.add_trace(go.Bar(name=policy, x=group["요청"], y=group[metric]))
    return _layout(
        fig,
        f"요청별 {metric.split(' ')[0]} (이름 끝의 p0 = 가장 중요)",
        barmode="group",
        xaxis_title="요청 (도착 순서)",
        yaxis_title="ms",
    )
