"""Chapter 09's lab parts (Streamlit): the three experiments' setups (a burst that does not fit a
small KV cache, recompute vs swap on the same arrivals, FCFS vs priority vs static batching), their
views and the prediction box. The page composes them; what they run and compute is in
ui/experiments/ch09.py."""

import pandas as pd
import streamlit as st

from ui.experiments.ch09 import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_POLICY_SEQS,
    DEFAULT_REQUESTS,
    NOBODY,
    POLICIES,
    PREEMPTION_MODES,
    PRIORITY_KO,
    blocks_needed,
    burst_workload,
    fairness_figure,
    first_victim,
    overrides_of,
    policy_latency_figure,
    policy_workload,
    preemption_config,
    preemption_events,
    swap_cost_per_block,
    swap_vs_recompute_figure,
    thrash_figure,
    token_cost_figure,
    waiting_queue,
    wrap_costs,
    wrap_policies,
)
from ui.lab import LabContext, Side, evidence_kind, run_results
from ui.predict import compare, predict
from ui.widgets import evidence, show_frame

EXP_BURST = "① 누가 선점되나"
EXP_SWAP = "② 재계산 vs 스왑"
EXP_POLICY = "③ FCFS vs 우선순위 vs 정적"
EXPERIMENTS = [EXP_BURST, EXP_SWAP, EXP_POLICY]
RESULT = {
    EXP_BURST: "ch09_result_burst",
    EXP_SWAP: "ch09_result_swap",
    EXP_POLICY: "ch09_result_policy",
}
HISTORY = "ch09_history"
SWAP_CHOICES = ["스왑 복사가 더 오래 걸린다", "비슷하다", "재계산이 더 오래 걸린다"]
POLICY_CHOICES = ["줄어든다", "비슷하다", "늘어난다"]


# -- the live part: queue order and preemptions, every step ----------------------------------------


def _live_view(ctx: LabContext) -> None:
    st.markdown("**대기열과 선점 기록** (지금 스텝 기준)")
    cols = st.columns(len(ctx.sides))
    for col, side in zip(cols, ctx.sides):
        with col:
            if len(ctx.sides) > 1:
                st.markdown(f"*{side.label}*")
            engine = ctx.engines[side.key]
            queue = waiting_queue(engine)
            if len(queue):
                st.caption("대기열 (앞 → 뒤): 다음 스텝에 자리가 나면 위에서부터 들어갑니다")
                show_frame(queue, width="stretch")
            else:
                st.caption("대기열이 비어 있습니다.")
            events = preemption_events(ctx.records(side))
            if len(events):
                st.caption("선점 기록")
                show_frame(events, width="stretch")
            else:
                st.caption("아직 선점이 없었습니다.")


# -- ① who is preempted ----------------------------------------------------------------------------


def burst_view(ctx: LabContext) -> None:
    _live_view(ctx)

    def wrap(runs: dict):
        result = wrap_costs(runs)
        row = result.costs.iloc[0]
        res = next(iter(runs.values()))
        history = st.session_state.setdefault(HISTORY, [])
        history.append(
            {
                "KV 블록": int(row["KV 블록"]),
                "요청 수": len(res.requests),
                "출력 토큰": res.specs[0].max_tokens if res.specs else 0,
                "선점 횟수": int(row["선점 횟수"]),
                "재계산 / 유용한 토큰 (%)": float(row["재계산 / 유용한 토큰 (%)"]),
            }
        )
        return result

    result = run_results(ctx, RESULT[EXP_BURST], wrap)
    if result is None:
        st.info("워크로드가 끝나면 여기에 선점의 비용(재계산 토큰)이 나옵니다.")
        return
    res = next(iter(result.runs.values()))
    compare("ch09_victim", first_victim(res.records) or NOBODY)
    row = result.costs.iloc[0]
    st.plotly_chart(token_cost_figure(result.costs), key="ch09_cost")
    evidence(
        evidence_kind(ctx.engines[ctx.sides[0].key]),
        f"선점 {row['선점 횟수']}회, 유용한 토큰 {row['유용한 토큰']}개, "
        f"재계산 토큰 {row['재계산 토큰']}개 (엔진의 스텝 기록에서 센 값)",
        **res.conditions,
    )
    evidence(
        "계산값",
        f"재계산 / 유용한 토큰 = {row['재계산 토큰']} / {row['유용한 토큰']} = "
        f"{row['재계산 / 유용한 토큰 (%)']:.1f}%",
        formula="Σ 재계산 토큰 / (Σ 스텝 토큰 − Σ 재계산 토큰)",
    )
    history = pd.DataFrame(st.session_state.get(HISTORY, []))
    if len(history):
        st.plotly_chart(thrash_figure(history), key="ch09_thrash")
        st.caption(
            "KV 블록 수나 요청 수를 바꿔 다시 실행할 때마다 점이 하나씩 늘어납니다. 블록이 "
            "모자랄수록 같은 일을 하려고 다시 계산하는 토큰이 늘어나는지 보세요 (스래싱)."
        )
    show_frame(result.costs)


# -- ② recompute vs swap ---------------------------------------------------------------------------


def swap_view(ctx: LabContext) -> None:
    _live_view(ctx)
    result = run_results(ctx, RESULT[EXP_SWAP], wrap_costs)
    if result is None:
        st.info("두 엔진이 모두 끝나면 여기에 재계산과 스왑의 비용이 나란히 나옵니다.")
        return
    costs = result.costs.set_index("실행")
    st.plotly_chart(swap_vs_recompute_figure(result.costs), key="ch09_swap_cost")
    st.plotly_chart(token_cost_figure(result.costs), key="ch09_cost2")
    show_frame(result.costs)
    labels = list(result.runs)
    recompute = costs.loc[labels[0], "재계산 시간 (ms, 추정)"]
    swap = costs.loc[labels[1], "스왑 복사 시간 (ms)"]
    if costs.loc[labels[1], "스왑 아웃 블록"] and costs.loc[labels[0], "재계산 토큰"]:
        measured = (
            SWAP_CHOICES[0]
            if swap > 1.25 * recompute
            else SWAP_CHOICES[2]
            if recompute > 1.25 * swap
            else SWAP_CHOICES[1]
        )
        compare("ch09_swap", measured)
    elif costs.loc[labels[1], "선점 횟수"] and not costs.loc[labels[1], "스왑 아웃 블록"]:
        st.warning(
            "스왑 공간이 모자라 스왑 엔진도 모든 선점을 재계산으로 처리했습니다 (스왑한 블록 "
            "0개). 스왑 공간을 늘리면 두 방식의 비용을 비교할 수 있습니다."
        )
    else:
        st.caption("이번 실행에서는 선점이 없어 두 비용을 비교할 수 없습니다.")
    per = swap_cost_per_block(result.runs)
    for label, res in result.runs.items():
        evidence(
            "측정값",
            f"{label}: 선점 {costs.loc[label, '선점 횟수']}회, 스왑 아웃 "
            f"{costs.loc[label, '스왑 아웃 블록']}블록 · "
            f"스왑 인 {costs.loc[label, '스왑 인 블록']}블록, "
            f"복사 시간 {costs.loc[label, '스왑 복사 시간 (ms)']:.2f} ms, 전체 "
            f"{costs.loc[label, '전체 시간 (s)']:.2f} s",
            **res.conditions,
        )
    copy_ms = per[labels[1]]["copy_ms_per_block"]
    token_ms = per[labels[0]]["recompute_ms_per_token"]
    if copy_ms is not None and token_ms is not None:
        res = result.runs[labels[0]]
        evidence(
            "계산값",
            f"블록 하나(= {res.block_size}토큰) 복사 {copy_ms:.3f} ms ↔ 토큰 "
            f"{res.block_size}개 재계산 약 {token_ms * res.block_size:.2f} ms",
            formula="복사 시간 / 옮긴 블록 수; 재계산 시간(추정) / 재계산 토큰 × 블록 크기",
        )
    evidence(
        "계산값",
        f"재계산 시간 (추정) {recompute:.1f} ms",
        formula="Σ 스텝 시간 × (그 스텝의 재계산 토큰 / 그 스텝의 토큰)",
    )
    first = result.runs[labels[0]]
    if str(first.conditions.get("장치", "")).startswith("cpu"):
        st.caption(
            "이 엔진은 CPU에서 돌고 있어, '호스트 메모리로의 스왑'이 같은 DRAM 안의 복사입니다. "
            "GPU에서는 같은 블록이 PCIe를 건너가야 하므로 복사 비용의 비율이 다릅니다."
        )


# -- ③ policies ------------------------------------------------------------------------------------


def policy_view(ctx: LabContext) -> None:
    _live_view(ctx)
    result = run_results(ctx, RESULT[EXP_POLICY], wrap_policies)
    if result is None:
        st.info("세 엔진이 모두 끝나면 여기에 정책별 대기 시간과 요청별 지연이 나옵니다.")
        return
    st.plotly_chart(fairness_figure(result.waits), key="ch09_fairness")
    st.plotly_chart(policy_latency_figure(result.waits), key="ch09_policy_e2e")
    st.plotly_chart(policy_latency_figure(result.waits, "TTFT (ms)"), key="ch09_policy_ttft")
    st.markdown("**정책별 요약** (엔진 시계)")
    show_frame(result.summary)
    with st.expander("요청별 표 (우선순위, 대기, TTFT, E2E, 선점)"):
        waits = result.waits.copy()
        waits["우선순위"] = [PRIORITY_KO.get(p, p) for p in waits["우선순위"]]
        show_frame(waits.round(1))
    s = result.summary.set_index("정책")
    col = "우선순위 0 대기 평균 (ms)"
    labels = list(result.runs)
    if col in s and labels[0] in s.index and labels[1] in s.index:
        fcfs, prio = s.loc[labels[0], col], s.loc[labels[1], col]
        measured = (
            POLICY_CHOICES[0]
            if prio < 0.8 * fcfs
            else POLICY_CHOICES[2]
            if prio > 1.25 * fcfs
            else POLICY_CHOICES[1]
        )
        compare("ch09_policy", measured)
        st.caption(f"우선순위 0 요청의 평균 대기: FCFS {fcfs:.0f} ms, 우선순위 정책 {prio:.0f} ms")
    for side, (label, res) in zip(ctx.sides, result.runs.items()):
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{label}: 스텝 {len(res.records)}개, 선점 {int(s.loc[label, '선점 횟수'])}회, "
            f"전체 {res.elapsed_s:.2f} s (엔진 시계)",
            **res.conditions,
        )
    evidence(
        "계산값",
        "대기 시간 = (첫 배정 − 도착) + Σ (선점 뒤 다시 배정 − 선점)",
        formula="요청 여정의 엔진 시계 시각",
    )


# -- the experiments' setups -----------------------------------------------------------------------


def policy_setup(base, blocks: int, sim: dict, c2, c3):
    """③: the six prioritised requests, one engine per policy."""
    seqs = c2.slider("최대 동시 요청 수 (max_num_seqs)", 1, 6, DEFAULT_POLICY_SEQS, key="ch09_seqs")
    max_tokens = c3.slider(
        "출력 토큰 수 (max_tokens)", 8, 32, DEFAULT_MAX_TOKENS, step=4, key="ch09_p_tokens"
    )
    workload = policy_workload(max_tokens)
    sides = [
        Side(
            f"ch09_{policy}",
            label,
            overrides_of(preemption_config(base, blocks, policy=policy, max_num_seqs=seqs)) | sim,
        )
        for label, policy in POLICIES.items()
    ]
    note = (
        "워크로드: 요청 6개(프롬프트 16토큰)가 모두 0 ms에 A, B, C, … 순서로 도착합니다. "
        "이름 끝의 p0/p1/p2가 우선순위(낮을수록 중요)이고, 덜 중요한 요청이 먼저 옵니다."
    )
    return sides, workload, note


def burst_setup(exp: str, base, blocks: int, sim: dict, c2, c3):
    """① one recompute engine, or ② recompute vs swap, on the burst."""
    num = c2.slider("요청 수", 2, 6, DEFAULT_REQUESTS, key="ch09_requests")
    max_tokens = c3.slider(
        "출력 토큰 수 (max_tokens)", 8, 32, DEFAULT_MAX_TOKENS, step=4, key="ch09_tokens"
    )
    workload = burst_workload(num, max_tokens)
    if exp == EXP_BURST:
        cfg = preemption_config(base, blocks)
        sides = [Side("ch09_one", f"재계산 · KV {blocks}블록", overrides_of(cfg) | sim)]
    else:
        swap_blocks = st.slider(
            "스왑 공간 (블록)",
            0,
            16,
            8,
            key="ch09_swap_blocks",
            help="스왑된 K/V를 담는 호스트 메모리 블록 수. 가득 차면 재계산으로 넘어갑니다.",
        )
        sides = [
            Side(
                f"ch09_{mode}",
                label,
                overrides_of(
                    preemption_config(base, blocks, mode=mode, num_swap_blocks=swap_blocks)
                ),
            )
            for label, mode in PREEMPTION_MODES.items()
        ]
    note = (
        f"워크로드: 요청 {num}개({', '.join(workload.names())}; "
        f"프롬프트 {workload.requests[0].prompt_len}토큰, 출력 {max_tokens}토큰)가 모두 "
        "0 ms에 이 순서로 도착합니다."
    )
    return sides, workload, note


def fit_evidence(workload, blocks: int) -> None:
    need = blocks_needed(workload)
    verdict = (
        "모자라므로, 어딘가에서 선점이 일어납니다"
        if need > blocks
        else "모두 들어가므로 선점은 없어야 합니다"
    )
    evidence(
        "계산값",
        f"모든 요청이 끝까지 함께 돌면 KV 블록 {need}개가 필요하고, 캐시는 {blocks}개"
        f"(= {blocks * 16}토큰)입니다: {verdict}",
        formula="Σ ⌈(프롬프트 + 출력 − 1) / 블록 크기 16⌉",
    )


def predict_box(exp: str, workload, locked: bool) -> None:
    if exp == EXP_BURST:
        predict(
            "ch09_victim",
            "KV 블록이 처음 모자라는 순간, 가장 먼저 선점되는 요청은?",
            options=workload.names() + [NOBODY],
            locked=locked,
        )
    elif exp == EXP_SWAP:
        predict(
            "ch09_swap",
            "이 기계에서, 선점된 K/V를 스왑으로 옮기는 시간과 다시 계산하는 시간 중 어느 "
            "쪽이 클까?",
            options=SWAP_CHOICES,
            locked=locked,
        )
    else:
        predict(
            "ch09_policy",
            "우선순위 0(가장 중요) 요청들의 평균 대기 시간은, FCFS에 비해 우선순위 정책에서?",
            options=POLICY_CHOICES,
            locked=locked,
        )
