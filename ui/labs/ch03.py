"""Chapter 03's lab parts (Streamlit): generation with and without the KV cache (measured), KV
bytes per token from config.json (derived), and the cache growing block by block. The page
composes them; what they compute is in ui/experiments/ch03.py."""

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from engine.kv_cache import KVCacheManager
from ui.experiments.ch00 import FIRST_PROMPT
from ui.experiments.ch03 import GROWTH_MAX_TOKENS, block_growth, growth_workload
from ui.lab import LabContext, Progress
from ui.lab import lab as engine_lab
from ui.measure import compare_kv_cache, kv_allocated_bytes, prompt_of_length, read_config
from ui.predict import compare, predict
from ui.session import conditions_of, current_settings, get_engine, reset_engine
from ui.widgets import evidence, show_code

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cache_compare_lab() -> None:
    st.subheader("① 캐시를 켠 생성 vs 끈 생성 (실제 모델로 측정)")
    st.caption(
        "캐시 없음 = 새 토큰 하나마다 지금까지의 전체 시퀀스(프롬프트 + 생성된 토큰)를 새 요청으로 "
        "처음부터 prefill (prefix 캐시도 끔). 캐시 있음 = 평소처럼 prefill 한 번 뒤 토큰 하나씩 "
        "decode."
    )
    c1, c2 = st.columns(2)
    n_prompt = c1.select_slider(
        "프롬프트 토큰 수", [16, 32, 64, 128, 256], value=64, key="ch03_prompt_len"
    )
    n_new = c2.slider("생성할 토큰 수", 4, 48, 12, key="ch03_new_tokens")
    predict(
        "ch03_ratio",
        "캐시 없이 생성하면 캐시를 쓸 때보다 몇 배 오래 걸릴까요?",
        unit="배",
        step=0.5,
    )
    if st.button("캐시 있음 / 없음 비교", key="ch03_compare", type="primary"):
        settings = current_settings()
        common = dict(
            max_num_batched_tokens=1024,
            long_prefill_token_threshold=0,  # every prefill and recompute in one step
            max_model_len=1024,
            num_kv_blocks=max(settings.num_kv_blocks, 1024 // settings.block_size),
        )
        for key in ("ch03_cached", "ch03_uncached"):
            reset_engine(key)
        cached = get_engine("ch03_cached", **common)
        uncached = get_engine("ch03_uncached", enable_prefix_caching=False, **common)
        progress = Progress(n_new, "캐시 없는 생성 토큰")
        result = compare_kv_cache(
            cached, uncached, prompt_of_length(cached, n_prompt), n_new, on_token=progress
        )
        progress.close()
        st.session_state["ch03_result"] = (
            result,
            conditions_of(
                cached, 배치="요청 1개", 프롬프트=f"{n_prompt} 토큰", 생성=f"{n_new} 토큰 (greedy)"
            ),
        )
    if "ch03_result" not in st.session_state:
        st.info("버튼을 누르면 같은 프롬프트로 두 방식의 생성을 실제로 돌려 시간을 잽니다.")
        return
    _show_cache_comparison(*st.session_state["ch03_result"])


def _cache_figure(r) -> go.Figure:
    """Time per generated token, both ways, on a zero-based ms axis."""
    n = len(r.step_ms_cached)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            name="캐시 있음 (스텝 시간)",
            x=list(range(1, n + 1)),
            y=r.step_ms_cached,
            mode="lines+markers",
        )
    )
    fig.add_trace(
        go.Scatter(
            name="캐시 없음 (전체 재계산)",
            x=list(range(1, len(r.step_ms_uncached) + 1)),
            y=r.step_ms_uncached,
            mode="lines+markers",
        )
    )
    fig.update_layout(
        height=320,
        title=dict(text="생성 토큰마다 걸린 시간", y=0.98, yanchor="top"),
        xaxis_title="몇 번째 생성 토큰",
        yaxis=dict(title="ms", rangemode="tozero"),
        legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom"),
        margin=dict(l=10, r=10, t=70, b=10),
    )
    return fig


def _show_cache_comparison(r, cond: dict) -> None:
    """The measured comparison: per-token times, totals, ratios and whether the tokens agree."""
    st.plotly_chart(_cache_figure(r), key="ch03_compare_fig")
    df = pd.DataFrame(
        {
            "방식": ["캐시 있음", "캐시 없음"],
            "전체 시간 (ms)": [round(r.total_ms_cached, 1), round(r.total_ms_uncached, 1)],
            "모델에 넣은 토큰 수 (합)": [
                sum(r.tokens_computed_cached),
                sum(r.tokens_computed_uncached),
            ],
        }
    )
    st.dataframe(df, hide_index=True)
    ratio_time = r.total_ms_uncached / r.total_ms_cached if r.total_ms_cached else float("nan")
    ratio_tok = sum(r.tokens_computed_uncached) / max(sum(r.tokens_computed_cached), 1)
    evidence(
        "측정값",
        f"캐시 없음이 {ratio_time:.1f}배 오래 걸림 (전체 {r.total_ms_uncached:.0f} ms vs "
        f"{r.total_ms_cached:.0f} ms)",
        **cond,
    )
    evidence(
        "계산값",
        f"모델에 넣은 토큰은 {ratio_tok:.1f}배 — 시간 비율이 이보다 작은 것은 긴 입력을 한 번에 "
        "처리할 때 토큰당 비용이 싸지기 때문",
        formula="캐시 없음: Σ_{k=0}^{n−1}(P+k), 캐시 있음: P + (n−1)",
    )
    compare("ch03_ratio", ratio_time, "배")
    if r.same_tokens:
        st.success(
            f"두 방식의 greedy 토큰 {len(r.tokens_cached)}개가 모두 같습니다: 캐시는 계산을 아낄 "
            "뿐 답을 바꾸지 않습니다."
        )
    else:
        st.warning(
            "두 방식의 토큰이 다릅니다 (부동소수점 합 순서 차이로 비슷한 후보가 뒤바뀐 경우일 수 "
            "있음)."
        )
    show_code(compare_kv_cache, "방금 실행된 코드 (비교 측정)")


def kv_bytes_lab() -> None:
    st.subheader("② 토큰 하나가 남기는 KV 바이트 (config.json에서)")
    engine = get_engine("ch03")
    c = read_config(engine)
    L = c["num_hidden_layers"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rows = [
        {
            "dtype": d,
            "토큰당 KV 바이트": 2 * L * kv * hd * b,
            "블록당 바이트 (16토큰)": 2 * L * kv * hd * b * 16,
            "1,024토큰": 2 * L * kv * hd * b * 1024,
        }
        for d, b in DTYPE_BYTES.items()
    ]
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    evidence(
        "계산값",
        f"fp32: 2 × {L} × {kv} × {hd} × 4 B = {2 * L * kv * hd * 4:,} B/토큰",
        formula="2 (K와 V) × 층 수 × KV head 수 × head_dim × dtype 바이트 (값은 config.json에서)",
    )
    mha = 2 * L * c["num_attention_heads"] * hd * 4
    evidence(
        "계산값",
        f"KV head를 query head 수({c['num_attention_heads']})만큼 두었다면(MHA) {mha:,} B/토큰 "
        f"→ GQA로 {c['num_attention_heads'] // kv}분의 1",
        formula="2 × L × n_q × d × 4",
    )
    allocated = kv_allocated_bytes(engine)
    if allocated:
        slots = engine.num_blocks * engine.config.block_size
        evidence(
            "측정값",
            f"이 엔진이 실제로 잡은 KV 텐서 {allocated:,} B ÷ {slots:,} 토큰 칸 = "
            f"{allocated // slots:,} B/토큰",
            **conditions_of(engine, 블록=engine.num_blocks),
        )


def growth_lab() -> None:
    st.subheader("③ 캐시가 블록 단위로 자라는 모습")
    st.caption(
        "**워크로드 넣기**로 요청 하나(출력 정확히 "
        f"{GROWTH_MAX_TOKENS} 토큰)를 넣고 **다음 스텝**이나 **N 스텝**을 눌러 보세요. 'KV 캐시' "
        "탭의 격자에서 요청의 칸이 16토큰마다 하나씩 늘고, 사용률 그림이 계단처럼 오릅니다. "
        "요청이 끝나면 블록이 빈칸(또는 prefix 캐시 보관)으로 돌아갑니다."
    )
    engine = get_engine("ch03")
    engine_lab(
        "ch03",
        default_max_tokens=GROWTH_MAX_TOKENS,
        workload=growth_workload(engine),
        workload_note=(
            f"워크로드: '{FIRST_PROMPT}' 요청 하나, 출력 정확히 {GROWTH_MAX_TOKENS} 토큰 (종료 "
            "토큰이 나와도 멈추지 않음, ignore_eos). 예시 프롬프트는 답을 마치면 종료 토큰에서 "
            "멈춰 블록이 거의 늘지 않습니다."
        ),
        chapter_view=_growth_view,
        show_code_panel=False,
    )
    show_code(KVCacheManager.allocate_slots, "방금 실행된 코드 (블록 배정)")


def _growth_view(ctx: LabContext) -> None:
    """The first request's blocks so far: after its prefill, now, and the ⌈tokens ÷ 16⌉ rule."""
    requests = sorted(ctx.engines["ch03"].all_requests(), key=lambda r: r.arrival_time)
    growth = block_growth(ctx.records("ch03"), requests[0].request_id) if requests else None
    if growth is None:
        return
    last_blocks, last_tokens = growth.blocks[-1], growth.tokens[-1]
    live = last_blocks > 0
    now = growth.rule(last_tokens) if live else growth.peak
    cols = st.columns(3)
    cols[0].metric("prefill 직후 블록", growth.after_prefill)
    cols[1].metric("지금 블록" if live else "가장 많을 때 블록", now)
    cols[2].metric("decode 중 새로 받은 블록", growth.grown)
    later = (
        f"지금 {last_blocks}개 (캐시에 든 토큰 {last_tokens}개)"
        if live
        else f"가장 많을 때 {growth.peak}개, 끝나며 모두 반납"
    )
    evidence(
        "측정값",
        f"요청의 블록 테이블: prefill 직후 {growth.after_prefill}개 → {later}",
        **conditions_of(ctx.engines["ch03"], 근거="StepRecord.kv.block_tables"),
    )
    if live:
        evidence(
            "계산값",
            f"⌈{last_tokens} ÷ {growth.block_size}⌉ = {growth.rule(last_tokens)} 블록",
            formula="블록 수 = ⌈캐시에 든 토큰 수 ÷ 블록 크기⌉",
        )
