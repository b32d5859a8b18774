"""Chapter 12's tensor-parallel lab parts (Streamlit): the sides (tp 1 vs tp N, optionally pp 2,
real worker processes or a simulated GPU cluster), starting their engines with progress, the
controls, and the views: what each worker holds (the weight matrices cut by columns and rows),
compute vs all-reduce time per step, the layouts' step times side by side, and (simulated) the
communication share as tp grows. The page composes them; what they compute is in
ui/experiments/ch12.py."""

import os
import time
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from engine.artifact import resolve_model_path
from engine.layers.sharding import all_reduces_per_step, valid_tensor_parallel_sizes
from engine.models.config import LlamaConfig
from engine.tools.presets import load_hardware_preset, load_model_preset
from ui import figures
from ui.errors import show_error
from ui.experiments.ch12 import (
    DEFAULT_OUT,
    DEFAULT_REQUESTS,
    DEFAULT_TP,
    MATRICES,
    PROMPT_LEN,
    SPEED_CHOICES,
    base_names,
    communication_table,
    lab_comparison,
    lab_run,
    matrix_cuts,
    parallel_conditions,
    planned_layout,
    shard_table,
    simulated_fit_error,
    simulated_sizes,
    speed_verdict,
    steady_step_ms,
    tp_scaling,
)
from ui.experiments.common import Workload, is_simulated
from ui.lab import (
    LabContext,
    Side,
    attach_workload,
    evidence_kind,
    run_results,
    run_steps,
    set_playing,
)
from ui.predict import compare, predict
from ui.session import current_settings, get_engine, persist_key, reset_engine
from ui.simulation import simulation_overrides
from ui.widgets import evidence, show_frame

BASE_KEY, TP_KEY, PP_KEY = "ch12_tp1", "ch12_tpn", "ch12_pp2"
RESULT = "ch12_result"
COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#B279A2", "#72B7B2", "#FF9DA6", "#9D755D"]
# Vendor-reported interconnect figures (NVIDIA H100 datasheet / PCI-SIG), for scale only.
NVLINK = "H100 SXM의 NVLink(4세대): GPU 한 장당 900 GB/s (양방향 합)"
PCIE = "PCIe 5.0 x16: 약 128 GB/s (양방향 합)"


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
        legend=figures.LEGEND_BELOW,
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
        legend=figures.LEGEND_BELOW,
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
    evidence("제조사 문서", NVLINK, source="NVIDIA H100 데이터시트")
    evidence("제조사 문서", PCIE, source="PCI-SIG PCIe 5.0 규격")


def _interconnect_evidence(engine) -> None:
    """제조사 문서: the simulated hardware's interconnect, as its preset states it (with source)."""
    hw = engine.executor.hardware
    evidence(
        "제조사 문서",
        f"{hw.name}의 {hw.interconnect}: GPU 한 장당 {hw.interconnect_bandwidth / 1e9:,.0f} GB/s "
        "(양방향 합; 비용 모델은 한 방향, 즉 절반을 씀)",
        source=f"{hw.source} (데이터시트)",
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
        legend=figures.LEGEND_BELOW,
        margin=dict(l=10, r=10, t=40, b=90),
    )
    st.plotly_chart(fig, key="ch12_scale")
    show_frame(table.replace({"메모리에 들어감": {True: "예", False: "아니오"}}))
    _kv_room_note(table)
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


def _kv_room_note(table, batch: int = 32, context: int = 1024) -> None:
    """계산값 from the table: what the smallest size that fits leaves for the KV cache, against
    the tokens the decode row assumes cached (batch × context)."""
    fitting = table[(table["단계"] == "decode") & table["메모리에 들어감"]]
    if fitting.empty:
        return
    row = fitting.iloc[0]
    tokens, needed = int(row["KV 캐시에 들어가는 토큰"]), batch * context
    verdict = (
        f"표의 decode 스텝이 가정한 {needed:,}토큰(요청 {batch}개 × {context:,})에 모자랍니다. "
        "가중치는 들어가도 요청을 몇 개 받지 못하는, 겨우 들어가는 크기입니다"
        if tokens < needed
        else f"표의 decode 스텝이 가정한 {needed:,}토큰을 담을 수 있습니다"
    )
    evidence(
        "계산값",
        f"메모리에 들어가는 가장 작은 크기 tp {int(row['GPU 수 (tp)'])}: GPU마다 가중치 "
        f"{row['GPU당 가중치 (GB)']} GB를 올리고 나면 KV 캐시 자리는 "
        f"{row['GPU당 KV 캐시 자리 (GB)']} GB, 엔진 전체로 {tokens:,}토큰입니다. {verdict}.",
        formula="KV 자리 = 메모리 × gpu_memory_utilization − 가중치/tp − 활성값 예비분 (05장)",
    )


SIM_MODEL, SIM_TP = "llama-3.1-70b", 8  # the simulated default: 70B on 8 GPUs vs 4
LIVE = "_ch12_live"  # the signature of the real engines the learner started (None: not yet)
PENDING = "_ch12_pending"  # "run" or "load": what to do once those engines are up
persist_key(LIVE)  # a reload finds the started engines (held by the registry) as started


def lab_model_config() -> LlamaConfig:
    return LlamaConfig.from_model_dir(resolve_model_path(current_settings().model or None))


def _label(tp: int, pp: int) -> str:
    return f"tp {tp} × pp {pp}"


def simulated_sides(spec: dict, with_pp: bool) -> list[Side] | str:
    """The simulated lab's sides (N/2 GPUs as the base, N GPUs as tp, optionally N/2 × pp 2), or
    the reason they cannot run."""
    sizes = simulated_sizes(spec["tensor_parallel_size"])
    if not sizes:
        return "GPU 수를 2장 이상 고르세요: GPU 수의 절반(기준)과 나란히 비교합니다."
    if not with_pp:
        sizes = sizes[:2]
    cfg = current_settings().to_config()
    for tp, pp in sizes:
        error = simulated_fit_error(
            spec["model_preset"],
            spec["hardware"],
            tp,
            pp,
            cfg.max_model_len or 8192,
            cfg.block_size,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
        )
        if error:
            return f"tp {tp} × pp {pp}: {error}"
    keys = [BASE_KEY, TP_KEY, PP_KEY]
    return [
        Side(
            key,
            _label(tp, pp),
            simulation_overrides(
                {**spec, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
            ),
        )
        for key, (tp, pp) in zip(keys, sizes)
    ]


def real_sides(tp: int, with_pp: bool, model_config: LlamaConfig) -> list[Side]:
    """tp 1 and tp N (and pp 2) on the CPU, each multi-worker engine one process per rank.
    Prefix caching off: a rerun on the same engines computes every prompt token again."""
    common = {"device": "cpu", "enable_prefix_caching": False}
    sides = [
        Side(BASE_KEY, _label(1, 1), dict(common)),
        Side(TP_KEY, _label(tp, 1), {**common, "tensor_parallel_size": tp}),
    ]
    if with_pp and model_config.num_layers >= 2:
        sides.append(Side(PP_KEY, _label(1, 2), {**common, "pipeline_parallel_size": 2}))
    return sides


def _workers(sides: list[Side]) -> int:
    """Worker processes the sides start (tp × pp of each multi-worker engine)."""
    sizes = [
        s.overrides.get("tensor_parallel_size", 1) * s.overrides.get("pipeline_parallel_size", 1)
        for s in sides
    ]
    return sum(n for n in sizes if n > 1)


def lab_signature(sides: list[Side]) -> tuple:
    return (current_settings(), tuple((s.key, tuple(sorted(s.overrides.items()))) for s in sides))


def _start_engines(sides: list[Side]) -> bool:
    """Build every side's engine now, saying which one is starting and how long each took (the
    worker processes import torch and load their shards: seconds each on a CPU)."""
    n = _workers(sides)
    with st.status(f"엔진을 만드는 중… (워커 프로세스 {n}개)", expanded=True) as status:
        for side in sides:
            start = time.perf_counter()
            st.write(f"{side.label}: 시작하는 중…")
            try:
                get_engine(side.key, **side.overrides)
            except Exception as exc:  # noqa: BLE001 - a Korean message, the page stays usable
                status.update(label="엔진을 만들지 못했습니다", state="error")
                show_error(exc, f"엔진을 만들 수 없습니다 ({side.label})")
                return False
            st.write(f"{side.label}: 준비됨 ({time.perf_counter() - start:.1f} s)")
        status.update(label=f"엔진 준비됨 (워커 프로세스 {n}개)", state="complete", expanded=False)
    return True


def not_started(sides: list[Side], question: str, model_config: LlamaConfig, tp: int) -> None:
    """The real lab before its engines exist: the planned layout, the prediction, and the two
    buttons that start the worker processes (nothing heavy runs when the page opens)."""
    stale = st.session_state.pop(LIVE, None)
    if stale is not None:  # the learner changed the layout: stop the workers it no longer uses
        now = dict(lab_signature(sides)[1])
        for key, overrides in stale[1]:
            if key != BASE_KEY and now.get(key) != overrides:
                reset_engine(key)
    planned_view(model_config, tp)
    evidence(
        "계산값",
        f"tp {tp}: 스텝마다 워커 하나가 all-reduce {all_reduces_per_step(model_config, tp, 1)}번 "
        f"(층 {model_config.num_layers}개 × 2: o 뒤 한 번, down 뒤 한 번)",
        formula="2 × 층 수 (tp > 1일 때; tp 1이면 0)",
    )
    predict("ch12_speed", question, options=SPEED_CHOICES)
    st.caption(
        f"아래 버튼을 누르면 엔진 {len(sides)}개와 워커 프로세스 {_workers(sides)}개가 뜹니다. "
        "워커마다 torch를 불러오고 자기 몫의 가중치를 읽으므로 이 기계에서 십수 초 걸립니다 "
        "(진행 상황이 여기 보입니다)."
    )
    c1, c2 = st.columns(2)
    run = c1.button(
        "실행", key="ch12_start_run", type="primary", width="stretch",
        help="엔진과 워커를 띄우고, 워크로드를 넣어 끝까지 실행합니다",
    )  # fmt: skip
    load = c2.button(
        "워크로드 넣기", key="ch12_start_load", width="stretch",
        help="엔진과 워커를 띄우고 워크로드만 넣습니다 (그 뒤 다음 스텝으로 한 스텝씩)",
    )  # fmt: skip
    if (run or load) and _start_engines(sides):
        st.session_state[LIVE] = lab_signature(sides)
        st.session_state[PENDING] = "run" if run else "load"
        st.rerun()


def load_workload(ctx: LabContext, workload: Workload) -> None:
    """Put the workload on every engine, each from step 0. An engine that has run nothing yet is
    used as it is (its workers are not started twice); a used one is rebuilt first, with a
    message while its workers start again."""
    used = [s for s in ctx.sides if ctx.records(s) or ctx.engines[s.key].all_requests()]
    n = _workers(used)
    message = f"엔진을 새로 만드는 중… (워커 프로세스 {n}개를 다시 띄웁니다, 십수 초)"
    with st.spinner(message if n else "엔진을 새로 만드는 중…"):
        for side in used:
            reset_engine(side.key)
            ctx.engines[side.key] = get_engine(side.key, **side.overrides)
    for side in ctx.sides:
        attach_workload(ctx, side.key, workload)


def run_buttons(ctx: LabContext, workload: Workload) -> None:
    """실행 and 워크로드 넣기 of the real lab (and what the start buttons asked for)."""
    pending = st.session_state.pop(PENDING, None)
    c1, c2 = st.columns(2)
    run = c1.button(
        "실행", key="ch12_run", type="primary", width="stretch",
        help="워크로드를 넣고 끝까지 실행합니다 (한 스텝씩 보려면 워크로드 넣기 → 다음 스텝)",
    ) or pending == "run"  # fmt: skip
    load = c2.button(
        "워크로드 넣기", key="ch12_load", width="stretch",
        help="워크로드의 요청을 모든 엔진에 넣습니다 (다음 스텝으로 한 스텝씩)",
    ) or pending == "load"  # fmt: skip
    if run or load:
        set_playing("ch12", False)
        load_workload(ctx, workload)
        if run:
            run_steps(ctx, None)


def layout_controls(real_config: LlamaConfig, spec: dict | None) -> tuple[int, int, int, bool]:
    """tp, requests, output tokens and the pp switch (tp: the sizes this model divides into)."""
    sizes = [s for s in valid_tensor_parallel_sizes(real_config) if s > 1] or [1]
    c1, c2, c3, c4 = st.columns(4)
    tp = c1.selectbox(
        "tp 크기 (tensor_parallel_size)",
        sizes,
        index=sizes.index(DEFAULT_TP) if DEFAULT_TP in sizes else 0,
        key="ch12_tp",
        help=f"이 모델(query 헤드 {real_config.num_heads}개, KV 헤드 "
        f"{real_config.num_kv_heads}개)을 나눌 수 있는 크기만 보입니다 (시뮬레이션에서는 위의 "
        "GPU 수를 씀)",
        disabled=spec is not None,
    )
    num = c2.slider("요청 수", 1, 4, DEFAULT_REQUESTS, key="ch12_requests")
    out = c3.slider("출력 토큰 수", 4, 32, DEFAULT_OUT, step=4, key="ch12_out")
    with_pp = c4.checkbox(
        "pp 2도 나란히", value=False, key="ch12_pp", help="층을 두 워커에 나눈 엔진을 하나 더"
    )
    return tp, num, out, with_pp


def lab_caption(spec: dict | None, num: int, out: int, tp: int, sides: list[Side]) -> None:
    if spec is None:
        st.caption(
            f"워크로드: 요청 {num}개(프롬프트 {PROMPT_LEN}토큰, 출력 {out}토큰)를 모든 엔진에 "
            "똑같이 넣습니다. 모든 엔진은 CPU에서 실행되고, tp·pp 엔진은 랭크마다 워커 프로세스 "
            "하나를 띄웁니다 (torch.distributed, gloo)."
        )
        return
    st.caption(
        f"워크로드: 요청 {num}개(프롬프트 {PROMPT_LEN}토큰, 출력 {out}토큰)를 모든 엔진에 "
        f"똑같이 넣습니다. 기준은 GPU {tp // 2}장(tp {tp // 2}), 비교는 GPU {tp}장(tp {tp})"
        + (f", 그리고 같은 {tp}장을 tp {tp // 2} × pp 2로" if len(sides) > 2 else "")
        + ". 스케줄러와 KV 관리자는 실제 코드이고, 스텝 시간과 워커별 시간은 계산값입니다."
    )
