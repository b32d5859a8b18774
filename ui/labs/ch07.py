"""Chapter 07's lab parts (Streamlit): the three engines' sides (sequential, static batches,
continuous batching), the summary view and the workload note. The page composes them; what they
compute is in ui/experiments/ch07.py."""

import plotly.graph_objects as go
import streamlit as st

from ui.experiments.ch07 import (
    batch_waste,
    batching_config,
    batching_summary,
    decode_step_ms,
    late_arrival_ms,
)
from ui.lab import LabContext, Side, evidence_kind, run_results
from ui.predict import compare
from ui.session import current_settings
from ui.simulation import build_simulated_engine, simulation_overrides
from ui.widgets import evidence, show_frame

RESULTS = "ch07_results"
SIDE_KEYS = {
    "순차 실행": "ch07_seq",
    "정적 배칭": "ch07_static",
    "continuous batching": "ch07_cont",
}


def lab_sides(batch: int, spec: dict | None) -> list[Side]:
    base = current_settings().to_config(enable_prefix_caching=False)
    sides = []
    for label, key in SIDE_KEYS.items():
        cfg = batching_config(base, label, batch)
        overrides = dict(
            scheduling_policy=cfg.scheduling_policy,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=False,
        ) | simulation_overrides(spec)
        sides.append(Side(key, label, overrides))
    return sides


def summary_view(ctx: LabContext) -> None:
    results = run_results(ctx, RESULTS)
    if results is None:
        st.info(
            "세 엔진이 워크로드를 모두 끝내면 여기에 전체 요약이 나옵니다. **실행**은 한 번에 "
            "끝까지, **워크로드 넣기** 뒤 **다음 스텝**은 세 엔진을 한 스텝씩 나란히 움직입니다."
        )
        return
    summary = batching_summary(results)
    st.markdown("**전체 실행 요약** (엔진 시계)")
    show_frame(summary, hide_index=True)
    fig = go.Figure()
    for label, res in results.items():
        t = res.request_table()
        fig.add_trace(go.Bar(name=f"{label} E2E", x=t["request_id"], y=t["e2e_ms"]))
    fig.update_layout(
        barmode="group",
        height=320,
        title="요청별 E2E (ms, 엔진 시계)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch07_e2e")
    c1, c2 = st.columns(2)
    fig = go.Figure(go.Bar(x=summary["방식"], y=summary["처리량 (토큰/s)"], marker_color="#1f77b4"))
    fig.update_layout(
        height=300,
        title="처리량 (토큰/s)",
        yaxis_title="토큰/s",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    c1.plotly_chart(fig, key="ch07_throughput")
    fig = go.Figure()
    fig.add_trace(go.Bar(name="빈 자리", x=summary["방식"], y=summary["빈 자리 (슬롯·스텝)"]))
    fig.add_trace(go.Bar(name="패딩 낭비", x=summary["방식"], y=summary["패딩 낭비 (슬롯·스텝)"]))
    fig.update_layout(
        barmode="group",
        height=300,
        title="낭비된 자리 (슬롯·스텝)",
        yaxis_title="슬롯·스텝",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    c2.plotly_chart(fig, key="ch07_waste")
    best = summary.loc[summary["처리량 (토큰/s)"].idxmax(), "방식"]
    compare("ch07_best", best)
    for side, (label, res) in zip(ctx.sides, results.items()):
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{label}: 전체 {res.elapsed_s:.2f} s (엔진 시계), "
            f"처리량 {res.throughput:.1f} 토큰/s, "
            f"스텝 {len(res.records)}개",
            **res.conditions,
        )
    w = batch_waste(results["정적 배칭"])
    evidence(
        "계산값",
        f"정적 배칭의 패딩 낭비 {w['padding_slot_steps']} 슬롯·스텝 (배치 {w['num_batches']}개)",
        formula="Σ 배치마다 (배치 크기 × 배치 스텝 수) − 실제로 일한 (요청, 스텝) 수",
    )
    evidence(
        "계산값",
        "빈 자리 = 최대 동시 요청 수 × 스텝 수 − Σ 스텝마다 배정된 요청 수; "
        "막힌 대기 = 대기 이유가 '정적 배치 진행 중' 또는 '최대 동시 요청 수'인 (요청, 스텝) 수",
        formula="스텝 기록(StepRecord)에서 셈",
    )
    st.caption(
        "주의: 우리 엔진의 정적 배칭은 끝난 요청을 실제로 계산하지는 않습니다. 패딩 낭비는 "
        "'패딩으로 채워 함께 계산하는 구현이었다면 헛돌았을 자리'이고, 자리가 비어 있어 다른 "
        "요청을 받지 못한 것은 실제입니다."
    )


def lab_step_ms(batch: int, spec: dict | None) -> float | None:
    """One decode step of `batch` requests on this lab's engine (ms), kept per configuration:
    measured on a short run (real engine) or computed (simulation). None if no engine could be
    built (the lab shows the engine's message)."""
    base = current_settings().to_config(enable_prefix_caching=False)
    cfg = batching_config(base, "continuous batching", batch)
    cache = st.session_state.setdefault("ch07_step_ms", {})
    key = (repr(cfg), repr(spec))
    if key not in cache:
        factory = None if spec is None else (lambda c: build_simulated_engine(spec, c))
        try:
            with st.spinner("이 엔진의 decode 스텝 시간을 재는 중…"):
                cache[key] = decode_step_ms(cfg, batch, engine_factory=factory)
        except Exception:  # noqa: BLE001 - the lab below shows why the engine cannot be built
            return None
    return cache[key]


def workload_note(workload, late_steps: int, step_ms: float | None, spec: dict | None) -> None:
    """The workload, and how the late arrivals' gap in steps became engine-clock ms."""
    st.caption(
        "워크로드: "
        + ", ".join(
            f"r{i}(프롬프트 {s.prompt_len}, 출력 {s.max_tokens}, 도착 {s.arrival_ms:.0f} ms)"
            for i, s in enumerate(workload.requests)
        )
    )
    if step_ms:
        source = "비용 모델이 계산" if spec else "이 엔진의 짧은 실행에서 잰 중앙값, 측정값"
        gap = late_arrival_ms(late_steps, step_ms)
        evidence(
            "계산값",
            f"늦게 오는 요청 둘의 도착 = {late_steps}스텝 × decode 스텝 {step_ms:.1f} ms"
            f"({source})와 그 두 배 = {gap:.0f} ms, {2 * gap:.0f} ms (엔진 시계)",
            formula="간격(스텝) × 배치 크기만큼 요청이 decode하는 스텝 하나의 시간",
        )
    st.caption(
        "도착 간격을 ms가 아닌 스텝으로 정하는 까닭: 스텝 하나가 이 CPU에서는 수십 ms, "
        "시뮬레이션한 GPU에서는 몇 ms라서, ms로 정한 도착은 한쪽에서는 배치 한가운데에, 다른 "
        "쪽에서는 모든 요청이 끝난 뒤에 떨어집니다. 스텝으로 정하면 두 모드에서 같은 장면이 됩니다."
    )
