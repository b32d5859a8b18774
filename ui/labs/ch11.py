"""Chapter 11's lab parts (Streamlit): float32, bfloat16, int8 and int4 engines side by side (bytes
per decode step, step time, greedy agreement), the quality measured against float32 and the bench
tables. The page composes them; what they compute is in ui/experiments/ch11.py."""

import plotly.graph_objects as go
import streamlit as st

from engine.tools.quality import TIE_MARGIN
from ui.experiments.ch04 import bench_conditions
from ui.experiments.ch11 import (
    VARIANTS,
    agreement_explanation,
    bytes_table,
    decode_summary,
    greedy_agreement_table,
    grid_fit_table,
    kernel_rows,
    outlier_table,
    peer_rows,
    quality_table,
    tie_report,
)
from ui.lab import LabContext, Side, run_results
from ui.predict import compare
from ui.session import current_settings
from ui.widgets import evidence, show_frame

RESULT = "ch11_result"
QUALITY = "ch11_quality"
EXPLAIN = "_ch11_explanation"  # (id of the runs it explains, grid fit, tie report)
CHOICES = ["float32보다 느리다", "1~2배 빠르다", "2배 이상 빠르다"]


def _model_dir():
    from engine.artifact import resolve_model_path

    return resolve_model_path(current_settings().model or None)


def has_gguf() -> bool:
    from engine.worker.quantization import gguf_source

    try:
        gguf_source(_model_dir())
        return True
    except Exception:  # noqa: BLE001 - any model without a GGUF source
        return False


def sides(labels: list[str]) -> list[Side]:
    sides = []
    for label in labels:
        slug = label.split()[0].replace("/", "_")
        overrides = dict(VARIANTS[label], enable_prefix_caching=False)
        sides.append(Side(f"ch11_{slug}", label, overrides))
    return sides


def _speed_choice(ratio: float) -> str:
    return CHOICES[0] if ratio < 1.0 else CHOICES[1] if ratio < 2.0 else CHOICES[2]


def summary_view(ctx: LabContext) -> None:
    first = ctx.engines[ctx.sides[0].key]
    st.markdown("**decode 스텝 하나가 읽는 가중치** (이 모델의 config.json 모양으로 계산)")
    st.dataframe(bytes_table(first.model_config), hide_index=True)
    evidence(
        "계산값",
        "행렬마다 out × in 가중치의 저장 바이트; 양자화 엔진의 lm_head는 int8",
        formula="float32 4 B · bfloat16 2 B · int8 1 B + 행마다 scale 4 B · "
        "int4 ½ B + 32개마다 scale·min 8 B",
    )
    runs = run_results(ctx, RESULT)
    if runs is None:
        st.info("모든 엔진이 워크로드를 끝내면 여기에 측정 요약이 나옵니다.")
        return
    weight_bytes = {s.label: ctx.engines[s.key].weight_bytes() for s in ctx.sides}
    summary = decode_summary(runs, weight_bytes)
    st.markdown("**측정 요약** (엔진 시계, decode만 한 스텝의 중앙값)")
    show_frame(summary, hide_index=True)
    fig = go.Figure(
        go.Bar(
            x=summary["엔진"],
            y=summary["decode 스텝 중앙값 (ms)"],
            text=summary["가중치 (MB)"].map(lambda mb: f"가중치 {mb} MB"),
            name="decode 스텝 (ms)",
        )
    )
    fig.update_layout(
        height=300,
        title="decode 스텝 하나의 시간 (ms, 중앙값) — 막대 위: 엔진이 가진 가중치",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    st.plotly_chart(fig, key="ch11_decode_fig")
    for side in ctx.sides:
        res = runs[side.label]
        evidence(
            "측정값",
            f"{side.label}: 스텝 {len(res.records)}개, 가중치 {weight_bytes[side.label] / 1e6:.1f} "
            "MB (engine.weight_bytes())",
            **res.conditions,
            양자화=VARIANTS[side.label]["quantization"] or "없음",
        )
    evidence(
        "계산값",
        "가중치 읽기 속도 = 가중치 바이트 ÷ decode 스텝 시간 (스텝의 다른 일까지 포함한 하한)",
        formula="weight_bytes / step_ms",
    )
    labels = list(summary["엔진"])
    if "float32" in labels and "int8" in labels:
        ms = summary.set_index("엔진")["decode 스텝 중앙값 (ms)"]
        if ms["float32"] and ms["int8"]:
            compare("ch11_speed", _speed_choice(ms["float32"] / ms["int8"]))
            st.caption(f"decode 스텝: float32 {ms['float32']} ms, int8 {ms['int8']} ms")
    _agreement_view(ctx, runs)


def _explanation(runs) -> tuple:
    """The grid fit (계산값) and the reference's margins (측정값) for these runs, kept in the
    session for the runs they explain (the grid fit is cached per process)."""
    stored = st.session_state.get(EXPLAIN)
    if stored is None or stored[0] != id(runs):
        with st.spinner("float32 가중치를 각 형식과 비교하고, float32의 로짓 차를 재는 중…"):
            stored = (id(runs), grid_fit_table(_model_dir()), tie_report(_model_dir(), runs))
        st.session_state[EXPLAIN] = stored
    return stored[1], stored[2]


def _agreement_view(ctx: LabContext, runs) -> None:
    """Greedy agreement with the first engine, and why it comes out as it does."""
    reference = ctx.sides[0].label
    st.markdown(f"**생성된 토큰이 {reference}와 얼마나 같은가** (greedy, 같은 프롬프트)")
    show_frame(greedy_agreement_table(runs))
    evidence(
        "측정값",
        f"각 엔진이 이 실행에서 낸 greedy 토큰을 위치마다 {reference}의 토큰과 비교한 비율",
        **runs[reference].conditions,
    )
    if reference != "float32":
        st.caption("왜 이런 숫자가 나오는지는 float32를 첫 엔진으로 고르면 설명합니다.")
        return
    fit, ties = _explanation(runs)
    st.markdown("**왜 이런 일치율인가**")
    c1, c2 = st.columns(2)
    show_frame(fit, c1)
    with c1:
        evidence(
            "계산값",
            "양자화 엔진이 가진 선형층(30개 층 × 4행렬)을 펼쳐 float32 엔진의 가중치와 비교",
            formula="max |dequantize(W_q) − W_float32|, 같은 값인 가중치의 비율",
        )
    if ties.table.empty:
        c2.caption("float32와 다른 토큰을 낸 엔진이 없습니다.")
    else:
        show_frame(ties.table, c2)
    with c2:
        evidence(
            "측정값",
            f"float32 모델에 프롬프트와 float32의 출력을 한 번에 넣어(teacher forcing) 위치마다 "
            f"1순위와 2순위 로짓 차를 잼: {len(ties.margins)}개 위치 중 {ties.near_ties}곳이 "
            f"{TIE_MARGIN} 미만",
            모델=_model_dir().name,
            dtype="float32",
        )
    for sentence in agreement_explanation(fit, ties):
        st.markdown("- " + sentence)


def quality_section() -> None:
    st.subheader("품질: float32와 얼마나 같은가")
    options = ["bfloat16", "int8", "int4", "int4/64"] + (["gguf"] if has_gguf() else [])
    chosen = st.multiselect(
        "품질을 잴 변형", options, default=["int8", "int4", "int4/64"], key="ch11_q_variants"
    )
    tokens = st.slider("teacher forcing 텍스트 길이 (토큰)", 32, 256, 96, step=32, key="ch11_q_len")
    if st.button("품질 측정 실행", key="ch11_quality_run", disabled=not chosen):
        with st.spinner("float32와 각 변형으로 같은 텍스트를 한 번씩 계산하는 중…"):
            st.session_state[QUALITY] = (quality_table(_model_dir(), chosen, tokens), tokens)
    stored = st.session_state.get(QUALITY)
    if stored is None:
        st.info("버튼 **품질 측정 실행** 을 누르면 README.md 앞부분으로 각 변형을 잽니다.")
    else:
        table, n = stored
        st.dataframe(table, hide_index=True)
        fig = go.Figure(go.Bar(x=table["변형"], y=table["top-1 일치 (%)"], name="top-1 일치"))
        fig.update_layout(
            height=280,
            title="teacher forcing: 다음 토큰 1순위가 float32와 같은 위치의 비율 (%)",
            yaxis_title="%",
            margin=dict(l=10, r=10, t=40, b=10),
        )
        st.plotly_chart(fig, key="ch11_quality_fig")
        evidence(
            "측정값",
            "top-1 일치 = 1순위 토큰이 float32와 같은 위치의 비율; perplexity = exp(실제 다음 "
            "토큰의 평균 교차 엔트로피); KL = float32 분포 대비 평균 KL",
            텍스트=f"README.md 앞 {n}토큰",
            모델=_model_dir().name,
        )

    st.subheader("정말로 잃는 경우: 이상치 하나가 행 전체를 거칠게 만든다")
    st.dataframe(outlier_table(), hide_index=True)
    evidence(
        "측정값",
        "64 × 256 무작위 행렬(표준편차 0.02)의 4개 행에 2.0짜리 가중치 하나씩; 평범한 가중치의 "
        "반올림 오차 RMS",
        행렬="seed 0, engine.tools.quality.outlier_demo",
    )


def _bench_table(results: dict | None, title: str, table, missing: str, what: str) -> None:
    """One table of the latest `python -m engine bench` result with its evidence label, or how to
    produce it when that run did not measure it."""
    st.subheader(title)
    if table is None:
        st.info(missing)
        return
    st.dataframe(table, hide_index=True)
    evidence("측정값", what, **bench_conditions(results["conditions"]))


def bench_sections() -> None:
    from ui.experiments.ch04 import latest_bench

    results = latest_bench()  # read once for both tables
    _bench_table(
        results,
        "커널이 없으면: 같은 바이트, 다른 속도",
        kernel_rows(results),
        "`python -m engine bench`(전체 실행)를 돌리면 여기에 행렬 커널 표(1행 GB/s, 32행 "
        "GFLOP/s)가 나옵니다.",
        "30개 층의 선형 행렬 전부를 커널별로 곱한 시간 (bench 6절)",
    )
    _bench_table(
        results,
        "같은 파일, 같은 기계: 우리 엔진과 llama.cpp",
        peer_rows(results),
        "`pip install llama-cpp-python` 뒤에 `python -m engine bench --compare-quantization`을 "
        "돌리면 여기에 배치 1 decode 비교가 나옵니다 (llama.cpp가 같은 GGUF 파일을 씁니다).",
        "배치 1 decode, 같은 프롬프트, 한 실행 안에서 차례로 (bench 10절); "
        "llama.cpp는 자식 프로세스에서 같은 스레드 수로",
    )
