"""Chapters 04–08 under streamlit.testing.v1.AppTest: each page opens from app.py, its lab's 실행
button drives real engine runs, and the lab's plotly figures are present and carry data.

The session's engine settings point at the tiny test model (the same path the sidebar's model field
takes), so the labs run real engines in seconds; the real model is exercised by the browser test."""

from __future__ import annotations

import pytest
from _apptest import app_fixture, assert_charts

TIMEOUT = 180

PAGES = {
    "04": (
        "pages/ch04_latency_throughput.py",
        ["ch04_run"],
        ["ch04_journey", "ch04_schedule", "ch04_per_request", "ch04_dist"],
    ),
    "05": (
        "pages/ch05_memory_dtype.py",
        ["ch05_run"],
        ["ch05_budget_fig", "ch05_requests_fig", "ch05_measure_fig"],
    ),
    "06": ("pages/ch06_paged_kv.py", ["ch06_run"], ["ch06_compare_fig", "ch06_grid_mid"]),
    "07": (
        "pages/ch07_batching.py",
        ["ch07_run"],
        [
            "ch07_seq_journey",
            "ch07_static_journey",
            "ch07_cont_journey",
            "ch07_static_schedule",
            "ch07_e2e",
            "ch07_throughput",
            "ch07_waste",
        ],
    ),
    "08": (
        "pages/ch08_continuous_batching.py",
        ["ch08_run"],
        ["ch08_on_schedule", "ch08_off_schedule", "ch08_on_kvgrid", "ch08_step_times", "ch08_itl"],
    ),
}


app = app_fixture(timeout=TIMEOUT)


@pytest.mark.parametrize("chapter_id", list(PAGES))
def test_lab_runs_and_draws(app, chapter_id):
    page, buttons, plots = PAGES[chapter_id]
    app.switch_page(page)
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    assert any("실험실" in h.value for h in app.header)
    for key in buttons:
        app.button(key=key).click().run()
        assert not app.exception, (chapter_id, [e.value for e in app.exception])
    assert_charts(app, plots)
    # the quiz (≥ 3 questions) is rendered below the lab
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 3
    # evidence labels are shown
    text = " ".join(m.value for m in app.markdown)
    assert "측정값" in text or "계산값" in text


def test_results_are_cached_across_reruns(app):
    app.switch_page(PAGES["07"][0])
    app.run()
    first = app.session_state["ch07_results"]
    app.run()  # a plain rerun must not recompute
    assert app.session_state["ch07_results"] is first


def test_ch04_runs_accumulate_and_ch08_sliders_drive_runs(app):
    app.switch_page(PAGES["04"][0])
    app.run()
    before = len(app.session_state["ch04_runs"])
    app.slider(key="ch04_seqs").set_value(2).run()
    app.button(key="ch04_run").click().run()
    runs = app.session_state["ch04_runs"]
    assert len(runs) == before + 1 and runs[-1].config.max_num_seqs == 2
    assert_charts(app, ["ch04_history"])

    app.switch_page(PAGES["08"][0])
    app.run()
    app.slider(key="ch08_budget").set_value(128).run()
    app.slider(key="ch08_seqs").set_value(2).run()
    app.button(key="ch08_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    on = app.session_state["ch08_result"].runs["chunked prefill 켬"]
    assert on.config.max_num_batched_tokens == 128 and on.config.max_num_seqs == 2
    assert max(r.total_tokens for r in on.records) <= 128


def test_ch04_states_its_claim_and_draws_honest_axes(app):
    """The default run (the sliders at their defaults): the claim above the lab, r4 and r5 waiting
    in the swimlanes' 대기열 colour, request names on a categorical axis, every magnitude from 0,
    and the run history on two zero-based axes with the legend above the plot."""
    from _apptest import chart

    from ui import figures
    from ui.experiments import ch04

    app.switch_page(PAGES["04"][0])
    app.run()
    assert any(ch04.CLAIM in i.value for i in app.info)
    app.slider(key="ch04_seqs").set_value(ch04.DEFAULT_MAX_NUM_SEQS).run()
    app.button(key="ch04_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    journey = chart(app, "ch04_journey")
    queue = next(t for t in journey["data"] if t["name"] == "대기열")
    assert queue["marker"]["color"] == figures.SEGMENT_COLORS["대기열"]
    assert {"r4", "r5"} <= set(queue["y"])
    assert journey["layout"]["yaxis"]["type"] == "category"
    per_request = chart(app, "ch04_per_request")["layout"]
    assert per_request["xaxis"]["type"] == "category"
    assert per_request["yaxis"]["rangemode"] == "tozero"
    assert per_request["legend"]["y"] > 1 and per_request["legend"]["orientation"] == "h"
    dist = chart(app, "ch04_dist")["layout"]
    assert dist["yaxis"]["rangemode"] == dist["yaxis2"]["rangemode"] == "tozero"
    assert dist["yaxis"].get("type") != "log"
    if len(app.session_state["ch04_runs"]) < 2:  # the history is drawn from the second run on
        app.button(key="ch04_run").click().run()
    history = chart(app, "ch04_history")["layout"]
    assert history["yaxis"]["rangemode"] == history["yaxis2"]["rangemode"] == "tozero"
    assert history["yaxis2"]["overlaying"] == "y" and history["legend"]["y"] > 1


def test_ch04_shows_bench_json_with_its_conditions(app, monkeypatch):
    import engine.tools.bench.results as bench

    fake = {
        "conditions": {
            "date": "2026-01-01T00:00:00+00:00",
            "device": "cpu",
            "device_name": "test-cpu",
            "threads": 2,
            "dtype": "float32",
            "model_name": "tiny",
            "weight_bytes_per_step": 538_000_000,
            "load_before": 2.4,
            "load_after": 3.9,
            "busy": True,
        },
        "ceilings": {"memory_read_gb_s": 20.0, "matmul_gflop_s": {"float32": 100.0}},
        "rooflines": {"decode_tokens_per_s": 20e9 / 538e6},
        "decode_batch1": {
            "tokens_per_s": 20.0,
            "fraction_of_roofline": 0.54,
            "bandwidth_gb_s": 19.9,
            "fraction_of_best_roofline": 0.52,
        },
    }
    monkeypatch.setattr(bench, "load_latest_results", lambda path=None: fake)
    app.switch_page(PAGES["04"][0])
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    text = " ".join(m.value for m in app.markdown)
    assert "20.0 GB/s" in text and "test-cpu" in text and "26.9 ms" in text
    # the batch-1 fraction names the bandwidth it was divided by, and the run's best beside it
    assert "루프라인의 54% (바로 앞뒤에서 잰 대역폭 19.9 GB/s 기준" in text and "52%" in text
    shown = text + " ".join(c.value for c in app.caption)
    assert "부하 평균=2.40→3.90 (바쁨" in shown  # a run under load says so beside each number


def test_ch07_engines_step_in_lockstep(app):
    """One 다음 스텝 advances each of the three engines; 리셋 clears all three."""
    app.switch_page(PAGES["07"][0])
    app.run()
    assert any("이 실험이 보여 줄 것" in i.value and "처리량" in i.value for i in app.info)
    # the late arrivals' gap is set in steps and turned into engine-clock ms with this engine's
    # own decode step (measured once, kept for the session)
    (step_ms,) = app.session_state["ch07_step_ms"].values()
    assert step_ms > 0 and any("늦게 오는 요청 둘의 도착" in m.value for m in app.markdown)
    app.button(key="ch07_load").click().run()
    assert not app.exception, [e.value for e in app.exception]
    keys = ("ch07_seq", "ch07_static", "ch07_cont")
    assert all(len(app.session_state["_records"][k]) == 0 for k in keys)
    app.button(key="ch07_step").click().run()
    assert all(len(app.session_state["_records"][k]) == 1 for k in keys)
    app.number_input(key="ch07_step_count").set_value(3).run()
    app.button(key="ch07_nsteps").click().run()
    assert all(len(app.session_state["_records"][k]) == 4 for k in keys)
    seq = app.session_state["_records"]["ch07_seq"]
    assert all(len(r.scheduled) <= 1 for r in seq)  # sequential: one request at a time
    app.button(key="ch07_reset").click().run()
    assert all(len(app.session_state["_records"][k]) == 0 for k in keys)


def test_ch08_chunking_off_takes_vllms_budget(app):
    """The default run: the off engine's budget is raised to max_model_len (vLLM's rule), so both
    engines take the same four requests and the off one prefills the long prompt in one step."""
    app.switch_page(PAGES["08"][0])
    app.run()
    app.button(key="ch08_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    runs = app.session_state["ch08_result"].runs
    on, off = runs["chunked prefill 켬"], runs["chunked prefill 끔"]
    assert on.config.max_num_batched_tokens == 64
    assert off.config.max_num_batched_tokens == 1024 == off.max_model_len
    assert not on.rejected and not off.rejected and len(on.requests) == len(off.requests) == 4
    long_steps = [s for r in off.records for s in r.scheduled if s.request_id == "긴-프롬프트"]
    assert long_steps[0].num_tokens == 420
    assert any("예산을 1,024토큰" in i.value for i in app.info)
    assert any("이 실험이 보여 줄 것" in i.value and "ITL 최대" in i.value for i in app.info)
    assert not app.warning, [w.value for w in app.warning]


def test_ch08_simulation_switch_runs_the_same_lab_at_8b_scale(app):
    """실행 대상 → 시뮬레이션: the same lab steps a simulated Llama-3.1-8B on an H100 (the real
    scheduler over the cost model), its timings labelled 계산값, and the budget sweep draws the
    TTFT/ITL trade-off from real simulator runs."""
    from ui.simulation import is_simulated

    app.switch_page(PAGES["08"][0])
    app.run()
    app.radio(key="ch08_target").set_value("시뮬레이션").run()
    assert not app.exception, [e.value for e in app.exception]
    app.slider(key="ch08_budget_sim").set_value(1024).run()
    app.button(key="ch08_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    on = app.session_state["ch08_result"].runs["chunked prefill 켬"]
    assert on.config.max_num_batched_tokens == 1024
    assert max(r.total_tokens for r in on.records) <= 1024
    long_prefills = [s for r in on.records for s in r.scheduled if s.request_id == "긴-프롬프트"]
    assert sum(s.num_tokens for s in long_prefills) >= 6000  # the 6,000-token prompt, in chunks
    engines = [e["engine"] for e in app.session_state["_engines"].values()]
    assert any(is_simulated(e) and e.num_blocks > 10_000 for e in engines)  # H100's KV budget
    text = " ".join(m.value for m in app.markdown)
    assert "계산값" in text and "Llama-3.1-8B" in text
    app.slider(key="ch08_sweep_requests").set_value(40).run()
    app.button(key="ch08_sweep_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    (table,) = app.session_state["ch08_sweeps"].values()
    assert list(table["토큰 예산"]) == [256, 512, 1024, 2048, 4096, 8192]
    # the trade-off itself: a larger budget shortens TTFT and lengthens the ITL tail
    assert table["TTFT p50 (ms)"].iloc[-1] < table["TTFT p50 (ms)"].iloc[0]
    assert table["ITL p99 (ms)"].iloc[-1] > table["ITL p99 (ms)"].iloc[0]
    assert_charts(app, ["ch08_sweep_fig", "ch08_on_schedule"])
    app.radio(key="ch08_target").set_value("실제 엔진").run()
    assert not app.exception, [e.value for e in app.exception]


def test_ch07_simulation_switch_compares_the_three_ways_on_a_simulated_gpu(app):
    app.switch_page(PAGES["07"][0])
    app.run()
    app.radio(key="ch07_target").set_value("시뮬레이션").run()
    app.selectbox(key="ch07_sim_model").set_value("llama-3.1-70b").run()
    app.selectbox(key="ch07_sim_hardware").set_value("h200").run()
    # 70B in bfloat16 (141 GB) does not fit one 141 GB H200: a Korean message, no traceback
    assert any("들어가지 않습니다" in e.value for e in app.error)
    app.selectbox(key="ch07_sim_tp").set_value(2).run()
    assert not app.error, [e.value for e in app.error]
    app.button(key="ch07_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    results = app.session_state["ch07_results"]
    assert set(results) == {"순차 실행", "정적 배칭", "continuous batching"}
    assert all(r.conditions["모델 프리셋"] == "Llama-3.1-70B" for r in results.values())
    assert all(len(r.requests) == len(r.specs) for r in results.values())  # everyone finished
    text = " ".join(m.value for m in app.markdown)
    assert "계산값" in text and "H200" in text
    app.radio(key="ch07_target").set_value("실제 엔진").run()


def test_ch05_capacity_simulation_runs_the_calculators_budget(app):
    """② runs the calculator's choice on the simulated engine: more requests than fit at full
    length are admitted, then preempted as they grow (the chapter's common mistake)."""
    app.switch_page(PAGES["05"][0])
    app.run()
    app.slider(key="ch05_sim_requests").set_value(150).run()
    app.button(key="ch05_sim_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    (run,) = app.session_state["ch05_capacity"].values()
    assert run.model == "Llama-3.1-8B" and run.planned_requests > 0
    assert run.peak_running > run.planned_requests and run.preemptions > 0
    assert_charts(app, ["ch05_sim_kv"])
