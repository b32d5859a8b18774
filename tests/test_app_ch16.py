"""Chapter 16 (structured outputs) under streamlit.testing.v1.AppTest on the tiny model: the lab's
실행 steps both real engines (one request under the grammar, the same request free) to the end,
the per-step tables appear (allowed tokens, top tokens before and after the mask, the removed
probability, the mask time), the schema view marks the output's position, the kinds switch (a
choice constraint), 다음 스텝 advances both engines, and 파싱 성공률 재기 counts valid outputs."""

from __future__ import annotations

import pytest

pytest.importorskip("streamlit")
from _apptest import app_fixture, no_exception  # noqa: E402

from ui.experiments.ch16 import PRESETS  # noqa: E402

PAGE = "pages/ch16_structured_outputs.py"
app = app_fixture(PAGE)


def button(at, label: str):
    return next(b for b in at.button if b.label == label)


def frames(at) -> list:
    return [df.value for df in at.dataframe]


def test_run_steps_both_engines_and_shows_the_mask_per_step(app):
    at = app
    assert any("같은 요청, 문법 제약 있음·없음" in s.value for s in at.subheader)
    button(at, "실행").click().run()
    no_exception(at)
    tables = frames(at)
    on = next(t for t in tables if "허용 토큰 수" in t.columns)
    assert len(on) > 0
    assert {"마스크 전 상위 5", "마스크 후 상위 5", "마스크가 지운 확률"} <= set(on.columns)
    assert all(0 <= v <= 1 for v in on["마스크가 지운 확률"])
    assert all(int(v.split(" / ")[0].replace(",", "")) < 2048 for v in on["허용 토큰 수"])
    off = next(
        t for t in tables if "마스크 전 상위 5" in t.columns and "허용 토큰 수" not in t.columns
    )
    assert len(off) > 0
    labels = [m.label for m in at.metric]
    assert "마스크가 지운 확률 (최대)" in labels and "허용 토큰 수 (최소 … 최대)" in labels
    texts = " ".join(m.value for m in at.markdown)
    assert "측정값" in texts and "계산값" in texts


def test_choice_kind_and_next_step(app):
    at = app
    at.radio(key="ch16_kind").set_value("선택지").run()
    no_exception(at)
    assert at.selectbox(key="ch16_constraint").value.startswith("감정")
    button(at, "리셋").click().run()
    button(at, "예시 요청 추가").click().run()
    button(at, "다음 스텝").click().run()
    button(at, "다음 스텝").click().run()
    no_exception(at)
    on = next(t for t in frames(at) if "허용 토큰 수" in t.columns)
    assert len(on) >= 1  # the prefill step samples the first token under the choice grammar
    first = on["허용 토큰 수"].iloc[0]
    assert int(first.split(" / ")[0].replace(",", "")) <= 3 * 8  # the choices' first tokens


def test_parse_rate_counts_valid_outputs(app):
    at = app
    at.radio(key="ch16_kind").set_value("JSON 스키마").run()
    at.slider(key="ch16_parse_n").set_value(1).run()
    at.slider(key="ch16_parse_tokens").set_value(16).run()
    button(at, "파싱 성공률 재기").click().run()
    no_exception(at)
    labels = {m.label: m.value for m in at.metric}
    assert labels["말로만 부탁"].endswith("/ 1") and labels["제약을 걸어서"].endswith("/ 1")


def test_schema_marks_the_property_being_written(app):
    """Stepped one step at a time, the person schema's outline marks the property whose value the
    constrained output is writing (the key path of the partial JSON)."""
    at = app
    at.radio(key="ch16_kind").set_value("JSON 스키마").run()
    at.selectbox(key="ch16_constraint").set_value(next(iter(PRESETS))).run()
    button(at, "리셋").click().run()
    button(at, "예시 요청 추가").click().run()
    marked = []
    for _ in range(40):  # the random tiny model spends steps on JSON whitespace
        button(at, "다음 스텝").click().run()
        no_exception(at)
        marked += [m.value for m in at.markdown if "▶ name" in m.value or "▶ age" in m.value]
        if marked:
            break
    assert marked, [c.value for c in at.code if c.language == "text"][:2]
