"""15 · prefill/decode disaggregation and the KV cache's tiers: one engine (colocated) against a
prefill engine and a decode engine (a DisaggregatedPair) in lockstep while a long prompt arrives
among decoding requests; the K/V bytes a request hands over and their time per link; the host
tier's device hit, tier hit and miss; the simulator's P:D sweep."""

import streamlit as st

from engine.entrypoints.disagg import DisaggregatedPair
from ui.experiments.ch15 import LAB_LONG_LEN, LONG_ARRIVAL_STEP, lab_workload
from ui.lab import LabContext, run_workload_button
from ui.lab import lab as engine_lab
from ui.labs.ch15 import (
    bytes_section,
    lab_sides,
    make_feeders,
    predict_split,
    split_view,
    sweep_section,
    tier_section,
)
from ui.lesson import render_chapter
from ui.widgets import show_code


def lab() -> None:
    st.subheader("함께 배치 vs 분리: decode 중에 긴 프롬프트가 도착할 때")
    long_len = st.slider(
        "긴 프롬프트 길이 (토큰)", 64, 900, LAB_LONG_LEN, step=4, key="ch15_long_len"
    )
    workload = lab_workload(long_len)
    note = (
        f"워크로드: 짧은 요청 3개(프롬프트 16토큰, 출력 40토큰씩)가 0 ms에, 긴 프롬프트 "
        f"{long_len}토큰(출력 8토큰)이 짧은 요청들이 decode하는 동안, 각 엔진의 "
        f"{LONG_ARRIVAL_STEP}번째 스텝 전에 도착합니다. 함께 배치는 엔진 하나, "
        "분리는 prefill 엔진(kv_producer)과 decode 엔진(kv_consumer)이 한 채널로 이어진 쌍이며, "
        "세 엔진 모두 한 스텝에 프롬프트 하나를 통째로 계산합니다."
    )
    st.caption(note)
    sides = lab_sides()

    def before(ctx: LabContext) -> None:
        predict_split(ctx)
        run_workload_button(ctx, workload)

    engine_lab(
        "ch15",
        sides,
        presets=None,
        workload=workload,
        workload_note=note,
        before=before,
        chapter_view=split_view,
        show_code_panel=False,
        make_feeders=make_feeders,
    )
    bytes_section(sides[0].key, sides[0].overrides)
    tier_section(sides[0].key, sides[0].overrides)
    sweep_section()
    show_code(
        DisaggregatedPair.step, "prefill 엔진과 decode 엔진을 함께 한 스텝 (요청 넘기기 포함)"
    )


CLAIM = (
    "짧은 요청들이 decode하는 중에 긴 프롬프트가 오면, 함께 배치한 엔진에서는 그 prefill이 "
    "짧은 요청들의 decode와 같은 스텝에 들어가 그 토큰 간격이 늘어나고, 분리한 쪽의 decode "
    "엔진은 프롬프트를 불러오기만 하므로 그런 스텝이 없습니다."
)

render_chapter("15", lab, claim=CLAIM)
