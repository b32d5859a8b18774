"""13 · speculative decoding: n-gram drafts verified in one forward, stepped side by side with the
same engine without speculation; acceptance rate against the formula, outputs compared token for
token, and the speed of the same requests at batch 1 and at a full batch."""

import streamlit as st

from engine.sample.rejection_sampler import verify_greedy
from engine.spec_decode import NgramProposer
from ui.experiments.ch13 import (
    DEFAULT_MAX_TOKENS,
    PROMPTS,
    REPEATING,
    expected_tokens_per_step,
    spec_config,
)
from ui.lab import LabContext
from ui.lab import lab as engine_lab
from ui.labs.ch13 import KEY, chapter_view, run_button, sides, speed_section
from ui.lesson import render_chapter
from ui.predict import predict
from ui.session import current_settings
from ui.widgets import show_code

CLAIM = (
    "기본 프롬프트(목록 그대로 옮기기)의 답은 프롬프트의 목록을 되풀이합니다. 그래서 n-gram "
    "초안이 받아들여져 초안을 검증한 스텝 하나가 평균 1개보다 많은 토큰을 내고, 추측 디코딩을 "
    "끈 엔진과 토큰 하나까지 같은 출력을 절반도 안 되는 스텝에 냅니다."
)


def lab() -> None:
    st.subheader("같은 요청, 추측 디코딩 켬·끔")
    settings = current_settings()
    c1, c2, c3 = st.columns(3)
    k = c1.slider(
        "추측 토큰 수 k (num_speculative_tokens)",
        1,
        8,
        min(max(settings.num_speculative_tokens, 1), 8),
        key=f"{KEY}_k",
    )
    lookup_max = c2.slider(
        "n-gram 최대 길이 (prompt_lookup_max)",
        1,
        5,
        min(max(settings.prompt_lookup_max, 1), 5),
        key=f"{KEY}_lookup_max",
    )
    lookup_min = c3.slider(
        "n-gram 최소 길이 (prompt_lookup_min)",
        1,
        5,
        min(max(settings.prompt_lookup_min, 1), 5),
        key=f"{KEY}_lookup_min",
    )
    if lookup_min > lookup_max:
        st.warning(
            f"n-gram 최소 길이({lookup_min})가 최대 길이({lookup_max})보다 커서, 최소를 "
            f"{lookup_max}로 맞춰 씁니다."
        )
    spec = spec_config(k, lookup_max, lookup_min)
    st.caption(
        "두 엔진은 같은 설정이고, 한쪽만 n-gram 초안을 씁니다. 예시 프롬프트 중 '(반복)'이 붙은 "
        f"것({len(REPEATING)}개)은 답이 프롬프트를 되풀이합니다. 한 번의 **다음 스텝**이 두 엔진을 "
        "함께 한 스텝씩 진행합니다."
    )

    def before(ctx: LabContext) -> None:
        predict(
            f"{KEY}_tps",
            f"고른 예시 프롬프트(처음엔 '목록 그대로 옮기기')에서 추측 디코딩을 켜면 (k={k}), "
            "초안을 검증한 스텝 하나에 평균 "
            f"몇 토큰이 나올까요? (공식의 최댓값은 k+1 = {k + 1}, α=0.5면 "
            f"{expected_tokens_per_step(0.5, k):.2f})",
            unit="토큰/스텝",
            step=0.25,
            locked=ctx.started,
        )
        run_button(ctx)

    engine_lab(
        KEY,
        sides(spec),
        presets=PROMPTS,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        before=before,
        chapter_view=lambda ctx: chapter_view(ctx, k),
        show_code_panel=False,
    )
    show_code(NgramProposer.propose, "방금 실행된 코드 (n-gram 초안 찾기)")
    show_code(verify_greedy, "방금 실행된 코드 (greedy 검증)")
    speed_section(spec, k)


render_chapter("13", lab, claim=CLAIM)
