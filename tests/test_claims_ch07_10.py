"""Chapters 07–10: each lab's claim (render_chapter(..., claim=...)) holds for its DEFAULT workload,
on the real engine (the default SmolLM2 artifact, @slow) and, where the lab has the switch, on the
simulator with the page's default presets (Llama-3.1-8B on an H100 SXM). The runs go through the
same ui/experiments helpers the pages use, with the pages' default sliders (the constants they
read), and each test also checks that the number the page's predict → compare box shows is the
quantity its question asks about.

Timing claims are read on the engine clock (measured step durations, or the cost model's); the
workloads are built so the effect is large (≥ 1.3× on the CPU, more in simulation; ch07's
throughput, which depends on the CPU, is the exception stated at its test) and the engines of
one comparison step in lockstep, so a busy machine slows them alike."""

from __future__ import annotations

import math

import pytest

from engine.kv_cache import KVSnapshot
from ui.experiments import ch07, ch08, ch09, ch10, common
from ui.session import EngineSettings
from ui.simulation import DEFAULT_HARDWARE, DEFAULT_MODEL_PRESET, build_simulated_engine

SIM_SPEC = {
    "model_preset": DEFAULT_MODEL_PRESET,
    "hardware": DEFAULT_HARDWARE,
    "tensor_parallel_size": 1,
}
MODES = [pytest.param("real", marks=pytest.mark.slow), "sim"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Real-engine steps on one thread: on this shared 2-core machine two OpenMP threads per
    step spin against the other processes and single steps stretch 10x at random (a 4-token
    decode step measured 250-1,800 ms), which a worst-ITL statistic cannot absorb. One thread
    keeps each step's time proportional to its work (ui/registry.py does the same per click)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sim_factory(spec: dict):
    return lambda config: build_simulated_engine(spec, config)


def _setup(mode: str, request, spec: dict | None = None):
    """(sidebar settings, engine factory) of one mode: the real model, or the simulator."""
    if mode == "sim":
        return EngineSettings(), sim_factory(spec or SIM_SPEC)
    return EngineSettings(model=str(request.getfixturevalue("default_model_dir"))), None


# -- 07 · continuous batching beats static batching on throughput --------------------------------


def step_costs(results: dict) -> str:
    """Each mode's throughput and its median step time per (requests in the step, kind): what a
    failed throughput claim needs to be read on a machine nobody can log into."""
    from conftest import machine_line

    lines = [machine_line()]
    for label, res in results.items():
        table = res.step_table().groupby(["num_requests", "kind"])["duration_ms"]
        shapes = ", ".join(
            f"{rows}×{kind} {int(n)}× {ms:.1f} ms"
            for (rows, kind), (n, ms) in table.agg(["count", "median"]).iterrows()
        )
        lines.append(f"{label}: {res.throughput:.1f} tokens/s, {res.elapsed_s:.2f} s; {shapes}")
    return "\n".join(lines)


@pytest.mark.parametrize("mode", MODES)
def test_ch07_continuous_batching_has_the_highest_throughput(mode, request):
    settings, factory = _setup(mode, request)
    base = settings.to_config(enable_prefix_caching=False)  # the page's _sides
    batch = ch07.DEFAULT_BATCH
    step_ms = ch07.decode_step_ms(
        ch07.batching_config(base, "continuous batching", batch), batch, factory
    )
    assert step_ms > 0
    late_ms = ch07.late_arrival_ms(ch07.DEFAULT_LATE_STEPS, step_ms)
    workload = ch07.batching_workload(ch07.DEFAULT_REQUESTS, late_ms)
    results = ch07.compare_batching(base, workload, batch, engine_factory=factory)
    if mode == "real":  # the faster of two runs per mode (see below)
        again = ch07.compare_batching(base, workload, batch, engine_factory=factory)
        results = {k: min(r, again[k], key=lambda x: x.elapsed_s) for k, r in results.items()}
    seq, static, cont = results.values()
    for res in results.values():  # nobody refused, everyone finished
        assert not res.rejected and len(res.requests) == len(workload.requests)
        assert res.output_tokens == sum(s.max_tokens for s in workload.requests)
    # the late requests arrived while static batching's first batch still ran (they waited)
    assert ch07.batch_waste(static)["blocked_request_steps"] > 0
    assert len(cont.records) <= 0.6 * len(static.records)
    # The claim is "highest"; by how much depends on how a step's time grows with its rows,
    # which is the CPU's: continuous batching takes ~half the steps (asserted above), and its
    # steps hold more rows. One thread on a Zen 4 VM: 1.54-1.59x; CI's machine of 2026-12-07
    # measured 1.11x with longer prompts (docs/performance.md). A burst of load while all
    # three run slows continuous batching's whole run and only part of static batching's, so
    # each mode keeps the faster of two runs (as a benchmark keeps its best repeat).
    margin = 1.05 if mode == "real" else 1.6
    assert cont.throughput >= margin * static.throughput, step_costs(results)
    assert cont.throughput > seq.throughput
    # the compare box: the method with the highest throughput in the summary table
    summary = ch07.batching_summary(results)
    assert summary.loc[summary["처리량 (토큰/s)"].idxmax(), "방식"] == "continuous batching"


# -- 08 · chunked prefill lowers the decoding requests' worst ITL --------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_ch08_chunked_prefill_lowers_the_worst_itl(mode, request):
    settings, factory = _setup(mode, request)
    d = ch08.REAL_DEFAULTS if mode == "real" else ch08.SIM_DEFAULTS
    # the page's _sides: max_model_len per mode, 64 blocks on the CPU, the GPU's budget simulated
    blocks = max(settings.num_kv_blocks, d.max_model_len // settings.block_size)
    base = settings.to_config(
        max_model_len=d.max_model_len, num_kv_blocks=blocks if mode == "real" else None
    )
    workload = ch08.long_prompt_workload(d.long_prompt_len, long_arrival_ms=d.long_arrival_ms)
    cmp = ch08.compare_chunked_prefill(
        base, workload, d.budget, d.max_num_seqs, engine_factory=factory
    )
    on, off = cmp.runs[ch08.ON], cmp.runs[ch08.OFF]
    # both engines accept the same requests: the off side's budget covers max_model_len
    assert off.config.max_num_batched_tokens == d.max_model_len
    for res in (on, off):
        assert not res.rejected and len(res.requests) == len(workload.requests)
    assert max(r.total_tokens for r in on.records) <= d.budget
    assert max(r.total_tokens for r in off.records) > d.long_prompt_len  # prefilled whole
    worst_on, worst_off = ch08.worst_itl(cmp.summary)
    # the box's value is the short (decoding) requests' largest inter-token gap
    for res, worst in ((on, worst_on), (off, worst_off)):
        itl = res.itl_samples_ms()
        short = itl[itl["request_id"] != ch08.LONG_NAME]["itl_ms"]
        assert math.isclose(worst, round(short.max(), 1), abs_tol=0.051)
    assert worst_on * 2 <= worst_off, (worst_on, worst_off)
    assert ch08.itl_change(worst_on, worst_off) == "줄어든다"


def test_ch08_budget_sweep_figure_is_zero_based_with_the_legend_clear():
    import pandas as pd

    table = pd.DataFrame(
        {
            "토큰 예산": [256, 512, 1024],
            "TTFT p50 (ms)": [900.0, 700.0, 650.0],
            "TTFT p90 (ms)": [1500.0, 1200.0, 1100.0],
            "ITL p50 (ms)": [30.0, 31.0, 33.0],
            "ITL p99 (ms)": [40.0, 60.0, 95.0],
        }
    )
    fig = ch08.budget_sweep_figure(table).to_dict()
    layout = fig["layout"]
    assert layout["yaxis"]["rangemode"] == "tozero" and layout["yaxis2"]["rangemode"] == "tozero"
    legend = layout["legend"]
    assert legend["orientation"] == "h" and legend["y"] < 0  # under the plot, not over its ticks
    assert layout["xaxis"]["tickvals"] == [256, 512, 1024]
    assert {t["name"] for t in fig["data"]} == set(table.columns[1:])


# -- 09 · the default burst preempts, newest running first ---------------------------------------


def _sim_spec_ch09() -> dict:
    return {**SIM_SPEC, "num_kv_blocks": ch09.DEFAULT_BLOCKS}  # the page's small cache


@pytest.mark.parametrize("mode", MODES)
def test_ch09_default_burst_preempts_the_newest_running_request(mode, request):
    settings, factory = _setup(mode, request, _sim_spec_ch09())
    result = ch09.run_burst(
        settings.to_config(),
        ch09.DEFAULT_BLOCKS,
        ch09.DEFAULT_REQUESTS,
        ch09.DEFAULT_MAX_TOKENS,
        modes={"재계산 · KV 8블록": "recompute"},
        engine_factory=factory,
    )
    (res,) = result.runs.values()
    workload = ch09.burst_workload(ch09.DEFAULT_REQUESTS, ch09.DEFAULT_MAX_TOKENS)
    assert ch09.blocks_needed(workload) > ch09.DEFAULT_BLOCKS
    assert res.num_blocks == ch09.DEFAULT_BLOCKS
    assert not res.rejected and all(r.finish_reason == "length" for r in res.requests)
    row = result.costs.iloc[0]
    assert row["선점 횟수"] >= 1 and row["재계산 토큰"] > 0
    assert ch09.first_victim(res.records) == "D"  # what the compare box shows


@pytest.mark.parametrize("mode", MODES)
def test_ch09_default_policies_preempt_and_priority_serves_p0_first(mode, request):
    settings, factory = _setup(mode, request, _sim_spec_ch09())
    result = ch09.run_policies(
        settings.to_config(),
        ch09.DEFAULT_BLOCKS,
        ch09.DEFAULT_POLICY_SEQS,
        ch09.DEFAULT_MAX_TOKENS,
        # the two policies the compare box weighs (static batching adds only run time here)
        policies=dict(list(ch09.POLICIES.items())[:2]),
        engine_factory=factory,
    )
    s = result.summary.set_index("정책")
    assert s["선점 횟수"].sum() >= 1
    fcfs, prio = (s.loc[label, "우선순위 0 대기 평균 (ms)"] for label in list(ch09.POLICIES)[:2])
    assert prio < 0.8 * fcfs  # the compare box's "줄어든다"


# -- 10 · the shared system prompt hits the prefix cache and shortens TTFT -----------------------


@pytest.mark.slow
def test_ch10_default_hits_and_lowers_the_later_ttfts(default_model_dir):
    from engine.tokenizer import Tokenizer

    settings = EngineSettings(model=str(default_model_dir))
    blocks = max(settings.num_kv_blocks, ch10.LAB_MAX_MODEL_LEN // settings.block_size)
    configs = {
        label: settings.to_config(**ch10.lab_overrides(on, blocks))
        for label, on in ch10.CACHING_MODES.items()
    }
    tokenizer = Tokenizer(default_model_dir)
    workload = ch10.prefix_workload(
        tokenizer,
        "shared",
        ch10.DEFAULT_REQUESTS,
        ch10.DEFAULT_GAP_MS["shared"],
        ch10.LAB_MAX_TOKENS,
    )
    result = ch10.prefix_comparison(common.run_lockstep(configs, workload))
    t = result.table.set_index("요청")
    later = t.index[1:]
    assert (t.loc[later, "히트 토큰 (켬)"] > 0).all()
    assert (t.loc[later, "히트 토큰 (켬)"] == t.loc[later, "최대 가능 히트 (계산값)"]).all()
    assert (t.loc[later, "TTFT 켬 (ms)"] < t.loc[later, "TTFT 끔 (ms)"]).all()
    assert t.loc[later, "TTFT 끔 (ms)"].mean() >= 1.5 * t.loc[later, "TTFT 켬 (ms)"].mean()
    # the compare box: found ÷ looked-up prompt tokens of the caching engine
    queries, hits = ch10.hit_totals(result.runs[list(ch10.CACHING_MODES)[0]].records)
    assert result.hit_rate == pytest.approx(hits / queries) and result.hit_rate > 0.5


def _snapshot(num_blocks: int, tables: dict[str, list[int]], cached: tuple[int, ...] = ()):
    used = len({b for ids in tables.values() for b in ids})
    return KVSnapshot(
        num_blocks,
        16,
        tables,
        cached,
        used,
        len(cached),
        num_blocks - used,
        used / num_blocks,
        0,
        0,
    )


def _texts(fig) -> list[str]:
    return [t for row in fig.to_dict()["data"][0]["text"] for t in row if t]


def test_ch10_shared_grid_labels_fit_their_cells():
    # four requests sharing a 6-block system prompt, each with its own tail; two cached blocks
    shared = list(range(6))
    tables = {f"q{i}": shared + [6 + i] for i in range(4)}
    fig = ch10.shared_grid_figure(_snapshot(64, tables, cached=(20, 21)))
    texts = _texts(fig)
    assert texts == ["4"] * 6  # only the shared blocks carry a label: their ref count
    heat = fig.to_dict()["data"][0]
    font = heat["textfont"]["size"]
    cell = ch10.GRID_WIDTH_PX / 16 - 4
    assert font * 0.7 * max(map(len, texts)) <= cell
    legend = fig.to_dict()["layout"]["legend"]
    assert legend["orientation"] == "h" and legend["y"] < 0  # under the grid, not over the cells
    # the LRU grids name what a block holds ("A0"): short labels, a font sized to 8 cells
    labels = {i: f"A{i}" for i in range(4)} | {4: "B0"}
    fig = ch10.shared_grid_figure(
        _snapshot(8, {"b": [4]}, cached=(0, 1, 2, 3)), columns=8, labels=labels
    )
    assert sorted(_texts(fig)) == ["A0", "A1", "A2", "A3", "B0"]
    font = fig.to_dict()["data"][0]["textfont"]["size"]
    assert font * 0.7 * 2 <= ch10.GRID_WIDTH_PX / 8 - 4
    # cells too narrow for any readable label: colours and hover only
    wide = {i: f"A{i:03d}" for i in range(128)}
    fig = ch10.shared_grid_figure(_snapshot(128, {"x": list(range(128))}), columns=128, labels=wide)
    assert _texts(fig) == []
    assert all(h for row in fig.to_dict()["data"][0]["customdata"] for h in row)
