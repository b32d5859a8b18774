"""08 · continuous batching과 토큰 단위 스케줄링: a long prompt arriving while others decode, with and
without chunked prefill; the token budget and max running requests as sliders driving real runs."""

import plotly.graph_objects as go
import streamlit as st

from engine.scheduler import Scheduler
from ui import figures
from ui.experiments import compare_chunked_prefill, long_prompt_workload
from ui.lesson import render_chapter
from ui.session import current_settings
from ui.widgets import decision_table, evidence, show_code

RESULT = "ch08_result"


def lab() -> None:
    st.subheader("긴 프롬프트가 decode 중인 요청들 사이에 끼어들 때")
    c1, c2, c3 = st.columns(3)
    budget = c1.slider("토큰 예산 (max_num_batched_tokens)", 16, 512, 64, step=16, key="ch08_budget")
    seqs = c2.slider("최대 동시 요청 수 (max_num_seqs)", 1, 8, 4, key="ch08_seqs")
    long_len = c3.slider("긴 프롬프트 길이 (토큰)", 400, 600, 420, step=20, key="ch08_long")
    workload = long_prompt_workload(long_len)
    st.caption(f"워크로드: 짧은 요청 3개(프롬프트 16, 출력 40)가 먼저 오고, {workload.requests[-1].arrival_ms:.0f} ms 뒤 "
               f"{long_len}토큰 프롬프트 하나가 도착. chunked prefill을 끄면 예산은 max(예산, 가장 긴 요청 = {long_len}+{workload.requests[-1].max_tokens})로 "
               "올라갑니다 (한 스텝에 요청 전체가 들어가야 하므로: 선점 뒤 재계산할 때는 생성된 토큰까지 한 번에 "
               "계산합니다. 그래서 엔진은 예산 ≥ max_model_len을 요구하고, 이 실행의 max_model_len은 가장 긴 요청 길이입니다).")
    if st.button("실행", key="ch08_run", type="primary"):
        cfg = current_settings().to_config(max_model_len=1024, num_kv_blocks=max(current_settings().num_kv_blocks,
                                                                                   1024 // current_settings().block_size))
        with st.spinner("chunked prefill 켬/끔으로 두 번 실행하는 중…"):
            st.session_state[RESULT] = compare_chunked_prefill(cfg, workload, budget, seqs)
    result = st.session_state.get(RESULT)
    if result is None:
        st.info("슬라이더를 정하고 **실행**을 누르면 같은 워크로드를 chunked prefill 켬/끔으로 실제 엔진에서 돌립니다.")
        return
    st.dataframe(result.summary, hide_index=True)
    cols = st.columns(2)
    for i, (label, res) in enumerate(result.runs.items()):
        with cols[i]:
            fig = figures.schedule_figure(res.records)
            fig.update_layout(title=f"{label}: 스텝별 토큰 (예산 {res.config.max_num_batched_tokens})")
            st.plotly_chart(fig, key=f"ch08_schedule_{i}")
    fig = go.Figure()
    for label, res in result.runs.items():
        steps = res.step_table()
        fig.add_trace(go.Scatter(x=steps["start_ms"], y=steps["duration_ms"], mode="lines+markers", name=f"{label} 스텝 시간",
                                 customdata=steps[["step", "num_tokens"]], hovertemplate=
                                 "스텝 %{customdata[0]} · 토큰 %{customdata[1]}<br>%{y:.1f} ms<extra></extra>"))
    fig.update_layout(height=320, title="스텝 시간 (ms) — 긴 프롬프트가 든 스텝이 튀는지", xaxis_title="시작 시각 (ms)",
                      yaxis_title="ms", margin=dict(l=10, r=10, t=40, b=10))
    st.plotly_chart(fig, key="ch08_step_times")
    fig = go.Figure()
    for label, res in result.runs.items():
        itl = res.itl_samples_ms()
        others = itl[itl["request_id"] != "긴-프롬프트"]
        fig.add_trace(go.Scatter(x=others["time_ms"], y=others["itl_ms"], mode="markers", name=f"{label}: 짧은 요청 ITL",
                                 text=others["request_id"]))
    fig.update_layout(height=320, title="짧은 요청들의 ITL (토큰 사이 간격)", xaxis_title="시각 (ms)", yaxis_title="ms",
                      margin=dict(l=10, r=10, t=40, b=10))
    st.plotly_chart(fig, key="ch08_itl")
    for label, res in result.runs.items():
        evidence("측정값", f"{label}: 스텝 {len(res.records)}개, 전체 {res.wall_s:.2f} s", **res.conditions)
    evidence("계산값", "다른 요청 ITL 최대 = 짧은 요청들의 연속한 두 토큰 시각 차 중 최대; 긴 요청 TTFT = 첫 토큰 시각 − 도착 시각",
             formula="RequestMetrics.token_times에서 셈")
    res_on = next(iter(result.runs.values()))
    mixed = [r for r in res_on.records if len({s.phase for s in r.scheduled}) > 1]
    if mixed:
        st.markdown(f"**섞인 스텝 하나의 결정** (chunked prefill 켬, 스텝 {mixed[0].step})")
        st.dataframe(decision_table(mixed[0]), hide_index=True)
    blocked = [r for r in res_on.records if r.unscheduled]
    if blocked:
        st.markdown(f"**대기 이유가 붙은 스텝** (chunked prefill 켬, 스텝 {blocked[0].step})")
        st.dataframe(decision_table(blocked[0]), hide_index=True)
    show_code(Scheduler.schedule, "방금 실행된 코드 (스케줄러의 결정)")


render_chapter("08", lab)
