"""kv_cache_dtype (vLLM's CacheConfig.cache_dtype): a float32 engine whose KV cache holds
bfloat16. The setting is checked where it is given; the cache, its byte count and the blocks a
memory budget buys follow it; K/V are rounded as they are written, and every path that attends
(our kernel, the torch path, a first prefill chunk on its fresh K/V, a chunked prompt) sees the
same rounded values, so greedy tokens do not depend on which path or how the prompt was cut."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.config import EngineConfig, check_kv_cache_dtype
from engine.entrypoints.weights_cli import add_quantization_args
from engine.sampling_params import SamplingParams

PROMPTS = ["모델의 가중치는", "The KV cache holds the keys and values of every token so far", "1 2"]


def greedy(engine, prompts: list[str], n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in requests]


def test_the_setting_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="float32 or bfloat16 model"):
        EngineConfig(dtype="float16", kv_cache_dtype="bfloat16")
    for dtype in (None, "auto", "float32", "bfloat16", torch.float32):
        check_kv_cache_dtype("bfloat16", dtype)
    assert EngineConfig().kv_cache_dtype == "auto"


def test_the_cli_flag_names_the_config_field():
    p = argparse.ArgumentParser()
    add_quantization_args(p)
    assert p.parse_args([]).kv_cache_dtype == "auto"
    assert p.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])


def test_a_bfloat16_cache_holds_twice_the_blocks_in_the_same_bytes(make_engine):
    budget = 1 << 20
    full = make_engine(num_kv_blocks=None, kv_cache_memory=budget)
    half = make_engine(num_kv_blocks=None, kv_cache_memory=budget, kv_cache_dtype="bfloat16")
    assert full.kv_cache_dtype == torch.float32 and half.kv_cache_dtype == torch.bfloat16
    assert half.dtype == torch.float32  # only the cache changes
    full_worker, half_worker = full.executor.worker, half.executor.worker
    assert half_worker.bytes_per_block * 2 == full_worker.bytes_per_block
    assert half.num_blocks == 2 * full.num_blocks
    for k, v in half_worker.runner.kv_caches:
        assert k.dtype == v.dtype == torch.bfloat16
    assert half.kv_cache_bytes() == full.kv_cache_bytes()


def test_the_cache_holds_the_rounded_keys_the_model_computed(make_engine):
    """The same request in a float32 cache and a bfloat16 one: every written slot holds the
    float32 value rounded to nearest even (torch's .to(torch.bfloat16))."""
    engines = [
        make_engine(kernels="torch"),
        make_engine(kernels="torch", kv_cache_dtype="bfloat16"),
    ]
    for engine in engines:
        greedy(engine, PROMPTS[1:2], n=1)  # the prompt's K/V only: no token of their own yet
    (k32, v32), (k16, v16) = (e.executor.worker.runner.kv_caches[0] for e in engines)
    written = k32.abs().sum(dim=(2, 3)) > 0  # the slots the prompt wrote
    assert written.sum() > 0
    assert torch.equal(k16[written], k32[written].to(torch.bfloat16))
    assert torch.equal(v16[written], v32[written].to(torch.bfloat16))


def test_every_attention_path_gives_the_same_tokens(ext, make_engine):
    """Our kernel and the torch path; a prompt attended whole (SDPA on its fresh, rounded K/V)
    and cut into 4-token chunks that read the rounded cache."""
    outputs = {
        (kernels, budget): greedy(
            make_engine(
                kernels=kernels,
                kv_cache_dtype="bfloat16",
                max_num_batched_tokens=budget,
                long_prefill_token_threshold=0,
            ),
            PROMPTS,
        )
        for kernels in ("auto", "torch")
        for budget in (512, 4)
    }
    first = outputs[("torch", 512)]
    assert all(len(tokens) == 12 for tokens in first)
    assert all(tokens == first for tokens in outputs.values()), outputs


@pytest.mark.parametrize("use_kernel", [False, True])
def test_a_prompt_whole_or_in_two_chunks_attends_to_the_same_rounded_keys(ext, use_kernel):
    """A first chunk attends to its fresh K/V (SDPA), a later chunk to what the cache holds: with
    a bfloat16 cache both must be the rounded values, or a prompt's outputs would depend on
    where the scheduler cut it."""
    from engine.layers.attention import build_attention_metadata, paged_attention

    g = torch.Generator().manual_seed(0)
    n, cut, kv_heads, group, head_dim, block_size = 40, 24, 2, 3, 64, 16
    q = torch.randn(n, kv_heads * group, head_dim, generator=g)
    k = torch.randn(n, kv_heads, head_dim, generator=g) * 3
    v = torch.randn(n, kv_heads, head_dim, generator=g) * 3
    table, scale = [[2, 0, 1]], head_dim**-0.5
    kernels = ext if use_kernel else None

    def cache():
        return torch.zeros(3, block_size, kv_heads, head_dim, dtype=torch.bfloat16)

    kc, vc = cache(), cache()
    whole = paged_attention(
        q, k, v, kc, vc, build_attention_metadata([n], [0], table, 16), scale, kernels
    )
    kc, vc = cache(), cache()
    rows = slice(0, cut)
    first = build_attention_metadata([cut], [0], table, block_size)
    paged_attention(q[rows], k[rows], v[rows], kc, vc, first, scale, kernels)
    rows = slice(cut, n)
    second = build_attention_metadata([n - cut], [cut], table, block_size, for_kernel=use_kernel)
    rest = paged_attention(q[rows], k[rows], v[rows], kc, vc, second, scale, kernels)
    torch.testing.assert_close(rest, whole[rows], atol=2e-5, rtol=1e-4)
