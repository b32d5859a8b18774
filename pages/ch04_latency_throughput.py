"""04 · 지연 시간과 처리량: a workload on the real engine, TTFT/TPOT/ITL/E2E per request and as
percentiles, throughput, the conditions of the measurement, and the latest bench JSON if any."""

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from ui.bench_runner import run_quick_bench
from ui.experiments.ch04 import METRIC_DEFINITIONS, latest_bench, percentile_table
from ui.experiments.common import RunResult, Workload, korean_table, run_workload
from ui.lab import LabContext, Side, run_results, run_workload_button
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence, show_code, show_frame

RUNS = "ch04_runs"  # list of RunResult, newest last (kept so runs can be compared)


def _per_request_figure(res: RunResult) -> go.Figure:
    t = res.request_table()
    fig = go.Figure()
    for col, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        fig.add_trace(go.Bar(name=name, x=t["request_id"], y=t[col]))
    fig.update_layout(
        barmode="group",
        height=300,
        title="요청별 TTFT · TPOT · E2E (ms, 엔진 시계)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def _percentile_figure(res: RunResult) -> go.Figure:
    t = res.request_table()
    samples = {
        "TTFT": t["ttft_ms"].dropna(),
        "TPOT": t["tpot_ms"].dropna(),
        "ITL": res.itl_samples_ms()["itl_ms"],
        "E2E": t["e2e_ms"].dropna(),
    }
    fig = go.Figure()
    for name, values in samples.items():
        fig.add_trace(
            go.Box(
                y=values,
                name=f"{name} (n={len(values)})",
                boxpoints="all",
                jitter=0.4,
                pointpos=0,
                marker_size=4,
            )
        )
    fig.update_layout(
        height=340,
        title="분포: 점 하나가 표본 하나 (상자 = p25–p75, 가운데 선 = p50)",
        yaxis_title="ms (로그)",
        yaxis_type="log",
        showlegend=False,
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def _history_figure(runs: list[RunResult]) -> go.Figure:
    xs = [r.config.max_num_seqs for r in runs]
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=[r.throughput for r in runs],
            mode="markers+text",
            name="처리량 (토큰/s)",
            text=[f"#{i + 1}" for i in range(len(runs))],
            textposition="top center",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=[r.request_table()["tpot_ms"].mean() for r in runs],
            mode="markers",
            name="TPOT 평균 (ms)",
            yaxis="y2",
            marker_symbol="diamond",
        )
    )
    fig.update_layout(
        height=300,
        title="실행 기록: 최대 동시 요청 수 ↔ 처리량, TPOT",
        xaxis_title="최대 동시 요청 수",
        yaxis=dict(title="토큰/s"),
        yaxis2=dict(title="ms", overlaying="y", side="right"),
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def _bench_section(runs: list[RunResult]) -> None:
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
    cond = {
        "장치": c.get("device_name") or c.get("device"),
        "스레드": c.get("threads"),
        "dtype": c.get("dtype"),
        "모델": c.get("model_name"),
        "날짜": c.get("date"),
    }
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
            evidence(
                "측정값",
                f"bench의 배치 1 decode: {b1['tokens_per_s']:.1f} 토큰/s = 루프라인의 "
                f"{100 * (b1.get('fraction_of_roofline') or 0):.0f}%",
                **cond,
            )
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


def _whole_run(ctx: LabContext, gap: int) -> None:
    last = run_results(ctx, "_ch04_last")
    runs: list[RunResult] = st.session_state.setdefault(RUNS, [])
    if last is not None:
        res = next(iter(last.values()))
        if not any(r is res for r in runs):
            runs.append(res)
    if not runs:
        st.info(
            "설정을 고르고 **실행**을 누르면 실제 엔진이 워크로드를 끝까지 돌리고, 요청별 지연 "
            "시간과 백분위수를 보여 줍니다. **워크로드 넣기** 뒤 **다음 스텝**으로 한 스텝씩 볼 "
            "수도 있습니다."
        )
        return
    res = runs[-1]
    cond = dict(res.conditions, 워크로드=Workload(res.specs).describe(), 도착간격=f"{gap} ms")
    st.markdown("**요청별 측정값** (엔진 시계)")
    table = res.request_table()
    st.dataframe(
        korean_table(
            table,
            [
                "request_id",
                "prompt_tokens",
                "output_tokens",
                "arrival_ms",
                "queue_ms",
                "ttft_ms",
                "tpot_ms",
                "mean_itl_ms",
                "max_itl_ms",
                "e2e_ms",
            ],
        ),
        hide_index=True,
    )
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
    st.plotly_chart(_per_request_figure(res), key="ch04_per_request")
    left, right = st.columns([3, 2])
    with left:
        st.plotly_chart(_percentile_figure(res), key="ch04_dist")
    with right:
        st.markdown("**정의**")
        for name, text in METRIC_DEFINITIONS.items():
            st.markdown(f"- **{name}**: {text}")
    st.markdown("**평균과 백분위수** (numpy 선형 보간; n이 작으면 p99는 사실상 최댓값)")
    pct = percentile_table(res)
    show_frame(pct, hide_index=True)
    evidence(
        "측정값",
        f"출력 토큰 처리량 {res.throughput:.1f} 토큰/s ({res.output_tokens}토큰 / "
        f"{res.elapsed_s:.2f} s, 엔진 시계), 스텝 {len(res.records)}개",
        **cond,
    )
    compare("ch04_tput", res.throughput, "토큰/s")
    if len(runs) > 1:
        st.markdown("**실행 기록** — 동시 요청 수만 바꿔 다시 실행하며 비교해 보세요.")
        history = pd.DataFrame(
            [
                dict(r.summary(), 실행=f"#{i + 1}", 최대동시요청=r.config.max_num_seqs)
                for i, r in enumerate(runs)
            ]
        )
        show_frame(history, hide_index=True)
        st.plotly_chart(_history_figure(runs), key="ch04_history")


def lab() -> None:
    st.subheader("① 워크로드를 실행하고 지연 시간을 재기")
    settings = current_settings()
    c1, c2, c3 = st.columns(3)
    n = c1.slider("요청 수", 2, 8, 6, key="ch04_n")
    prompt_len = c2.select_slider(
        "프롬프트 길이 (토큰)", [16, 32, 64, 128], value=32, key="ch04_prompt"
    )
    out_len = c3.slider("출력 길이 (토큰)", 8, 48, 24, step=4, key="ch04_out")
    c1, c2 = st.columns(2)
    seqs = c1.slider("최대 동시 요청 수", 1, 8, min(settings.max_num_seqs, 8), key="ch04_seqs")
    gap = c2.slider("요청 사이 도착 간격 (ms)", 0, 500, 0, step=50, key="ch04_gap")
    workload = Workload.uniform(n, prompt_len, out_len, gap)
    side = Side("ch04", f"동시 {seqs}", dict(max_num_seqs=seqs, enable_prefix_caching=False))

    def before(ctx: LabContext) -> None:
        predict(
            "ch04_tput",
            "이 설정의 출력 토큰 처리량은 몇 토큰/s일까요?",
            unit="토큰/s",
            locked=ctx.started and not ctx.finished,
            step=10.0,
        )
        b1, b2 = st.columns([1, 1])
        with b1:
            run_workload_button(ctx, workload)
        if b2.button("기록 지우기", key="ch04_clear"):
            st.session_state[RUNS] = []

    engine_lab(
        "ch04",
        [side],
        presets=None,
        workload=workload,
        before=before,
        chapter_view=lambda ctx: _whole_run(ctx, gap),
        show_code_panel=False,
    )
    show_code(run_workload, "방금 실행된 코드 (워크로드 실행)")
    _bench_section(st.session_state.get(RUNS, []))


render_chapter("04", lab)
