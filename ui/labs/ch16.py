"""Chapter 16's lab parts (Streamlit): a constrained and a free request side by side (the shared
lab steps both engines), each step's mask facts with the schema position marked, and the parse
rate of the same prompts with and without the constraint. What they compute is in
ui/experiments/ch16.py."""

from __future__ import annotations

import json

import streamlit as st

from ui.experiments.ch16 import (
    DEFAULT_MAX_TOKENS,
    PRESETS,
    TOP,
    Preset,
    mask_summary,
    parse_rate,
    schema_outline,
    schema_path,
    step_rows,
    step_table,
    vocab_mask_bytes,
)
from ui.lab import LabContext, Progress, Side, add_prompt, reset_lab, run_steps, set_playing
from ui.predict import compare, predict
from ui.session import current_settings
from ui.widgets import evidence

KEY = "ch16"
SIDE_KEYS = {"제약 있음": "ch16_constrained", "제약 없음": "ch16_free"}
PARSE = "ch16_parse"
ALLOWED = "ch16_allowed"


def sides(preset: Preset) -> list[Side]:
    """Two engines of the same settings; only the first side's requests carry the grammar. Both
    ask for the per-step report (the top tokens before and after the mask)."""
    report = {"report_top_tokens": TOP}
    return [
        Side(
            SIDE_KEYS["제약 있음"],
            "제약 있음",
            request_params={"structured_outputs": preset.params(), **report},
        ),
        Side(SIDE_KEYS["제약 없음"], "제약 없음", request_params=report),
    ]


def predict_allowed(ctx: LabContext, vocab: int) -> None:
    predict(
        ALLOWED,
        f"제약 있는 요청의 첫 출력 스텝에서, 어휘 {vocab:,}개 중 마스크가 허용하는 토큰은 몇 "
        "개일까요?",
        unit="개",
        step=1,
        locked=ctx.started,
    )


def run_button(ctx: LabContext, preset: Preset) -> None:
    """Both engines fresh, the preset's prompt on each, run to the end."""
    if not st.button(
        "실행",
        key=f"{KEY}_run",
        type="primary",
        help="두 엔진을 새로 만들고, 고른 제약의 프롬프트를 양쪽에 넣어 끝까지 실행합니다 "
        "(한 스텝씩 보려면 예시 요청 추가 → 다음 스텝)",
    ):
        return
    set_playing(KEY, False)
    reset_lab(ctx)
    max_tokens = int(st.session_state.get(f"{KEY}_max_tokens", DEFAULT_MAX_TOKENS))
    add_prompt(ctx, preset.prompt, max_tokens=max_tokens)
    run_steps(ctx, None)


def constraint_view(preset: Preset, path: list | None) -> None:
    """The constraint, with the property the output is writing now marked (JSON schema)."""
    if preset.kind == "json":
        here = tuple(schema_path(path or []))
        lines = []
        for depth, text, prop in schema_outline(preset.spec):
            pad = "&nbsp;" * 4 * depth
            if prop == here:
                lines.append(f"{pad}:orange-background[**▶ {text}**]")
            elif here[: len(prop)] == prop:
                lines.append(f"{pad}**{text}**")
            else:
                lines.append(f"{pad}{text}")
        st.markdown("  \n".join(lines))
        with st.expander("JSON 스키마 원문"):
            st.code(json.dumps(preset.spec, indent=2, ensure_ascii=False), language="json")
    elif preset.kind == "regex":
        st.code(preset.spec, language="text")
    else:
        st.markdown(" · ".join(f"`{c}`" for c in preset.spec))


def chapter_view(ctx: LabContext, preset: Preset) -> None:
    on_key, off_key = SIDE_KEYS["제약 있음"], SIDE_KEYS["제약 없음"]
    engine = ctx.engines[on_key]
    vocab = engine.model_config.vocab_size
    requests = sorted(engine.all_requests(), key=lambda r: r.arrival_time)
    free_requests = sorted(ctx.engines[off_key].all_requests(), key=lambda r: r.arrival_time)
    st.markdown("#### 스텝마다 마스크가 한 일")
    if not requests or not ctx.records(on_key):
        st.markdown("**제약**")
        constraint_view(preset, None)
        st.info(
            "**실행**을 누르거나, 예시 요청을 추가하고 **다음 스텝**을 누르면 여기에 스텝마다 "
            f"허용된 토큰 수, 마스크 전과 후의 상위 {TOP}개 토큰과 확률, 마스크가 지운 확률, "
            "마스크 계산 시간이 나옵니다."
        )
        return
    rows = step_rows(ctx.records(on_key), engine.tokenizer, requests[0].request_id)
    free_rows = []
    if free_requests:
        free_rows = step_rows(
            ctx.records(off_key), ctx.engines[off_key].tokenizer, free_requests[0].request_id
        )
    c1, c2 = st.columns([2, 3])
    with c1:
        st.markdown("**제약** (지금 쓰는 자리: ▶)")
        constraint_view(preset, rows[-1].path if rows else None)
    with c2:
        st.markdown("**지금까지의 출력**")
        st.code(rows[-1].text if rows else "", language="text")
        if free_rows:
            st.caption("제약 없는 쪽의 출력")
            st.code(free_rows[-1].text, language="text")
    _tables(rows, free_rows, engine.tokenizer, vocab)
    _summary(ctx, rows, vocab, preset)


def _tables(rows, free_rows, tokenizer, vocab: int) -> None:
    left, right = st.columns(2)
    with left:
        st.markdown("**제약 있음: 스텝마다**")
        table = step_table(rows, tokenizer, vocab, masked=True)
        st.dataframe(table, hide_index=True, width="stretch", key=f"{KEY}_table_on")
    with right:
        st.markdown("**제약 없음: 스텝마다**")
        st.dataframe(
            step_table(free_rows, tokenizer, vocab, masked=False),
            hide_index=True,
            width="stretch",
            key=f"{KEY}_table_off",
        )
    st.caption(
        "확률은 모델 분포(logits의 softmax, temperature 1) 기준입니다. 마스크 후 확률은 허용된 "
        "토큰끼리 다시 나눠 합이 1이 되게 한 값이고, '마스크가 지운 확률'은 1 − (허용된 토큰들의 "
        "마스크 전 확률 합)입니다. ␣는 공백, \\n은 줄바꿈입니다."
    )


def _summary(ctx: LabContext, rows, vocab: int, preset: Preset) -> None:
    if not rows:
        return
    facts = mask_summary(rows)
    cond = dict(요청="제약 있는 첫 요청", 제약=preset.kind, 어휘=f"{vocab:,}")
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("허용 토큰 수 (최소 … 최대)", f"{facts['min_allowed']:,} … {facts['max_allowed']:,}")
    c2.metric("마스크가 지운 확률 (최대)", f"{facts['max_removed']:.3f}")
    c3.metric("1위 토큰이 바뀐 스텝", f"{facts['forced_steps']} / {facts['steps']}")
    c4.metric("마스크 시간 (평균 ms)", f"{facts['mean_mask_ms']:.2f}")
    evidence(
        "측정값",
        f"출력 스텝 {facts['steps']}개: 허용 토큰 {facts['min_allowed']:,}…"
        f"{facts['max_allowed']:,}개, 마스크가 지운 확률 평균 {facts['mean_removed']:.3f} · 최대 "
        f"{facts['max_removed']:.3f}, 마스크 때문에 1위 토큰이 바뀐 스텝 "
        f"{facts['forced_steps']}개, "
        f"마스크 계산 평균 {facts['mean_mask_ms']:.2f} ms · 최대 {facts['max_mask_ms']:.2f} ms "
        "(스케줄러 안에서 잰 시간, 이 기계의 CPU)",
        **cond,
    )
    evidence(
        "계산값",
        f"마스크 하나는 {vocab_mask_bytes(vocab):,}바이트입니다: 토큰마다 1비트, 32비트 단어 "
        f"{-(-vocab // 32):,}개. 스텝마다 요청마다 어휘 전체에 대해 한 번 만듭니다.",
        formula="4 × ⌈어휘 크기 / 32⌉",
    )
    compare(ALLOWED, rows[0].num_allowed, "개", fmt="{:,.0f}")


def parse_section(label: str) -> None:
    """The same prompts asked in words only and under the constraint: how many outputs are
    valid. A small live version of the lesson's measurement."""
    preset = PRESETS[label]
    st.subheader("부탁만 하면 몇 개나 맞을까: 파싱 성공률")
    c1, c2 = st.columns(2)
    n = c1.slider("프롬프트 수", 1, len(preset.subjects), 2, key=f"{KEY}_parse_n")
    max_tokens = c2.slider("출력 토큰 수 (요청마다)", 16, 64, 40, step=8, key=f"{KEY}_parse_tokens")
    st.caption(
        f"같은 요청 {n}개(주제만 다름)를 말로만 부탁한 것과 제약을 건 것, 모두 {2 * n}개를 한 "
        "배치로 greedy 실행하고, 출력이 제약을 만족하는지(JSON이면 파싱 후 스키마 검증) 셉니다."
    )
    if st.button("파싱 성공률 재기", key=f"{KEY}_parse_run", type="primary"):
        bar = Progress(max_tokens + 2)
        run = parse_rate(
            current_settings().to_config(),
            label,
            preset.prompts(n),
            max_tokens,
            on_step=bar,
        )
        bar.close()
        st.session_state[PARSE] = run
    run = st.session_state.get(PARSE)
    if run is None or run.preset_label != label:
        st.info("**파싱 성공률 재기**를 누르면 위에서 고른 제약으로 잽니다.")
        return
    c1, c2 = st.columns(2)
    c1.metric("말로만 부탁", f"{run.free_ok} / {run.num_prompts}")
    c2.metric("제약을 걸어서", f"{run.constrained_ok} / {run.num_prompts}")
    evidence(
        "측정값",
        f"유효한 출력: 말로만 {run.free_ok}/{run.num_prompts}, 제약 {run.constrained_ok}/"
        f"{run.num_prompts} ({run.steps}스텝, {run.wall_s:.1f} s)",
        **run.conditions,
    )
    with st.expander("출력 보기"):
        for free, constrained in zip(run.free_texts, run.constrained_texts):
            st.markdown("말로만:")
            st.code(free, language="text")
            st.markdown("제약:")
            st.code(constrained, language="text")
