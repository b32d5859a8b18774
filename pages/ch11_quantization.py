"""11 · 양자화와 dtype: the same request on float32, bfloat16, int8 and int4 engines stepped side
by side (bytes read per decode step, measured step time, greedy agreement), the quality measured
against float32, and where quantization visibly loses."""

import plotly.graph_objects as go
import streamlit as st

from engine.kernels.quant import quantize_int4, quantize_int8
from engine.tools.quality import TIE_MARGIN
from ui.experiments.ch11 import (
    DEFAULT_BATCH,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT_LEN,
    DEFAULT_SIDES,
    VARIANTS,
    agreement_explanation,
    bytes_table,
    decode_summary,
    decode_workload,
    greedy_agreement_table,
    grid_fit_table,
    kernel_rows,
    outlier_table,
    peer_rows,
    quality_table,
    tie_report,
)
from ui.lab import LabContext, Side, run_results, run_workload_button
from ui.lab import lab as engine_lab
from ui.lesson import render_chapter
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence, show_code, show_frame

RESULT = "ch11_result"
QUALITY = "ch11_quality"
EXPLAIN = "_ch11_explanation"  # (id of the runs it explains, grid fit, tie report)
CLAIM = (
    "동시 요청 1개에서 int8과 int4 엔진은 float32가 읽는 가중치 바이트의 약 1/4과 1/5만 "
    "읽습니다. 토큰이 float32와 갈라지는 곳은 float32 자신이 망설이는(1·2순위 로짓 차가 아주 "
    "작은) 위치이고, int4(그룹 32)의 선형층 가중치는 float32와 똑같습니다: 이 모델의 float32가 "
    "원래 그 4비트 격자에서 왔기 때문입니다."
)
CHOICES = ["float32보다 느리다", "1~2배 빠르다", "2배 이상 빠르다"]


def _model_dir():
    from engine.artifact import resolve_model_path

    return resolve_model_path(current_settings().model or None)


def _has_gguf() -> bool:
    from engine.worker.quantization import gguf_source

    try:
        gguf_source(_model_dir())
        return True
    except Exception:  # noqa: BLE001 - any model without a GGUF source
        return False


def _sides(labels: list[str]) -> list[Side]:
    sides = []
    for label in labels:
        slug = label.split()[0].replace("/", "_")
        overrides = dict(VARIANTS[label], enable_prefix_caching=False)
        sides.append(Side(f"ch11_{slug}", label, overrides))
    return sides


def _speed_choice(ratio: float) -> str:
    return CHOICES[0] if ratio < 1.0 else CHOICES[1] if ratio < 2.0 else CHOICES[2]


def _summary_view(ctx: LabContext) -> None:
    first = ctx.engines[ctx.sides[0].key]
    st.markdown("**디코드 스텝 하나가 읽는 가중치** (이 모델의 config.json 모양으로 계산)")
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
    st.markdown("**측정 요약** (엔진 시계, 디코드만 한 스텝의 중앙값)")
    show_frame(summary, hide_index=True)
    fig = go.Figure(
        go.Bar(
            x=summary["엔진"],
            y=summary["디코드 스텝 중앙값 (ms)"],
            text=summary["가중치 (MB)"].map(lambda mb: f"가중치 {mb} MB"),
            name="디코드 스텝 (ms)",
        )
    )
    fig.update_layout(
        height=300,
        title="디코드 스텝 하나의 시간 (ms, 중앙값) — 막대 위: 엔진이 가진 가중치",
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
        "가중치 읽기 속도 = 가중치 바이트 ÷ 디코드 스텝 시간 (스텝의 다른 일까지 포함한 하한)",
        formula="weight_bytes / step_ms",
    )
    labels = list(summary["엔진"])
    if "float32" in labels and "int8" in labels:
        ms = summary.set_index("엔진")["디코드 스텝 중앙값 (ms)"]
        if ms["float32"] and ms["int8"]:
            compare("ch11_speed", _speed_choice(ms["float32"] / ms["int8"]))
            st.caption(f"디코드 스텝: float32 {ms['float32']} ms, int8 {ms['int8']} ms")
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


def _quality_section() -> None:
    st.subheader("품질: float32와 얼마나 같은가")
    options = ["bfloat16", "int8", "int4", "int4/64"] + (["gguf"] if _has_gguf() else [])
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
    c = results["conditions"]
    evidence("측정값", what, 장치=c.get("device_name"), 스레드=c.get("threads"), 날짜=c.get("date"))


def _bench_sections() -> None:
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
        "돌리면 여기에 배치 1 디코드 비교가 나옵니다 (llama.cpp가 같은 GGUF 파일을 씁니다).",
        "배치 1 디코드, 같은 프롬프트, 한 실행 안에서 차례로 (bench 10절); "
        "llama.cpp는 자식 프로세스에서 같은 스레드 수로",
    )


def lab() -> None:
    st.subheader("같은 요청, 다른 숫자: float32 · bfloat16 · int8 · int4")
    options = list(VARIANTS) if _has_gguf() else [v for v in VARIANTS if "gguf" not in v]
    c1, c2, c3 = st.columns([2, 1, 1])
    labels = c1.multiselect(
        "비교할 엔진 (최대 3개)",
        options,
        default=list(DEFAULT_SIDES),
        max_selections=3,
        key="ch11_sides",
    )
    batch = c2.slider("동시 요청 수", 1, 8, DEFAULT_BATCH, key="ch11_batch")
    max_tokens = c3.slider("출력 토큰 수", 8, 64, DEFAULT_MAX_TOKENS, step=8, key="ch11_tokens")
    if not labels:
        st.info("비교할 엔진을 하나 이상 고르세요.")
        return
    workload = decode_workload(DEFAULT_PROMPT_LEN, max_tokens, batch)
    st.caption(
        f"워크로드: {DEFAULT_PROMPT_LEN}토큰 프롬프트 {batch}개가 함께 도착, 각각 "
        f"{max_tokens}토큰을 greedy로 생성합니다. 한 스텝에 모든 엔진이 한 번씩 실행됩니다."
    )

    def before(ctx: LabContext) -> None:
        predict(
            "ch11_speed",
            f"동시 요청 {batch}개일 때, int8 엔진의 디코드 스텝은 float32 엔진과 비교해 어떨까?",
            options=CHOICES,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch11",
        _sides(labels),
        presets=None,
        workload=workload,
        before=before,
        chapter_view=_summary_view,
        show_code_panel=False,
    )
    show_code(quantize_int8, "int8 양자화: 행마다 scale 하나")
    show_code(quantize_int4, "int4 양자화: 묶음마다 scale과 min")
    _quality_section()
    _bench_sections()


render_chapter("11", lab, claim=CLAIM)
