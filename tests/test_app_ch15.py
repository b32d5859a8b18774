"""Chapter 15 (prefill/decode disaggregation, the host KV tier): the page under Streamlit's
AppTest on the tiny model, and the experiment functions of ui/experiments/ch15.py: the K/V bytes
of a request from the model config, the time over each link preset."""

from __future__ import annotations

import pytest
from _apptest import app_fixture, assert_charts

from engine.tools.presets import load_link_preset
from ui.experiments import ch15

PAGE = "pages/ch15_disaggregation.py"


def test_kv_bytes_follow_the_formula_and_links_divide_them():
    kv = ch15.KVBytes(num_layers=24, num_kv_heads=4, head_dim=64, dtype_bytes=2, tokens=100)
    assert kv.per_token == 24 * 2 * 4 * 64 * 2 == 24_576
    assert kv.total == 2_457_600  # the quiz's number
    assert f"{kv.total:,}" in kv.formula()
    rows = ch15.link_rows(kv.total)
    times = list(rows["예상 전송 시간 (ms, 계산값)"])
    assert times == sorted(times), "fastest link first"
    nvlink = load_link_preset("nvlink")
    assert times[0] == pytest.approx(1e3 * nvlink.transfer_seconds(kv.total), abs=1e-3)


app = app_fixture()


def test_page_runs_and_shows_bytes_with_their_evidence(app):
    app.switch_page(PAGE)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    app.slider(key="ch15_bytes_tokens").set_value(400).run()
    assert not app.exception, [e.value for e in app.exception]
    text = " ".join(m.value for m in app.markdown)
    assert "계산값" in text and "제조사 문서" in text
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 3


def test_tier_experiment_runs_on_the_page(app):
    app.switch_page(PAGE)
    app.run()
    app.radio(key="predict_ch15_tier").set_value("장치 < 계층 < 못 찾음").run()
    app.button(key="ch15_tier_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    cases = app.session_state["ch15_tier"]
    assert [c.case for c in cases] == list(ch15.TIER_CASES)
    assert cases[1].tier_hit_tokens > 0 and cases[1].load_bytes > 0  # the worker side copied
    assert cases[0].output_token_ids == cases[1].output_token_ids == cases[2].output_token_ids
    text = " ".join(m.value for m in app.markdown)
    assert "계층의 숫자" in text and "예측 ↔ 측정" in text


def test_lab_steps_the_real_pair_and_compares(app):
    app.switch_page(PAGE)
    app.run()
    assert any("이 실험이 보여 줄 것" in i.value for i in app.info)
    app.slider(key="ch15_long_len").set_value(200).run()
    app.radio(key="predict_ch15_split").set_value("함께 배치만").run()
    app.button(key="ch15_load").click().run()  # 워크로드 넣기
    for _ in range(3):
        app.button(key="ch15_step").click().run()  # 다음 스텝: all three engines, lockstep
    assert not app.exception, [e.value for e in app.exception]
    records = app.session_state["_records"]
    assert all(records[k] for k in ("ch15_colocated", "ch15_prefill", "ch15_decode"))
    app.button(key="ch15_run").click().run()  # 실행: reload and run to the end
    assert not app.exception, [e.value for e in app.exception]
    feeders = app.session_state["_lab_feeders"]
    driver = feeders["ch15_prefill"].driver
    assert {t.request_id for t in driver.transfers} == {"짧은-0", "짧은-1", "짧은-2", "긴-프롬프트"}
    pair = driver.pair
    assert pair.prefill is app.session_state["_engines"]["ch15_prefill"]["engine"]
    assert pair.decode is app.session_state["_engines"]["ch15_decode"]["engine"]
    runs = app.session_state["ch15_result"]
    assert len(runs) == 3
    assert_charts(
        app, ["ch15_crossing", "ch15_itl", "ch15_colocated_journey", "ch15_decode_journey"]
    )
    text = " ".join(m.value for m in app.markdown)
    assert "예측 ↔ 측정" in text and "측정값" in text


def test_pd_sweep_names_the_best_split(app):
    app.switch_page(PAGE)
    app.run()
    app.slider(key="ch15_sweep_total").set_value(3).run()
    app.button(key="ch15_sweep_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    sweep = app.session_state["ch15_sweep"]
    assert sweep.total_gpus == 3 and sweep.best in ("1:2", "2:1")
    assert_charts(app, ["ch15_sweep_fig"])
    text = " ".join(m.value for m in app.markdown)
    assert f"P:D {sweep.best}" in text and "계산값" in text and "제조사 문서" in text
