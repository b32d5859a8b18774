"""10 · prefix caching: requests that share a beginning (a system prompt, a growing chat), run with
the prefix cache on and off side by side; then the hash chain of one request, LRU eviction in a
small cache and cache_salt isolation, each measured on a fresh engine."""

import streamlit as st

from engine.kv_cache import KVCacheManager
from ui.errors import show_error
from ui.experiments.ch10 import (
    CHAT,
    DEFAULT_GAP_MS,
    DEFAULT_REQUESTS,
    LAB_BUDGET,
    LAB_MAX_TOKENS,
    QUESTIONS,
    SCENARIOS,
    prefix_workload,
)
from ui.lab import LabContext, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch10 import chain_section, lab_sides, lru_section, salt_section, summary_view
from ui.lesson import render_chapter
from ui.predict import predict
from ui.session import current_settings, get_engine
from ui.widgets import show_code


def lab() -> None:
    st.subheader("같은 앞부분을 가진 요청들: prefix caching 켬·끔")
    c1, c2, c3 = st.columns(3)
    scenario_label = c1.radio("시나리오", list(SCENARIOS), key="ch10_scenario", horizontal=True)
    scenario = SCENARIOS[scenario_label]
    n = c2.slider("질문·턴 수", 2, min(len(QUESTIONS), len(CHAT)), DEFAULT_REQUESTS, key="ch10_n")
    gap = c3.slider(
        "도착 간격 (ms)",
        0,
        3000,
        int(DEFAULT_GAP_MS[scenario]),
        step=50,
        key=f"ch10_gap_{scenario}",
        help="요청 i는 i × 간격(엔진 시계)에 도착합니다. 0이면 모두 같은 스텝에 들어옵니다.",
    )
    sides = lab_sides()
    try:
        tokenizer = get_engine(sides[0].key, **sides[0].overrides).tokenizer
    except Exception as exc:  # noqa: BLE001
        show_error(exc, "엔진을 만들 수 없습니다")
        return
    workload = prefix_workload(tokenizer, scenario, n, float(gap), LAB_MAX_TOKENS)
    lens = [s.prompt_len for s in workload.requests]
    what = (
        "같은 시스템 프롬프트 뒤에 질문 하나씩"
        if scenario == "shared"
        else "턴마다 앞 턴 전체(질문과 답) + 새 질문; 답은 미리 정한 문장으로 대신함"
    )
    note = (
        f"워크로드: 요청 {n}개 ({what}), 프롬프트 {', '.join(map(str, lens))}토큰, 출력 "
        f"{LAB_MAX_TOKENS}토큰씩, {gap} ms 간격으로 도착 (엔진 시계). 두 엔진 모두 토큰 예산 "
        f"{LAB_BUDGET}, 같은 설정에서 prefix caching만 다릅니다."
    )
    st.caption(note)

    def before(ctx: LabContext) -> None:
        predict(
            "ch10_hit",
            "prefix caching을 켠 엔진의 전체 히트율(캐시에서 찾은 토큰 ÷ 조회한 프롬프트 토큰)은 "
            "몇 %일까요?",
            unit="%",
            step=5.0,
            locked=ctx.started,
        )
        run_workload_button(ctx, workload)

    engine_lab(
        "ch10",
        sides,
        presets=None,
        workload=workload,
        workload_note=note,
        before=before,
        chapter_view=summary_view,
        show_code_panel=False,
    )
    block_size = current_settings().block_size
    chain_section(block_size)
    lru_section(block_size)
    salt_section(block_size)
    show_code(KVCacheManager.get_computed_blocks, "prefix 캐시를 찾는 코드 (요청이 들어올 때)")


CLAIM = (
    "같은 시스템 프롬프트로 시작하는 질문 네 개를 보내면, prefix caching을 켠 엔진은 두 번째 "
    "질문부터 그 앞부분 블록을 캐시에서 찾아(히트) 계산을 건너뛰므로, 뒤 질문들의 TTFT가 끈 "
    "엔진보다 짧아집니다."
)

render_chapter("10", lab, claim=CLAIM)
