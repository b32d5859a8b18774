"""Chapter 09 · 선점과 스케줄링 정책.

Unit tests of ui/experiments/ch09.py on the tiny model (who is preempted, where the victim waits,
what recompute and swap cost, what each policy does to the waiting times), and the page under
streamlit.testing.v1.AppTest: the burst lab stepped to its first preemption and run to the end,
then the policy comparison run once."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest
from _apptest import app_fixture, assert_charts

from engine.request import RequestStatus
from ui.experiments import ch09
from ui.experiments.common import WorkloadFeeder, run_workload

PAGE = "pages/ch09_preemption.py"
TIMEOUT = 240
RECOMPUTE, SWAP = list(ch09.PREEMPTION_MODES)
FCFS, PRIORITY, STATIC = list(ch09.POLICIES)
XY = ("x", "y")  # this chapter's plots carry data on x or y (no z-only heatmap counts)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return {"model": str(tiny_model_dir), "device": "cpu"}


@pytest.fixture(scope="module")
def burst(base):
    """The default burst (5 requests × (24 + 24) tokens) on 8 blocks, recompute and swap."""
    return ch09.run_burst(base, num_kv_blocks=8, num_requests=5, max_tokens=24)


@pytest.fixture(scope="module")
def policies(base):
    return ch09.run_policies(base, num_kv_blocks=8, max_num_seqs=3, max_tokens=24)


# -- workloads and configs -----------------------------------------------------------------------


def test_workloads_arrive_together_in_order():
    w = ch09.burst_workload(4, 16)
    assert w.names() == ["A", "B", "C", "D"]
    assert {s.arrival_ms for s in w.requests} == {0.0}
    assert all(s.prompt_len == ch09.PROMPT_LEN and s.max_tokens == 16 for s in w.requests)
    p = ch09.policy_workload(12)
    assert p.names() == ["A-p2", "B-p1", "C-p0", "D-p2", "E-p1", "F-p0"]
    assert [s.priority for s in p.requests] == ch09.POLICY_PRIORITIES


def test_config_is_a_small_cache_without_prefix_caching(base):
    cfg = ch09.preemption_config(base, 6, mode="swap", policy="priority", num_swap_blocks=3)
    assert (cfg.num_kv_blocks, cfg.max_model_len, cfg.num_swap_blocks) == (6, 96, 3)
    assert not cfg.enable_prefix_caching and cfg.scheduling_policy == "priority"
    assert ch09.preemption_config(base, 6, num_swap_blocks=3).num_swap_blocks is None
    assert set(ch09.overrides_of(cfg)) == set(ch09.FIELDS)


def test_blocks_needed_is_derived_per_request():
    # (24 + 24 - 1) = 47 tokens → 3 blocks of 16, five requests
    assert ch09.blocks_needed(ch09.burst_workload(5, 24)) == 15
    assert ch09.blocks_needed(ch09.burst_workload(2, 8)) == 2 * 2  # 31 tokens → 2 blocks


# -- who is preempted, and where it waits ------------------------------------------------------


def test_newest_running_request_is_preempted_first_and_waits_at_the_head(base):
    """A-D fill the 8 blocks, E waits; when A needs a third block, D (the newest running, not E)
    is preempted, then C for B. Both go back in front of E, the older one first."""
    from engine.core import EngineCore

    engine = EngineCore(ch09.preemption_config(base, 8))
    feeder = WorkloadFeeder(engine, ch09.burst_workload(5, 24))
    records = []
    while not any(r.preempted for r in records):
        records.append(feeder.step())
    assert records[-1].preempted == ["D", "C"]
    assert ch09.first_victim(records) == "D"
    queue = ch09.waiting_queue(engine)
    assert list(queue["요청"]) == ["C", "D", "E"]
    assert list(queue["상태"]) == ["선점됨 → 재개 대기", "선점됨 → 재개 대기", "새 요청"]
    assert list(queue["K/V 보관"]) == ["없음 (재계산)", "없음 (재계산)", "—"]
    victim = engine.scheduler.requests["D"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert "D" not in records[-1].kv.block_tables  # its blocks left the grid
    events = ch09.preemption_events(records)
    assert list(events["선점된 요청"]) == ["D", "C"] and set(events["방식"]) == {"재계산"}


def test_recompute_costs_tokens_and_swap_costs_copies(burst):
    costs = burst.costs.set_index("실행")
    rec, swp = costs.loc[RECOMPUTE], costs.loc[SWAP]
    assert rec["선점 횟수"] >= 2 and rec["재계산 토큰"] > 0 and rec["스왑 아웃 블록"] == 0
    assert swp["선점 횟수"] >= 2 and swp["재계산 토큰"] == 0
    assert swp["스왑 아웃 블록"] == swp["스왑 인 블록"] > 0
    assert swp["스왑 복사 시간 (ms)"] > 0 and rec["재계산 시간 (ms, 추정)"] > 0
    # the same useful work either way: every prompt and output token computed once
    useful = sum(s.prompt_len + s.max_tokens - 1 for s in ch09.burst_workload(5, 24).requests)
    assert rec["유용한 토큰"] == swp["유용한 토큰"] == useful
    ratio = 100 * rec["재계산 토큰"] / rec["유용한 토큰"]
    assert rec["재계산 / 유용한 토큰 (%)"] == pytest.approx(ratio, abs=0.05)
    per = ch09.swap_cost_per_block(burst.runs)
    assert per[SWAP]["copy_ms_per_block"] > 0 and per[SWAP]["recompute_ms_per_token"] is None
    assert per[RECOMPUTE]["recompute_ms_per_token"] > 0


def test_preemption_does_not_change_the_output(base, burst):
    """Greedy outputs are the same whether a request was preempted (either mode) or never was."""
    roomy = run_workload(ch09.preemption_config(base, 32), ch09.burst_workload(5, 24))
    assert sum(r.num_preemptions for r in roomy.requests) == 0
    want = {r.request_id: r.output_token_ids for r in roomy.requests}
    for res in burst.runs.values():
        assert {r.request_id: r.output_token_ids for r in res.requests} == want


def test_a_full_swap_space_falls_back_to_recompute(base):
    result = ch09.run_burst(base, 8, 5, 24, modes={SWAP: "swap"}, num_swap_blocks=0)
    row = result.costs.iloc[0]
    assert row["선점 횟수"] > 0 and row["스왑 아웃 블록"] == 0 and row["재계산 토큰"] > 0


def test_recompute_seconds_splits_step_time_by_tokens(burst):
    res = burst.runs[RECOMPUTE]
    rec = next(r for r in res.records if r.num_recomputed_tokens)
    share = rec.engine_duration * rec.num_recomputed_tokens / rec.total_tokens
    assert 0 < share <= rec.engine_duration
    assert ch09.recompute_seconds([rec]) == pytest.approx(share)
    assert ch09.recompute_seconds(burst.runs[SWAP].records) == 0


# -- policies ------------------------------------------------------------------------------------


def test_policies_pick_different_victims(policies):
    """FCFS preempts the newest running request (C-p0, the most important one); priority
    preempts the least important running one."""
    fcfs = ch09.preemption_events(policies.runs[FCFS].records)
    prio = ch09.preemption_events(policies.runs[PRIORITY].records)
    assert fcfs["선점된 요청"].iloc[0] == "C-p0"
    assert prio["선점된 요청"].iloc[0] == "B-p1"


def test_priority_serves_the_important_first(policies):
    waits = policies.waits
    s = policies.summary.set_index("정책")
    col = "우선순위 0 대기 평균 (ms)"
    assert s.loc[PRIORITY, col] < s.loc[FCFS, col]
    assert s.loc[PRIORITY, "우선순위 2 대기 평균 (ms)"] > s.loc[PRIORITY, col]
    prio = waits[waits["정책"] == PRIORITY].set_index("요청")
    table = policies.runs[PRIORITY].request_table().set_index("request_id")
    # the two p0 requests (and the first p1) are admitted in step 1, ahead of earlier arrivals
    assert set(table.index[table["first_step"] == 1]) == {"C-p0", "F-p0", "B-p1"}
    assert prio["대기 시간 (ms)"].idxmax() in {"A-p2", "D-p2"}
    # static batching admits nobody new until the whole first batch is done
    static = policies.runs[STATIC].request_table().set_index("request_id")
    first_batch_done = static.loc[["A-p2", "B-p1", "C-p0"], "finish_step"].max()
    assert static.loc[["D-p2", "E-p1", "F-p0"], "first_step"].min() > first_batch_done


def test_waits_add_the_time_after_a_preemption(policies):
    for res in policies.runs.values():
        waits = ch09.request_waits(res).set_index("요청")
        table = res.request_table().set_index("request_id")
        for rid in waits.index:
            queue = table.loc[rid, "queue_ms"]
            if table.loc[rid, "preemptions"] == 0:
                assert waits.loc[rid, "대기 시간 (ms)"] == pytest.approx(queue, abs=1e-6)
            else:
                assert waits.loc[rid, "대기 시간 (ms)"] > queue


def test_figures_carry_data(burst, policies):
    import pandas as pd

    history = pd.DataFrame(
        [
            {
                "KV 블록": 8,
                "요청 수": 5,
                "출력 토큰": 24,
                "선점 횟수": 3,
                "재계산 / 유용한 토큰 (%)": 40.0,
            },
            {
                "KV 블록": 12,
                "요청 수": 5,
                "출력 토큰": 24,
                "선점 횟수": 1,
                "재계산 / 유용한 토큰 (%)": 13.6,
            },
        ]
    )
    figures = [
        ch09.token_cost_figure(burst.costs),
        ch09.swap_vs_recompute_figure(burst.costs),
        ch09.thrash_figure(history),
        ch09.fairness_figure(policies.waits),
        ch09.policy_latency_figure(policies.waits),
    ]
    for fig in figures:
        assert isinstance(fig, go.Figure) and fig.data and fig.layout.title.text
    fair = ch09.fairness_figure(policies.waits)
    assert [t.name for t in fair.data] == list(ch09.POLICIES)
    assert list(ch09.thrash_figure(history).data[0].x) == [8, 12]
    again = pd.concat([history, history.assign(**{"출력 토큰": 16})], ignore_index=True)
    lines = ch09.thrash_figure(again).data
    assert [t.name for t in lines] == ["요청 5개 · 출력 16토큰", "요청 5개 · 출력 24토큰"]


# -- the page ------------------------------------------------------------------------------------


app = app_fixture(PAGE, TIMEOUT)


def test_page_burst_lab_steps_to_the_preemption_and_runs(app):
    assert any("실험실" in h.value for h in app.header)
    # the claim above the lab names what the default run shows (asserted in test_claims_ch07_10)
    assert any("이 실험이 보여 줄 것" in i.value and "D부터" in i.value for i in app.info)
    app.radio(key="predict_ch09_victim").set_value("E").run()
    app.button(key="ch09_load").click().run()
    app.number_input(key="ch09_step_count").set_value(10).run()
    app.button(key="ch09_nsteps").click().run()
    assert not app.exception, [e.value for e in app.exception]
    records = app.session_state["_records"]["ch09_one"]
    assert records[-1].preempted == ["D", "C"]
    queues = [df.value for df in app.dataframe if "K/V 보관" in df.value.columns]
    assert queues and list(queues[0]["요청"]) == ["C", "D", "E"]
    app.button(key="ch09_to_end").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert_charts(app, ["ch09_one_journey", "ch09_one_kvgrid", "ch09_cost", "ch09_thrash"], XY)
    result = app.session_state["ch09_result_burst"]
    assert result.costs.iloc[0]["재계산 토큰"] > 0
    assert len(app.session_state["ch09_history"]) == 1
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["내 예측"] == "E" and metrics["측정값"] == "D"
    text = " ".join(m.value for m in app.markdown)
    assert "측정값" in text and "계산값" in text
    assert sum(1 for m in app.markdown if m.value.startswith("**문제 ")) >= 4


def test_page_policy_comparison_runs_three_engines(app):
    app.radio(key="ch09_exp").set_value("③ FCFS vs 우선순위 vs 정적").run()
    app.button(key="ch09_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert_charts(app, ["ch09_fairness", "ch09_policy_e2e", "ch09_fcfs_journey"], XY)
    result = app.session_state["ch09_result_policy"]
    assert list(result.runs) == list(ch09.POLICIES)
    assert {r.config.scheduling_policy for r in result.runs.values()} == {
        "fcfs",
        "priority",
        "static",
    }
    assert any("예측 ↔ 측정" in m.value for m in app.markdown)


def test_page_recompute_vs_swap_and_a_full_swap_space(app):
    app.radio(key="ch09_exp").set_value("② 재계산 vs 스왑").run()
    app.button(key="ch09_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert_charts(app, ["ch09_swap_cost", "ch09_cost2", "ch09_swap_kvgrid"], XY)
    costs = app.session_state["ch09_result_swap"].costs.set_index("실행")
    assert costs.loc[SWAP, "스왑 아웃 블록"] > 0 and costs.loc[SWAP, "재계산 토큰"] == 0
    assert any("블록 하나(= 16토큰) 복사" in m.value for m in app.markdown)
    app.slider(key="ch09_swap_blocks").set_value(0).run()
    app.button(key="ch09_run").click().run()
    costs = app.session_state["ch09_result_swap"].costs.set_index("실행")
    assert costs.loc[SWAP, "스왑 아웃 블록"] == 0 and costs.loc[SWAP, "재계산 토큰"] > 0
    assert any("재계산으로 처리했습니다" in w.value for w in app.warning)


def test_page_policy_comparison_in_simulation_keeps_the_decisions(app):
    """실행 대상 → 시뮬레이션: the same small KV cache and arrivals on a simulated Llama-3.1-8B
    on an H100: the scheduler decides exactly as on the real engine (same victims), only the
    step times are computed (labelled 계산값)."""
    from ui.simulation import is_simulated

    app.radio(key="ch09_exp").set_value("③ FCFS vs 우선순위 vs 정적").run()
    app.button(key="ch09_run").click().run()
    real = app.session_state["ch09_result_policy"]
    real_preempted = {k: [r.preempted for r in res.records] for k, res in real.runs.items()}
    app.radio(key="ch09_target").set_value("시뮬레이션").run()
    app.button(key="ch09_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    sim = app.session_state["ch09_result_policy"]
    assert sim is not real
    keys = {f"ch09_{policy}" for policy in ch09.POLICIES.values()}
    engines = [e["engine"] for k, e in app.session_state["_engines"].items() if k in keys]
    assert engines and all(is_simulated(e) for e in engines)
    assert {k: [r.preempted for r in res.records] for k, res in sim.runs.items()} == real_preempted
    assert all(r.conditions["모델 프리셋"] == "Llama-3.1-8B" for r in sim.runs.values())
    app.radio(key="ch09_target").set_value("실제 엔진").run()
    assert not app.exception, [e.value for e in app.exception]
