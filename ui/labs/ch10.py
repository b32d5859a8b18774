"""Chapter 10's lab parts (Streamlit): prefix caching on and off side by side (the live block view
and the summary), the block-hash chain, LRU eviction and cache salts. The page composes them; what
they run and compute is in ui/experiments/ch10.py."""

import pandas as pd
import streamlit as st

from ui.errors import show_error
from ui.experiments.ch10 import (
    CACHING_MODES,
    LAB_MAX_MODEL_LEN,
    hash_chain_experiment,
    hash_chain_figure,
    hit_rate_figure,
    hit_totals,
    lab_overrides,
    lru_experiment,
    most_shared_record,
    num_shared_blocks,
    prefix_comparison,
    salt_experiment,
    shared_grid_figure,
    ttft_figure,
)
from ui.experiments.common import measurement_conditions
from ui.lab import LabContext, Progress, Side, run_results
from ui.predict import compare, predict
from ui.session import build_engine, current_settings, get_engine
from ui.widgets import evidence, show_frame

RESULT = "ch10_result"
SIDE_KEYS = {"prefix caching 켬": "ch10_on", "prefix caching 끔": "ch10_off"}
ON, OFF = list(SIDE_KEYS)
LRU_CHOICES = ["꽉 찬 블록 전부", "앞쪽 일부만", "하나도 못 찾음"]


def lab_sides() -> list[Side]:
    settings = current_settings()
    blocks = max(settings.num_kv_blocks, LAB_MAX_MODEL_LEN // settings.block_size)
    return [
        Side(SIDE_KEYS[label], label, lab_overrides(on, blocks))
        for label, on in CACHING_MODES.items()
    ]


def _make_engine(**overrides):
    """A fresh engine for the small experiments below the lab (weights are shared per process)."""
    return build_engine(current_settings(), **overrides)


def _live_view(ctx: LabContext) -> None:
    """While stepping: the on side's per-step hits and its blocks by reference count."""
    records = ctx.records(SIDE_KEYS[ON])
    if not records:
        st.info(
            "실행하거나 워크로드를 넣고 한 스텝씩 진행하면, 여기에 히트와 공유 블록이 나옵니다."
        )
        return
    st.markdown(f"**{ON}: 스텝별 prefix 캐시 히트**")
    st.plotly_chart(hit_rate_figure(records), key="ch10_hits")
    rec = records[-1] if not ctx.finished else most_shared_record(records)
    st.plotly_chart(
        shared_grid_figure(
            rec.kv,
            title=f"스텝 {rec.step}의 KV 블록 (공유 블록의 숫자 = ref_cnt, 함께 쓰는 요청 수): "
            f"공유 블록 {num_shared_blocks(rec.kv)}개",
        ),
        key="ch10_shared_grid",
    )
    queries, hits = hit_totals(records)
    engine = ctx.engines[SIDE_KEYS[ON]]
    evidence(
        "측정값",
        f"{ON}: 지금까지 조회한 프롬프트 토큰 {queries}개 중 {hits}개를 캐시에서 찾음 "
        f"(스텝 {rec.step}의 공유 블록 {num_shared_blocks(rec.kv)}개)",
        **measurement_conditions(engine, 블록크기=engine.config.block_size),
    )


def summary_view(ctx: LabContext) -> None:
    _live_view(ctx)
    result = run_results(ctx, RESULT, prefix_comparison)
    if result is None:
        st.info("두 엔진이 워크로드를 끝내면 여기에 요청별 TTFT 비교가 나옵니다.")
        return
    on = result.runs[ON]
    table = result.table
    st.markdown("**요청별 비교** (히트 토큰은 스케줄러 기록, 시간은 엔진 시계)")
    show_frame(table)
    st.plotly_chart(ttft_figure(table), key="ch10_ttft")
    if result.hit_rate is not None:
        compare("ch10_hit", 100 * result.hit_rate, unit="%")
    queries, hits = hit_totals(on.records)
    evidence(
        "측정값",
        f"{ON}: 히트율 {0 if not queries else 100 * hits / queries:.1f}% "
        f"(찾은 {hits} ÷ 조회한 {queries} 프롬프트 토큰)",
        **on.conditions,
    )
    for label, res in result.runs.items():
        t = table[f"TTFT {'켬' if label == ON else '끔'} (ms)"]
        evidence(
            "측정값",
            f"{label}: TTFT 평균 {t.mean():.1f} ms, 스텝 {len(res.records)}개, "
            f"전체 {res.elapsed_s:.2f} s (엔진 시계)",
            **res.conditions,
        )
    evidence(
        "계산값",
        "최대 가능 히트 = ⌊min(앞 요청과 같은 앞부분, 프롬프트 − 1) ÷ 블록 크기⌋ × 블록 크기; "
        "TTFT 차이 = 끔의 TTFT − 켬의 TTFT",
        formula="꽉 찬 블록만 캐시, 마지막 토큰은 항상 계산",
    )
    diff = table["TTFT 차이 (끔−켬, ms)"].dropna()
    saved = int(table["히트 토큰 (켬)"].sum())
    if len(diff) and saved and diff.mean() <= 0:
        st.warning(
            f"이번 측정에서는 캐시를 켠 쪽의 TTFT가 더 길었습니다(평균 차이 {diff.mean():.1f} ms). "
            f"켠 엔진은 프롬프트 {saved}토큰을 덜 계산했지만, 스텝 시간은 이 기계의 다른 일에 따라 "
            "흔들립니다. 위의 요청 여정과 스텝 결정에서 두 엔진의 스텝 시간을 비교하고 다시 "
            "실행해 보세요."
        )
    dec_on, dec_off = table["decode 스텝 (켬)"], table["decode 스텝 (끔)"]
    if len(table) and (dec_on == dec_off).all():
        st.success(
            f"캐시 히트가 있어도 요청마다 decode 스텝은 켬·끔 모두 {int(dec_on.iloc[0])}번입니다"
            "(측정값). 캐시가 아껴 준 것은 프롬프트 앞부분의 K/V 계산뿐이고, 출력 토큰은 매번 "
            "모델이 새로 계산합니다."
        )


def chain_section(block_size: int) -> None:
    st.subheader("해시 사슬: 왜 꽉 찬 블록만 캐시되나")
    c1, c2 = st.columns(2)
    length = c1.slider("프롬프트 길이 (토큰)", 8, 120, 4 * block_size - 1, key="ch10_chain_len")
    pos = c2.slider(
        "바꿀 토큰 위치",
        0,
        119,
        40,
        key="ch10_change_pos",
        help="프롬프트 길이보다 크면 마지막 토큰을 바꿉니다",
    )
    pos = min(pos, length - 1)
    st.caption(
        f"같은 엔진(prefix caching 켬, 블록 {block_size}토큰)에 ① 프롬프트, ② 같은 프롬프트, "
        f"③ 위치 {pos}의 토큰 하나만 바꾼 프롬프트를 차례로 보냅니다 (각각 출력 4토큰)."
    )
    state = st.session_state.get("ch10_chain")
    predict(
        "ch10_chain",
        f"{length}토큰 프롬프트를 한 번 보낸 뒤 똑같이 다시 보내면, 두 번째 요청은 몇 토큰을 "
        "캐시에서 찾을까요?",
        unit="토큰",
        step=1.0,
        locked=state is not None and state.prompt_len == length,
    )
    if st.button("해시 사슬 실행", key="ch10_chain_run"):
        bar = Progress(3, "요청")
        try:
            st.session_state["ch10_chain"] = state = hash_chain_experiment(
                _make_engine, length, pos, block_size, progress=bar
            )
        except Exception as exc:  # noqa: BLE001
            show_error(exc, "해시 사슬 실험을 실행하지 못했습니다")
        bar.close()
    if state is None:
        return
    st.plotly_chart(hash_chain_figure(state.chains, state.block_size), key="ch10_chain_fig")
    rows = [
        {
            "요청": s.name,
            "프롬프트 토큰": s.num_prompt_tokens,
            "히트 토큰 (측정값)": s.hit_tokens,
            "히트 토큰 (계산값)": state.expected[s.name],
            "decode 스텝": s.decode_steps,
        }
        for s in state.sent
    ]
    show_frame(pd.DataFrame(rows))
    second = state.sent[1]
    compare("ch10_chain", second.hit_tokens, unit="토큰", fmt="{:,.0f}")
    full = state.prompt_len // state.block_size
    evidence(
        "계산값",
        f"꽉 찬 블록 {full}개, 마지막 블록 {state.prompt_len - full * state.block_size}토큰"
        f"(해시 없음). 다시 보낸 요청의 히트 = ⌊({state.prompt_len} − 1) ÷ {state.block_size}⌋ × "
        f"{state.block_size} = {state.expected[second.name]}토큰",
        formula="⌊(n − 1) ÷ 블록⌋ × 블록 (마지막 토큰은 logits를 위해 늘 계산)",
    )
    evidence(
        "측정값",
        "히트 토큰: "
        + ", ".join(f"{s.name} {s.hit_tokens}" for s in state.sent)
        + " (스케줄러 기록 num_prefix_hit_tokens)",
        **measurement_conditions(_make_engine_conditions(), 블록크기=state.block_size),
    )


def _make_engine_conditions():
    return get_engine(SIDE_KEYS[ON], **lab_sides()[0].overrides)


def lru_section(block_size: int) -> None:
    st.subheader("LRU 축출: 작은 캐시에서는 캐시된 블록도 밀려난다")
    n = st.slider("작은 캐시의 KV 블록 수", 6, 12, 8, key="ch10_lru_blocks")
    st.caption(
        f"KV 블록 {n}개(블록당 {block_size}토큰)인 엔진에 A(꽉 찬 블록 4개 + 덜 찬 블록 1개) → "
        "다른 프롬프트 B(블록 6개) → A를 다시, 차례로 보냅니다. 각 요청은 끝난 뒤 다음이 옵니다."
    )
    res = st.session_state.get("ch10_lru")
    predict(
        "ch10_lru",
        f"블록 {n}개짜리 캐시에서 B가 지나간 뒤 A를 다시 보내면, A는 자기 앞부분을 얼마나 "
        "찾을까요?",
        options=LRU_CHOICES,
        locked=res is not None and res.num_blocks == n,
    )
    if st.button("LRU 실험 실행", key="ch10_lru_run"):
        bar = Progress(3, "요청")
        try:
            st.session_state["ch10_lru"] = lru_experiment(_make_engine, n, block_size, progress=bar)
        except Exception as exc:  # noqa: BLE001
            show_error(exc, "LRU 실험을 실행하지 못했습니다")
        bar.close()
    res = st.session_state.get("ch10_lru")
    if res is None:
        return
    show_frame(res.rows)
    measured = (
        LRU_CHOICES[0]
        if res.resent_hit_tokens >= res.expected_full_hit
        else LRU_CHOICES[2]
        if res.resent_hit_tokens == 0
        else LRU_CHOICES[1]
    )
    compare("ch10_lru", measured)
    st.caption(
        "각 단계가 끝난 뒤의 블록들. 칸의 글자는 그 블록이 들고 있는 내용입니다 (A0 = 프롬프트 "
        "A의 첫 블록). 초록은 아무도 쓰지 않지만 다시 찾을 수 있는 캐시 보관 블록입니다."
    )
    for i, (stage, snap) in enumerate(res.snapshots.items()):
        st.plotly_chart(
            shared_grid_figure(
                snap,
                title=f"{stage}: 캐시 보관 {snap.num_cached_free}/{res.num_blocks} 블록",
                columns=res.num_blocks,
                labels=res.contents.get(stage),
                height=150,
            ),
            key=f"ch10_lru_grid_{i}",
        )
    evidence(
        "측정값",
        f"KV 블록 {res.num_blocks}개: A를 다시 보냈을 때 히트 {res.resent_hit_tokens}토큰 "
        f"(밀려나지 않았다면 {res.expected_full_hit}토큰 — 계산값)",
        **measurement_conditions(_make_engine_conditions(), 블록크기=res.block_size),
    )


def salt_section(block_size: int) -> None:
    st.subheader("cache_salt: 같은 프롬프트라도 salt가 다르면 나누지 않는다")
    st.caption(
        "같은 엔진에 같은 80토큰 프롬프트를 네 번, salt만 바꿔 차례로 보냅니다: tenant-A, "
        "tenant-B, tenant-A, salt 없음."
    )
    if st.button("cache_salt 실험 실행", key="ch10_salt_run"):
        bar = Progress(4, "요청")
        try:
            st.session_state["ch10_salt"] = salt_experiment(
                _make_engine, 80, block_size, progress=bar
            )
        except Exception as exc:  # noqa: BLE001
            show_error(exc, "cache_salt 실험을 실행하지 못했습니다")
        bar.close()
    table = st.session_state.get("ch10_salt")
    if table is None:
        return
    show_frame(table)
    evidence(
        "측정값",
        "히트 토큰: " + ", ".join(str(v) for v in table["히트 토큰 (측정값)"]),
        **measurement_conditions(_make_engine_conditions(), 블록크기=block_size),
    )
