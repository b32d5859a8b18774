"""bfloat16 linears in a float32 engine (issue 37, engine/kernels/linear_precision.py): the
setting's validation, the layer's casts, the "auto" rule on timings, the environment override,
the default engine unchanged, tensor-parallel workers given the driver's choice, and (slow) the
real model's greedy tokens against float32 under the near-tie rule."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from _tiny import run_engine

import engine.kernels.linear_precision as lp
from engine import SamplingParams
from engine.config import EngineConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12, 13, 14]}


@pytest.fixture
def fresh_choice(monkeypatch):
    """No "auto" choice made yet in this process (restored after the test)."""
    monkeypatch.setattr(lp, "_choice", None)
    monkeypatch.delenv(lp.LINEAR_PRECISION_ENV, raising=False)


def tokens_of(engine) -> dict[str, list[int]]:
    for rid, ids in PROMPTS.items():
        engine.add_request(prompt_token_ids=ids, sampling_params=GREEDY, request_id=rid)
    _, final, _ = run_engine(engine)
    return {rid: out.token_ids for rid, out in final.items()}


def test_the_setting_is_refused_outside_a_float32_cpu_engine():
    assert EngineConfig().linear_precision == "float32"  # the default keeps float32's outputs
    EngineConfig(linear_precision="auto")  # device "auto", dtype None: decided at load
    EngineConfig(linear_precision="bfloat16", device="cpu", dtype="float32")
    refused = {
        "must be one of": dict(linear_precision="fp8"),
        "dtype='bfloat16'": dict(linear_precision="bfloat16", dtype="bfloat16"),
        "device='cuda'": dict(linear_precision="auto", device="cuda"),
        "quantization='int8'": dict(linear_precision="bfloat16", quantization="int8"),
    }
    for message, settings in refused.items():
        with pytest.raises(ValueError, match=message):
            EngineConfig(**settings)
    # a device "auto" that became a GPU: "auto" falls back to float32, "bfloat16" is refused
    gpu = lp.resolve_linear_precision("auto", "cuda", torch.bfloat16)
    assert gpu["precision"] == "float32" and "not a float32 CPU engine" in gpu["why"]
    with pytest.raises(ValueError, match="device='cuda'"):
        lp.resolve_linear_precision("bfloat16", "cuda", torch.float32)


def test_a_bfloat16_linear_layer_takes_and_returns_float32():
    from engine.layers.linear import ReplicatedLinear, RowParallelLinear

    torch.manual_seed(0)
    w, bias, x = torch.randn(48, 64) * 0.1, torch.randn(48), torch.randn(5, 64)
    exact = torch.nn.functional.linear(x, w, bias)
    for layer in (ReplicatedLinear(w.bfloat16(), bias), RowParallelLinear(w.bfloat16(), bias)):
        y = layer(x)
        assert layer.weight.dtype == torch.bfloat16 and y.dtype == torch.float32
        assert torch.allclose(y, exact, rtol=2e-2, atol=2e-2)  # bfloat16's 8-bit mantissa
        assert not torch.equal(y, exact)  # it did round
    # a bfloat16 engine's layer (bfloat16 activations) is the plain F.linear, as before
    xb = x.bfloat16()
    assert torch.equal(
        ReplicatedLinear(w.bfloat16())(xb), torch.nn.functional.linear(xb, w.bfloat16())
    )
    works = {"oneDNN": lp.onednn_bfloat16_works(), lp.PREPACKED: lp.prepacking_works()}
    for name, library in lp.BFLOAT16_LIBRARIES.items():
        if not works.get(name, True):  # oneDNN has no bfloat16 kernel on an AVX2 CPU
            continue
        assert torch.allclose(library(x, w.bfloat16(), bias), exact, rtol=2e-2, atol=2e-2)


def test_a_cpu_whose_onednn_cannot_multiply_bfloat16_never_sends_it_a_matrix(
    fresh_choice, monkeypatch
):
    """On an AVX2 CPU oneDNN has no bfloat16 kernel: a plain matrix beside a chosen layout
    falls back to F.linear there, and the "auto" timing leaves oneDNN out."""
    for library in (lp.PREPACKED, lp.TILES):
        monkeypatch.setattr(lp, "_choice", {"precision": "bfloat16", "library": library})
        monkeypatch.setattr(lp, "onednn_bfloat16_works", lambda: False)
        assert lp.bfloat16_matmul() is lp.bfloat16_linear
        monkeypatch.setattr(lp, "onednn_bfloat16_works", lambda: True)
        assert lp.bfloat16_matmul() is lp.bfloat16_onednn_linear
    monkeypatch.setattr(lp, "onednn_bfloat16_works", lambda: False)
    ms = lp._time_precisions([torch.randn(64, 64)])
    assert "oneDNN" not in ms[1] and "F.linear" in ms[1] and "float32" in ms[32]


needs_prepacking = pytest.mark.skipif(
    not lp.prepacking_works(), reason="this PyTorch cannot prepack weights for oneDNN"
)


@needs_prepacking
def test_a_prepacked_weight_gives_onednns_numbers_bit_for_bit():
    """Reordered once at load for oneDNN, the matrix multiplies exactly as the plain one does,
    at any row count and with a bias."""
    torch.manual_seed(0)
    for n, k in ((48, 64), (960, 576), (576, 1536)):
        w, bias = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(n)
        packed = lp.prepacked(w)
        assert packed.is_mkldnn and packed.shape == w.shape and packed.dtype == torch.bfloat16
        for rows in (1, 3, 16, 17, 70):
            x = torch.randn(rows, k)
            for b in (None, bias):
                expected = lp.bfloat16_onednn_linear(x, w, b)
                assert torch.equal(lp.bfloat16_prepacked_linear(x, packed, b), expected)


@needs_prepacking
def test_bfloat16_linears_are_prepacked_and_give_the_plain_weights_tokens(
    make_engine, fresh_choice, monkeypatch
):
    from engine.kernels.quant import storage_key
    from engine.models.llama import is_layer_matrix

    monkeypatch.setattr(lp, "_choice", {"precision": "bfloat16", "library": lp.PREPACKED})
    packed = make_engine(kernels="torch", linear_precision="bfloat16")
    m = packed.executor.worker.model
    matrices = [t for name, t in m.w.items() if is_layer_matrix(name, t)] + [m.w["lm_head"]]
    assert all(t.is_mkldnn for t in matrices)
    assert len({storage_key(t) for t in matrices}) == len(matrices)
    assert all(layer.mlp.gate_up.matmul is lp.bfloat16_prepacked_linear for layer in m.layers)
    monkeypatch.setattr(lp, "_choice", {"precision": "bfloat16", "library": "oneDNN"})
    from engine.worker import worker

    monkeypatch.setattr(worker, "_loaded_models", {})  # convert again, with plain weights
    plain = make_engine(kernels="torch", linear_precision="bfloat16")
    assert not plain.executor.worker.model.w["0.qkv"].is_mkldnn
    assert tokens_of(packed) == tokens_of(plain)


def test_engines_sharing_bfloat16_weights_each_say_why(make_engine, fresh_choice, monkeypatch):
    """The second engine on the same bfloat16 layout reuses the first one's weights, but records
    its own reason (auto's timing, or the setting), not the first engine's."""
    from engine.worker import worker
    from engine.worker.bfloat16_linears import linear_precision_of

    monkeypatch.setattr(worker, "_loaded_models", {})
    library = lp.bfloat16_library()
    monkeypatch.setattr(lp, "_choice", {"precision": "bfloat16", "library": library, "why": "t"})
    auto = make_engine(kernels="torch", linear_precision="auto").executor.worker.model
    explicit = make_engine(kernels="torch", linear_precision="bfloat16").executor.worker.model
    assert explicit.w["0.qkv"] is auto.w["0.qkv"]  # one copy of the weights
    assert linear_precision_of(auto) == {
        "precision": "bfloat16",
        "library": library,
        "why": "auto: t",
    }
    why = "linear_precision='bfloat16'"
    assert linear_precision_of(explicit) == {
        "precision": "bfloat16",
        "library": library,
        "why": why,
    }


def timings(f32_1, bf_1, f32_32, bf_32, onednn_factor=1.5) -> dict:
    return {
        1: {"float32": f32_1, "F.linear": bf_1, "oneDNN": bf_1 * onednn_factor},
        32: {"float32": f32_32, "F.linear": bf_32, "oneDNN": bf_32 * onednn_factor},
    }


def test_the_auto_rule_on_timings():
    choose = lp.choose_precision
    no_isa = choose(None, None)
    assert no_isa["precision"] == "float32" and "no bfloat16 instructions" in no_isa["why"]
    fast = choose(timings(10, 9, 100, 40), "avx512_bf16")
    assert (fast["precision"], fast["library"]) == ("bfloat16", "F.linear")
    assert "avx512_bf16" in fast["why"] and "2.50×" in fast["why"]
    assert choose(timings(10, 9, 100, 80), "amx_bf16")["precision"] == "float32"  # 1.25× at 32
    slower_at_one_row = choose(timings(10, 11, 100, 40), "amx_bf16")
    assert slower_at_one_row["precision"] == "float32" and "≥ 1×" in slower_at_one_row["why"]
    assert choose(timings(10, 10, 130, 100), "amx_bf16")["precision"] == "bfloat16"  # the edge
    onednn = choose(timings(10, 9, 100, 40, onednn_factor=0.5), "amx_bf16")
    assert onednn["library"] == "oneDNN"  # the faster library over 1 + 32 rows
    ms = timings(10, 11, 100, 40)  # plain bfloat16 slower at one row, prepacked faster
    ms[1][lp.PREPACKED], ms[32][lp.PREPACKED] = 8.0, 30.0
    prepacked = choose(ms, "amx_bf16")
    assert (prepacked["precision"], prepacked["library"]) == ("bfloat16", lp.PREPACKED)
    assert f"bfloat16 ({lp.PREPACKED}) 8.0 ms (1.25×)" in prepacked["why"]
    assert lp.bfloat16_isa("fpu avx512f avx512_bf16 amx_tile amx_bf16") == "amx_bf16"
    assert lp.bfloat16_isa("fpu avx512f avx512_bf16") == "avx512_bf16"
    assert lp.bfloat16_isa("fpu avx2 fma") is None


def test_the_environment_skips_the_timing_and_the_choice_is_kept(fresh_choice, monkeypatch):
    def no_timing(*args):
        raise AssertionError("timed although the environment set the precision")

    monkeypatch.setattr(lp, "time_linears", no_timing)
    monkeypatch.setenv(lp.LINEAR_PRECISION_ENV, "bfloat16")
    choice = lp.linear_precision_choice(lambda: no_timing())
    assert choice["precision"] == "bfloat16" and lp.LINEAR_PRECISION_ENV in choice["why"]
    monkeypatch.setenv(lp.LINEAR_PRECISION_ENV, "float32")
    assert lp.linear_precision_choice() is choice  # once per process
    resolved = lp.resolve_linear_precision("auto", "cpu", torch.float32)
    assert resolved["precision"] == "bfloat16" and resolved["why"].startswith("auto: ")


def layer_matrix_names(model) -> list[str]:
    """The names of a float32 model's layer matrices (bfloat16 linears may hold them in tiles)."""
    from engine.models.llama import is_layer_matrix

    return [name for name, t in model.w.items() if is_layer_matrix(name, t)]


def test_bfloat16_linears_hold_half_the_bytes_and_the_default_is_unchanged(
    make_engine, fresh_choice
):
    from engine.kernels.quant import weight_nbytes
    from engine.worker.bfloat16_linears import linear_precision_of

    default = make_engine(kernels="torch")
    model = default.executor.worker.model
    assert linear_precision_of(model)["precision"] == "float32"
    assert all(t.dtype == torch.float32 for t in model.w.values())
    float32_tokens = tokens_of(default)
    assert tokens_of(make_engine(kernels="torch", linear_precision="float32")) == float32_tokens

    bf16 = make_engine(kernels="torch", linear_precision="bfloat16")
    m = bf16.executor.worker.model
    why, library = "linear_precision='bfloat16'", lp.bfloat16_library()
    assert linear_precision_of(m) == {"precision": "bfloat16", "library": library, "why": why}
    assert m.w["embed"].dtype == torch.float32 and m.w["lm_head"].dtype == torch.bfloat16
    matrices = [m.w[name] for name in layer_matrix_names(model)]
    assert matrices and all(t.dtype == torch.bfloat16 for t in matrices)
    assert m.w["0.input_norm"].dtype == torch.float32  # norms stay float32
    assert bf16.executor.worker.runner.kv_caches[0][0].dtype == torch.float32  # so does K/V
    # every linear matrix at 2 bytes, plus a bfloat16 lm_head beside the tied float32 table
    saved = sum(weight_nbytes(t) for t in matrices) - weight_nbytes(m.w["lm_head"])
    assert bf16.weight_bytes() == default.weight_bytes() - saved
    out = tokens_of(bf16)
    assert set(out) == set(PROMPTS) and all(len(t) == GREEDY.max_tokens for t in out.values())
    assert default.executor.worker.model.w["0.qkv"].dtype == torch.float32  # weights not shared


def test_tensor_parallel_workers_get_the_drivers_choice(make_engine, fresh_choice, monkeypatch):
    from engine.kernels.quant import weight_nbytes

    monkeypatch.setenv(lp.LINEAR_PRECISION_ENV, "bfloat16")  # what "auto" would time to here
    small = dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24, kernels="torch")
    tp1 = make_engine(**small, linear_precision="bfloat16")
    engine = make_engine(**small, linear_precision="auto", tensor_parallel_size=2)
    try:
        assert engine.executor.spec["linear_precision"] == "bfloat16"
        # each rank holds its bfloat16 shards and its own embedding, lm_head and norms: tp 1's
        # bytes twice, less one set of (bfloat16) layer matrices; float32 shards would hold twice
        model = tp1.executor.worker.model
        names = layer_matrix_names(make_engine(**small).executor.worker.model)
        matrices = sum(weight_nbytes(model.w[name]) for name in names)
        assert matrices > 0 and engine.weight_bytes() == 2 * tp1.weight_bytes() - matrices
    finally:
        engine.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_default_model_bfloat16_linears_agree_with_float32_under_the_near_tie_rule(
    default_model_dir, hf_reference, fresh_choice
):
    from engine.entrypoints.llm import LLM
    from engine.tools.near_tie import TIE_MARGIN, compare_greedy

    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for precision in ("float32", "bfloat16"):
        llm = LLM(
            str(default_model_dir),
            device="cpu",
            num_kv_blocks=32,
            max_model_len=256,
            linear_precision=precision,
        )
        tokenizer = llm.get_tokenizer()
        prompt_ids = [tokenizer.encode(t) for t in texts]
        done = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params, use_tqdm=False)
        outputs[precision] = [o.token_ids for o in done]
    for i, ids in enumerate(prompt_ids):
        ours, ref = outputs["bfloat16"][i], outputs["float32"][i]
        verdict = compare_greedy(hf_reference, texts[i], ids, ours, ref, TIE_MARGIN[torch.bfloat16])
        assert verdict.ok, verdict


def test_the_bench_runs_the_offline_workload_again_with_auto(
    tiny_model_dir, fresh_choice, monkeypatch
):
    from engine.entrypoints.llm import LLM
    from engine.tools.bench.bf16_linears import run_bfloat16_linears
    from engine.tools.bench.config import BenchConfig
    from engine.tools.bench.offline import run_engine_offline
    from engine.tools.bench.report import format_offline
    from engine.tools.bench.run import BenchRun
    from engine.tools.workload import make_workload

    config = BenchConfig.quick_config(model=str(tiny_model_dir), max_num_seqs=4, kernels="torch")
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_num_seqs=4, kernels="torch")
    run = BenchRun(config, llm, tiny_model_dir, log=lambda _: None, sections=[])
    workload = make_workload(4, (8, 24), (4, 8), 0, 100, [])
    float32_run = run_engine_offline(llm, workload)
    monkeypatch.setattr(lp, "bfloat16_isa", lambda flags=None: "avx512_bf16")
    monkeypatch.setattr(lp, "_choice", lp.choose_precision(None, None))  # timed: float32
    skipped = run_bfloat16_linears(run, workload, float32_run)
    assert not skipped["ran"] and "auto chooses float32: this CPU has no bfloat16" in skipped["why"]
    monkeypatch.setattr(lp, "_choice", None)
    monkeypatch.setenv(lp.LINEAR_PRECISION_ENV, "bfloat16")  # what "auto" would time to here
    b = run_bfloat16_linears(run, workload, float32_run)
    assert b["ran"] and b["amx"] == "not an AMX machine"
    assert b["engine"]["output_tokens"] == float32_run["output_tokens"]
    assert b["ratio"] == b["engine"]["output_tokens_per_s"] / float32_run["output_tokens_per_s"]
    assert b["float32_weight_bytes"] == llm.engine.weight_bytes() != b["weight_bytes"]
    kv = b["with_bfloat16_kv_cache"]  # the same engine over a bfloat16 KV cache
    assert b["kv_cache_dtype"] == "float32" and kv["kv_cache_dtype"] == "bfloat16"
    assert kv["engine"]["output_tokens"] == float32_run["output_tokens"]
    assert kv["ratio"] == kv["engine"]["output_tokens_per_s"] / float32_run["output_tokens_per_s"]
    for a in (b["agreement"], kv["agreement"]):
        assert a["requests"] == 4 and a["identical_requests"] + len(a["divergences"]) == 4
        assert a["near_ties"] + a["not_near_ties"] == len(a["divergences"])
        assert a["tie_margin"] == 0.5
    offline = {"engine": {k: v for k, v in float32_run.items() if k != "tokens"}}
    text = "\n".join(format_offline({**offline, "bfloat16_linears": b}))
    assert "bf16 linears" in text and "not an AMX machine" in text and "near-tie" in text
    assert "+ bf16 KV cache" in text
    text = "\n".join(format_offline({**offline, "bfloat16_linears": skipped}))
    assert "bfloat16 linears (auto): not run: auto chooses float32" in text
