"""Chapter 04's lab parts (Streamlit): TTFT/TPOT/ITL/E2E per request and as percentiles, the queue
evidence, the history of runs and the latest bench JSON. The page composes them; what they compute
is in ui/experiments/ch04.py."""

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from ui import figures
from ui.bench_runner import run_quick_bench
from ui.experiments import ch04
from ui.experiments.ch04 import METRIC_DEFINITIONS, batch1_line, latest_bench, percentile_table
from ui.experiments.common import RunResult, Workload, korean_table
from ui.lab import LabContext, run_results
from ui.predict import compare
from ui.widgets import evidence, show_frame

RUNS = "ch04_runs"  # list of RunResult, newest last (kept so runs can be compared)
PER_REQUEST = (("ttft_ms", "TTFT", "#1f77b4"), ("tpot_ms", "TPOT", "#ff7f0e"))
PER_REQUEST += (("e2e_ms", "E2E", "#2ca02c"),)


def _per_request_figure(res: RunResult) -> go.Figure:
    t = res.request_table()
    fig = go.Figure()
    for col, name, color in PER_REQUEST:
        fig.add_trace(go.Bar(name=name, x=t["request_id"], y=t[col], marker_color=color))
    fig.update_layout(
        figures.chart_layout(
            "요청별 TTFT · TPOT · E2E (ms, 엔진 시계)",
            [name for _, name, _ in PER_REQUEST],
            barmode="group",
            xaxis=figures.category_axis("요청", list(t["request_id"])),
            yaxis=figures.zero_axis("ms"),
        )
    )
    return fig


def _percentile_figure(res: RunResult) -> go.Figure:
    """Two panels on zero-based ms axes: per request (TTFT, E2E: hundreds of ms to seconds) and per
    token (TPOT, ITL: tens of ms), so neither squeezes the other into a line."""
    t = res.request_table()
    panels = (
        {"TTFT": t["ttft_ms"].dropna(), "E2E": t["e2e_ms"].dropna()},
        {"TPOT": t["tpot_ms"].dropna(), "ITL": res.itl_samples_ms()["itl_ms"]},
    )
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("요청마다 하나", "토큰 간격"), horizontal_spacing=0.14
    )
    for col, samples in enumerate(panels, start=1):
        for name, values in samples.items():
            box = go.Box(
                y=values,
                name=f"{name} (n={len(values)})",
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                marker_size=4,
            )
            fig.add_trace(box, row=1, col=col)
        fig.update_xaxes(type="category", row=1, col=col)
        fig.update_yaxes(rangemode="tozero", type="linear", title_text="ms", row=1, col=col)
    layout = figures.chart_layout("분포: 점 하나가 표본 하나 (상자 = p25–p75, 가운데 선 = p50)")
    layout["margin"]["t"] += 22  # the panels' own titles sit between the title and the plots
    layout["height"] += 22
    fig.update_layout(layout)
    return fig


def _history_figure(runs: list[RunResult]) -> go.Figure:
    labels = [f"#{i + 1} · 동시 {r.config.max_num_seqs}" for i, r in enumerate(runs)]
    throughput = figures.AxisSeries(
        "처리량", [r.throughput for r in runs], "토큰/s", "#1f77b4", "bar"
    )
    tpot = figures.AxisSeries(
        "TPOT 평균",
        [r.request_table()["tpot_ms"].mean() for r in runs],
        "ms",
        "#ff7f0e",
        "lines+markers",
    )
    return figures.dual_axis_figure(
        labels, throughput, tpot, "실행 기록: 처리량과 TPOT", "실행 · 최대 동시 요청 수"
    )


def bench_section(runs: list[RunResult]) -> None:
    st.subheader("② 벤치마크 JSON (`python -m engine bench`)")
    if st.button(
        "빠른 벤치마크 실행 (python -m engine bench --quick)",
        key="ch04_bench",
        help="이 기계의 대역폭·행렬곱 속도와 decode 루프라인을 잽니다 (수 분 걸릴 수 있음)",
    ):
        bar = st.progress(0.0, text="벤치마크를 시작하는 중…")
        code, tail = run_quick_bench(lambda f, text: bar.progress(min(max(f, 0.0), 1.0), text=text))
        bar.empty()
        if code != 0:
            st.error(
                "벤치마크가 끝나지 못했습니다. 터미널에서 `python -m engine bench --quick`를 "
                "실행해 보세요."
            )
            with st.expander("벤치마크 출력의 끝부분"):
                st.code(tail, language=None)
    bench = latest_bench()
    if not bench:
        st.info(
            "아직 벤치마크 결과가 없습니다. 위 버튼(또는 터미널에서 `python -m engine bench "
            "--quick`)을 실행하면 `bench-results/latest.json`이 생기고, 여기에 이 기계의 "
            "대역폭·행렬곱 속도와 decode 루프라인이 나타납니다."
        )
        return
    c0 = bench.get("conditions", {})
    st.caption(
        f"마지막 측정: {c0.get('date', '날짜 모름')} · "
        f"{c0.get('device_name') or c0.get('device', '?')} · 스레드 {c0.get('threads', '?')}"
    )
    c = bench.get("conditions", {})
    cond = ch04.bench_conditions(c)
    ce, ro, b1 = (
        bench.get("ceilings", {}),
        bench.get("rooflines", {}),
        bench.get("decode_batch1", {}),
    )
    if ce.get("memory_read_gb_s"):
        evidence("측정값", f"메모리 읽기 대역폭 {ce['memory_read_gb_s']:.1f} GB/s", **cond)
    for dt, gf in (ce.get("matmul_gflop_s") or {}).items():
        evidence("측정값", f"행렬곱 {dt}: {gf:.1f} GFLOP/s", **cond)
    roof_tps = ro.get("decode_tokens_per_s")
    weight_bytes = c.get("weight_bytes_per_step")
    if roof_tps:
        bound_ms = 1000 / roof_tps
        evidence(
            "계산값",
            f"decode 스텝 시간 하한 ≈ {bound_ms:.1f} ms (배치 1의 루프라인 {roof_tps:.1f} 토큰/s)",
            formula=f"가중치 바이트 {weight_bytes:,} B / 측정 대역폭"
            if weight_bytes
            else "가중치 바이트 / 측정 대역폭",
        )
        if b1.get("tokens_per_s"):
            evidence("측정값", batch1_line(b1), **cond)
        if runs:
            tpot = runs[-1].request_table()["tpot_ms"].mean()
            evidence(
                "계산값",
                f"내 마지막 실행의 TPOT 평균 {tpot:.1f} ms ÷ 하한 {bound_ms:.1f} ms = "
                f"{tpot / bound_ms:.1f}배 (내 실행은 배치 {runs[-1].config.max_num_seqs}까지 섞여 "
                "있으니 배치 1 하한과 그대로 비교하진 마세요)",
                formula="TPOT / (가중치 바이트 / 대역폭)",
            )
    with st.expander("bench JSON 전체 보기"):
        st.json(bench, expanded=False)


def _runs(ctx: LabContext) -> list[RunResult]:
    """This session's finished runs, newest last (the lab's latest run added once)."""
    last = run_results(ctx, "_ch04_last")
    runs: list[RunResult] = st.session_state.setdefault(RUNS, [])
    if last is not None:
        res = next(iter(last.values()))
        if not any(r is res for r in runs):
            runs.append(res)
    return runs


def _request_table(res: RunResult) -> None:
    st.markdown("**요청별 측정값** (엔진 시계)")
    table = res.request_table()
    columns = ["request_id", "prompt_tokens", "output_tokens", "arrival_ms", "queue_ms"]
    columns += ["ttft_ms", "tpot_ms", "mean_itl_ms", "max_itl_ms", "e2e_ms"]
    st.dataframe(korean_table(table, columns), hide_index=True)
    row = table.iloc[-1]
    if row["output_tokens"] >= 2:
        evidence(
            "계산값",
            f"{row['request_id']}의 TPOT = ({row['e2e_ms']:.1f} − {row['ttft_ms']:.1f}) / "
            f"({int(row['output_tokens'])} − 1) ≈ "
            f"{(row['e2e_ms'] - row['ttft_ms']) / (row['output_tokens'] - 1):.1f} ms "
            f"(표의 값 {row['tpot_ms']:.1f} ms)",
            formula="TPOT = (E2E − TTFT) / (N − 1)",
        )
    with st.expander("스윔레인과 표 맞춰 보기: 대기 = tokenize 막대 + 대기열 막대"):
        show_frame(ch04.journey_waits(res.requests, res.t0), hide_index=True)
        st.caption(
            "표의 대기는 도착부터 첫 스케줄까지입니다. 스윔레인은 그 구간을 토큰화(이 실험실은 "
            "토큰 id를 바로 넣으므로 1 ms도 안 됩니다)와 대기열로 나누어 그립니다."
        )


def _queue_evidence(res: RunResult) -> None:
    effect = ch04.queue_effect(res)
    if not effect.waited or effect.ttft_ratio is None:
        return
    evidence(
        "계산값",
        f"자리를 기다린 {', '.join(effect.waited)}의 가장 짧은 TTFT "
        f"{effect.min_waited_ttft_ms:.1f} ms ÷ 바로 들어간 요청의 가장 긴 TTFT "
        f"{effect.max_served_ttft_ms:.1f} ms = {effect.ttft_ratio:.1f}배; 그 TTFT의 "
        f"{100 * effect.min_wait_share:.0f}% 이상이 대기열에서 보낸 시간",
        formula="min TTFT(기다린 요청) / max TTFT(바로 들어간 요청), 대기 / TTFT",
    )


def _distribution(res: RunResult, cond: dict) -> None:
    st.plotly_chart(_per_request_figure(res), key="ch04_per_request")
    left, right = st.columns([3, 2])
    with left:
        st.plotly_chart(_percentile_figure(res), key="ch04_dist")
    with right:
        st.markdown("**정의**")
        for name, text in METRIC_DEFINITIONS.items():
            st.markdown(f"- **{name}**: {text}")
    st.markdown("**평균과 백분위수** (numpy 선형 보간; n이 작으면 p99는 사실상 최댓값)")
    show_frame(percentile_table(res), hide_index=True)
    evidence(
        "측정값",
        f"출력 토큰 처리량 {res.throughput:.1f} 토큰/s ({res.output_tokens}토큰 / "
        f"{res.elapsed_s:.2f} s, 엔진 시계), 스텝 {len(res.records)}개",
        **cond,
    )


def _history(runs: list[RunResult]) -> None:
    st.markdown("**실행 기록** — 동시 요청 수만 바꿔 다시 실행하며 비교해 보세요.")
    history = pd.DataFrame(
        [
            dict(r.summary(), 실행=f"#{i + 1}", 최대동시요청=r.config.max_num_seqs)
            for i, r in enumerate(runs)
        ]
    )
    show_frame(history, hide_index=True)
    st.plotly_chart(_history_figure(runs), key="ch04_history")


def whole_run(ctx: LabContext, gap: int) -> None:
    runs = _runs(ctx)
    if not runs:
        st.info(
            "설정을 고르고 **실행**을 누르면 실제 엔진이 워크로드를 끝까지 돌리고, 요청별 지연 "
            "시간과 백분위수를 보여 줍니다. **워크로드 넣기** 뒤 **다음 스텝**으로 한 스텝씩 볼 "
            "수도 있습니다."
        )
        return
    res = runs[-1]
    cond = dict(res.conditions, 워크로드=Workload(res.specs).describe(), 도착간격=f"{gap} ms")
    _request_table(res)
    _queue_evidence(res)
    _distribution(res, cond)
    compare("ch04_tput", res.throughput, "토큰/s")
    if len(runs) > 1:
        _history(runs)
