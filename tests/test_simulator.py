"""The simulator: presets, the cost model, the simulated executor on the real scheduler, the
calibration fit, the CLI, and the property that matters most: for the same inputs, the simulated
engine makes the same scheduling decisions as the real one, step for step. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import numpy as np
import pytest
from _tiny import TINY_VOCAB_SIZE

from engine.layers.sharding import all_reduces_per_step, stage_layers
from engine.request import RequestMetrics
from engine.sampling_params import SamplingParams
from engine.tools.calibration import fit_efficiency
from engine.tools.cost_model import CostModel, Efficiency
from engine.tools.presets import (
    PresetError,
    hardware_preset_names,
    load_hardware_preset,
    load_model_preset,
    model_preset_from_dir,
    model_preset_names,
)
from engine.tools.simulator import (
    make_simulated_engine,
    plan_memory,
    simulate,
)
from engine.tools.workload import SimRequest, poisson_workload, run_workload
from engine.trace import StepRecord

REPORTED_PARAMS = {  # model cards, rounded (reported); the presets' counts are computed from shapes
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "qwen2.5-7b": 7.62e9,
    "mistral-7b-v0.3": 7.25e9,
    "smollm2-135m-instruct": 0.1345e9,
}


# -- presets ------------------------------------------------------------------------------------


def test_model_presets_have_their_shapes_and_sources():
    assert set(REPORTED_PARAMS) <= set(model_preset_names())
    for key, reported in REPORTED_PARAMS.items():
        p = load_model_preset(key)
        assert p.source.startswith("https://huggingface.co/") and "config.json" in p.source
        assert abs(p.num_parameters() - reported) / reported < 0.01, key
    c = load_model_preset("llama-3.1-70b").config
    assert (
        c.hidden_size,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.intermediate_size,
        c.vocab_size,
    ) == (8192, 80, 64, 8, 28672, 128256)
    assert load_model_preset("qwen2.5-7b").config.attention_bias
    assert load_model_preset("mistral-7b-v0.3").config.vocab_size == 32768


def test_default_model_preset_matches_the_artifact(default_model_dir):
    from engine.models.llama import LlamaModel

    preset, artifact = (
        load_model_preset("smollm2-135m-instruct"),
        model_preset_from_dir(default_model_dir),
    )
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
    ):
        assert getattr(preset.config, field) == getattr(artifact.config, field), field
    model = LlamaModel.from_pretrained(default_model_dir, device="cpu")
    assert preset.num_parameters() == model.num_parameters()


def test_hardware_presets_are_labelled_vendor_reported():
    names = hardware_preset_names()
    assert {"h100-sxm", "h200", "a100-80gb-sxm", "l4", "rtx-4090", "this-machine"} <= set(names)
    h100 = load_hardware_preset("h100-sxm")
    assert h100.evidence == "vendor-reported" and "nvidia.com" in h100.source
    assert (h100.memory_bandwidth, h100.peak_flops, h100.memory_bytes) == (3.35e12, 989e12, 80e9)
    assert load_hardware_preset("rtx-4090").uncertain  # the figure we are not sure of says so


@pytest.mark.parametrize(
    "call, known",
    [
        (lambda: load_model_preset("gpt-5"), "llama-3.1-8b"),
        (lambda: load_hardware_preset("tpu-v9"), "h100-sxm"),
    ],
)
def test_unknown_presets_list_the_known_ones(call, known):
    with pytest.raises(PresetError, match=known):
        call()


# -- memory budget and bad input ----------------------------------------------------------------


def test_kv_capacity_follows_the_memory_budget():
    preset, hw = load_model_preset("llama-3.1-8b"), load_hardware_preset("h100-sxm")
    plan = plan_memory(preset, hw, 1, 16, 0.9, 512, 32)
    assert plan.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16  # worker.py's formula, bf16
    assert plan.weight_bytes == preset.num_parameters() * 2
    assert (
        plan.num_blocks
        == (int(80e9 * 0.9) - plan.weight_bytes - plan.activation_bytes) // plan.bytes_per_block
    )
    engine = make_simulated_engine("llama-3.1-8b", "h100-sxm", max_model_len=8192)
    assert engine.num_blocks == plan.num_blocks
    assert engine.weight_bytes() == plan.weight_bytes
    tp2 = plan_memory(preset, hw, 2, 16, 0.9, 512, 32)
    assert (
        tp2.weight_bytes == plan.weight_bytes // 2
        and tp2.bytes_per_block == plan.bytes_per_block // 2
    )


def test_a_model_that_does_not_fit_says_by_how_much():
    with pytest.raises(PresetError, match=r"GB short"):
        make_simulated_engine("llama-3.1-70b", "h100-sxm")
    engine = make_simulated_engine(
        "llama-3.1-70b", "h100-sxm", tensor_parallel_size=4, max_model_len=8192
    )
    assert engine.num_blocks > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rate=0), "rate"),
        (dict(rate=-1.0), "rate"),
        (dict(rate=float("nan")), "rate"),
        (dict(num_requests=0), "num_requests"),
        (dict(tensor_parallel_size=3), "heads"),
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
        (dict(pipeline_parallel_size=33), "layers"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        simulate("llama-3.1-8b", "h100-sxm", **{"num_requests": 5, **kwargs})


# -- the cost model -------------------------------------------------------------------------------


def test_cost_model_is_a_roofline():
    preset, hw = load_model_preset("llama-3.1-8b"), load_hardware_preset("h100-sxm")
    ideal = Efficiency(
        linear_memory=1, linear_compute=1, attention=1, step_overhead_s=0, per_request_s=0
    )
    cost = CostModel(preset.config, hw, 1, ideal)
    decode = cost.step_cost([(1, 100)], 1)
    # batch-1 decode reads every matmul weight once: ≈ weight bytes / bandwidth (plus a little KV)
    matmul_bytes = (
        preset.num_parameters() - preset.config.vocab_size * preset.config.hidden_size
    ) * 2
    assert decode.memory_bound and decode.linear_s == pytest.approx(
        matmul_bytes / hw.memory_bandwidth, rel=0.01
    )
    prefill = cost.step_cost([(8192, 0)], 1)
    assert not prefill.memory_bound
    # prefill: 2 FLOP per weight per token in the layers; the LM head runs for one sampled row
    layer_params = (
        preset.num_parameters() - 2 * preset.config.vocab_size * preset.config.hidden_size
    )
    head_bytes = preset.config.vocab_size * preset.config.hidden_size * 2
    assert prefill.linear_s == pytest.approx(
        2 * 8192 * layer_params / hw.peak_flops + head_bytes / hw.memory_bandwidth, rel=0.01
    )
    assert decode.allreduce_s == 0
    tp = CostModel(preset.config, hw, 2, ideal).step_cost([(1, 100)], 1)
    assert tp.allreduce_s > 0 and tp.linear_s == pytest.approx(decode.linear_s / 2, rel=0.01)


def known_steps(truth: Efficiency):
    """Cost-model terms and step costs of decode batches of 1–32 and prefills up to 8192 tokens,
    made by the cost model itself with known efficiencies."""
    preset, hw = load_model_preset("smollm2-135m-instruct"), load_hardware_preset("l4")
    cost = CostModel(preset.config, hw, 1, truth)
    batches = [([(1, 50 + 10 * i)] * b, b) for b in (1, 4, 16, 32) for i in range(5)]
    batches += [([(n, 0)], 1) for n in (256, 512, 2048, 4096, 8192)] + [([(512, 512), (1, 30)], 2)]
    terms = [cost.terms(batch, sampled) for batch, sampled in batches]
    return terms, [cost.step_cost(batch, sampled) for batch, sampled in batches]


FITTED = ("linear_memory", "linear_compute", "attention", "step_overhead_s", "per_request_s")
TRUTH = Efficiency(
    linear_memory=0.6,
    linear_compute=0.4,
    attention=0.3,
    step_overhead_s=0.004,
    per_request_s=0.0002,
)


@pytest.mark.parametrize("overhead_measured", [False, True])
def test_fit_recovers_known_efficiencies(overhead_measured):
    """Step times made by the cost model itself, with known efficiencies: the fit finds them,
    from whole steps alone or with each step's forward measured apart from its bookkeeping (then
    also the small-matmul ramp, which a whole-step fit cannot tell from a fixed cost)."""
    truth = replace(TRUTH, linear_compute_ramp_tokens=24.0) if overhead_measured else TRUTH
    terms, steps = known_steps(truth)
    forward = [s.model_s for s in steps] if overhead_measured else None
    fitted, stats = fit_efficiency(terms, [s.total_s for s in steps], forward_durations=forward)
    for name in FITTED + (("linear_compute_ramp_tokens",) if overhead_measured else ()):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert stats["median_abs_relative_error"] < 1e-6


def test_measured_overhead_is_not_confused_with_reading_the_weights():
    """Noisy forwards: the fixed cost comes from (step − forward), so it stays the measured few
    milliseconds instead of soaking up the weight-reading time every memory-bound step shares."""
    truth = Efficiency(
        linear_memory=0.5, linear_compute=0.5, attention=0.5, step_overhead_s=0.002, per_request_s=0
    )
    terms, steps = known_steps(truth)
    noise = np.random.default_rng(0).uniform(0.85, 1.15, len(steps))
    forward = [s.model_s * k for s, k in zip(steps, noise)]
    total = [f + s.overhead_s for f, s in zip(forward, steps)]
    fitted, _ = fit_efficiency(terms, total, forward_durations=forward)
    assert fitted.step_overhead_s == pytest.approx(0.002, rel=1e-6)
    assert fitted.linear_memory == pytest.approx(0.5, rel=0.2)


# -- the simulated engine -------------------------------------------------------------------------


def test_simulate_returns_the_engines_own_records_and_metrics():
    result = simulate(
        "llama-3.1-8b",
        "h100-sxm",
        rate=8,
        num_requests=40,
        prompt_len=(16, 300),
        output_len=(2, 40),
        max_num_seqs=8,
    )
    assert len(result.metrics) == 40 and all(isinstance(m, RequestMetrics) for m in result.metrics)
    assert all(isinstance(r, StepRecord) for r in result.records)
    assert all(m.clock == "engine" and m.ttft > 0 for m in result.metrics)
    # the output-length model: EOS at each request's target length
    workload = poisson_workload(40, 8, (16, 300), (2, 40), 128256, 0, {128000, 128001})
    for request, w in zip(result.requests, workload):
        assert request.num_output_tokens == w.output_len and request.finish_reason == "stop"
    # the engine clock advanced by exactly the computed step times
    durations = [c.total_s for c in result.costs]
    assert [r.engine_duration for r in result.records if r.scheduled] == pytest.approx(durations)
    s = result.summary
    assert (
        s["ttft_s"]["p50"] <= s["ttft_s"]["p90"]
        and s["output_tokens_per_s"] > 0
        and s["steps"] == len(result.records)
    )
    assert result.conditions["hardware"]["evidence"] == "vendor-reported"


def test_simulated_engine_steps_like_the_real_one():
    """What the app's lab drives: add requests (text or ids), step, read records and journeys."""
    engine = make_simulated_engine("qwen2.5-7b", "l4", max_num_seqs=4, max_model_len=4096)
    request = engine.add_request("hello simulated world", SamplingParams(max_tokens=5))
    engine.add_request(
        prompt_token_ids=list(range(100, 400)), sampling_params=SamplingParams(max_tokens=3)
    )
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    assert (
        request.num_output_tokens == 5 and request.finish_reason == "length"
    )  # no target: max_tokens ends it
    assert all(r.engine_duration > 0 for r in records)
    kinds = [e.kind for e in request.journey]
    assert (
        kinds[0] == "arrival" and "first_token" in kinds and kinds[-1] in ("finished", "streamed")
    )
    assert request.metrics(clock="engine").ttft == pytest.approx(records[0].engine_duration)


def test_preemption_happens_when_the_kv_cache_is_small():
    result = simulate(
        "llama-3.1-8b",
        "h100-sxm",
        rate=None,
        num_requests=12,
        prompt_len=(200, 400),
        output_len=(50, 100),
        num_kv_blocks=48,
        max_model_len=512,
        max_num_seqs=16,
    )
    assert result.summary["preemptions"] > 0
    assert all(r.finish_reason == "stop" for r in result.requests)


# -- tensor and pipeline parallel: layout and per-worker timings (chapter 12 at scale) -------------


def extra_copies(cfg, tp: int, pp: int, b: int = 2) -> int:
    """What a layout holds more than once, from the config alone (tests/test_parallel.py's
    replicated_bytes for the real executor, for untied embeddings, biases and any pp too): with
    tp > 1 every rank of a stage holds its embedding / lm_head and norms whole; a tied embedding
    is on the first stage and again (as lm_head) on the last; with tp > KV heads each KV head's K
    and V rows (and biases) are on tp / KV heads ranks."""
    h, matrix = cfg.hidden_size, cfg.vocab_size * cfg.hidden_size * b
    matrices = 1 if cfg.tie_word_embeddings and pp == 1 else 2
    extra = (tp - 1) * (matrices * matrix + (2 * cfg.num_layers + 1) * h * b)
    if cfg.tie_word_embeddings and pp > 1:
        extra += matrix
    if tp > cfg.num_kv_heads:
        kv_rows = 2 * cfg.num_kv_heads * cfg.head_dim
        bias = 1 if cfg.attention_bias else 0
        extra += (tp // cfg.num_kv_heads - 1) * kv_rows * (h + bias) * b * cfg.num_layers
    return extra


@pytest.mark.parametrize(
    "key, tp, pp",
    [
        ("llama-3.1-70b", 8, 1),
        ("llama-3.1-70b", 4, 2),
        ("llama-3.1-70b", 16, 1),  # 8 KV heads on 16 GPUs: each KV head on two
        ("qwen2.5-7b", 4, 1),  # q/k/v biases
        ("smollm2-135m-instruct", 3, 2),  # tied embedding on two stages
        ("smollm2-135m-instruct", 1, 3),
    ],
)
def test_simulated_layout_adds_up_like_the_real_one(key, tp, pp):
    preset = load_model_preset(key)
    cfg = preset.config
    engine = make_simulated_engine(
        preset, "h100-sxm", tp, pipeline_parallel_size=pp, max_model_len=4096, num_kv_blocks=1024
    )
    assert (engine.config.tensor_parallel_size, engine.config.pipeline_parallel_size) == (tp, pp)
    layout = engine.executor.layout()
    assert [r["rank"] for r in layout] == list(range(tp * pp))
    total = sum(r["weight_bytes"] for r in layout)
    assert total == preset.num_parameters() * 2 + extra_copies(cfg, tp, pp)
    assert engine.weight_bytes() == total
    if tp == 1:
        assert all(r["replicated_bytes"] == 0 for r in layout)
    # the stages cover the layers in order; each stage's tp ranks cover every query head once
    assert [r["layers"] for r in layout[::tp]] == [
        [s.start, s.stop] for s in stage_layers(cfg.num_layers, pp)
    ]
    for stage in range(pp):
        ranks = layout[stage * tp : (stage + 1) * tp]
        assert [r["q_heads"] for r in ranks] == [
            [i * cfg.num_heads // tp, (i + 1) * cfg.num_heads // tp] for i in range(tp)
        ]
        assert sum(r["shapes"]["down"][1] for r in ranks) == cfg.intermediate_size
        assert all(r["holds_embedding"] == (stage == 0) for r in ranks)
        assert all(r["holds_lm_head"] == (stage == pp - 1) for r in ranks)
    for r in layout:
        q = (r["q_heads"][1] - r["q_heads"][0]) * cfg.head_dim
        kv_heads = r["kv_heads"][1] - r["kv_heads"][0]
        assert r["shapes"]["qkv"] == [q + 2 * kv_heads * cfg.head_dim, cfg.hidden_size]
        assert r["shapes"]["o"] == [cfg.hidden_size, q]
        layers = r["layers"][1] - r["layers"][0]
        assert r["num_layers"] == layers
        per_block = 2 * layers * kv_heads * cfg.head_dim * 2 * engine.config.block_size
        assert r["kv_cache_bytes"] == per_block * engine.num_blocks
    assert engine.kv_cache_bytes() == sum(r["kv_cache_bytes"] for r in layout)


def test_simulated_tp1_has_no_workers_and_no_layout():
    """As the real engine's single in-process worker (UniProcExecutor)."""
    result = simulate("llama-3.1-8b", "h100-sxm", rate=None, num_requests=3, output_len=(2, 5))
    assert all(not r.workers for r in result.records)
    assert result.records and make_simulated_engine("llama-3.1-8b").executor.layout() == []


@pytest.mark.parametrize(
    "tp, pp, hardware", [(8, 1, "h100-sxm"), (4, 2, "h100-sxm"), (1, 2, "h200")]
)
def test_simulated_workers_report_each_step(tp, pp, hardware):
    """Per step, one entry per rank with the real executor's keys: the all-reduce count equals
    the derived 2 per layer the rank runs, the bytes count × tokens × hidden × dtype bytes; the
    stages run one after the other and the step's computed time is the last one's end plus the
    fixed overhead."""
    preset = load_model_preset("llama-3.1-70b")
    cfg = preset.config
    result = simulate(
        preset,
        hardware,
        rate=None,
        num_requests=6,
        prompt_len=(20, 300),
        output_len=(3, 12),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=4096,
        max_num_batched_tokens=256,  # chunked prefill: steps of mixed sizes
    )
    stepped = [r for r in result.records if r.scheduled]
    assert len(stepped) == len(result.costs) > 3
    stages = stage_layers(cfg.num_layers, pp)
    keys = {
        "rank", "tp_rank", "pp_rank", "step_s", "compute_s", "comm_s", "all_reduce_count",
        "all_reduce_bytes", "p2p_bytes", "control_bytes", "round_trip_s",
    }  # fmt: skip
    for record, cost in zip(stepped, result.costs):
        workers = record.workers
        assert [w["rank"] for w in workers] == list(range(tp * pp))
        hidden_bytes = record.total_tokens * cfg.hidden_size * 2
        for w in workers:
            assert set(w) == keys
            assert w["all_reduce_count"] == (2 * len(stages[w["pp_rank"]]) if tp > 1 else 0)
            assert w["all_reduce_bytes"] == w["all_reduce_count"] * hidden_bytes
            neighbours = (w["pp_rank"] > 0) + (w["pp_rank"] < pp - 1)
            assert w["p2p_bytes"] == neighbours * hidden_bytes
            assert w["compute_s"] > 0 and w["comm_s"] >= 0
            assert w["step_s"] == pytest.approx(w["compute_s"] + w["comm_s"])
        assert max(w["all_reduce_count"] for w in workers) == all_reduces_per_step(cfg, tp, pp)
        # stage s + 1 finishes after stage s; the step = the last stage's end + fixed overhead
        ends = [workers[s * tp]["step_s"] for s in range(pp)]
        assert ends == sorted(ends)
        assert record.engine_duration == pytest.approx(ends[-1] + cost.overhead_s)
        assert cost.total_s == pytest.approx(record.engine_duration)
        # compute over the stages adds up to the cost model's linears + attention (any pp)
        compute = sum(workers[s * tp]["compute_s"] for s in range(pp))
        assert compute == pytest.approx(cost.linear_s + cost.attention_s)
        if pp == 1:  # no hand-off: the forward is exactly the cost model's
            assert workers[0]["comm_s"] == pytest.approx(cost.allreduce_s)
            assert ends[-1] == pytest.approx(cost.model_s)
        else:  # the hand-offs make the step longer than the same layers on tp alone
            assert ends[-1] > cost.model_s


def test_same_gpus_more_tp_shorter_step_but_less_than_n_times():
    """The chapter's mistake at scale, computed: 70B decode on 8 H100s vs 4 is faster, but less
    than twice, and the all-reduce share of the step grows with tp."""
    preset, hw = load_model_preset("llama-3.1-70b"), load_hardware_preset("h100-sxm")
    batch = [(1, 1024)] * 32
    costs = {tp: CostModel(preset.config, hw, tp).step_cost(batch, 32) for tp in (4, 8)}
    speedup = costs[4].total_s / costs[8].total_s
    assert 1 < speedup < 2
    shares = [costs[tp].allreduce_s / costs[tp].total_s for tp in (4, 8)]
    assert shares[0] < shares[1]


# -- the property: same decisions as the real engine ---------------------------------------------


def decisions(records):
    return [
        (
            [(s.request_id, s.phase, s.num_tokens, s.num_computed_tokens) for s in r.scheduled],
            dict(r.unscheduled),
            list(r.preempted),
            r.kv.num_used,
        )
        for r in records
    ]


@pytest.mark.parametrize(
    "config",
    [
        # A cache far larger than the workload (no preemption). Not the simulated H100's own
        # size: for the tiny model that is ~18 million blocks, whose pool took 150 s and 17 GB.
        dict(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=64),
        dict(
            num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=40, max_num_seqs=4
        ),  # preemptions
        dict(
            num_kv_blocks=8,
            max_model_len=128,
            max_num_batched_tokens=48,
            scheduling_policy="priority",
        ),
    ],
    ids=["chunked", "preempting", "priority"],
)
def test_simulated_decisions_equal_the_real_engines(tiny_model_dir, config):
    from engine.core import EngineCore

    vocab = TINY_VOCAB_SIZE
    workload = poisson_workload(8, None, (5, 60), (10, 40), vocab, seed=7, special_ids={0, 1, 2})
    shared = workload[0].prompt_token_ids[:20]
    workload[3].prompt_token_ids = shared + workload[3].prompt_token_ids[:10]  # a prefix-cache hit
    real_work = [SimRequest(w.prompt_token_ids, w.output_len, 0.0, w.output_len) for w in workload]
    real = EngineCore(model=str(tiny_model_dir), device="cpu", dtype="float32", **config)
    real_records, real_requests = run_workload(real, real_work)
    # output lengths taken from the real run; the simulated sampler ends each with EOS there
    lengths = [r.num_output_tokens for r in real_requests]
    sim_work = [
        SimRequest(w.prompt_token_ids, n, 0.0, max_tokens=64) for w, n in zip(workload, lengths)
    ]
    targets = {f"sim-{i}": n for i, n in enumerate(lengths)}
    # scheduling does not depend on the (simulated) parallel layout: tp 2 and pp 2 decide the same
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        sim = make_simulated_engine(
            model_preset_from_dir(tiny_model_dir),
            "h100-sxm",
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            output_len=targets.get,
            **{"max_model_len": 512, **config},
        )
        sim_records, sim_requests = run_workload(sim, sim_work)
        assert decisions(sim_records) == decisions(real_records), (tp, pp)
        assert [r.num_output_tokens for r in sim_requests] == lengths
        assert all(len(r.workers) == (0 if tp * pp == 1 else 2) for r in sim_records if r.scheduled)
    if config["num_kv_blocks"] == 8 and config.get("scheduling_policy") != "priority":
        assert any(r.preempted for r in real_records)


def test_runs_without_per_step_outputs_decide_and_journey_the_same(tiny_model_dir):
    """run_workload turns the engine's per-step RequestOutputs off (the simulator reads records,
    journeys and metrics only): the decisions, tokens and journeys stay those of a run with them,
    no output state is left behind, and the engine's own setting is restored."""
    from engine.core import EngineCore

    workload = poisson_workload(6, None, (5, 40), (5, 20), TINY_VOCAB_SIZE, seed=3)
    work = [SimRequest(w.prompt_token_ids, w.output_len, 0.0, w.output_len) for w in workload]
    runs = {}
    for keep in (True, False):
        engine = EngineCore(model=str(tiny_model_dir), device="cpu", dtype="float32")
        records, requests = run_workload(engine, work, keep_outputs=keep)
        assert engine.emit_outputs is True and not engine.output_processor.states
        assert any(r.outputs for r in records) == keep
        journeys = [[e.kind for e in r.journey if e.kind != "streamed"] for r in requests]
        runs[keep] = (decisions(records), [r.output_token_ids for r in requests], journeys)
    assert runs[True] == runs[False]


# -- the command line -----------------------------------------------------------------------------


def run_cli(*argv):
    from engine.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["simulate", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cli_prints_percentiles_and_writes_json(tmp_path):
    path = tmp_path / "sim.json"
    rc, out, _ = run_cli(
        "--model-preset",
        "mistral-7b-v0.3",
        "--hardware",
        "a100-80gb-sxm",
        "--rate",
        "20",
        "--num-requests",
        "30",
        "--output-len",
        "4",
        "32",
        "--max-num-seqs",
        "16",
        "--json",
        str(path),
    )
    assert rc == 0
    for word in (
        "TTFT",
        "TPOT",
        "E2E",
        "throughput",
        "preemptions",
        "simulated time",
        "wall time",
        "vendor-reported",
    ):
        assert word in out, word
    data = json.loads(path.read_text())
    assert (
        len(data["requests"]) == 30
        and data["conditions"]["hardware"]["evidence"] == "vendor-reported"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-preset", "nope"], "known:"),
        (["--hardware", "nope"], "h100-sxm"),
        (["--rate", "0"], "rate"),
        (["--num-requests", "0"], "num_requests"),
        (["--model-preset", "llama-3.1-70b", "--hardware", "l4"], "GB short"),
    ],
)
def test_cli_bad_input_is_one_line(argv, message):
    rc, _, err = run_cli(*argv)
    assert rc == 1 and message in err and "Traceback" not in err


def test_cli_pipeline_parallel_counts_every_gpu():
    rc, out, _ = run_cli(
        "--model-preset", "llama-3.1-70b", "--hardware", "h100-sxm", "-tp", "4", "-pp", "2",
        "--num-requests", "6", "--output-len", "2", "8",
    )  # fmt: skip
    assert rc == 0 and "8 (tp 4 × pp 2)" in out


def test_cli_lists_presets():
    rc, out, _ = run_cli("--list")
    assert rc == 0 and "llama-3.1-70b" in out and "this-machine" in out


# -- calibration and the benchmark's fidelity section ----------------------------------------------


def test_fidelity_section_calibrates_and_compares(tiny_model_dir, tmp_path):
    """On the tiny model: a calibration is fitted and cached, then the benchmark's workload runs
    on the real and on the simulated engine; every figure has both values and an error."""
    from engine.tools.bench.config import BenchConfig
    from engine.tools.bench.fidelity import simulator_fidelity
    from engine.tools.bench.report import format_fidelity
    from engine.tools.calibration import load_calibration

    config = BenchConfig.quick_config(
        model=str(tiny_model_dir),
        num_requests=5,
        prompt_len=(8, 40),
        output_len=(3, 9),
        max_num_seqs=4,
    )
    path = tmp_path / "calibration.json"
    fidelity = simulator_fidelity(config, path, log=lambda message: None)
    calibration = load_calibration(path)
    assert calibration is not None and calibration.hardware.evidence == "measured"
    assert calibration.efficiency.evidence.startswith("fitted")
    assert set(fidelity["figures"]) == {
        "total_time_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "tpot_p50_s",
        "output_tokens_per_s",
    }
    for row in fidelity["figures"].values():
        assert row["real"] > 0 and row["simulated"] > 0 and row["relative_error"] is not None
    assert (
        fidelity["steps"]["real"] == fidelity["steps"]["simulated"]
    )  # same scheduler, same lengths
    assert "10. Simulator fidelity" in format_fidelity(fidelity)
    json.dumps(fidelity)  # it goes into the benchmark's results file


def test_a_failing_fidelity_section_costs_its_row_not_the_benchmark(monkeypatch, tmp_path):
    """Section 10 runs last, after every measured number: an error there (a second engine that
    finds no memory on a GPU, say) is recorded and printed, and the results are still returned."""
    from types import SimpleNamespace

    from engine.tools.bench import run as bench_run
    from engine.tools.bench.report import format_fidelity

    def fails(*args, **kwargs):
        raise ValueError("KV cache of 0 blocks")

    monkeypatch.setattr(bench_run, "simulator_fidelity", fails)
    logged = []
    run = SimpleNamespace(
        config=SimpleNamespace(quantization=None),
        results={},
        log=logged.append,
        section=logged.append,
    )
    bench_run.run_fidelity(run, tmp_path / "calibration.json")
    assert run.results["simulator_fidelity"] == {"error": "ValueError: KV cache of 0 blocks"}
    assert any("simulator fidelity failed" in line for line in logged)
    assert "not measured, the section failed (ValueError" in format_fidelity(
        run.results["simulator_fidelity"]
    )
