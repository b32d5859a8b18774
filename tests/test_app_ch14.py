"""Chapter 14: the experiment functions (ui/experiments/ch14*.py) against a real in-process server
on 127.0.0.1 with the tiny model, and the page under AppTest (its lab's buttons drive the engine
and the server; the server is shut down and its threads end).

Timings are never asserted: only counts, orders, states and what the server's /metrics says."""

from __future__ import annotations

import threading
import time

import pytest
from _apptest import app_fixture, assert_charts

from ui.experiments import ch14, ch14_client, ch14_load, ch14_server, ch14_stream

PAGE = "pages/ch14_api_server.py"


class SlowSteps:
    """A step listener that makes every engine step take a little longer (so a stream is still
    live when the test disconnects it, and /metrics polls see requests running)."""

    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self, record) -> None:
        time.sleep(self.delay)


@pytest.fixture
def live(make_engine):
    engine = make_engine(num_kv_blocks=32, max_model_len=256, max_num_seqs=4)
    server = ch14_server.start_live_server(engine)
    threads = server.threads
    assert server.alive and server.url.startswith("http://127.0.0.1:")
    yield server
    server.stop()
    assert not any(t.is_alive() for t in threads), "server threads left running"


def prompts(server, n: int = 4, length: int = 12) -> list[list[int]]:
    from ui.experiments.common import prompt_ids

    return [prompt_ids(server.engine, length, i) for i in range(n)]


# -- part 1: prefill fairness ------------------------------------------------------------------


def test_threshold_lets_short_requests_start_in_the_first_step(make_engine):
    from engine.core import EngineCore

    cfg = make_engine().config
    workload = ch14.fairness_workload(200, num_short=3)
    result = ch14.compare_fairness(
        cfg, workload, budget=64, max_num_seqs=4, thresholds=(0, 32), engine_factory=EngineCore
    )
    s = result.summary.set_index("실행")
    off, on = s.loc[ch14.fairness_label(0)], s.loc[ch14.fairness_label(32)]
    # off: the long prompt takes the whole budget until its prefill ends (ceil(200 / 64) = 4)
    assert off["긴 요청 최대 조각 (토큰)"] == 64 and off["짧은 요청이 처음 들어간 스텝"] == 4
    # on: 32 + 3 × 8 = 56 ≤ 64, so the short ones share the first step
    assert on["긴 요청 최대 조각 (토큰)"] == 32 and on["짧은 요청이 처음 들어간 스텝"] == 1
    assert on["긴 요청 prefill 스텝 수"] > off["긴 요청 prefill 스텝 수"]
    for res in result.runs.values():
        assert max(r.total_tokens for r in res.records) <= 64
        assert not res.rejected


def test_direction_and_arrivals():
    assert ch14.direction(50, 100) == "줄어든다"
    assert ch14.direction(100, 95) == "비슷하다"
    assert ch14.direction(200, 100) == "늘어난다"
    assert ch14.direction(None, 1) is None
    a = ch14_load.user_arrivals(5.0, 10, 3.0, seed=1)
    assert a == sorted(a) and 0 < len(a) <= 10 and all(0 < t < 3.0 for t in a)
    assert a == ch14_load.user_arrivals(5.0, 10, 3.0, seed=1)
    assert a != ch14_load.user_arrivals(5.0, 10, 3.0, seed=2)
    assert len(ch14_load.user_arrivals(1000.0, 7, 3.0)) == 7  # the user count caps it
    assert ch14_load.user_arrivals(0, 10, 3.0) == []


def test_parse_metrics_and_histogram_mean():
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 3.0\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 2.0\n'
    )
    m = ch14_server.parse_metrics(text)
    assert m[ch14_server.RUNNING] == 3.0
    assert m[ch14_server.TTFT_HIST + "_bucket{le=0.1}"] == 1.0
    assert ch14_server.histogram_mean({}, m, ch14_server.TTFT_HIST) == pytest.approx(0.25)
    assert ch14_server.histogram_mean(m, m, ch14_server.TTFT_HIST) is None


# -- part 2: the live server -----------------------------------------------------------------


def test_start_is_bound_to_localhost_and_stop_ends_its_threads(make_engine):
    server = ch14_server.start_live_server(make_engine(num_kv_blocks=16))
    threads = server.threads
    m = ch14_server.fetch_metrics(server.url)
    assert m[ch14_server.RUNNING] == 0 and m[ch14_server.KV_USAGE] == 0
    assert server.handle.host == "127.0.0.1"
    server.stop()
    assert not any(t.is_alive() for t in threads) and not server.alive


def test_an_idle_server_stops_itself(make_engine):
    server = ch14_server.start_live_server(make_engine(num_kv_blocks=16), idle_s=0.4)
    threads = server.threads
    assert server.alive
    deadline = time.monotonic() + 20
    while server.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.alive
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    server.stop()  # stopping again is harmless


def test_load_test_measures_every_user_and_polls_the_server(live):
    live.async_llm.step_listeners.append(SlowSteps(0.01))
    ticks = []
    res = ch14_load.run_load_test(
        live.url,
        prompts(live),
        rate=50.0,
        max_users=8,
        duration_s=1.0,
        max_tokens=8,
        prompt_tokens=12,
        drain_s=20.0,
        on_tick=ticks.append,
    )
    assert len(res.clients) == 8 and len(res.completed) == 8
    for c in res.clients:
        assert c.status == 200 and c.finished and not c.cut
        assert c.sent_s >= c.arrival_s - 1e-3
        assert c.chunk_times == sorted(c.chunk_times) and c.first_visible_s <= c.e2e_s
    p = res.percentiles()
    assert p["완료"] == 8 and p["TTFT p50 (ms)"] is not None and p["ITL p90 (ms)"] is not None
    # the server's own histograms saw exactly these requests
    server = res.server_means_ms()
    assert server["TTFT 관측 수"] == 8 and server["E2E 관측 수"] == 8
    # polled /metrics: 8 requests on 4 slots → some ran, some waited, KV was used, then freed
    assert res.samples and max(s.running for s in res.samples) >= 1
    assert max(s.running for s in res.samples) <= 4
    assert max(s.kv_usage for s in res.samples) > 0
    assert res.samples[-1].running == 0 and res.samples[-1].kv_usage == 0
    assert ticks and ticks[-1]["total"] == 8
    assert len(res.request_table()) == 8 and len(res.percentile_table()) == 3


def test_requests_open_at_the_cap_are_cut_and_aborted(live):
    live.async_llm.step_listeners.append(SlowSteps(0.05))
    res = ch14_load.run_load_test(
        live.url, prompts(live), 50.0, 4, duration_s=0.2, max_tokens=200, drain_s=0.5
    )
    assert res.clients and all(c.cut for c in res.clients)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = ch14_server.fetch_metrics(live.url)
        if m[ch14_server.RUNNING] == 0 and m[ch14_server.WAITING] == 0:
            break
        time.sleep(0.05)
    assert m[ch14_server.RUNNING] == 0 and m[ch14_server.KV_USAGE] == 0  # the server aborted them


def test_disconnect_frees_the_blocks(live):
    live.async_llm.step_listeners.append(SlowSteps(0.03))
    stream = ch14_stream.BackgroundStream(
        live.url, ch14_client.request_body(prompts(live, 1, 40)[0], 200, True)
    )
    deadline = time.monotonic() + 20
    while len(stream.chunks) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stream.alive and len(stream.chunks) >= 3
    result = ch14_stream.disconnect_and_watch(live.url, stream)
    assert result.cut and not stream.alive and stream.disconnected and not stream.finished
    assert result.before.running == 1 and result.before.kv_usage > 0
    assert result.after[-1].running == 0 and result.after[-1].kv_usage == 0
    assert result.freed_after_ms is not None
    text = ch14_server.fetch_metrics(live.url)
    aborted = [k for k in text if "request_success" in k]
    assert aborted  # counted under finished_reason="abort" (summed over labels here)


def test_disconnect_at_once_needs_no_chunk_to_arrive(live):
    # a cut must not wait for the next chunk: with 3 s steps the next one is far away
    slow = SlowSteps(3.0)
    live.async_llm.step_listeners.append(slow)
    stream = ch14_stream.BackgroundStream(
        live.url, ch14_client.request_body(prompts(live, 1)[0], 100, True)
    )
    deadline = time.monotonic() + 20
    while (
        ch14_server.fetch_metrics(live.url)[ch14_server.RUNNING] < 1 and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert stream.disconnect(timeout=1.5)  # returns long before the next chunk could arrive
    assert not stream.alive and stream.disconnected and not stream.finished
    slow.delay = 0.0
    while ch14_server.fetch_metrics(live.url)[ch14_server.RUNNING] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ch14_server.fetch_metrics(live.url)[ch14_server.KV_USAGE] == 0


def test_stream_and_nonstream_return_the_same_answer(live):
    table = ch14_stream.stream_vs_nonstream(live.url, prompts(live, 1)[0], 12, repeats=2)
    assert len(table) == 4 and table["_text"].nunique() == 1
    assert set(table["상태"]) == {"완료"}
    streamed = table[table["방식"].str.startswith("스트리밍")]
    whole = table[table["방식"].str.startswith("비스트리밍")]
    # streamed: the first text comes before the end; non-streamed: they are the same moment
    assert (streamed["첫 글자가 보이기까지 (ms)"] <= streamed["전체 답 (E2E, ms)"]).all()
    assert (streamed["조각 수"] > 1).all() and (whole["조각 수"] == 1).all()
    assert (whole["첫 글자가 보이기까지 (ms)"] == whole["전체 답 (E2E, ms)"]).all()
    assert len(ch14_stream.stream_summary(table)) == 2
    assert ch14_stream.stream_e2e_verdict(table) in ch14.CHOICES


def test_stream_verdict_treats_overlapping_ranges_as_similar():
    import pandas as pd

    def table(streamed, whole):
        rows = [{"방식": "스트리밍 (stream=true)", "전체 답 (E2E, ms)": v} for v in streamed]
        rows += [{"방식": "비스트리밍 (stream=false)", "전체 답 (E2E, ms)": v} for v in whole]
        return pd.DataFrame(rows)

    assert ch14_stream.stream_e2e_verdict(table([100, 300, 200], [250, 400, 500])) == "비슷하다"
    assert ch14_stream.stream_e2e_verdict(table([100, 110, 120], [300, 310, 320])) == "줄어든다"
    assert ch14_stream.stream_e2e_verdict(table([300, 310, 320], [100, 110, 120])) == "늘어난다"
    assert ch14_stream.stream_e2e_verdict(table([], [1.0])) is None


def test_latency_vs_load_runs_each_rate(live):
    results = ch14_load.latency_vs_load(
        live.url, prompts(live), [4.0, 1.0], 3, duration_s=1.0, max_tokens=4, drain_s=10.0
    )
    assert [r.rate for r in results] == [1.0, 4.0]
    table = ch14_load.curve_table(results)
    assert list(table["도착률 (요청/s)"]) == [1.0, 4.0]
    assert (table["완료"] == table["요청"]).all()
    assert ch14_load.capacity_estimate(4, 500.0) == pytest.approx(8.0)
    assert ch14_load.capacity_estimate(4, None) is None
    assert ch14_load.capacity_estimate(4, float("nan")) is None


# -- the page under AppTest ----------------------------------------------------------------------


def _stop_live_server(at) -> None:
    """A server the page started and a failed test left running is stopped with the module."""
    live = at.session_state["_ch14_server"] if "_ch14_server" in at.session_state else None
    if live is not None:
        live.stop()


app = app_fixture(PAGE, teardown=_stop_live_server)
XY = ("x", "y")  # this chapter's plots carry data on x or y


def ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]  # the page's own messages for a failure


def test_page_fairness_lab_runs_both_engines(app):
    app.slider(key="ch14_long").set_value(200).run()
    app.button(key="ch14_run").click().run()
    ok(app)
    result = app.session_state["ch14_fair_result"]
    s = result.summary.set_index("실행")
    assert s.loc["임계값 32", "짧은 요청이 처음 들어간 스텝"] == 1
    assert s.loc["임계값 끔 (0)", "짧은 요청이 처음 들어간 스텝"] > 1
    assert_charts(
        app, ["ch14_off_schedule", "ch14_on_schedule", "ch14_on_kvgrid", "ch14_fair_ttft"], XY
    )


def test_page_live_server_measures_and_stops(app):
    app.slider(key="ch14s_users").set_value(4).run()
    app.slider(key="ch14s_duration").set_value(1).run()
    app.slider(key="ch14s_max_tokens").set_value(4).run()
    app.slider(key="ch14s_prompt_len").set_value(16).run()
    app.button(key="ch14s_start").click().run()
    ok(app)
    live = app.session_state["_ch14_server"]
    assert live.alive
    app.button(key="ch14s_start").click().run()  # idempotent: the same server
    assert app.session_state["_ch14_server"] is live

    app.button(key="ch14s_load").click().run()
    ok(app)
    assert app.session_state["_ch14_server"] is live
    res = app.session_state["_ch14_load"]
    assert res.clients and all(c.status == 200 for c in res.clients)
    assert_charts(app, ["ch14_live", "ch14_ttft_scatter", "ch14_chunks"], XY)

    app.multiselect(key="ch14s_rates").set_value([1.0, 4.0]).run()
    app.button(key="ch14s_curve").click().run()
    ok(app)
    assert [r.rate for r in app.session_state["_ch14_curve"]] == [1.0, 4.0]
    assert_charts(app, ["ch14_curve"], XY)

    app.button(key="ch14s_streamcmp").click().run()
    ok(app)
    assert app.session_state["_ch14_streamcmp"]["_text"].nunique() == 1
    assert_charts(app, ["ch14_stream"], XY)

    app.button(key="ch14s_stream_start").click().run()
    ok(app)
    app.button(key="ch14s_disconnect").click().run()
    ok(app)
    result = app.session_state["_ch14_disconnect"]
    assert result.after and result.after[-1].running == 0 and result.after[-1].kv_usage == 0
    assert_charts(app, ["ch14_disconnect_fig"], XY)
    stream = app.session_state["_ch14_stream"]
    assert not stream.alive

    threads = live.threads
    app.button(key="ch14s_stop").click().run()
    ok(app)
    assert "_ch14_server" not in app.session_state
    assert not any(t.is_alive() for t in threads)
    assert not [t for t in threading.enumerate() if t.name == "ch14-stream" and t.is_alive()]
