"""Chapter 02's lab parts (Streamlit): token boundaries of a text, prefill vs decode timing, and
TTFT vs TPOT on the standard lab. The page composes them; what they compute is in
ui/experiments/ch02.py."""

import html

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine.request import RequestMetrics
from engine.tokenizer import Tokenizer
from ui.experiments.ch02 import (
    DEFAULT_LENGTHS,
    DEFAULT_NUM_DECODE,
    PROMPT_LENGTHS,
    TIMING_BUDGET,
    timing_overrides,
)
from ui.lab import LabContext, Progress
from ui.lab import lab as engine_lab
from ui.measure import measure_prefill_decode
from ui.predict import compare, predict
from ui.session import conditions_of, current_settings, get_engine
from ui.tokens import chip_pieces
from ui.widgets import evidence, show_code

CHIP_COLORS = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d7f9f8"]
PAIRS = [
    ("안녕하세요, 오늘 날씨가 정말 좋네요.", "Hello, the weather is really nice today."),
    (
        "대규모 언어 모델은 토큰을 하나씩 생성합니다.",
        "Large language models generate tokens one at a time.",
    ),
    ("서울은 대한민국의 수도입니다.", "Seoul is the capital of South Korea."),
]


def token_chips(model_dir, text: str) -> str:
    """HTML: one coloured chip per token, its id on hover (spaces shown as ␣). A token that holds
    only some bytes of a character shows those bytes (<0xEB>), with a dashed border."""
    chips = []
    for i, (tid, shown, partial) in enumerate(chip_pieces(model_dir, text)):
        label = html.escape(shown.replace(" ", "␣").replace("\n", "⏎")) or "∅"
        border = "1px dashed #c0392b" if partial else "1px solid #bbb"
        title = f"id {tid}" + (" · 글자의 일부 바이트만 담은 토큰" if partial else "")
        chips.append(
            f'<span title="{title}" style="background:{CHIP_COLORS[i % len(CHIP_COLORS)]};'
            f"border:{border};border-radius:4px;padding:1px 3px;margin:1px;"
            f'display:inline-block;font-family:monospace">{label}</span>'
        )
    return '<div style="line-height:2">' + "".join(chips) + "</div>"


def tokenize_lab(tok: Tokenizer, model_dir) -> None:
    st.subheader("① 아무 글이나 토큰으로 잘라 보기")
    text = st.text_area(
        "글",
        "안녕하세요! LLM 추론 서버는 토큰을 하나씩 만듭니다. Tokens are not words.",
        key="ch02_text",
        height=80,
    )
    pieces = tok.token_pieces(text)
    st.markdown(token_chips(model_dir, text), unsafe_allow_html=True)
    st.caption(
        "점선 테두리 칩은 글자 하나의 일부 바이트만 담은 토큰입니다 (한글 한 글자 = UTF-8 3바이트)."
    )
    ids = [tid for tid, _ in pieces]
    st.caption(
        f"토큰 {len(ids)}개 · 글자 {len(text)}자 · UTF-8 {len(text.encode())} 바이트 · "
        f"토큰 id: {ids[:40]}" + (" …" if len(ids) > 40 else "")
    )
    rows = []
    for ko, en in PAIRS:
        for lang, s in (("한국어", ko), ("영어", en)):
            n = len(tok.token_pieces(s))
            rows.append(
                {
                    "언어": lang,
                    "문장": s,
                    "글자 수": len(s),
                    "UTF-8 바이트": len(s.encode()),
                    "토큰 수": n,
                    "글자당 토큰": round(n / len(s), 3),
                }
            )
    df = pd.DataFrame(rows)
    st.dataframe(df, hide_index=True, width="stretch")
    per_char = df.groupby("언어")["글자당 토큰"].mean()
    evidence(
        "측정값",
        f"글자당 토큰 (평균): 한국어 {per_char['한국어']:.2f}, 영어 {per_char['영어']:.2f} "
        f"→ 한국어가 글자당 {per_char['한국어'] / per_char['영어']:.1f}배",
        토크나이저="SmolLM2-135M-Instruct tokenizer.json (byte-level BPE)",
        표본=f"같은 뜻 문장 {len(PAIRS)}쌍",
    )
    show_code(Tokenizer.token_pieces, "방금 실행된 코드 (토큰 경계)")


def _timing_figure(df: pd.DataFrame) -> go.Figure:
    """Grouped bars per prompt length: the lengths are categories (one slot each, in order, not a
    numeric axis that would put 512 between ticks), the times a zero-based magnitude."""
    lengths = [str(n) for n in df["프롬프트 토큰"]]
    fig = go.Figure()
    fig.add_trace(go.Bar(name="prefill 한 번 (ms)", x=lengths, y=df["prefill (ms)"]))
    fig.add_trace(go.Bar(name="decode 한 스텝 평균 (ms)", x=lengths, y=df["decode 스텝 평균 (ms)"]))
    fig.update_layout(
        barmode="group",
        height=340,
        title=dict(text="prefill 한 번 vs decode 한 스텝", y=0.98, yanchor="top"),
        xaxis=dict(
            title="프롬프트 토큰 수", type="category", categoryorder="array", categoryarray=lengths
        ),
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom"),
        margin=dict(l=10, r=10, t=70, b=10),
    )
    return fig


def timing_lab() -> None:
    st.subheader("② prefill과 decode, 이 기계에서 재기")
    st.caption(
        "요청 하나만 넣고, 프롬프트 전체를 한 번에 계산하는 prefill 스텝과 토큰 하나씩의 decode "
        "스텝 시간을 잽니다."
    )
    sizes = st.multiselect(
        "프롬프트 길이 (토큰)", PROMPT_LENGTHS, default=DEFAULT_LENGTHS, key="ch02_sizes"
    )
    num_decode = st.slider("decode 스텝 수", 2, 32, DEFAULT_NUM_DECODE, key="ch02_num_decode")
    predict(
        "ch02_ratio",
        "가장 긴 프롬프트의 prefill 한 번은 decode 한 스텝의 몇 배 걸릴까요?",
        unit="배",
        step=0.5,
    )
    if st.button("prefill / decode 재기", key="ch02_measure", type="primary"):
        settings = current_settings()
        engine = get_engine(
            "ch02_timing", **timing_overrides(settings.num_kv_blocks, settings.block_size)
        )
        results = []
        progress = Progress(len(sizes), "프롬프트 길이")
        for n in sorted(sizes):
            results.append(measure_prefill_decode(engine, n, num_decode))
            progress()
        progress.close()
        st.session_state["ch02_results"] = (
            results,
            conditions_of(engine, 배치="요청 1개", 토큰예산=TIMING_BUDGET, prefix캐시="끔"),
        )
    if "ch02_results" not in st.session_state:
        st.info("버튼을 누르면 길이별로 실제 prefill과 decode를 돌려 시간을 잽니다.")
        return
    results, cond = st.session_state["ch02_results"]
    df = pd.DataFrame(
        [
            {
                "프롬프트 토큰": r.num_prompt_tokens,
                "prefill (ms)": round(r.prefill_ms, 1),
                "prefill 토큰당 (ms)": round(r.prefill_ms / r.num_prompt_tokens, 2),
                "decode 스텝 평균 (ms)": round(r.decode_ms_mean, 1),
                "TTFT (ms)": round(r.ttft_ms or 0, 1),
                "TPOT (ms)": round(r.tpot_ms or 0, 1),
            }
            for r in results
        ]
    )
    st.dataframe(df, hide_index=True, width="stretch")
    st.plotly_chart(_timing_figure(df), key="ch02_timing_fig")
    longest = results[-1]
    evidence(
        "측정값",
        f"{longest.num_prompt_tokens}토큰 prefill {longest.prefill_ms:.0f} ms "
        f"(토큰당 {longest.prefill_ms / longest.num_prompt_tokens:.2f} ms) vs decode 한 스텝 "
        f"{longest.decode_ms_mean:.0f} ms (토큰 1개)",
        **cond,
    )
    compare("ch02_ratio", longest.prefill_ms / longest.decode_ms_mean, "배")
    from engine.core import EngineCore

    show_code(EngineCore.step)


def ttft_lab() -> None:
    st.subheader("③ 실제 요청의 TTFT와 TPOT")
    st.caption(
        "요청을 넣고 **끝까지**를 누르면, 끝난 요청마다 엔진이 기록한 시각으로 TTFT·TPOT을 "
        "계산합니다 (엔진 시계: 버튼 사이에 쉰 시간은 세지 않음)."
    )
    engine_lab("ch02", default_max_tokens=24, chapter_view=_metrics_view, show_code_panel=False)


def _metrics_view(ctx: LabContext) -> None:
    engine = ctx.engines["ch02"]
    done = [r for r in engine.all_requests() if r.is_finished]
    if not done:
        return
    rows = []
    for r in done:
        m = r.metrics(clock="engine")
        rebuilt = None if m.tpot is None else 1000 * (m.ttft + m.tpot * (m.num_output_tokens - 1))
        rows.append(
            {
                "요청": r.request_id,
                "프롬프트 토큰": m.num_prompt_tokens,
                "출력 토큰": m.num_output_tokens,
                "TTFT (ms)": round(1000 * m.ttft, 1),
                "TPOT (ms)": "—" if m.tpot is None else round(1000 * m.tpot, 1),
                "E2E (ms)": round(1000 * m.e2e, 1),
                "TTFT + TPOT×(n−1) (ms)": "—" if rebuilt is None else round(rebuilt, 1),
            }
        )
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    evidence(
        "측정값",
        "TTFT, TPOT, E2E: 엔진이 요청마다 남긴 도착·첫 토큰·토큰·완료 시각 (엔진 시계)",
        **conditions_of(engine, 배치=f"요청 {len(engine.all_requests())}개 (이 세션)"),
    )
    evidence(
        "계산값",
        "마지막 열은 정의에서 다시 계산한 E2E입니다 (E2E 열과 거의 같아야 합니다). "
        "출력이 1토큰이면 TPOT은 정의되지 않습니다(—)",
        formula="E2E ≈ TTFT + TPOT × (출력 토큰 수 − 1)",
    )
    show_code(RequestMetrics, "방금 실행된 코드 (지표 정의)")
