"""Chapter 05's lab parts (Streamlit): the memory-budget calculator (weights + KV + headroom over
real model configs and GPU memory sizes), that budget run by the real scheduler on a simulated GPU,
and our model loaded in fp32/bf16/fp16 here. The page composes them; what they compute is in
ui/experiments/ch05.py and ui/hardware_data.py."""

import pandas as pd
import plotly.graph_objects as go
import streamlit as st
from plotly.subplots import make_subplots

from ui import figures
from ui.errors import show_error
from ui.experiments.ch05 import (
    DEFAULT_GPU,
    DEFAULT_MODEL,
    DEFAULT_NUM_TOKENS,
    DEFAULT_SEQ_LEN,
    DEFAULT_SIM_REQUESTS,
    DEFAULT_UTILIZATION,
    DTYPES,
    DtypeMeasurement,
    measure_dtype,
    simulate_capacity,
)
from ui.hardware_data import GB, GPU_KEYS, GPUS, MODEL_KEYS, MODELS, memory_budget
from ui.lab import Progress
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence, show_code, show_frame

MEASURED = "ch05_measured"  # dtype → DtypeMeasurement
SPEED_CHOICES = ["bf16이 더 빠르다", "비슷하다", "bf16이 더 느리다"]


def _name_of(keys: dict[str, str], key: str) -> str:
    """The display name whose preset key is `key` (ui.hardware_data maps names → keys)."""
    return next(name for name, k in keys.items() if k == key)


def _budget_figure(b) -> go.Figure:
    parts = [
        ("가중치", b.weight_bytes, "#1f77b4"),
        ("활성값·여유", b.headroom_bytes, "#9467bd"),
        ("KV 예산", max(b.kv_budget_bytes, 0), "#2ca02c"),
        ("사용률 밖 (예약 안 함)", GPUS[b.gpu].memory_bytes - b.usable_bytes, "#cccccc"),
    ]
    fig = go.Figure()
    for name, value, color in parts:
        fig.add_trace(
            go.Bar(
                name=name,
                y=[b.gpu],
                x=[value / GB],
                orientation="h",
                marker_color=color,
                hovertemplate=f"{name}: %{{x:.2f}} GB<extra></extra>",
            )
        )
    fig.add_vline(x=GPUS[b.gpu].memory_gb, line_dash="dash", annotation_text="장치 메모리")
    fig.update_layout(
        barmode="stack",
        height=220,
        title=f"{b.model} · {b.dtype} 메모리 나눔 (GB = 10⁹ B)",
        xaxis_title="GB",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def _requests_figure(
    model: str, dtype: str, util: float, headroom: float, seq_len: int
) -> go.Figure:
    fig = go.Figure()
    for m in MODELS:
        if m == model or "우리 모델" not in m:
            ys = [memory_budget(m, g, dtype, util, headroom, seq_len).max_requests for g in GPUS]
            fig.add_trace(go.Bar(name=m, x=list(GPUS), y=ys))
    fig.update_layout(
        barmode="group",
        height=320,
        title=f"길이 {seq_len:,} 토큰 요청이 동시에 몇 개 들어가나 (0 = 불가)",
        xaxis=dict(type="category"),
        yaxis=dict(title="요청 수", rangemode="tozero"),
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def calculator() -> tuple[str, str, float, int]:
    """The budget calculator; returns its model, GPU, utilization and L for the next section."""
    st.subheader("① 메모리 예산 계산기 (계산값)")
    c1, c2, c3 = st.columns(3)
    models, gpus = list(MODELS), list(GPUS)
    model = c1.selectbox(
        "모델", models, index=models.index(_name_of(MODEL_KEYS, DEFAULT_MODEL)), key="ch05_model"
    )
    gpu = c2.selectbox(
        "GPU", gpus, index=gpus.index(_name_of(GPU_KEYS, DEFAULT_GPU)), key="ch05_gpu"
    )
    dtype = c3.selectbox(
        "가중치·KV dtype", ["bfloat16", "float16", "float32", "int8"], key="ch05_dtype"
    )
    c1, c2, c3 = st.columns(3)
    util = c1.slider(
        "사용률 (gpu_memory_utilization)", 0.5, 0.98, DEFAULT_UTILIZATION, 0.01, key="ch05_util"
    )
    headroom = c2.slider("활성값·여유 (GB)", 0.0, 10.0, 2.0, 0.5, key="ch05_headroom")
    seq_len = c3.select_slider(
        "요청 길이 L (토큰)",
        [512, 1024, 2048, 4096, 8192, 16384, 32768, 131072],
        value=DEFAULT_SEQ_LEN,
        key="ch05_len",
    )
    b = memory_budget(model, gpu, dtype, util, headroom, seq_len)
    st.plotly_chart(_budget_figure(b), key="ch05_budget_fig")
    cols = st.columns(4)
    cols[0].metric("가중치", f"{b.weight_bytes / GB:.2f} GB")
    cols[1].metric("KV 예산", f"{b.kv_budget_bytes / GB:.2f} GB" if b.fits else "0 (부족)")
    cols[2].metric("토큰당 KV", f"{b.kv_bytes_per_token:,} B")
    cols[3].metric(f"L={seq_len:,} 동시 요청", f"{b.max_requests:,}")
    _budget_evidence(b, model, gpu, util, headroom)
    st.plotly_chart(
        _requests_figure(model, dtype, util, headroom, seq_len), key="ch05_requests_fig"
    )
    _source_tables()
    return model, gpu, util, seq_len


def _budget_evidence(b, model: str, gpu: str, util: float, headroom: float) -> None:
    """The calculator's numbers with their formulas (계산값) and the GPU's figures (제조사 문서)."""
    m, g = MODELS[model], GPUS[gpu]
    evidence(
        "계산값",
        f"가중치 = {m.param_count:,} 파라미터 × {b.weight_bytes // m.param_count} B = "
        f"{b.weight_bytes / GB:.2f} GB",
        formula="파라미터 수 × dtype 바이트 (파라미터 수는 config 숫자로 센 값)",
    )
    evidence(
        "계산값",
        f"토큰당 KV = 2 × {m.num_layers} × {m.num_kv_heads} × {m.head_dim} × "
        f"{b.kv_bytes_per_token // (2 * m.num_layers * m.num_kv_heads * m.head_dim)} B = "
        f"{b.kv_bytes_per_token:,} B",
        formula="2 (K, V) × 층 × KV head × head_dim × 바이트",
    )
    evidence(
        "계산값",
        f"KV 예산 = {g.memory_gb:g} × {util:.2f} − {b.weight_bytes / GB:.2f} − {headroom:g} = "
        f"{b.kv_budget_bytes / GB:.2f} GB → 토큰 {b.token_capacity:,}개 → 요청 "
        f"{b.max_requests:,}개",
        formula=(
            "장치 메모리 × 사용률 − 가중치 − 활성값·여유; 동시 요청 = KV 예산 / (토큰당 KV × L)"
        ),
    )
    if not b.fits:
        st.error(
            "가중치와 여유만으로 사용 가능한 메모리를 넘습니다. 이 조합은 한 장에 올라가지 "
            "않습니다 (바이트 줄이기: 11장 양자화, 나누기: 12장 분산 실행)."
        )
    evidence(
        "제조사 문서",
        f"{g.name} 메모리 {g.memory_gb:g} GB, 대역폭 {g.bandwidth_gbps:,} GB/s",
        source=g.source,
    )
    st.caption(
        f"모델 숫자 출처: {m.source} (config 숫자로 센 파라미터 {m.param_count / 1e9:.3f} B, "
        f"모델 카드 표기 ≈ {m.reported_params / 1e9:g} B)"
    )


def _source_tables() -> None:
    """The public config numbers of every model preset and the GPU figures behind the calculator."""
    with st.expander("모델 config 숫자 표 (공개 config.json에서)"):
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "모델": s.name,
                        "층": s.num_layers,
                        "hidden": s.hidden_size,
                        "heads": s.num_heads,
                        "KV heads": s.num_kv_heads,
                        "head_dim": s.head_dim,
                        "intermediate": s.intermediate_size,
                        "vocab": s.vocab_size,
                        "tied": s.tied_embeddings,
                        "파라미터 (계산)": f"{s.param_count:,}",
                        "토큰당 KV bf16 (B)": s.kv_bytes_per_token("bfloat16"),
                        "출처": s.source,
                    }
                    for s in MODELS.values()
                ]
            ),
            hide_index=True,
        )
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "GPU": x.name,
                        "메모리 (GB, 제조사 문서)": x.memory_gb,
                        "대역폭 (GB/s, 제조사 문서)": x.bandwidth_gbps,
                        "출처": x.source,
                    }
                    for x in GPUS.values()
                ]
            ),
            hide_index=True,
        )


CAPACITY = "ch05_capacity"  # settings → CapacityRun


def capacity_simulation(model: str, gpu: str, util: float, seq_len: int) -> None:
    """The budget above, run by the real scheduler on a simulated GPU."""
    st.subheader("② 이 예산에 요청을 실제로 넣으면 (시뮬레이션, 계산값)")
    st.caption(
        f"위 계산기의 {model} · {gpu} · 사용률 {util:.2f} · 길이 L={seq_len:,}으로 KV 캐시를 잡은 "
        "엔진(같은 스케줄러와 KV 관리자, 스텝 시간은 비용 모델)에 길이 L인 요청을 한꺼번에 "
        "넣습니다. 요청은 프롬프트 L − 256토큰으로 시작해 출력 256토큰만큼 자랍니다."
    )
    if gpu not in GPU_KEYS:
        st.info("이 GPU는 시뮬레이터 프리셋이 없습니다.")
        return
    num = st.slider(
        "한꺼번에 도착하는 요청 수", 10, 300, DEFAULT_SIM_REQUESTS, step=10, key="ch05_sim_requests"
    )
    key = (model, gpu, util, seq_len, num)
    runs = st.session_state.setdefault(CAPACITY, {})
    if st.button("시뮬레이션 실행", key="ch05_sim_run", icon=":material/play_arrow:"):
        with st.spinner("시뮬레이션 중…"):
            try:
                runs[key] = simulate_capacity(MODEL_KEYS[model], GPU_KEYS[gpu], util, seq_len, num)
            except ValueError as exc:  # the weights alone do not fit, or L is too long
                show_error(exc, "시뮬레이션")
                return
    run = runs.get(key)
    if run is None:
        st.info(
            "계산기가 말한 '동시 요청 수'보다 요청을 많이 넣으면 스케줄러가 무엇을 할지 예측한 뒤 "
            "**시뮬레이션 실행**을 누르세요."
        )
        return
    cols = st.columns(4)
    cols[0].metric("KV 블록 (메모리 계획)", f"{run.num_blocks:,}")
    cols[1].metric("L까지 자라도 들어가는 요청", f"{run.planned_requests:,}")
    cols[2].metric("스케줄러가 한때 함께 돌린 요청", f"{run.peak_running:,}")
    cols[3].metric("선점", f"{run.preemptions:,}")
    st.plotly_chart(figures.kv_usage_figure(run.records), key="ch05_sim_kv")
    evidence(
        "계산값",
        f"KV 블록 {run.num_blocks:,}개 × {run.block_size}토큰 ÷ L {seq_len:,} = 요청 "
        f"{run.planned_requests:,}개 (활성값 예약 {run.activation_bytes / GB:.2f} GB는 위 "
        "슬라이더가 아니라 시뮬레이터가 가장 큰 스텝에서 계산)",
        formula="블록 = (메모리 × 사용률 − 가중치 − 활성값 예약) ÷ 블록당 KV 바이트",
    )
    evidence(
        "계산값",
        f"한때 {run.peak_running}개 실행, 선점 {run.preemptions}번, 스텝 {run.steps}개, "
        f"TTFT p50 {1000 * (run.ttft_p50_s or 0):,.0f} ms · "
        f"p90 {1000 * (run.ttft_p90_s or 0):,.0f} ms, 전체 {run.duration_s:.1f} s (가상 시계)",
        formula="실제 스케줄러의 결정 + 비용 모델의 스텝 시간 (효율 계수는 가정값)",
    )
    if run.peak_running > run.planned_requests:
        st.caption(
            "스케줄러는 요청이 지금 차지한 만큼만 보고 받아들입니다. 요청들이 자라며 블록이 "
            "모자라면 가장 늦게 들어온 요청부터 선점됩니다(09장) — KV가 토큰마다 자란다는 것을 "
            "잊은 계산이 틀리는 지점입니다."
        )


def _measure_table(results: dict[str, DtypeMeasurement]) -> pd.DataFrame:
    rows = []
    for dt, r in results.items():
        rows.append(
            {
                "dtype": dt,
                "계산 가중치 (MB)": round(r.computed_bytes / 1e6, 1),
                "측정 텐서 바이트 (MB)": round(r.tensor_bytes / 1e6, 1),
                "RSS 증가 (MB)": round(r.rss_delta_bytes / 1e6, 1)
                if r.rss_delta_bytes is not None
                else "이미 로드됨",
                "로드 (s)": round(r.load_s, 2) if r.load_s is not None else "—",
                "TTFT (ms)": round(r.ttft_ms, 1),
                "TPOT (ms)": round(r.tpot_ms, 1),
                "decode (토큰/s)": round(r.decode_tokens_per_s, 1),
                "fp32와 같은 토큰": (
                    "기준"
                    if r.agree_with is None
                    else (
                        "모두 같음"
                        if r.first_divergence is None
                        else f"{r.first_divergence}번째부터 다름"
                    )
                ),
                "출력": r.text[:60],
            }
        )
        if r.device_allocated_bytes is not None:  # on a GPU: the allocator's own counters
            rows[-1].update(
                {
                    "GPU 할당 증가 (MB)": round(r.device_allocated_bytes / 1e6, 1),
                    "그중 KV (MB)": round(r.kv_cache_bytes / 1e6, 1),
                    "decode 활성값 최대 (MB)": round(r.activation_peak_bytes / 1e6, 2),
                }
            )
    return pd.DataFrame(rows)


def _measure_figure(results: dict[str, DtypeMeasurement]) -> go.Figure:
    """Two panels, each on its own zero-based axis: weight bytes (computed beside measured) and
    decode speed. One axis per quantity, so neither a shared scale nor a second axis that starts
    near the data's minimum makes a small difference look large; the legend sits above the plots,
    clear of their ticks."""
    names = list(results)
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("가중치 메모리 (MB)", "decode 속도 (토큰/s)"),
        horizontal_spacing=0.12,
    )
    bars = [
        ("계산 가중치 (MB)", [results[d].computed_bytes / 1e6 for d in names], "#9ecae1"),
        ("측정 텐서 바이트 (MB)", [results[d].tensor_bytes / 1e6 for d in names], "#1f77b4"),
    ]
    for label, values, color in bars:
        fig.add_trace(go.Bar(name=label, x=names, y=values, marker_color=color), row=1, col=1)
    speeds = [results[d].decode_tokens_per_s for d in names]
    fig.add_trace(
        go.Bar(name="decode 토큰/s (측정)", x=names, y=speeds, marker_color="#ff7f0e"), row=1, col=2
    )
    fig.update_yaxes(rangemode="tozero")
    fig.update_xaxes(type="category")
    fig.update_layout(
        barmode="group",
        height=360,
        title=dict(text="dtype별 가중치 메모리와 decode 속도", y=0.98, yanchor="top"),
        legend=dict(orientation="h", x=0, xanchor="left", y=1.12, yanchor="bottom"),
        margin=dict(l=10, r=10, t=90, b=10),
    )
    return fig


def measurement() -> None:
    st.subheader("③ 우리 모델을 fp32 · bf16 · fp16으로 올려 재기 (측정값)")
    st.caption(
        "각 dtype마다 가중치를 한 번 올리고(프로세스 안에서 공유되므로 두 번째부터는 '이미 "
        "로드됨'), 같은 프롬프트로 greedy 생성을 해 TPOT를 잽니다. CPU에서 bf16/fp16은 빠른 커널이 "
        "없으면 fp32보다 느릴 수 있습니다."
    )
    c1, c2 = st.columns(2)
    dtypes = c1.multiselect("dtype", DTYPES, default=DTYPES, key="ch05_dtypes")
    n_tokens = c2.slider("생성 토큰 수", 4, 32, DEFAULT_NUM_TOKENS, key="ch05_ntok")
    predict("ch05_bf16", "이 기계에서 bf16 decode는 fp32에 비해 어떨까요?", options=SPEED_CHOICES)
    if st.button("실행", key="ch05_run", type="primary"):
        cfg = current_settings().to_config()
        results: dict[str, DtypeMeasurement] = {}
        order = ["float32"] + [d for d in dtypes if d != "float32"]  # fp32 first: the reference
        progress = Progress(len(order), "dtype")
        for dt in order:
            results[dt] = measure_dtype(
                cfg, dt, num_tokens=n_tokens, reference=results.get("float32")
            )
            progress()
        progress.close()
        st.session_state[MEASURED] = results
    results = st.session_state.get(MEASURED)
    if not results:
        st.info("**실행**을 누르면 이 기계에서 실제로 측정합니다 (dtype당 수 초).")
        return
    show_frame(_measure_table(results))  # "이미 로드됨" beside numbers: Arrow-safe as text
    st.plotly_chart(_measure_figure(results), key="ch05_measure_fig")
    for dt, r in results.items():
        evidence(
            "측정값",
            f"{dt}: 로드된 텐서 {r.tensor_bytes / 1e6:.1f} MB, TPOT {r.tpot_ms:.1f} ms "
            f"({r.decode_tokens_per_s:.1f} 토큰/s)",
            **r.conditions,
        )
    on_gpu = [r for r in results.values() if r.device_allocated_bytes is not None]
    for r in on_gpu:
        evidence(
            "측정값",
            f"{r.dtype}: 엔진을 만들며 GPU에 할당 {r.device_allocated_bytes / 1e6:.1f} MB "
            f"(그중 KV 캐시 {r.kv_cache_bytes / 1e6:.1f} MB; 가중치가 이미 올라 있었다면 KV만), "
            f"decode 중 활성값 최대 {r.activation_peak_bytes / 1e6:.2f} MB",
            출처="torch.cuda.memory_allocated / max_memory_allocated",
            **r.conditions,
        )
    if not on_gpu:
        st.caption(
            "GPU에서는 이 표에 torch.cuda가 센 할당량(가중치+KV, KV, decode 활성값 최대)이 "
            "붙습니다. CPU에는 그런 계수기가 없어 프로세스 RSS 증가만 보입니다."
        )
    if "float32" in results and "bfloat16" in results:
        ratio = results["bfloat16"].decode_tokens_per_s / max(
            results["float32"].decode_tokens_per_s, 1e-9
        )
        measured = (
            SPEED_CHOICES[0]
            if ratio > 1.15
            else SPEED_CHOICES[2]
            if ratio < 0.87
            else SPEED_CHOICES[1]
        )
        compare("ch05_bf16", measured)
        st.caption(f"bf16 decode 속도 / fp32 decode 속도 = {ratio:.2f}")
    first = next(iter(results.values()))
    evidence(
        "계산값",
        f"가중치 = {first.param_count:,} × 4 B (fp32) 또는 × 2 B (bf16/fp16)",
        formula="측정 텐서 바이트와 비교: 파라미터 수 × dtype 바이트",
    )
    show_code(measure_dtype, "방금 실행된 코드 (dtype 측정)")
