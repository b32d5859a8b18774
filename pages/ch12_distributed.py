"""12 · executor and workers: the same requests on tp 1 and tp N (and optionally pp 2) side by side,
each tp/pp engine running one worker process per rank (engine/multiproc_executor.py). The chapter
view shows what each worker holds (the weight matrices cut by columns and rows, with the workers'
own shard shapes), per-step compute vs all-reduce time measured in the workers, the all-reduce
count derived and measured, and the step times of the layouts on this machine's shared CPU."""

import os
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from engine.artifact import resolve_model_path
from engine.models.llama import LlamaConfig
from engine.multiproc_executor import (
    MultiprocExecutor,
    all_reduces_per_step,
    valid_tensor_parallel_sizes,
)
from ui.experiments.ch12 import (
    MATRICES,
    SPEED_CHOICES,
    communication_table,
    lab_comparison,
    lab_run,
    matrix_cuts,
    shard_table,
    speed_verdict,
    steady_step_ms,
)
from ui.experiments.common import Workload
from ui.lab import LabContext, Side, evidence_kind, run_results, run_workload_button
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import current_settings, reset_engine
from ui.widgets import evidence, show_code

RESULT = "ch12_result"
BASE_KEY, TP_KEY, PP_KEY = "ch12_tp1", "ch12_tpn", "ch12_pp2"
PROMPT_LEN = 32
COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#B279A2", "#72B7B2", "#FF9DA6", "#9D755D"]
# Vendor-reported interconnect figures (NVIDIA H100 datasheet / PCI-SIG), for scale only.
NVLINK = "H100 SXM의 NVLink(4세대): GPU 한 장당 900 GB/s (양방향 합)"
PCIE = "PCIe 5.0 x16: 약 128 GB/s (양방향 합)"


def _model_config() -> LlamaConfig:
    return LlamaConfig.from_model_dir(resolve_model_path(current_settings().model or None))


def _label(tp: int, pp: int) -> str:
    return f"tp {tp} × pp {pp}"


def _shard_figure(model_config: LlamaConfig, layout: list[dict], tp: int) -> go.Figure:
    """The four matrices of one layer as A in Y = X·A (input × output), cut among the tp ranks."""
    cuts = matrix_cuts(model_config, layout)
    names = list(MATRICES)
    fig = make_subplots(
        rows=1, cols=len(names), subplot_titles=[f"{n} · {MATRICES[n][0]}" for n in names]
    )
    for col, name in enumerate(names, start=1):
        for _, row in cuts[cuts["행렬"] == name].iterrows():
            out_full, in_full = row["전체 출력"], row["전체 입력"]
            a, b = row["시작"], row["시작"] + row["크기"]
            if row["자른 축"] == "출력":  # column-parallel: a band of A's columns
                x0, x1, y0, y1 = a, b, 0, in_full
            else:  # row-parallel: a band of A's rows
                x0, x1, y0, y1 = 0, out_full, a, b
            rank = int(row["tp rank"])
            fig.add_trace(
                go.Scatter(
                    x=[x0, x1, x1, x0, x0],
                    y=[y0, y0, y1, y1, y0],
                    fill="toself",
                    mode="lines",
                    line=dict(color="white", width=1),
                    fillcolor=COLORS[rank % len(COLORS)],
                    name=f"tp rank {rank}",
                    legendgroup=f"rank{rank}",
                    showlegend=col == 1,
                    hovertext=f"rank {rank}: 조각 {row['조각 모양']} (PyTorch 출력 × 입력)",
                    hoverinfo="text",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="출력 특징", row=1, col=col)
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    fig.update_yaxes(title_text="입력 특징", row=1, col=1)
    fig.update_layout(
        height=330,
        title=f"한 층의 가중치를 tp {tp}개 워커가 나눠 가진 모양 (첫 층, 실제 조각 크기)",
        margin=dict(l=10, r=10, t=70, b=10),
    )
    return fig


def _holdings_view(ctx: LabContext, model_config: LlamaConfig, tp: int) -> None:
    st.markdown(f"**워커가 가진 것** (tp {tp} 엔진, 워커 프로세스 {tp}개)")
    executor = ctx.engines[TP_KEY].executor
    layout = executor.layout() if isinstance(executor, MultiprocExecutor) else []
    if not layout:
        st.info("tp 엔진이 아직 없습니다.")
        return
    st.plotly_chart(_shard_figure(model_config, layout, tp), key="ch12_shards")
    st.caption(
        "그림은 Y = X·A의 A(입력 × 출력)로 그렸습니다. 열 분할은 A의 열(출력 특징)을, 행 분할은 "
        "A의 행(입력 특징)을 워커마다 나눕니다. PyTorch는 같은 행렬을 [출력, 입력]으로 저장하므로 "
        "표의 조각 모양은 출력 × 입력 순서입니다."
    )
    st.dataframe(shard_table(layout), hide_index=True)
    total = sum(r["weight_bytes"] for r in layout)
    replicated = sum(r["replicated_bytes"] for r in layout)
    evidence(
        "측정값",
        f"워커 {len(layout)}개의 가중치 합 {total / 1e6:,.1f} MB, 그중 여러 워커가 똑같이 가진 "
        f"몫(임베딩·lm_head·정규화) {replicated / 1e6:,.1f} MB",
        출처="executor.layout() (각 워커가 자기 텐서의 바이트를 셈)",
        모델=Path(ctx.engines[TP_KEY].model_dir).name,
        dtype=str(ctx.engines[TP_KEY].dtype).replace("torch.", ""),
    )


def _communication_view(ctx: LabContext, model_config: LlamaConfig, tp: int) -> None:
    records = ctx.records(TP_KEY)
    derived = all_reduces_per_step(model_config, tp, 1)
    evidence(
        "계산값",
        f"tp {tp}: 스텝마다 워커 하나가 all-reduce {derived}번 "
        f"(층 {model_config.num_layers}개 × 2: o 뒤 한 번, down 뒤 한 번)",
        formula="2 × 층 수 (tp > 1일 때; tp 1이면 0)",
    )
    comm = communication_table(records)
    if comm.empty:
        st.info("스텝을 실행하면 여기에 워커별 계산·통신 시간이 그려집니다.")
        return
    first = comm[comm["rank"] == 0]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=first["step"], y=first["compute_ms"], name="계산 (rank 0)"))
    fig.add_trace(go.Bar(x=first["step"], y=first["comm_ms"], name="all-reduce 대기·전송 (rank 0)"))
    fig.add_trace(
        go.Scatter(
            x=first["step"],
            y=first["all_reduce_count"],
            name="all-reduce 횟수 (측정)",
            mode="lines+markers",
            yaxis="y2",
        )
    )
    fig.update_layout(
        barmode="stack",
        height=330,
        title=f"tp {tp}: 스텝마다 계산 시간과 통신 시간 (워커 rank 0)",
        xaxis_title="스텝",
        yaxis=dict(title="ms"),
        yaxis2=dict(title="all-reduce 횟수", overlaying="y", side="right", rangemode="tozero"),
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch12_comm")
    counts = sorted(set(int(c) for c in first["all_reduce_count"]))
    spent = comm["comm_ms"].sum()
    share = 100 * spent / max(comm["compute_ms"].sum() + spent, 1e-9)
    tokens = int(first["num_tokens"].iloc[-1])
    elem = ctx.engines[TP_KEY].dtype.itemsize
    bytes_formula = derived * tokens * model_config.hidden_size * elem
    evidence(
        "측정값",
        f"스텝당 all-reduce 횟수 {', '.join(map(str, counts))}번 (계산값 {derived}번); "
        f"통신이 워커 시간에서 차지한 비율 {share:.0f}%; 마지막 스텝의 all-reduce 데이터 "
        f"{first['all_reduce_kb'].iloc[-1]:,.1f} KB (계산값 {bytes_formula / 1e3:,.1f} KB)",
        **ctx_conditions(ctx, TP_KEY),
    )
    st.caption(
        f"계산값의 공식: 횟수 × 토큰 수 × hidden({model_config.hidden_size}) × "
        f"원소 바이트({elem}). "
        "통신 시간에는 다른 워커를 기다린 시간도 들어 있습니다 (all-reduce는 모두가 도착해야 "
        "끝납니다)."
    )


def ctx_conditions(ctx: LabContext, key: str) -> dict:
    engine = ctx.engines[key]
    return {
        "장치": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "모델": Path(engine.model_dir).name,
        "CPU 수 (os.cpu_count)": os.cpu_count(),
        "공유": "워커 프로세스들이 같은 CPU를 나눠 씀, 다른 사용자와도 공유될 수 있음",
    }


def _summary_view(ctx: LabContext, tp: int) -> None:
    def wrap(results: dict):
        runs = {}
        for side in ctx.sides:
            runs[side.label] = lab_run(results[side.label], ctx.engines[side.key])
        return lab_comparison(runs)

    result = run_results(ctx, RESULT, wrap)
    if result is None:
        st.info("모든 엔진이 워크로드를 끝내면 여기에 전체 비교가 나옵니다.")
        return
    st.markdown("**전체 비교** (같은 요청, 같은 기계)")
    table = result.summary.astype(object).where(result.summary.notna(), "—")
    st.dataframe(table.astype(str), hide_index=True)
    fig = go.Figure()
    for label, run in result.runs.items():
        steps = run.result.step_table()
        fig.add_trace(
            go.Scatter(
                x=steps["step"],
                y=steps["duration_ms"],
                mode="lines+markers",
                name=label,
                customdata=steps[["num_tokens"]],
                hovertemplate="스텝 %{x} · 토큰 %{customdata[0]}<br>%{y:.1f} ms<extra></extra>",
            )
        )
    fig.update_layout(
        height=320,
        title="스텝 시간 (ms): 워커를 늘리면 짧아지는가",
        xaxis_title="스텝",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch12_step_times")
    runs = list(result.runs.values())
    base, tp_run = runs[0], runs[1]
    base_ms, tp_ms = steady_step_ms(base.result), steady_step_ms(tp_run.result)
    if base_ms and tp_ms:
        speedup = base_ms / tp_ms
        compare("ch12_speed", speed_verdict(speedup, tp))
        st.caption(
            f"decode 스텝 중앙값: tp 1 {base_ms:.1f} ms, tp {tp} {tp_ms:.1f} ms → "
            f"tp 1 대비 {speedup:.2f}배 (처음 두 스텝은 한 번만 드는 비용이 있어 뺐습니다)"
        )
    for side in ctx.sides:
        run = result.runs[side.label]
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{side.label}: 스텝 {len(run.result.records)}개, 스텝 시간 합 "
            f"{sum(r.engine_duration for r in run.result.records):.2f} s",
            **ctx_conditions(ctx, side.key),
            스레드="워커마다 (이 프로세스의 스레드 수 ÷ 워커 수)",
        )
    st.caption(
        "엔진들은 한 스텝씩 번갈아 실행되므로(나란히 비교), 한 엔진의 벽시계 시간에는 다른 "
        "엔진의 스텝도 들어갑니다. 그래서 비교는 엔진마다 자기 스텝 시간으로 합니다. "
        "이 실험실의 워커들은 한 기계의 CPU를 나눠 쓰는 프로세스입니다. 워커마다 계산은 1/N로 "
        "줄지만 스레드도 1/N로 줄고, 층마다 두 번씩 서로를 기다립니다. GPU 여러 장이 빨라지는 "
        "것은 장치마다 자기 연산기와 메모리 대역폭이 따로 있기 때문입니다."
    )
    evidence("보고값", NVLINK, source="NVIDIA H100 데이터시트 (vendor-reported)")
    evidence("보고값", PCIE, source="PCI-SIG PCIe 5.0 규격 (vendor-reported)")


def lab() -> None:
    st.subheader("같은 요청을 워커 1개와 워커 여러 개로")
    model_config = _model_config()
    sizes = [s for s in valid_tensor_parallel_sizes(model_config) if s > 1]
    if not sizes:
        st.warning("이 모델은 tensor parallel로 나눌 수 있는 크기가 없습니다.")
        return
    c1, c2, c3, c4 = st.columns(4)
    tp = c1.selectbox(
        "tp 크기 (tensor_parallel_size)",
        sizes,
        index=sizes.index(3) if 3 in sizes else 0,
        key="ch12_tp",
        help=f"이 모델(query 헤드 {model_config.num_heads}개, KV 헤드 "
        f"{model_config.num_kv_heads}개)을 나눌 수 있는 크기만 보입니다",
    )
    num = c2.slider("요청 수", 1, 4, 2, key="ch12_requests")
    out = c3.slider("출력 토큰 수", 4, 32, 12, step=4, key="ch12_out")
    with_pp = c4.checkbox(
        "pp 2도 나란히", value=False, key="ch12_pp", help="층을 두 워커에 나눈 엔진을 하나 더"
    )
    sides = [
        Side(BASE_KEY, _label(1, 1), {"device": "cpu"}),
        Side(TP_KEY, _label(tp, 1), {"device": "cpu", "tensor_parallel_size": tp}),
    ]
    if with_pp and model_config.num_layers >= 2:
        sides.append(Side(PP_KEY, _label(1, 2), {"device": "cpu", "pipeline_parallel_size": 2}))
    else:
        reset_engine(PP_KEY)  # its worker processes stop
    workload = Workload.uniform(num, PROMPT_LEN, out)
    st.caption(
        f"워크로드: 요청 {num}개(프롬프트 {PROMPT_LEN}토큰, 출력 {out}토큰)를 모든 엔진에 똑같이 "
        "넣습니다. 모든 엔진은 CPU에서 실행되고, tp·pp 엔진은 랭크마다 워커 프로세스 하나를 "
        "띄웁니다 (torch.distributed, gloo)."
    )

    def before(ctx: LabContext) -> None:
        predict(
            "ch12_speed",
            f"tp {tp}(워커 {tp}개)로 돌리면, tp 1에 비해 decode 스텝 시간은?",
            options=SPEED_CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    def chapter_view(ctx: LabContext) -> None:
        _holdings_view(ctx, model_config, tp)
        _communication_view(ctx, model_config, tp)
        _summary_view(ctx, tp)

    engine_lab(
        "ch12",
        sides,
        presets=None,
        workload=workload,
        before=before,
        chapter_view=chapter_view,
        show_code_panel=False,
    )
    show_code(MultiprocExecutor.execute_model, "방금 실행된 코드 (실행자가 워커들에게 스텝을 보냄)")


render_chapter("12", lab)
