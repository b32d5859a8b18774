"""Chapter 13 (speculative decoding): the experiment functions of ui/experiments/ch13.py on the tiny
model, and the page under streamlit.testing.v1.AppTest: the lab's 실행 runs both engines (n-gram
drafts on and off) to the end, the draft grid and the formula figure carry data, the greedy outputs
are reported equal, 다음 스텝 advances both engines, 속도 재기 measures batch 1 and a full batch,
and the sidebar's settings turn speculative decoding on for every engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("streamlit")
from _apptest import app_fixture, chart  # noqa: E402

from ui.experiments import ch13  # noqa: E402
from ui.session import SETTINGS_KEY, EngineSettings, validate_settings  # noqa: E402

PAGE = "pages/ch13_speculative_decoding.py"
TIMEOUT = 240
SPEC = ch13.spec_config(3, 3, 1)
# Text that repeats itself, so the tiny model's context has n-grams to look up.
REPEATING = "one two three four one two three four one two three four one two three"


# -- the experiment functions ------------------------------------------------------------------


def test_expected_tokens_per_step_is_leviathans_formula():
    assert ch13.expected_tokens_per_step(0.8, 3) == pytest.approx(2.952)
    assert ch13.expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    assert ch13.expected_tokens_per_step(0.0, 5) == 1.0
    assert ch13.expected_tokens_per_step(1.0, 3) == 4.0
    # the sum 1 + a + ... + a^k, and the limit 1 / (1 - a) as k grows
    a, k = 0.37, 6
    assert ch13.expected_tokens_per_step(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    assert ch13.expected_tokens_per_step(0.5, 200) == pytest.approx(2.0)


def test_alpha_counts_only_the_positions_the_verifier_judged():
    """vLLM's acceptance rate divides by every draft; Leviathan et al.'s alpha is the chance a
    position is accepted given the ones before it were, so the drafts behind a rejection (never
    judged) are left out. Steps: 1 of 3 accepted, 3 of 3, 0 of 2."""
    stats = ch13.SpecStats(3, 0, 0, 0, 0, 0, 0, [], [0] * 3, [0] * 3)
    for drafts, accepted in ((3, 1), (3, 3), (2, 0)):
        ch13._count_verify_step(stats, drafts, accepted)
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    assert stats.alpha == pytest.approx(4 / 6)
    assert stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert (stats.accepted_per_pos, stats.reached_per_pos) == ([2, 1, 1], [3, 2, 1])
    assert stats.formula == pytest.approx(
        (2 * ch13.expected_tokens_per_step(4 / 6, 3) + ch13.expected_tokens_per_step(4 / 6, 2)) / 3
    )
    # the quote example of the lesson: about 1.5 accepted per step is alpha ≈ 0.7, 2.5 tokens
    assert ch13.expected_tokens_per_step(0.7, 3) == pytest.approx(2.533)
    assert ch13.speedup_estimate(0.7, 3, 0.0) == pytest.approx(2.533)
    assert ch13.speedup_estimate(0.7, 3, 0.05) == pytest.approx(2.533 / 1.15)


def test_spec_config_is_accepted_by_the_engine_and_keeps_min_below_max():
    from engine.spec_decode import SpeculativeConfig

    cfg = ch13.spec_config(4, 2, 5)
    assert cfg["prompt_lookup_min"] == 2 and cfg["num_speculative_tokens"] == 4
    assert SpeculativeConfig.from_value(cfg).prompt_lookup_max == 2


def test_compare_outputs_finds_the_first_difference():
    same = ch13.compare_outputs([[1, 2, 3], [4]], [[1, 2, 3], [4]])
    assert same["all_equal"] and same["tokens_compared"] == 4 and same["first_diff"] is None
    diff = ch13.compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert not diff["all_equal"] and diff["first_diff"] == (1, 1) and diff["equal_requests"] == 1
    shorter = ch13.compare_outputs([[1, 2]], [[1, 2, 3]])  # one side still generating
    assert not shorter["all_equal"] and shorter["first_diff"] == (0, 2)


def test_prompts_that_repeat_are_marked():
    assert ch13.REPEATING and all("(반복)" in label for label in ch13.REPEATING)
    assert "1. " in ch13.PROMPTS["목록 그대로 옮기기 (반복)"]
    assert ch13.list_prompt(3) == ch13.list_prompt(3) != ch13.list_prompt(4)
    assert len(set(ch13.speed_prompts(list(ch13.SPEED_KINDS)[1], 8))) == 8


@pytest.fixture(scope="module")
def spec_run(tiny_model_dir):
    from engine.config import EngineConfig

    cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    on = ch13.run_prompts(replace(cfg, speculative_config=SPEC), [REPEATING, "hello"], 24, "on")
    off = ch13.run_prompts(cfg, [REPEATING, "hello"], 24, "off")
    return on, off


def test_greedy_outputs_are_equal_with_and_without_drafts(spec_run):
    on, off = spec_run
    assert [len(o) for o in on.outputs] == [24, 24]
    assert ch13.compare_outputs(on.outputs, off.outputs)["all_equal"]
    stats = ch13.spec_stats(on.records, 3)
    assert stats.verify_steps > 0, "the repeating prompt must give drafts"
    # fewer steps exactly when drafts were accepted
    assert len(on.records) < len(off.records) or stats.accepted == 0


def test_spec_stats_agree_with_the_engine_counters(spec_run):
    on, _ = spec_run
    stats = ch13.spec_stats(on.records, 3)
    proposed = sum(len(s.draft_token_ids) for r in on.records for s in r.scheduled)
    accepted = sum(s.num_accepted_tokens for r in on.records for s in r.scheduled)
    assert (stats.proposed, stats.accepted) == (proposed, accepted)
    assert stats.acceptance_rate == pytest.approx(accepted / proposed)
    assert stats.tokens_per_verify_step == pytest.approx(1 + accepted / stats.verify_steps)
    rejected = sum(
        0 < len(s.draft_token_ids) != s.num_accepted_tokens for r in on.records for s in r.scheduled
    )
    assert stats.alpha == pytest.approx(accepted / (accepted + rejected))
    assert stats.formula_at_k == pytest.approx(ch13.expected_tokens_per_step(stats.alpha, 3))
    # every decode token of the run is counted: outputs minus the first token of each prefill
    assert stats.decode_tokens == sum(map(len, on.outputs)) - len(on.outputs)
    assert ch13.spec_stats(on.records, 3, "r1").proposed <= stats.proposed


def test_draft_table_rows_follow_the_records(spec_run, tiny_tokenizer):
    on, _ = spec_run
    table = ch13.draft_table(on.records, tiny_tokenizer)
    verified = [(r.step, s) for r in on.records for s in r.scheduled if s.draft_token_ids]
    assert len(table) == len(verified)
    for row, (step, s) in zip(table.to_dict("records"), verified):
        assert row["스텝"] == step and row["초안 수"] == len(s.draft_token_ids)
        assert row["받아들임"] == s.num_accepted_tokens <= row["초안 수"]
        assert row["이 스텝 토큰"] == s.num_accepted_tokens + 1
        assert row["모델 토큰 종류"] == ("보너스" if row["받아들임"] == row["초안 수"] else "교정")
        assert row["모델 토큰"] == ch13.token_text(tiny_tokenizer, s.bonus_token_id)
    fig = ch13.draft_grid_figure(table, 3)
    z = fig.data[0].z
    assert len(z) == min(len(table), 16) and all(len(r) == 4 for r in z)
    for zrow, row in zip(z, table.tail(16).to_dict("records")):
        accepted = [v for v in zrow[:3] if v == ch13.ACCEPTED]
        assert len(accepted) == row["받아들임"] and zrow[3] == ch13.MODEL_TOKEN


def test_token_text_shows_blanks_and_newlines(tiny_tokenizer):
    newline = tiny_tokenizer.encode("\n")[-1]
    assert "↵" in ch13.token_text(tiny_tokenizer, newline)
    assert ch13.token_text(tiny_tokenizer, None) == ""


def test_speedup_table_compares_the_same_requests(tiny_model_dir):
    from engine.config import EngineConfig

    cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=96, max_model_len=256)
    steps = []
    kind = list(ch13.SPEED_KINDS)[0]
    runs = ch13.measure_speedup(cfg, SPEC, kind, 6, batches=(1, 3), on_step=steps.append)
    assert set(runs) == {(1, False), (1, True), (3, False), (3, True)}
    assert len(steps) == sum(len(r.records) for r in runs.values())
    assert runs[(3, True)].config.speculative_config == SPEC
    assert runs[(3, False)].config.speculative_config is None
    table = ch13.speed_table(runs, 3)
    assert list(table["방식"]) == ["추측 디코딩 끔", "추측 디코딩 켬"] * 2
    on_rows = table[table["방식"] == "추측 디코딩 켬"]
    assert list(on_rows["출력 같음"]) == [True, True]
    for (batch, on), run in runs.items():
        assert run.output_tokens == 6 * batch
    big = on_rows[on_rows["배치 (요청 수)"] == 3].iloc[0]
    assert big["속도 향상 (끔 시간 / 켬 시간)"] == pytest.approx(
        runs[(3, False)].elapsed_s / runs[(3, True)].elapsed_s, abs=0.01
    )
    assert big["decode만 속도 향상"] == pytest.approx(
        ch13.decode_seconds(runs[(3, False)].records)
        / ch13.decode_seconds(runs[(3, True)].records),
        abs=0.01,
    )
    prefill_steps = [
        r for r in runs[(3, True)].records if any(s.phase != "decode" for s in r.scheduled)
    ]
    assert (
        prefill_steps and ch13.decode_seconds(runs[(3, True)].records) < runs[(3, True)].elapsed_s
    )
    shown = ch13.display_table(table)
    assert all(isinstance(v, str) for v in shown.to_numpy().ravel())
    assert set(shown["출력 같음"]) <= {"예", "—"}
    fig = ch13.speed_figure(table)
    assert [t.name for t in fig.data] == ["추측 디코딩 끔", "추측 디코딩 켬"]


def test_formula_figure_marks_the_measured_point(spec_run):
    on, _ = spec_run
    stats = ch13.spec_stats(on.records, 3)
    fig = ch13.formula_figure(3, stats)
    point = fig.data[-1]
    assert point.x[0] == pytest.approx(stats.alpha)
    assert point.y[0] == pytest.approx(stats.tokens_per_verify_step)
    curve = next(t for t in fig.data if t.name.startswith("공식 k=3"))
    assert curve.y[0] == pytest.approx(1.0) and max(curve.y) < 4.0


# -- the settings ------------------------------------------------------------------------------


def test_settings_carry_speculative_decoding_into_the_engine_config():
    off = EngineSettings()
    assert off.speculative_config() is None and off.to_config().speculative_config is None
    on = EngineSettings(speculative_method="ngram", num_speculative_tokens=5, prompt_lookup_max=4)
    assert on.to_config().speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    # a page's own override still wins
    assert on.to_config(speculative_config=None).speculative_config is None
    bad = EngineSettings(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    _, note, ok = validate_settings(bad)
    assert not ok and "n-gram 최소" in note


# -- the page ----------------------------------------------------------------------------------


app = app_fixture(PAGE, TIMEOUT)


def no_errors(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_page_opens_with_its_lab_and_quiz(app):
    assert any("실험실" in h.value for h in app.header)
    no_errors(app)
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 4
    labels = {s.label for s in app.slider}
    assert {"추측 토큰 수 k (num_speculative_tokens)", "출력 토큰 수 (요청마다)"} <= labels
    assert "목록 그대로 옮기기 (반복)" in app.selectbox(key="ch13_preset").options


def test_run_drives_both_engines_and_shows_drafts(app):
    app.switch_page(PAGE)
    app.selectbox(key="ch13_preset").set_value("목록 그대로 옮기기 (반복)").run()
    app.button(key="ch13_run").click().run()
    no_errors(app)
    records = app.session_state["_records"]
    on, off = records["ch13_on"], records["ch13_off"]
    assert on and off
    assert any(s.draft_token_ids for r in on for s in r.scheduled)
    assert not any(s.draft_token_ids for r in off for s in r.scheduled)
    for key in ("ch13_on_schedule", "ch13_off_schedule", "ch13_on_kvgrid"):
        assert chart(app, key)["data"]
    grid = chart(app, "ch13_drafts")["data"][0]
    assert grid["type"] == "heatmap" and grid["z"] and grid["text"]
    formula = chart(app, "ch13_formula")["data"]
    assert any(t.get("name", "").startswith("측정") for t in formula)
    assert any("토큰 하나하나까지 같습니다" in s.value for s in app.success)
    text = " ".join(m.value for m in app.markdown)
    assert "측정값" in text and "계산값" in text and "α = " in text


def test_next_step_advances_both_engines(app):
    app.switch_page(PAGE)
    app.button(key="ch13_reset").click().run()
    app.button(key="ch13_add_preset").click().run()
    no_errors(app)
    records = app.session_state["_records"]
    assert len(records["ch13_on"]) == len(records["ch13_off"]) == 0
    for n in (1, 2, 3):
        app.button(key="ch13_step").click().run()
        records = app.session_state["_records"]
        assert len(records["ch13_on"]) == len(records["ch13_off"]) == n
    no_errors(app)


def test_k_slider_changes_the_speculating_engine(app):
    app.switch_page(PAGE)
    app.slider(key="ch13_k").set_value(5).run()
    app.button(key="ch13_run").click().run()
    no_errors(app)
    engine = app.session_state["_engines"]["ch13_on"]["engine"]
    assert engine.config.speculative_config["num_speculative_tokens"] == 5
    on = app.session_state["_records"]["ch13_on"]
    assert max(len(s.draft_token_ids) for r in on for s in r.scheduled) <= 5
    app.slider(key="ch13_k").set_value(3).run()


def test_speed_comparison_measures_batch_1_and_a_full_batch(app):
    app.switch_page(PAGE)
    app.slider(key="ch13_speedup_tokens").set_value(8).run()
    app.button(key="ch13_speedup_run").click().run()
    no_errors(app)
    result = app.session_state["ch13_speedup"]
    table = result["table"]
    assert sorted(set(table["배치 (요청 수)"])) == list(ch13.BATCHES)
    assert len(table) == 2 * len(ch13.BATCHES)
    assert all(table[table["방식"] == "추측 디코딩 켬"]["출력 같음"])
    assert set(table["출력 토큰"]) == {8 * b for b in ch13.BATCHES}
    bars = chart(app, "ch13_speedup_fig")["data"]
    assert len(bars) == 2 and all(t["y"] for t in bars)
    text = " ".join(m.value for m in app.markdown)
    assert "속도 향상" in text and "보고값" in text


def test_sidebar_turns_speculation_on(app):
    app.switch_page(PAGE)
    app.selectbox(key="cfg_spec_method").set_value("ngram (prompt lookup)")
    app.number_input(key="cfg_spec_k").set_value(2)
    app.button(key="cfg_apply").click().run()
    no_errors(app)
    settings = app.session_state[SETTINGS_KEY]
    assert settings.speculative_method == "ngram" and settings.num_speculative_tokens == 2
    assert settings.to_config().speculative_config["num_speculative_tokens"] == 2
    # and back off, so the other tests of this module see the defaults
    app.selectbox(key="cfg_spec_method").set_value("끔")
    app.button(key="cfg_apply").click().run()
    assert app.session_state[SETTINGS_KEY].speculative_config() is None
