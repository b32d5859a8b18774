"""The engine's Llama forward on a tiny random model, checked against transformers (fast).

Each comparison goes through the paged KV cache the way the engine will use it: flat batches
mixing prefill from 0, prefill chunks at an offset, and decode tokens; block tables that are
shuffled and blocks that hold junk from earlier requests."""

from __future__ import annotations

import pytest
import torch
from _paged import PagedRunner, blocks_needed, greedy_batched, rel_err
from _tiny import TINY_VOCAB_SIZE

from engine.layers.attention import build_attention_metadata
from engine.models.llama import LlamaModel

BLOCK = 16
TOL = 1e-4  # max relative error vs transformers, float32


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return LlamaModel.from_pretrained(tiny_model_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def sequences():
    """Seeded random token sequences of assorted lengths (around block boundaries on purpose)."""
    g = torch.Generator().manual_seed(1234)
    lengths = {"a": 13, "b": 37, "c": 31, "d": 33, "e": 16, "f": 1, "g": 100}
    return {
        k: torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=g).tolist() for k, n in lengths.items()
    }


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `ids`, [len, vocab] float32."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_loads_all_weights_and_config(tiny_model, tiny_hf_model):
    cfg = tiny_model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        2,
        64,
        4,
        2,
        16,
    )
    assert cfg.rope_theta == 1000.0
    assert cfg.tie_word_embeddings
    assert tiny_model.w["lm_head"].data_ptr() == tiny_model.w["embed"].data_ptr()
    hf_params = sum(p.numel() for p in tiny_hf_model.parameters())  # tied weights counted once
    assert tiny_model.num_parameters() == hf_params
    assert tiny_model.weight_bytes() == 4 * hf_params


@pytest.mark.parametrize("name", ["f", "a", "e", "b", "g"])
def test_prefill_logits_match_transformers(tiny_model, tiny_hf_model, sequences, name):
    ids = sequences[name]
    runner = PagedRunner(tiny_model, blocks_needed([len(ids)], BLOCK), BLOCK)
    (ours,) = runner.step([("x", ids)], all_logits=True)
    ref = hf_logits(tiny_hf_model, ids)
    assert ours.shape == ref.shape == (len(ids), TINY_VOCAB_SIZE)
    assert rel_err(ours, ref) <= TOL


def test_prefill_of_real_text_matches_transformers(tiny_model, tiny_hf_model, tiny_tokenizer):
    tokenizer = tiny_tokenizer
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "한국의 수도는? Answer briefly 🙂"}]
        )
    )
    runner = PagedRunner(tiny_model, blocks_needed([len(ids)], BLOCK), BLOCK)
    (ours,) = runner.step([("x", ids)], all_logits=True)
    assert rel_err(ours, hf_logits(tiny_hf_model, ids)) <= TOL


def test_chunked_prefill_matches_transformers(tiny_model, tiny_hf_model, sequences):
    """One prompt fed in uneven chunks (not aligned to blocks, one of a single token): every
    position's logits equal transformers' for the full sequence."""
    ids = sequences["g"]
    ref = hf_logits(tiny_hf_model, ids)
    runner = PagedRunner(tiny_model, blocks_needed([len(ids)], BLOCK), BLOCK, shuffle_seed=3)
    start = 0
    for size in (5, 11, 1, 20, 3, 17, 43):
        (ours,) = runner.step([("x", ids[start : start + size])], all_logits=True)
        assert rel_err(ours, ref[start : start + size]) <= TOL, f"chunk at {start}+{size}"
        start += size
    assert start == len(ids)


def run_mixed_batch(model, seqs, shuffle_seed=None, garbage=False):
    """Earlier steps cache b[:20], c[:30], d[:32]; then ONE flat step holds
    a: prefill from 0 (13 tokens) | b: prefill chunk at offset 20 (17 tokens) |
    c: decode of token 30 | d: decode of token 32 (first slot of a fresh block)."""
    a, b, c, d = seqs["a"], seqs["b"], seqs["c"], seqs["d"]
    runner = PagedRunner(model, 24, BLOCK, shuffle_seed=shuffle_seed)
    if garbage:
        runner.fill_garbage()
    runner.step([("c", c[:30]), ("b", b[:20])])
    runner.step([("d", d[:32])])
    out = runner.step([("a", a), ("c", c[30:31]), ("b", b[20:37]), ("d", d[32:33])])
    return dict(zip("acbd", out)), runner


def test_mixed_flat_batch_equals_alone_and_transformers(tiny_model, tiny_hf_model, sequences):
    batched, _ = run_mixed_batch(tiny_model, sequences)
    expected_len = {"a": 13, "b": 37, "c": 31, "d": 33}
    for name, n in expected_len.items():
        ids = sequences[name][:n]
        alone_runner = PagedRunner(tiny_model, blocks_needed([n], BLOCK), BLOCK)
        (alone,) = alone_runner.step([(name, ids)])
        ref = hf_logits(tiny_hf_model, ids)[-1]
        assert rel_err(batched[name], alone) <= 1e-5, name
        assert rel_err(batched[name], ref) <= TOL, name
        assert batched[name].argmax() == ref.argmax(), name


@pytest.fixture
def float32_linear(monkeypatch):
    """Force the float32 linear library ("mkl" or "onednn") for one test, then forget it."""
    import engine.kernels.float32_linear as f32

    def force(backend: str | None):
        monkeypatch.setattr(f32, "_float32_linear", None)
        if backend is None:
            monkeypatch.delenv(f32.FLOAT32_LINEAR_ENV, raising=False)
        else:
            monkeypatch.setenv(f32.FLOAT32_LINEAR_ENV, backend)
        return f32.float32_linear_backend()

    yield force
    monkeypatch.setattr(f32, "_float32_linear", None)


def test_float32_linear_library_is_timed_once_or_set_by_the_environment(float32_linear):
    """Unset: both libraries are timed at 1 and 32 rows, once per process, and one is chosen;
    the environment variable skips the timing. `linear` then runs exactly that library."""
    import torch.nn.functional as F

    from engine.kernels.float32_linear import ONEDNN_LINEAR, float32_linear_backend, onednn_linear
    from engine.layers.linear import linear

    timed = float32_linear(None)
    assert float32_linear_backend() is timed  # measured once
    if ONEDNN_LINEAR:
        assert timed["backend"] in ("mkl", "onednn") and set(timed["ms"]) == {1, 32}
    x, w, b = torch.randn(3, 48), torch.randn(20, 48), torch.randn(20)
    assert float32_linear("mkl")["why"].endswith("=mkl")
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    if ONEDNN_LINEAR:
        assert float32_linear("onednn")["backend"] == "onednn"
        assert torch.equal(linear(x, w, b), onednn_linear(x, w, b))


@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_both_float32_linear_libraries_match_transformers(
    tiny_model, tiny_hf_model, sequences, float32_linear, backend
):
    """Whichever library this machine picks, the model agrees with transformers through it."""
    from engine.kernels.float32_linear import ONEDNN_LINEAR

    if backend == "onednn" and not ONEDNN_LINEAR:
        pytest.skip("this PyTorch build has no oneDNN linear")
    float32_linear(backend)
    model = tiny_model.with_kernels("torch")  # its layers choose the library as they are built
    batched, _ = run_mixed_batch(model, sequences)
    for name, n in {"a": 13, "b": 37, "c": 31, "d": 33}.items():
        ref = hf_logits(tiny_hf_model, sequences[name][:n])[-1]
        assert rel_err(batched[name], ref) <= TOL, name


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shuffled_block_tables_and_stale_blocks_give_same_logits(tiny_model, sequences, seed):
    contiguous, _ = run_mixed_batch(tiny_model, sequences)
    shuffled, runner = run_mixed_batch(tiny_model, sequences, shuffle_seed=seed, garbage=True)
    tables = list(runner.tables.values())
    assert any(
        t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in tables
    )  # really non-contiguous
    for name in "abcd":
        torch.testing.assert_close(shuffled[name], contiguous[name], rtol=1e-6, atol=1e-6)


def test_rope_table_gives_the_angles_computed_for_each_step(tiny_model):
    """On a CPU the model looks cos and sin up in a table (vLLM's cos_sin_cache): the same bits
    as computing them, at positions inside the first table, past it (the table grows three
    times here: to 512, to about 5,000, then to twice that), in any order, in bfloat16 too; a
    negative position is a clear error."""
    from engine.layers.ops import RotaryEmbedding

    rotary = tiny_model.rotary
    assert rotary.cos_sin == rotary.looked_up
    g = torch.Generator().manual_seed(3)
    for positions in (
        torch.tensor([0]),
        torch.randint(0, 256, (40,), generator=g),
        torch.tensor([300, 2, 299]),
        torch.randint(0, 5000, (300,), generator=g),
        torch.arange(6000),
    ):
        (cos, sin), (want_cos, want_sin) = rotary.cos_sin(positions), rotary.computed(positions)
        assert cos.shape == want_cos.shape == (len(positions), 1, tiny_model.cfg.head_dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert len(rotary.cos_table) >= 6000
    bf16 = RotaryEmbedding(rotary.inv_freq, dtype=torch.bfloat16)
    positions = torch.randint(0, 1000, (50,), generator=g)
    assert torch.equal(bf16.cos_sin(positions)[0], bf16.computed(positions)[0])
    with pytest.raises(ValueError, match="negative"):
        rotary.cos_sin(torch.tensor([4, -1]))
    assert RotaryEmbedding(torch.ones(4, device="meta")).cos_sin.__name__ == "computed"


def test_forward_builds_no_autograd_graph_and_refuses_weights_that_want_one(tiny_model):
    """forward runs without torch.inference_mode (entering it each step cost ~15 µs in a cold
    cache): no weight requires a gradient, so its logits carry no graph; a weight that does is
    refused when the model is built."""
    ids = torch.tensor([5, 6, 7])
    caches = tiny_model.allocate_kv_cache(4, 16)
    meta = build_attention_metadata([3], [0], [[0]], 16)
    logits = tiny_model.forward(ids, torch.arange(3), caches, meta, torch.tensor([2]))
    assert not logits.requires_grad and logits.grad_fn is None
    weights = {**tiny_model.w, "final_norm": tiny_model.w["final_norm"].clone().requires_grad_()}
    with pytest.raises(ValueError, match="gradients"):
        LlamaModel(tiny_model.cfg, weights, tiny_model.device, tiny_model.dtype)


def test_slot_mapping_writes_only_own_slots(tiny_model, sequences):
    """After a step, cache slots outside the requests' tokens keep their old contents."""
    runner = PagedRunner(tiny_model, 8, BLOCK, shuffle_seed=5)
    runner.fill_garbage(seed=9)
    before = [k.clone() for k, _ in runner.kv_caches]
    runner.step([("x", sequences["a"])])  # 13 tokens: 1 block, slots 0..12 of it
    (block,) = runner.tables["x"]
    for k_before, (k_after, _) in zip(before, runner.kv_caches):
        changed = (k_before != k_after).flatten(2).any(-1)  # [num_blocks, block_size]
        expect = torch.zeros_like(changed)
        expect[block, :13] = True
        assert torch.equal(changed, expect)


def test_batched_greedy_decode_equals_transformers_generate(tiny_model, tiny_hf_model, sequences):
    prompts = [sequences["f"], sequences["e"], sequences["g"], sequences["c"]]
    ours, schedule = greedy_batched(
        tiny_model, prompts, max_new_tokens=12, chunk=24, long_prompt=40, shuffle_seed=7
    )
    assert any(len(s) > 1 and max(s) > 1 and 1 in s for s in schedule)  # chunks mixed with decodes
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            ref = tiny_hf_model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=None,
                pad_token_id=2,
            )[0, len(prompt) :].tolist()
        assert len(ref) == 12
        assert out == ref


def test_bfloat16_runs_and_stays_close(tiny_model_dir, tiny_hf_model, sequences):
    model = LlamaModel.from_pretrained(tiny_model_dir, device="cpu", dtype=torch.bfloat16)
    assert model.w["embed"].dtype == torch.bfloat16
    kv = model.allocate_kv_cache(4, BLOCK)
    assert kv[0][0].dtype == torch.bfloat16
    batched, _ = run_mixed_batch(model, sequences)
    for name, n in {"a": 13, "b": 37, "c": 31, "d": 33}.items():
        ref = hf_logits(tiny_hf_model, sequences[name][:n])[-1]
        got = batched[name]
        assert got.dtype == torch.float32  # logits come back as float32 whatever the model dtype
        assert torch.isfinite(got).all()
        assert rel_err(got, ref) <= 0.1, name
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.995, name


def test_bfloat16_with_the_attention_kernel_stays_close(tiny_model_dir, tiny_hf_model, sequences):
    """A bfloat16 engine on a CPU runs our C++ attention over its bfloat16 cache (kernels="auto"):
    as close to transformers as the torch path, and close to that path itself."""
    from engine import kernels

    base = LlamaModel.from_pretrained(tiny_model_dir, device="cpu", dtype=torch.bfloat16)
    model = base.with_kernels("auto")
    if model.kernel_path != "cpu":
        pytest.skip(f"C++ kernels unavailable: {kernels.build_error()}")
    batched, _ = run_mixed_batch(model, sequences)
    reference, _ = run_mixed_batch(base.with_kernels("torch"), sequences)
    for name, n in {"a": 13, "b": 37, "c": 31, "d": 33}.items():
        ref = hf_logits(tiny_hf_model, sequences[name][:n])[-1]
        assert rel_err(batched[name], ref) <= 0.1, name
        assert torch.nn.functional.cosine_similarity(batched[name], ref, dim=0) > 0.995, name
        assert rel_err(batched[name], reference[name]) <= 0.05, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_mixed_batch_matches_transformers(tiny_model_dir, tiny_hf_model, sequences):
    model = LlamaModel.from_pretrained(tiny_model_dir, device="cuda", dtype=torch.float32)
    assert model.w["embed"].is_cuda and model.allocate_kv_cache(1, BLOCK)[0][0].is_cuda
    batched, _ = run_mixed_batch(model, sequences, shuffle_seed=1)
    for name, n in {"a": 13, "b": 37, "c": 31, "d": 33}.items():
        ref = hf_logits(tiny_hf_model, sequences[name][:n])[-1]
        assert rel_err(batched[name], ref) <= 1e-3, name  # GPU kernels sum in another order
        assert batched[name].argmax() == ref.argmax(), name


def test_qwen2_style_model_with_qkv_bias_matches_transformers(tiny_qwen2_dir, sequences):
    """Qwen2 directories load too: q/k/v projections carry a bias, lm_head is untied."""
    from transformers import AutoModelForCausalLM

    model = LlamaModel.from_pretrained(tiny_qwen2_dir, device="cpu", dtype=torch.float32)
    assert model.cfg.attention_bias and not model.cfg.tie_word_embeddings
    assert "0.qkv_bias" in model.w and model.w["lm_head"].data_ptr() != model.w["embed"].data_ptr()
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    batched, _ = run_mixed_batch(model, sequences)
    for name, n in {"a": 13, "b": 37, "c": 31, "d": 33}.items():
        ref = hf_logits(hf, sequences[name][:n])[-1]
        assert rel_err(batched[name], ref) <= TOL, name
        assert batched[name].argmax() == ref.argmax(), name
