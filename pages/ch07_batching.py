"""07 · 배칭 기초: one workload run sequentially, in static batches and with continuous batching on
the real engine; latency, padding waste, idle slots, head-of-line blocking, throughput side by side."""

import plotly.graph_objects as go
import streamlit as st

from ui import figures
from ui.experiments import batch_waste, batching_summary, batching_workload, compare_batching
from ui.lesson import render_chapter
from ui.session import current_settings
from ui.widgets import evidence, show_code

RESULTS = "ch07_results"


def lab() -> None:
    st.subheader("같은 워크로드, 세 가지 방식")
    c1, c2, c3 = st.columns(3)
    n = c1.slider("요청 수", 3, 8, 6, key="ch07_n")
    batch = c2.slider("배치 크기 (최대 동시 요청 수)", 2, 6, 4, key="ch07_batch")
    late = c3.slider("늦게 오는 요청의 도착 간격 (ms)", 0, 1000, 400, step=100, key="ch07_late")
    workload = batching_workload(n, late)
    st.caption("워크로드: " + ", ".join(f"r{i}(프롬프트 {s.prompt_len}, 출력 {s.max_tokens}, 도착 {s.arrival_ms:.0f} ms)"
                                     for i, s in enumerate(workload.requests)))
    if st.button("실행", key="ch07_run", type="primary"):
        cfg = current_settings().to_config(enable_prefix_caching=False)
        with st.spinner("세 방식으로 실행하는 중…"):
            st.session_state[RESULTS] = compare_batching(cfg, workload, batch)
    results = st.session_state.get(RESULTS)
    if not results:
        st.info("**실행**을 누르면 같은 요청들을 순차 실행, 정적 배칭, continuous batching으로 실제 엔진에서 돌립니다.")
        return
    for i, (label, res) in enumerate(results.items()):
        fig = figures.journey_figure(res.requests, t0=res.t0)
        fig.update_layout(title=f"{label} — 요청 여정")
        st.plotly_chart(fig, key=f"ch07_journey_{i}")
    summary = batching_summary(results)
    st.dataframe(summary, hide_index=True)

    fig = go.Figure()
    for label, res in results.items():
        t = res.request_table()
        fig.add_trace(go.Bar(name=f"{label} E2E", x=t["request_id"], y=t["e2e_ms"]))
    fig.update_layout(barmode="group", height=320, title="요청별 E2E (ms)", yaxis_title="ms",
                      margin=dict(l=10, r=10, t=40, b=10))
    st.plotly_chart(fig, key="ch07_e2e")
    fig = go.Figure()
    fig.add_trace(go.Bar(name="처리량 (토큰/s)", x=summary["방식"], y=summary["처리량 (토큰/s)"]))
    fig.add_trace(go.Bar(name="빈 자리 (슬롯·스텝)", x=summary["방식"], y=summary["빈 자리 (슬롯·스텝)"], yaxis="y2"))
    fig.add_trace(go.Bar(name="패딩 낭비 (슬롯·스텝)", x=summary["방식"], y=summary["패딩 낭비 (슬롯·스텝)"], yaxis="y2"))
    fig.update_layout(barmode="group", height=320, title="처리량과 낭비된 자리",
                      yaxis=dict(title="토큰/s"), yaxis2=dict(title="슬롯·스텝", overlaying="y", side="right"),
                      margin=dict(l=10, r=10, t=40, b=10))
    st.plotly_chart(fig, key="ch07_waste")
    static = results["정적 배칭"]
    st.plotly_chart(figures.schedule_figure(static.records), key="ch07_static_schedule")
    st.caption("정적 배칭의 스케줄러 결정: 먼저 끝난 요청의 자리가 배치가 끝날 때까지 비고, 대기 요청에는 "
               "'정적 배치 진행 중' 이유가 붙습니다 (스케줄러 결정 표는 06장·08장 실험실에서 한 스텝씩 볼 수 있음).")
    for label, res in results.items():
        w = batch_waste(res)
        evidence("측정값", f"{label}: 전체 {res.wall_s:.2f} s, 처리량 {res.throughput:.1f} 토큰/s, 스텝 {len(res.records)}개",
                 **res.conditions)
    w = batch_waste(static)
    evidence("계산값", f"정적 배칭의 패딩 낭비 {w['padding_slot_steps']} 슬롯·스텝 (배치 {w['num_batches']}개)",
             formula="Σ 배치마다 (배치 크기 × 배치 스텝 수) − 실제로 일한 (요청, 스텝) 수")
    evidence("계산값", "빈 자리 = 최대 동시 요청 수 × 스텝 수 − Σ 스텝마다 배정된 요청 수; "
             "막힌 대기 = 대기 이유가 '정적 배치 진행 중' 또는 '최대 동시 요청 수'인 (요청, 스텝) 수",
             formula="스텝 기록(StepRecord)에서 셈")
    st.caption("주의: 우리 엔진의 정적 배칭은 끝난 요청을 실제로 계산하지는 않습니다. 패딩 낭비는 '패딩으로 채워 함께 "
               "계산하는 구현이었다면 헛돌았을 자리'이고, 자리가 비어 있어 다른 요청을 받지 못한 것은 실제입니다.")
    show_code(compare_batching, "방금 실행된 코드 (세 방식 비교)")


render_chapter("07", lab)
