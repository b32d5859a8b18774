"""Chapter 12's tensor-parallel lab, its views (Streamlit): what each worker holds (the weight
matrices cut by columns and rows), compute vs all-reduce time per step, the layouts' step times
side by side, and (simulated) the communication share as tp grows. The page
(pages/ch12_distributed.py) builds the engines and composes these; what they compute is in
ui/experiments/ch12.py."""

import os
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from engine.layers.sharding import all_reduces_per_step
from engine.models.config import LlamaConfig
from engine.tools.presets import load_hardware_preset, load_model_preset
from ui.experiments.ch12 import (
    MATRICES,
    base_names,
    communication_table,
    lab_comparison,
    lab_run,
    matrix_cuts,
    parallel_conditions,
    planned_layout,
    shard_table,
    speed_verdict,
    steady_step_ms,
    tp_scaling,
)
from ui.experiments.common import is_simulated
from ui.lab import LabContext, evidence_kind, run_results
from ui.predict import compare
from ui.widgets import evidence, show_frame

BASE_KEY, TP_KEY, PP_KEY = "ch12_tp1", "ch12_tpn", "ch12_pp2"
RESULT = "ch12_result"
COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#B279A2", "#72B7B2", "#FF9DA6", "#9D755D"]
# Vendor-reported interconnect figures (NVIDIA H100 datasheet / PCI-SIG), for scale only.
NVLINK = "H100 SXM의 NVLink(4세대): GPU 한 장당 900 GB/s (양방향 합)"
PCIE = "PCIe 5.0 x16: 약 128 GB/s (양방향 합)"
LEGEND_BELOW = dict(orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0)


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


def _draw_layout(model_config: LlamaConfig, layout: list[dict], tp: int) -> None:
    """The shard figure and the per-worker table of one layout (measured, planned or computed)."""
    st.plotly_chart(_shard_figure(model_config, layout, tp), key="ch12_shards")
    st.caption(
        "그림은 Y = X·A의 A(입력 × 출력)로 그렸습니다. 열 분할은 A의 열(출력 특징)을, 행 분할은 "
        "A의 행(입력 특징)을 워커마다 나눕니다. PyTorch는 같은 행렬을 [출력, 입력]으로 저장하므로 "
        "표의 조각 모양은 출력 × 입력 순서입니다."
    )
    show_frame(shard_table(layout))


def planned_view(model_config: LlamaConfig, tp: int) -> None:
    """Before any worker starts: what each of the tp workers will hold (계산값)."""
    st.markdown(f"**워커가 가질 것** (tp {tp} 엔진, 워커 프로세스 {tp}개: 아직 띄우지 않음)")
    layout = planned_layout(model_config, tp, 1)
    _draw_layout(model_config, layout, tp)
    total = sum(r["weight_bytes"] for r in layout)
    replicated = sum(r["replicated_bytes"] for r in layout)
    evidence(
        "계산값",
        f"워커 {len(layout)}개의 가중치 합 {total / 1e6:,.1f} MB, 그중 여러 워커가 똑같이 가질 "
        f"몫(임베딩·lm_head·정규화) {replicated / 1e6:,.1f} MB. 워커를 띄우면 각 워커가 자기 "
        "텐서를 센 측정값으로 바뀝니다 (KV 캐시는 그때 정해짐)",
        formula="engine/models/llama.py의 shard_weights를 이 모델 모양의 빈(meta) 텐서에 "
        "적용해, 워커마다 자기 조각의 원소 수 × 4 B (float32)",
    )


def holdings_view(ctx: LabContext, model_config: LlamaConfig, tp: int) -> None:
    engine = ctx.engines[TP_KEY]
    simulated = is_simulated(engine)
    who = f"GPU {tp}장 (시뮬레이션)" if simulated else f"워커 프로세스 {tp}개"
    st.markdown(f"**워커가 가진 것** (tp {tp} 엔진, {who})")
    executor = engine.executor
    layout = executor.layout() if hasattr(executor, "layout") else []
    if not layout:
        st.info("tp 엔진이 아직 없습니다.")
        return
    _draw_layout(model_config, layout, tp)
    total = sum(r["weight_bytes"] for r in layout)
    replicated = sum(r["replicated_bytes"] for r in layout)
    if simulated:
        evidence(
            "계산값",
            f"GPU {len(layout)}장의 가중치 합 {total / 1e9:,.1f} GB, 그중 여러 GPU가 똑같이 가진 "
            f"몫(임베딩·lm_head·정규화) {replicated / 1e9:,.1f} GB",
            formula="랭크마다 자기 조각의 원소 수 × dtype 바이트 (프리셋 config의 모양, 이 엔진의 "
            "나누는 방식: engine/layers/sharding.py의 head_ranges·mlp_range·stage_layers)",
            **parallel_conditions(engine),
        )
        return
    evidence(
        "측정값",
        f"워커 {len(layout)}개의 가중치 합 {total / 1e6:,.1f} MB, 그중 여러 워커가 똑같이 가진 "
        f"몫(임베딩·lm_head·정규화) {replicated / 1e6:,.1f} MB",
        출처="executor.layout() (각 워커가 자기 텐서의 바이트를 셈)",
        모델=Path(engine.model_dir).name,
        dtype=str(engine.dtype).replace("torch.", ""),
    )


def _communication_figure(first, tp: int, simulated: bool) -> go.Figure:
    """Rank 0's compute and all-reduce time per step (stacked bars) and its all-reduce count."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=first["step"], y=first["compute_ms"], name="계산 (rank 0)"))
    fig.add_trace(go.Bar(x=first["step"], y=first["comm_ms"], name="all-reduce 대기·전송 (rank 0)"))
    fig.add_trace(
        go.Scatter(
            x=first["step"],
            y=first["all_reduce_count"],
            name="all-reduce 횟수 " + ("(계산)" if simulated else "(측정)"),
            mode="lines+markers",
            yaxis="y2",
        )
    )
    fig.update_layout(
        barmode="stack",
        height=390,
        title=f"tp {tp}: 스텝마다 계산 시간과 통신 시간 (워커 rank 0)",
        xaxis_title="스텝",
        yaxis=dict(title="ms", rangemode="tozero"),
        yaxis2=dict(
            title="all-reduce 횟수",
            overlaying="y",
            side="right",
            range=[0, 1.2 * max(max(first["all_reduce_count"]), 1)],
            tickformat="d",
            showgrid=False,
        ),
        legend=LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=90),
    )
    return fig


def communication_view(ctx: LabContext, model_config: LlamaConfig, tp: int) -> None:
    records = ctx.records(TP_KEY)
    simulated = is_simulated(ctx.engines[TP_KEY])
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
    st.plotly_chart(_communication_figure(first, tp, simulated), key="ch12_comm")
    counts = sorted(set(int(c) for c in first["all_reduce_count"]))
    spent = comm["comm_ms"].sum()
    share = 100 * spent / max(comm["compute_ms"].sum() + spent, 1e-9)
    tokens = int(first["num_tokens"].iloc[-1])
    engine = ctx.engines[TP_KEY]
    elem = engine.executor.cost_model.dtype_bytes if simulated else engine.dtype.itemsize
    bytes_formula = derived * tokens * model_config.hidden_size * elem
    if simulated:
        evidence(
            "계산값",
            f"스텝당 all-reduce 횟수 {', '.join(map(str, counts))}번 (공식 {derived}번); "
            f"all-reduce가 GPU 시간에서 차지한 비율 {share:.0f}%; 마지막 스텝의 all-reduce "
            f"데이터 {first['all_reduce_kb'].iloc[-1]:,.1f} KB",
            formula="all-reduce 시간 = 2 × 층 수 × (2(N−1)/N × 토큰 × hidden × 바이트 ÷ "
            "(링크 한 방향 대역폭 × 효율) + 지연), 계산 = 비용 모델의 선형층·어텐션 시간",
            **parallel_conditions(engine),
        )
    else:
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
        + (
            "시뮬레이션의 통신 시간은 전송과 지연만 셉니다: 계산된 GPU들은 서로를 "
            "기다리지 않습니다."
            if simulated
            else "통신 시간에는 다른 워커를 기다린 시간도 들어 있습니다 (all-reduce는 모두가 "
            "도착해야 끝납니다)."
        )
    )


def ctx_conditions(ctx: LabContext, key: str) -> dict:
    engine = ctx.engines[key]
    if is_simulated(engine):
        return parallel_conditions(engine)
    return {
        "장치": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "모델": Path(engine.model_dir).name,
        "CPU 수 (os.cpu_count)": os.cpu_count(),
        "공유": "워커 프로세스들이 같은 CPU를 나눠 씀, 다른 사용자와도 공유될 수 있음",
    }


def summary_view(ctx: LabContext, tp: int) -> None:
    simulated = is_simulated(ctx.engines[TP_KEY])

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
    show_frame(result.summary)
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
        height=380,
        title="스텝 시간 (ms): 워커를 늘리면 짧아지는가",
        xaxis_title="스텝",
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=90),
    )
    st.plotly_chart(fig, key="ch12_step_times")
    runs = list(result.runs.values())
    base, tp_run = runs[0], runs[1]
    base_ms, tp_ms = steady_step_ms(base.result), steady_step_ms(tp_run.result)
    if base_ms and tp_ms:
        speedup = base_ms / tp_ms
        gpus = (tp_run.tp * tp_run.pp) / (base.tp * base.pp)  # workers / the base's
        compare("ch12_speed", speed_verdict(speedup, gpus))
        digits = 3 if simulated else 1
        st.caption(
            f"decode 스텝 중앙값: {base.result.label} {base_ms:.{digits}f} ms, "
            f"{tp_run.result.label} {tp_ms:.{digits}f} ms → {base_names(result.runs)[0]} "
            f"{speedup:.2f}배, GPU(워커) 수 비율 {gpus:g}배의 {100 * speedup / gpus:.0f}% "
            "(처음 두 스텝은 한 번만 드는 비용이 있어 뺐습니다)"
            + (
                ". 시뮬레이션이므로 예측 ↔ 측정 상자의 '측정값' 자리에 든 것은 비용 모델의 "
                "계산값입니다."
                if simulated
                else ""
            )
        )
    for side in ctx.sides:
        run = result.runs[side.label]
        extra = {} if simulated else {"스레드": "워커마다 (이 프로세스의 스레드 수 ÷ 워커 수)"}
        evidence(
            evidence_kind(ctx.engines[side.key]),
            f"{side.label}: 스텝 {len(run.result.records)}개, 스텝 시간 합 "
            f"{sum(r.engine_duration for r in run.result.records):.{4 if simulated else 2}f} s",
            **ctx_conditions(ctx, side.key),
            **extra,
        )
    if simulated:
        _interconnect_evidence(ctx.engines[TP_KEY])
        return
    st.caption(
        "엔진들은 한 스텝씩 번갈아 실행되므로(나란히 비교), 한 엔진의 벽시계 시간에는 다른 "
        "엔진의 스텝도 들어갑니다. 그래서 비교는 엔진마다 자기 스텝 시간으로 합니다. "
        "이 실험실의 워커들은 한 기계의 CPU를 나눠 쓰는 프로세스입니다. 워커마다 계산은 1/N로 "
        "줄지만 스레드도 1/N로 줄고, 층마다 두 번씩 서로를 기다립니다. GPU 여러 장이 빨라지는 "
        "것은 장치마다 자기 연산기와 메모리 대역폭이 따로 있기 때문입니다."
    )
    evidence("보고값", NVLINK, source="NVIDIA H100 데이터시트 (vendor-reported)")
    evidence("보고값", PCIE, source="PCI-SIG PCIe 5.0 규격 (vendor-reported)")


def _interconnect_evidence(engine) -> None:
    """보고값: the simulated hardware's interconnect, as its preset states it (with source)."""
    hw = engine.executor.hardware
    evidence(
        "보고값",
        f"{hw.name}의 {hw.interconnect}: GPU 한 장당 {hw.interconnect_bandwidth / 1e9:,.0f} GB/s "
        "(양방향 합; 비용 모델은 한 방향, 즉 절반을 씀)",
        source=f"{hw.source} ({hw.evidence})",
    )


def scale_view(spec: dict) -> None:
    """계산값: the communication share of one step as tp grows, for the picked presets."""
    model, hw = load_model_preset(spec["model_preset"]), load_hardware_preset(spec["hardware"])
    st.markdown(f"**GPU를 늘리면: {model.name} on {hw.name}, 한 스텝의 시간과 통신 비율**")
    table = tp_scaling(spec["model_preset"], spec["hardware"])
    fig = go.Figure()
    for phase, rows in table.groupby("단계", sort=False):
        fig.add_trace(
            go.Bar(
                x=[f"{phase} · tp {n}" for n in rows["GPU 수 (tp)"]],
                y=rows["계산 (ms)"] + rows["고정 비용 (ms)"],
                name="계산 + 고정 비용" if phase == "decode" else None,
                marker_color=COLORS[0],
                legendgroup="compute",
                showlegend=phase == "decode",
            )
        )
        fig.add_trace(
            go.Bar(
                x=[f"{phase} · tp {n}" for n in rows["GPU 수 (tp)"]],
                y=rows["all-reduce (ms)"],
                name="all-reduce" if phase == "decode" else None,
                marker_color=COLORS[1],
                legendgroup="allreduce",
                showlegend=phase == "decode",
            )
        )
    fig.update_layout(
        barmode="stack",
        height=390,
        title="GPU 수(tp)별 한 스텝: 계산은 1/N로 줄고, all-reduce는 줄지 않는다",
        xaxis=dict(type="category"),
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=90),
    )
    st.plotly_chart(fig, key="ch12_scale")
    show_frame(table.replace({"메모리에 들어감": {True: "예", False: "아니오"}}))
    evidence(
        "계산값",
        "decode 스텝: 요청 32개가 각자 1,024토큰을 캐시에 두고 한 토큰씩; prefill 스텝: 한 요청의 "
        "2,048토큰. 속도는 메모리에 들어가는 가장 작은 tp 대비, 이상적 속도는 GPU 수의 비율",
        formula="스텝 = 고정 비용 + 선형층(max(가중치 바이트/N ÷ 대역폭, FLOPs/N ÷ 최대 FLOP/s)"
        "/효율) + 어텐션 + 2 × 층 수 × (2(N−1)/N × 토큰 × hidden × 바이트 ÷ 링크 + 지연)",
        **{
            "모델 프리셋": model.name,
            "하드웨어": f"{hw.name} ({hw.evidence})",
            "효율 계수": "가정값",
        },
    )
