"""14 · API 서버와 스트리밍: prefill fairness stepped side by side on the real engine, then the
learner's own OpenAI-compatible server (engine/entrypoints/server/) on 127.0.0.1 driven by
simulated users over real HTTP, read through its own /metrics (the server lab: ui/labs/ch14.py)."""

import plotly.graph_objects as go
import streamlit as st

from engine.scheduler import TokenBudget
from ui.experiments.ch14 import (
    CHOICES,
    FAIR_BUDGET,
    FAIR_LONG,
    FAIR_SEQS,
    FAIR_SHORT,
    FAIR_THRESHOLD,
    LONG_NAME,
    FairnessComparison,
    direction,
    fairness_base,
    fairness_config,
    fairness_label,
    fairness_summary,
    fairness_workload,
)
from ui.lab import LabContext, Side, run_results, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch14 import server_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence, show_code, show_frame

RESULT = "ch14_fair_result"
CLAIM = (
    "긴 프롬프트가 먼저 줄을 서도, long_prefill_token_threshold(32)를 켜면 짧은 요청들이 긴 "
    "프롬프트의 prefill 조각과 같은 스텝에 실립니다. 그래서 짧은 요청들의 TTFT 평균이 임계값을 "
    "끈 엔진보다 크게 줄어듭니다 (엔진 시계)."
)
FIELDS = (
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_prefix_caching",
    "max_model_len",
    "num_kv_blocks",
    "long_prefill_token_threshold",
)


# -- part 1: prefill fairness on the lab component -------------------------------------------


def _sides(thresholds: list[int], budget: int, seqs: int) -> list[Side]:
    base = fairness_base(current_settings().to_config())
    sides = []
    for th in thresholds:
        cfg = fairness_config(base, th, budget, seqs)
        key = "ch14_off" if th == 0 else "ch14_on"
        sides.append(Side(key, fairness_label(th), {f: getattr(cfg, f) for f in FIELDS}))
    return sides


def _wrap(results: dict) -> FairnessComparison:
    return FairnessComparison(results, fairness_summary(results))


def _fair_view(ctx: LabContext) -> None:
    result = run_results(ctx, RESULT, _wrap)
    if result is None:
        st.info("두 엔진이 워크로드를 끝내면 여기에 짧은 요청들의 TTFT 비교가 나옵니다.")
        return
    st.markdown("**전체 실행 요약** (엔진 시계)")
    s = result.summary
    show_frame(s, hide_index=True)
    fig = go.Figure()
    for label, res in result.runs.items():
        t = res.request_table()
        fig.add_trace(go.Bar(x=t["request_id"], y=t["ttft_ms"], name=label))
    fig.update_layout(
        height=320,
        barmode="group",
        title="요청별 TTFT (ms, 엔진 시계) — 긴 프롬프트 뒤의 짧은 요청들",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch14_fair_ttft")
    if len(s) == 2:
        off, on = s["짧은 요청 TTFT 평균 (ms)"]
        measured = direction(on, off)
        if measured is not None:
            compare("ch14_fair", measured)
            st.caption(f"짧은 요청 TTFT 평균: 임계값 끔 {off:.1f} ms, 켬 {on:.1f} ms")
    for label, res in result.runs.items():
        evidence(
            "측정값",
            f"{label}: 스텝 {len(res.records)}개, 전체 {res.elapsed_s:.3f} s (엔진 시계)",
            **res.conditions,
        )
    evidence(
        "계산값",
        "짧은 요청 TTFT = 첫 토큰 시각 − 도착 시각; 짧은 요청이 처음 들어간 스텝 = 짧은 요청이 "
        "하나라도 스케줄된 첫 스텝",
        formula="RequestMetrics (엔진 시계), StepRecord.scheduled",
    )


def fairness_lab() -> None:
    st.subheader("① prefill 공정성: 긴 프롬프트 하나가 짧은 요청들 앞에 설 때")
    c1, c2, c3, c4 = st.columns(4)
    budget = c1.slider(
        "토큰 예산 (max_num_batched_tokens)", 32, 256, FAIR_BUDGET, step=16, key="ch14_budget"
    )
    threshold = c2.slider(
        "long_prefill_token_threshold (켠 쪽)", 8, 128, FAIR_THRESHOLD, step=8, key="ch14_threshold"
    )
    long_len = c3.slider("긴 프롬프트 길이 (토큰)", 100, 600, FAIR_LONG, step=20, key="ch14_long")
    num_short = c4.slider("짧은 요청 수", 1, 6, FAIR_SHORT, key="ch14_num_short")
    workload = fairness_workload(long_len, num_short=num_short)
    st.caption(
        f"워크로드: {long_len}토큰 프롬프트 하나(출력 4)가 먼저 줄을 서고, 같은 순간 짧은 요청 "
        f"{num_short}개(프롬프트 8, 출력 8)가 그 뒤에 섭니다. 두 엔진 모두 chunked prefill 켬, "
        f"토큰 예산 {budget}, 최대 동시 요청 4. 다른 것은 임계값 하나뿐입니다."
    )
    if threshold >= budget:
        st.warning(
            f"임계값({threshold})이 토큰 예산({budget}) 이상이면 긴 요청이 여전히 예산을 다 "
            "가져갈 수 있어, 두 엔진의 차이가 사라집니다."
        )

    def before(ctx: LabContext) -> None:
        predict(
            "ch14_fair",
            f"임계값을 {threshold}로 켜면, 끌 때에 비해 짧은 요청들의 TTFT 평균은?",
            options=CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch14",
        _sides([0, threshold], budget, FAIR_SEQS),
        presets=None,
        workload=workload,
        workload_note=workload.describe() + f" · 긴 요청 이름: {LONG_NAME}",
        before=before,
        chapter_view=_fair_view,
        show_code_panel=False,
    )
    show_code(TokenBudget.fit, "방금 실행된 코드 (요청 하나가 이번 스텝에 받을 토큰 수)")


def lab() -> None:
    fairness_lab()
    st.divider()
    server_lab()


render_chapter("14", lab, claim=CLAIM)
