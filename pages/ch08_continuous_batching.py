"""08 · continuous batching과 토큰 단위 스케줄링: a long prompt arriving while others decode, with
chunked prefill on and off under the same token budget, stepped side by side on the real engine."""

import plotly.graph_objects as go
import streamlit as st

from engine.scheduler import Scheduler
from ui.experiments.ch08 import (
    CHUNKED_MODES,
    SWEEP_BUDGETS,
    budget_sweep,
    ChunkedComparison,
    chunked_config,
    chunked_summary,
    long_prompt_workload,
)
from ui.lab import LabContext, Progress, Side, evidence_kind, run_results, run_workload_button
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import current_settings
from ui.simulation import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL_PRESET,
    simulation_caption,
    simulation_overrides,
    simulation_picker,
)
from ui.widgets import decision_table, evidence, show_code, show_frame

RESULT = "ch08_result"
SIDE_KEYS = {"chunked prefill 켬": "ch08_on", "chunked prefill 끔": "ch08_off"}
CHOICES = ["줄어든다", "비슷하다", "늘어난다"]
FIELDS = (
    "enable_chunked_prefill",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enable_prefix_caching",
    "max_model_len",
    "num_kv_blocks",
)


def _sides(labels: list[str], budget: int, seqs: int, spec: dict | None) -> list[Side]:
    settings = current_settings()
    blocks = max(settings.num_kv_blocks, 1024 // settings.block_size)
    # simulated: a long context, and the KV capacity from the GPU's memory budget
    base = settings.to_config(
        max_model_len=8192 if spec else 1024, num_kv_blocks=None if spec else blocks
    )
    sides = []
    for label in labels:
        cfg = chunked_config(base, CHUNKED_MODES[label], budget, seqs)
        overrides = {f: getattr(cfg, f) for f in FIELDS} | simulation_overrides(spec)
        sides.append(Side(SIDE_KEYS[label], label, overrides))
    return sides


def _wrap(results: dict) -> ChunkedComparison:
    return ChunkedComparison(results, chunked_summary(results))


def _summary_view(ctx: LabContext) -> None:
    for side in ctx.sides:
        feeder = ctx.feeders.get(side.key)
        if feeder is not None and feeder.rejected:
            st.warning(
                f"{side.label}: 최대 길이({ctx.engines[side.key].max_model_len}토큰)보다 긴 요청을 "
                f"엔진이 거절했습니다 — {', '.join(feeder.rejected)}. chunked prefill 없이 긴 "
                "프롬프트를 받으려면 토큰 예산을 그 길이 이상으로 올려야 합니다."
            )
    result = run_results(ctx, RESULT, _wrap)
    if result is None:
        st.info("모든 엔진이 워크로드를 끝내면 여기에 전체 요약이 나옵니다.")
        return
    st.markdown("**전체 실행 요약** (엔진 시계)")
    show_frame(result.summary, hide_index=True)
    fig = go.Figure()
    for label, res in result.runs.items():
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
        height=320,
        title="스텝 시간 (ms) — 긴 프롬프트가 든 스텝이 튀는지",
        xaxis_title="시작 시각 (ms, 엔진 시계)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch08_step_times")
    fig = go.Figure()
    for label, res in result.runs.items():
        itl = res.itl_samples_ms()
        others = itl[itl["request_id"] != "긴-프롬프트"]
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
        height=320,
        title="짧은 요청들의 ITL (토큰 사이 간격)",
        xaxis_title="시각 (ms, 엔진 시계)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch08_itl")
    s = result.summary.set_index("실행")
    if len(s) == 2:
        on, off = s["다른 요청 ITL 최대 (ms)"]
        if on is not None and off is not None:
            measured = (
                CHOICES[0] if on < 0.8 * off else CHOICES[2] if on > 1.25 * off else CHOICES[1]
            )
            compare("ch08_itl", measured)
            st.caption(f"짧은 요청 ITL 최대: 켬 {on:.1f} ms, 끔 {off:.1f} ms")
    for side, (label, res) in zip(ctx.sides, result.runs.items()):
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{label}: 스텝 {len(res.records)}개, 전체 {res.elapsed_s:.2f} s (엔진 시계)",
            **res.conditions,
        )
    evidence(
        "계산값",
        "다른 요청 ITL 최대 = 짧은 요청들의 연속한 두 토큰 시각 차 중 최대; "
        "긴 요청 TTFT = 첫 토큰 시각 − 도착 시각",
        formula="RequestMetrics (엔진 시계)",
    )
    first = next(iter(result.runs.values()))
    mixed = [r for r in first.records if len({x.phase for x in r.scheduled}) > 1]
    if mixed:
        st.markdown(f"**섞인 스텝 하나의 결정** ({first.label}, 스텝 {mixed[0].step})")
        show_frame(decision_table(mixed[0]), hide_index=True)
    for res in result.runs.values():
        blocked = [r for r in res.records if "token_budget" in r.unscheduled.values()]
        if blocked:
            st.markdown(
                f"**토큰 예산 때문에 빠진 요청이 있는 스텝** ({res.label}, 스텝 {blocked[0].step})"
            )
            show_frame(decision_table(blocked[0]), hide_index=True)


def _budget_sweep_view(spec: dict) -> None:
    """At 8B/70B scale: TTFT vs ITL as the token budget moves (simulated, 계산값)."""
    st.subheader("규모를 키우면: 토큰 예산에 따른 TTFT와 ITL (시뮬레이션)")
    c1, c2 = st.columns(2)
    rate = c1.slider("요청 도착률 (초당)", 1.0, 16.0, 4.0, step=1.0, key="ch08_sweep_rate")
    num = c2.slider("요청 수", 40, 200, 80, step=20, key="ch08_sweep_requests")
    st.caption(
        f"같은 Poisson 워크로드(프롬프트 256–4096, 출력 32–256토큰)를 토큰 예산 "
        f"{', '.join(map(str, SWEEP_BUDGETS))}로 한 번씩 돌립니다. chunked prefill 켬."
    )
    cache = st.session_state.setdefault("ch08_sweeps", {})
    tp = spec.get("tensor_parallel_size", 1)
    sweep_key = (spec["model_preset"], spec["hardware"], tp, rate, num)
    if st.button("예산 훑기 실행", key="ch08_sweep_run", icon=":material/query_stats:"):
        progress = Progress(len(SWEEP_BUDGETS), "예산")
        try:
            cache[sweep_key] = budget_sweep(
                spec["model_preset"],
                spec["hardware"],
                rate,
                num_requests=num,
                tensor_parallel_size=tp,
                progress=progress,
            )
        finally:
            progress.close()
    table = cache.get(sweep_key)
    if table is None:
        st.info("버튼을 누르면 예산마다 시뮬레이션을 한 번씩 돌려 표와 그림을 그립니다.")
        return
    fig = go.Figure()
    for col, dash in (("TTFT p50 (ms)", "solid"), ("TTFT p90 (ms)", "dot")):
        fig.add_trace(go.Scatter(x=table["토큰 예산"], y=table[col], name=col, line_dash=dash))
    for col, dash in (("ITL p50 (ms)", "solid"), ("ITL p99 (ms)", "dot")):
        fig.add_trace(
            go.Scatter(x=table["토큰 예산"], y=table[col], name=col, line_dash=dash, yaxis="y2")
        )
    fig.update_layout(
        height=340,
        title="예산이 크면 TTFT는 줄고 ITL 꼬리는 길어진다",
        xaxis=dict(title="max_num_batched_tokens", type="log"),
        yaxis=dict(title="TTFT (ms)"),
        yaxis2=dict(title="ITL (ms)", overlaying="y", side="right"),
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch08_sweep_fig")
    st.dataframe(table, hide_index=True)
    evidence(
        "계산값",
        "TTFT·ITL 백분위, 처리량: 시뮬레이션 엔진 시계 (실제 스케줄러, 비용 모델의 스텝 시간)",
        formula="스텝 시간 = max(가중치 바이트/대역폭, FLOPs/최대 FLOP/s)/효율 + 어텐션 + 고정",
    )
    st.caption(simulation_caption(spec))


def lab() -> None:
    st.subheader("긴 프롬프트가 decode 중인 요청들 사이에 끼어들 때")
    spec = simulation_picker("ch08")
    c1, c2, c3, c4 = st.columns(4)
    if spec is None:
        budget = c1.slider(
            "토큰 예산 (max_num_batched_tokens)", 16, 512, 64, step=16, key="ch08_budget"
        )
        long_len = c3.slider("긴 프롬프트 길이 (토큰)", 100, 600, 420, step=20, key="ch08_long")
    else:  # a GPU-scale engine: GPU-scale budgets and prompts
        budget = c1.slider(
            "토큰 예산 (max_num_batched_tokens)",
            256,
            8192,
            512,
            step=256,
            key="ch08_budget_sim",
        )
        long_len = c3.slider(
            "긴 프롬프트 길이 (토큰)", 1000, 8000, 6000, step=500, key="ch08_long_sim"
        )
    seqs = c2.slider("최대 동시 요청 수 (max_num_seqs)", 1, 8, 4, key="ch08_seqs")
    arrival = c4.slider("긴 프롬프트 도착 (ms)", 0, 500, 250, step=50, key="ch08_arrival")
    c1, c2 = st.columns(2)
    chunked = c1.toggle(
        "chunked prefill",
        value=True,
        key="ch08_chunked",
        help="한 엔진만 돌릴 때 켤지 끌지 (나란히 비교를 끄면 쓰임)",
    )
    both = c2.checkbox("켬·끔 나란히 비교 (한 스텝에 두 엔진)", value=True, key="ch08_both")
    chosen = next(k for k, v in CHUNKED_MODES.items() if v == chunked)
    labels = list(CHUNKED_MODES) if both else [chosen]
    workload = long_prompt_workload(long_len, long_arrival_ms=float(arrival))
    long_total = long_len + workload.requests[-1].max_tokens
    st.caption(
        f"워크로드: 짧은 요청 3개(프롬프트 16, 출력 40)가 먼저 오고, {arrival} ms 뒤(엔진 시계) "
        f"{long_len}토큰 프롬프트 하나(출력 {workload.requests[-1].max_tokens})가 도착합니다."
    )
    if "chunked prefill 끔" in labels:
        verdict = (
            f"이 워크로드의 긴 요청({long_total}토큰)은 {budget}토큰을 넘으므로 이 엔진이 "
            "거절합니다."
            if long_total > budget
            else "긴 프롬프트는 한 스텝에 통째로 들어가야 해서, 남은 예산이 모자라면 '토큰 예산 "
            "소진'으로 기다립니다."
        )
        st.info(
            f"chunked prefill을 끈 엔진은 토큰 예산을 올리지 않습니다 (예산 {budget}토큰 그대로). "
            "청크 없이는 요청 하나(선점 뒤 재계산 포함)가 한 스텝에 들어가야 하므로 엔진은 예산 ≥ "
            f"최대 길이를 요구합니다. 그래서 이 엔진의 최대 길이(max_model_len)를 {budget}토큰으로 "
            "낮췄습니다. " + verdict
        )

    def before(ctx: LabContext) -> None:
        predict(
            "ch08_itl",
            "chunked prefill을 켜면, 끌 때에 비해 짧은 요청들의 ITL 최대(가장 긴 토큰 간격)는?",
            options=CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch08",
        _sides(labels, budget, seqs, spec),
        presets=None,
        workload=workload,
        before=before,
        chapter_view=_summary_view,
        show_code_panel=False,
    )
    # the sweep runs the simulator whatever the lab above runs (its presets, or the defaults)
    _budget_sweep_view(spec or {"model_preset": DEFAULT_MODEL_PRESET, "hardware": DEFAULT_HARDWARE})
    show_code(Scheduler.schedule, "방금 실행된 코드 (스케줄러의 결정)")


render_chapter("08", lab)
