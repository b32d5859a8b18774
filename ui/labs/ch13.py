"""Chapter 13's lab parts (Streamlit): speculative decoding on and off side by side (the drafts,
the acceptance statistics, the outputs) and the speed section. The page composes them; what they
run and compute is in ui/experiments/ch13.py."""

import streamlit as st

from ui.experiments.ch13 import (
    BATCHES,
    DEFAULT_MAX_TOKENS,
    PROMPTS,
    SPEED_KINDS,
    compare_outputs,
    display_table,
    draft_grid_figure,
    draft_table,
    fmt_value,
    formula_figure,
    measure_speedup,
    spec_stats,
    speed_figure,
    speed_steps,
    speed_table,
    speedup_estimate,
)
from ui.lab import LabContext, Progress, Side, add_prompt, reset_lab, run_steps, set_playing
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence

KEY = "ch13"
SIDE_KEYS = {"추측 디코딩 켬": "ch13_on", "추측 디코딩 끔": "ch13_off"}
SPEED = "ch13_speedup"
SPEED_CHOICES = ["줄어든다", "비슷하다", "늘어난다"]
SIDE_VIEW = "ch13_view_request"


def sides(spec: dict) -> list[Side]:
    return [
        Side(SIDE_KEYS["추측 디코딩 켬"], "추측 디코딩 켬", {"speculative_config": spec}),
        Side(SIDE_KEYS["추측 디코딩 끔"], "추측 디코딩 끔", {"speculative_config": None}),
    ]


def run_button(ctx: LabContext) -> None:
    """Put the chosen example prompt on both engines (fresh) and run them to the end."""
    if not st.button(
        "실행",
        key=f"{KEY}_run",
        type="primary",
        help="두 엔진을 새로 만들고, 고른 예시 프롬프트를 양쪽에 넣어 끝까지 실행합니다 "
        "(한 스텝씩 보려면 예시 요청 추가 → 다음 스텝)",
    ):
        return
    state = st.session_state
    label = state.get(f"{KEY}_preset") or next(iter(PROMPTS))
    set_playing(KEY, False)
    reset_lab(ctx)
    add_prompt(
        ctx,
        PROMPTS[label],
        max_tokens=int(state.get(f"{KEY}_max_tokens", DEFAULT_MAX_TOKENS)),
        temperature=float(state.get(f"{KEY}_temperature", 0.0)),
        top_p=float(state.get(f"{KEY}_top_p", 1.0)),
        seed=int(state.get(f"{KEY}_seed", 0)) or None,
    )
    run_steps(ctx, None)


def chapter_view(ctx: LabContext, k: int) -> None:
    on_engine = ctx.engines[SIDE_KEYS["추측 디코딩 켬"]]
    on_records = ctx.records(SIDE_KEYS["추측 디코딩 켬"])
    st.markdown("#### 초안 → 검증 → 받아들임")
    requests = sorted(on_engine.all_requests(), key=lambda r: r.arrival_time)
    if not requests or not on_records:
        st.info(
            "**실행**을 누르거나, 예시 요청을 추가하고 **다음 스텝**을 누르면 여기에 스텝마다의 "
            "초안(초록: 받아들임, 빨강: 버림)과 모델이 낸 토큰(파랑)이 나옵니다."
        )
        return
    ids = [r.request_id for r in requests]
    rid = ids[0]
    if len(ids) > 1:
        rid = st.selectbox("볼 요청", ids, key=SIDE_VIEW)
    _draft_view(on_records, on_engine.tokenizer, rid, k)
    _stats_view(on_records, k, rid, ids)
    _outputs_view(ctx, requests, k)


def _draft_view(on_records, tokenizer, rid: str, k: int) -> None:
    """The drafts of one request, step by step (grid and table)."""
    table = draft_table(on_records, tokenizer, rid)
    if table.empty:
        st.caption(
            "이 요청은 아직 초안을 검증한 스텝이 없습니다 (prefill 중이거나, 마지막 n-gram이 "
            "앞에서 나온 적이 없어 초안이 비었습니다)."
        )
    else:
        st.plotly_chart(draft_grid_figure(table, k), width="stretch", key=f"{KEY}_drafts")
        with st.expander(f"초안 표 ({len(table)}개 검증 스텝, 요청 {rid})"):
            st.dataframe(
                display_table(table.drop(columns=["_drafts"])), hide_index=True, width="stretch"
            )


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _stats_view(on_records, k: int, rid: str, ids: list[str]) -> None:
    """vLLM's two metrics (acceptance rate, mean acceptance length) and Leviathan et al.'s α,
    each with its own definition, and the formula at that α against the measured tokens per step."""
    stats = spec_stats(on_records, k, rid)
    all_stats = spec_stats(on_records, k)
    c1, c2, c3, c4, c5 = st.columns(5)
    c1.metric("수락률 (받아들인 초안 ÷ 초안)", _rate(stats.acceptance_rate))
    c2.metric("α (앞이 맞았을 때 맞을 확률)", _rate(stats.alpha))
    c3.metric("검증 스텝당 토큰 = 평균 수락 길이 (측정)", _rate(stats.tokens_per_verify_step))
    c4.metric("공식 (1−α^(k+1))/(1−α)", _rate(stats.formula))
    c5.metric("decode 스텝당 토큰 (초안 없는 스텝 포함)", _rate(stats.tokens_per_decode_step))
    cond = dict(
        요청=rid,
        k=k,
        **{"초안 없는 decode 스텝": stats.decode_steps - stats.verify_steps},
    )
    if stats.alpha is not None:
        _stats_evidence(stats, k, cond)
        compare(f"{KEY}_tps", stats.tokens_per_verify_step, "토큰/스텝", fmt="{:.2f}")
    if all_stats.alpha is not None and len(ids) > 1:
        evidence(
            "측정값",
            f"이 엔진의 모든 요청: 수락률 {all_stats.acceptance_rate:.2f}, α = "
            f"{all_stats.alpha:.2f}, 검증 스텝당 {all_stats.tokens_per_verify_step:.2f}토큰",
            요청=len(ids),
            k=k,
        )
    st.plotly_chart(formula_figure(k, stats), width="stretch", key=f"{KEY}_formula")


def _stats_evidence(stats, k: int, cond: dict) -> None:
    """The counts behind each rate, then the formula at the measured α."""
    per_pos = ", ".join(
        f"{i + 1}번째 {a}/{r}"
        for i, (a, r) in enumerate(zip(stats.accepted_per_pos, stats.reached_per_pos))
        if r
    )
    evidence(
        "측정값",
        f"요청 {cond['요청']}: 초안 {stats.proposed}개 중 {stats.accepted}개 받아들임 → "
        f"수락률 {stats.acceptance_rate:.2f} (vLLM의 draft acceptance rate). 검증기가 실제로 "
        f"판정한 자리(앞 초안이 모두 맞은 자리)만 세면 {per_pos} → α = {stats.alpha:.2f}. "
        f"검증 스텝 {stats.verify_steps}개에서 평균 {stats.tokens_per_verify_step:.2f}토큰 "
        f"(받아들인 초안 + 모델 토큰 1개, vLLM의 mean acceptance length); 검증 스텝당 초안 "
        f"평균 {stats.mean_drafts:.2f}개",
        **cond,
    )
    evidence(
        "계산값",
        f"측정한 α = {stats.alpha:.2f}를 스텝마다 실제 초안 수와 함께 넣으면 검증 스텝당 "
        f"{stats.formula:.2f}토큰 (초안이 늘 k = {k}개였다면 {stats.formula_at_k:.2f}). "
        f"초안 비용 c ≈ 0인 n-gram에서 검증 스텝이 평범한 스텝과 같은 값이라면 기대 속도 향상은 "
        f"{speedup_estimate(stats.alpha, k, 0.0):.2f}배, 초안 하나가 대상 모델 forward의 "
        f"5%인 초안 모델(c = 0.05)이라면 {speedup_estimate(stats.alpha, k, 0.05):.2f}배",
        formula="(1 − α^(k+1)) / (1 − α), 속도 향상 (1 − α^(k+1)) / ((1 − α)(ck + 1)) "
        "(Leviathan et al., ICML'23)",
    )
    st.caption(
        "수락률은 틀린 초안 뒤에 있어 판정받지 못한 초안까지 분모에 넣으므로 α보다 낮게 "
        "나옵니다. 공식에 넣을 것은 α입니다. 공식은 또 맞을 확률이 자리마다 같고 서로 "
        "독립이라고 가정하므로, 맞고 틀림이 몰려 나오는 n-gram 초안에서는 측정값과 조금 "
        "어긋날 수 있습니다."
    )


def _outputs_view(ctx: LabContext, requests: list, k: int) -> None:
    """How many steps each engine took for the same output, and whether the outputs agree."""
    on_key, off_key = SIDE_KEYS["추측 디코딩 켬"], SIDE_KEYS["추측 디코딩 끔"]
    on_records, off_records = ctx.records(on_key), ctx.records(off_key)
    off_engine = ctx.engines[off_key]
    ids = [r.request_id for r in requests]
    st.markdown("#### 같은 출력을 몇 스텝에?")
    on_out = [list(r.output_token_ids) for r in requests]
    off_requests = sorted(off_engine.all_requests(), key=lambda r: r.arrival_time)
    off_out = [list(r.output_token_ids) for r in off_requests]
    c1, c2 = st.columns(2)
    c1.metric("켬: 스텝 수", len(on_records))
    c2.metric("끔: 스텝 수", len(off_records))
    evidence(
        "측정값",
        f"켬 {len(on_records)}스텝, 끔 {len(off_records)}스텝 (출력 토큰 켬 "
        f"{sum(map(len, on_out))}개, 끔 {sum(map(len, off_out))}개)",
        k=k,
        요청=len(ids),
    )
    sampled = any(r.sampling_params.temperature > 0 for r in requests)
    result = compare_outputs(on_out, off_out)
    if sampled:
        st.info(
            "temperature > 0 (샘플링)으로 넣은 요청이 있습니다. 추측 디코딩은 출력의 **분포**를 "
            "바꾸지 않지만, 난수를 뽑는 순서가 달라서 같은 seed라도 두 엔진의 글은 다를 수 "
            "있습니다. 토큰 하나하나를 비교하려면 temperature 0(greedy)으로 넣으세요."
        )
    elif result["all_equal"]:
        st.success(
            f"greedy 출력이 토큰 하나하나까지 같습니다: 요청 {result['requests']}개, 비교한 토큰 "
            f"{result['tokens_compared']}개 (두 엔진의 token id를 직접 비교)."
        )
    elif result["first_diff"] is not None:
        i, pos = result["first_diff"]
        if pos >= min(len(on_out[i]), len(off_out[i])):
            st.caption(
                "한쪽이 아직 생성 중입니다. 지금까지 나온 토큰은 같습니다 "
                f"(켬이 한 스텝에 여러 토큰을 내서 앞서 있습니다). 비교한 토큰 "
                f"{result['tokens_compared']}개."
            )
        else:
            st.error(
                f"요청 {i}의 {pos + 1}번째 토큰에서 두 출력이 다릅니다. 같은 greedy 요청에서 이런 "
                "일이 생기면 엔진의 버그입니다."
            )


def speed_section(spec: dict, k: int) -> None:
    st.subheader("속도: 요청 하나일 때와 배치가 꽉 찼을 때")
    st.caption(
        f"같은 요청들을 추측 디코딩을 켜고 끄고 끝까지 돌려 시간을 잽니다: 요청 1개, 그리고 서로 "
        f"다른 요청 {BATCHES[-1]}개를 한꺼번에. 초안 설정은 위 실험실과 같습니다 (k={k})."
    )
    c1, c2 = st.columns([3, 2])
    kind = c1.radio(
        "속도 잴 프롬프트", list(SPEED_KINDS), key=f"{KEY}_speedup_kind", horizontal=True
    )
    max_tokens = c2.slider(
        "출력 토큰 수 (요청마다)", 8, 64, 24, step=8, key=f"{KEY}_speedup_tokens"
    )
    predict(
        SPEED,
        f"요청 {BATCHES[-1]}개를 한꺼번에 돌릴 때, 추측 디코딩을 켜면 끌 때에 비해 다 끝내는 "
        "시간은?",
        options=SPEED_CHOICES,
    )
    if st.button("속도 재기", key=f"{KEY}_speedup_run", type="primary"):
        settings = current_settings()
        need = 8 * -(-(160 + max_tokens + k + 1) // settings.block_size) + 1
        cfg = settings.to_config(num_kv_blocks=max(settings.num_kv_blocks, need))
        bar = Progress(speed_steps(BATCHES, max_tokens))
        runs = measure_speedup(cfg, spec, kind, max_tokens, BATCHES, on_step=bar)
        bar.close()
        st.session_state[SPEED] = {
            "table": speed_table(runs, k),
            "conditions": runs[(BATCHES[-1], True)].conditions,
            "kind": kind,
            "k": k,
            "max_tokens": max_tokens,
        }
    result = st.session_state.get(SPEED)
    if result is None:
        st.info("**속도 재기**를 누르면 배치 1과 배치 8에서 켬·끔을 나란히 잽니다.")
        return
    table = result["table"]
    st.plotly_chart(speed_figure(table), width="stretch", key=f"{KEY}_speedup_fig")
    st.dataframe(display_table(table), hide_index=True, width="stretch")
    cond = dict(result["conditions"])
    cond.pop("배치", None)
    for row in table.to_dict("records"):
        if row["방식"] != "추측 디코딩 켬" or row["속도 향상 (끔 시간 / 켬 시간)"] is None:
            continue
        evidence(
            "측정값",
            f"배치 {row['배치 (요청 수)']}: 속도 향상 {row['속도 향상 (끔 시간 / 켬 시간)']:.2f}배 "
            "(끔 시간 ÷ 켬 시간; 1보다 크면 켬이 빠르고, 작으면 느림), prefill을 뺀 decode "
            f"스텝만으로는 {fmt_value(row['decode만 속도 향상'])}배, "
            f"수락률 {fmt_value(row['수락률 (받아들인 초안 ÷ 초안)'])}, "
            f"α = {fmt_value(row['α (앞이 맞았을 때 맞을 확률)'])}, "
            f"greedy 출력 같음: {fmt_value(row['출력 같음'])}",
            **cond,
            배치=row["배치 (요청 수)"],
            프롬프트=result["kind"],
            k=result["k"],
        )
    big = table[(table["배치 (요청 수)"] == BATCHES[-1]) & (table["방식"] == "추측 디코딩 켬")]
    if len(big):
        ratio = big["속도 향상 (끔 시간 / 켬 시간)"].iloc[0]
        measured = (
            SPEED_CHOICES[0] if ratio > 1.1 else SPEED_CHOICES[2] if ratio < 0.9 else "비슷하다"
        )
        compare(SPEED, measured)
    st.caption(
        "이 숫자는 이 기계에서 잰 것이고, 같은 기계를 다른 일이 함께 쓰면 흔들립니다. 한 번의 "
        "실행 안에서 잰 비율만 읽으세요. 켬·끔의 평균 스텝 시간 차이가 이 기계에서 초안 검증이 "
        "치르는 값입니다. GPU에서 부하가 낮을 때는 decode가 메모리 대역폭에 묶여 있어 남는 "
        "연산으로 초안을 거의 공짜로 검증하므로 이득이 더 크고, 배치가 꽉 차 연산이 병목이 되면 "
        "이득이 줄거나 손해가 됩니다 (아래 보고값)."
    )
    evidence(
        "보고값",
        "낮은 부하에서는 빨라지고(제목: 최대 2.8배), 부하가 높아 배치가 꽉 찬 서버에서는 "
        "오히려 느려질 수 있다",
        source="vLLM 블로그 'How Speculative Decoding Boosts vLLM Performance by up to 2.8x' "
        "(2024-10), vLLM 문서 'Speculative Decoding' (중·저 QPS의 메모리 병목 부하에서 ITL 감소)",
    )
