"""Our C++ kernels against their pure-torch references.

- paged attention: the kernel path of engine.attention.paged_attention against the torch path, on
  random flat batches (decodes, first prefill chunks, chunks after a cached prefix), shuffled
  non-contiguous block tables, GQA ratios 1, 3, 4, context lengths 1, block boundary ± 1 and
  several hundred, with junk in every cache slot nobody owns; float32 and bfloat16 (against the
  torch path and against float32 on the same inputs), and float32 queries over a bfloat16 cache
  (kv_cache_dtype); q, k, v as strided views of a fused qkv;
  one long context cut into key ranges and merged;
- int8 / int4 weight-only linear against dequantize-then-matmul, every row count 1..40 (the
  fused one-row path and the register tiles with their remainders); int4 with activations
  rounded to int8 blocks (the GGUF path, llama.cpp's Q4_1 x Q8_1) against rounding in torch;
- RMSNorm (alone and fused with the residual add), RoPE and SwiGLU's silu(gate) * up against
  the model's torch rms_norm, add_rms_norm, apply_rope and silu_and_mul, any shape;
- the fallback: "torch" never uses the extension, a failed build leaves the torch path; an
  engine's `kernels=` setting reaches its quantized linears (spied), engines side by side;
- the whole engine: greedy tokens with kernels="auto" equal kernels="torch" token for token (slow).

The extension is built once per session (a minute or two on 2 cores the very first time, then
cached); every kernel test skips with the reason if it cannot build.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import kernels
from engine.kernels.quant import (
    Int4Weight,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantized_linear,
    reference_linear,
    round_activations_q8,
    unpack_int4,
)
from engine.layers.attention import build_attention_metadata, paged_attention

HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# -- paged attention ------------------------------------------------------------------------


def run_both(
    ext,
    requests: list[tuple[int, int]],
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    fused: bool = False,
    with_exact: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """requests: (tokens already cached, new tokens) each. Returns (torch output, kernel output),
    and with_exact the torch path in float32 on the same inputs widened (the exact answer).
    fused: q, k, v are views of one [tokens, (heads + 2 kv_heads) * head_dim] tensor, as the
    model's fused qkv projection gives them (strided between tokens, heads contiguous).
    cache_dtype: what the caches hold (None: `dtype`; bfloat16 under float32: kv_cache_dtype)."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    total_blocks = sum(-(-(c + n) // block_size) for c, n in requests) + 3
    ids = list(range(total_blocks))
    random.Random(seed).shuffle(ids)  # non-contiguous, shuffled physical blocks
    tables = []
    for cached, new in requests:
        need = -(-(cached + new) // block_size)
        tables.append([ids.pop() for _ in range(need)])
    shape = (total_blocks, block_size, kv_heads, head_dim)
    # junk everywhere (blocks of finished requests); the cached prefixes are whatever lies there
    k_cache = (torch.randn(shape, generator=g) * 3).to(cache_dtype or dtype)
    v_cache = (torch.randn(shape, generator=g) * 3).to(cache_dtype or dtype)
    num_tokens = sum(n for _, n in requests)
    if fused:
        qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
        q, k, v = (
            part.view(num_tokens, -1, head_dim)
            for part in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
        )
        if num_tokens > 1:  # (torch gives a dimension of size 1 any stride it likes)
            assert q.stride(0) == k.stride(0) == v.stride(0) == qkv.stride(0)  # a fused row apart
    else:
        q = torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(dtype)
    lens = ([n for _, n in requests], [c for c, _ in requests], tables, block_size)
    meta = build_attention_metadata(*lens)
    # what the runner builds when the kernel attends: no padded decode groups, no masks
    kernel_meta = build_attention_metadata(*lens, for_kernel=True)
    assert not kernel_meta.decode_groups
    assert torch.equal(kernel_meta.slot_mapping, meta.slot_mapping)
    scale = head_dim**-0.5
    kc, vc = k_cache.clone(), v_cache.clone()
    exact = paged_attention(
        q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, scale, kernels=None
    )
    ref = paged_attention(q, k, v, kc, vc, meta, scale, kernels=None)
    out = paged_attention(q, k, v, k_cache, v_cache, kernel_meta, scale, kernels=ext)
    with pytest.raises(ValueError, match="for_kernel"):  # never silently half-attended
        paged_attention(q, k, v, kc.clone(), vc.clone(), kernel_meta, scale, kernels=None)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)  # the same cache writes
    assert out.dtype == dtype
    return (ref, out, exact) if with_exact else (ref, out)


@pytest.fixture
def two_threads():
    """The kernel cuts long contexts into key ranges only when there are threads to share them."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("context", [1, 2, 15, 16, 17, 31, 33, 300])
def test_decode_context_lengths_and_gqa(ext, group, context):
    """One decode token after context - 1 cached ones (context 1: a 1-token prompt, prefill)."""
    requests = [(context - 1, 1), (max(context - 5, 1), 1)]
    ref, out = run_both(
        ext, requests, kv_heads=3, group=group, head_dim=64, block_size=16, seed=context
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cached, new", [(16, 1), (15, 2), (16, 16), (17, 40), (300, 37), (5, 200)])
def test_prefill_chunk_after_a_cached_prefix(ext, cached, new):
    """Causal inside the chunk, full view of the prefix, tiles of 16 rows cut anywhere."""
    ref, out = run_both(
        ext,
        [(cached, new), (40, 1)],
        kv_heads=3,
        group=3,
        head_dim=64,
        block_size=16,
        seed=cached + new,
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [8, 24, 40, 72])
@pytest.mark.parametrize("group", [1, 3])
def test_head_dims_that_end_in_a_partial_vector(ext, head_dim, group):
    """The kernel's vectors are 16 (AVX-512) or 8 (AVX2) floats wide; the rest of a row is read
    with a lane mask. Decodes (one short, one past a chunk of keys) and a prefill after a prefix."""
    requests = [(20, 1), (3, 1), (37, 19)]
    ref, out = run_both(
        ext, requests, kv_heads=3, group=group, head_dim=head_dim, block_size=16, seed=head_dim
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "cached, new", [(128, 1), (129, 1), (500, 1), (2047, 1), (1000, 20), (300, 16), (200, 60)]
)
def test_batch_1_long_contexts_are_cut_into_key_ranges_and_merged(ext, two_threads, cached, new):
    """One request (3 KV heads: 3 items for 2 threads) splits its keys into ranges whose partial
    softmax states are merged; with a prefill chunk, late ranges are invisible to early rows."""
    ref, out = run_both(
        ext, [(cached, new)], kv_heads=3, group=3, head_dim=64, block_size=16, seed=cached + new
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_heads, group", [(1, 4), (2, 3), (3, 3)])
def test_batch_1_decode_items_take_every_kv_head_of_their_key_range(
    ext, two_threads, kv_heads, group
):
    """A decode tile's items take all KV heads of a key range (each cache row read in one
    stretch), one range per thread; their states merge into the same answer. Contexts around the
    range's minimum length, calls of other shapes in between: the kernel reuses its plan's
    buffers from call to call. A long context beside short ones is cut too."""
    for requests in ([(47, 1)], [(48, 1)], [(400, 1)], [(900, 1), (30, 1), (60, 1)], [(2, 1)]):
        ref, out = run_both(
            ext,
            requests,
            kv_heads=kv_heads,
            group=group,
            head_dim=64,
            block_size=16,
            seed=len(requests) + requests[0][0],
        )
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_a_fused_qkv_are_read_in_place(ext, dtype):
    """The model hands over q, k, v as strided views of its qkv projection: no copy needed."""
    requests = [(40, 1), (0, 7), (17, 5), (300, 1)]
    ref, out = run_both(
        ext,
        requests,
        kv_heads=3,
        group=3,
        head_dim=64,
        block_size=16,
        seed=7,
        dtype=dtype,
        fused=True,
    )
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(out, ref, **tol)


# bfloat16 outputs: the kernel and SDPA both compute in float32 and round once; their float32
# sums differ in order, which can move a rounded value by one bfloat16 step (2^-8 relative).
BF16_TOLERANCE = dict(atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize(
    "requests",
    [
        [(0, 1)],
        [(15, 1)],
        [(300, 1)],
        [(1000, 1)],
        [(40, 1), (3, 1), (37, 19)],
        [(0, 20), (100, 24)],
    ],
)
@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize("queries", [torch.bfloat16, torch.float32])
def test_bfloat16_cache_is_read_and_written_in_bfloat16(
    ext, two_threads, requests, head_dim, queries
):
    """A bfloat16 cache: K/V stream at half the bytes. Under a bfloat16 engine's queries, results
    within one rounding. Under a float32 engine's (kv_cache_dtype="bfloat16"), the new K/V are
    rounded as they are written (the same cache contents on both paths, a first chunk attending
    to its K/V rounded the same way) and everything else is float32: the kernel equals the torch
    path to float32's rounding."""
    ref, out, exact = run_both(
        ext,
        requests,
        kv_heads=3,
        group=3,
        head_dim=head_dim,
        block_size=16,
        seed=head_dim,
        dtype=queries,
        with_exact=True,
        cache_dtype=torch.bfloat16,
    )
    if queries == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        return
    torch.testing.assert_close(out, ref, **BF16_TOLERANCE)
    # against the exact answer: at most one bfloat16 step (2^-7 relative) from float32's own
    torch.testing.assert_close(out.float(), exact, atol=1e-5, rtol=2**-7)


@HYPOTHESIS
@given(
    requests=st.lists(
        # (cached, new); a third of them decodes (new = 1)
        st.tuples(st.integers(0, 400), st.integers(1, 40)).map(
            lambda r: (r[0], 1 if r[1] > 30 else r[1])
        ),
        min_size=1,
        max_size=6,
    ),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([16, 64]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
    dtypes=st.sampled_from(
        [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)]
    ),
    fused=st.booleans(),
)
def test_random_flat_batches(
    ext, requests, kv_heads, group, head_dim, block_size, seed, dtypes, fused
):
    dtype, cache_dtype = dtypes
    ref, out, exact = run_both(
        ext,
        requests,
        kv_heads,
        group,
        head_dim,
        block_size,
        seed,
        dtype,
        fused,
        with_exact=True,
        cache_dtype=cache_dtype,
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(out, ref, **BF16_TOLERANCE)
        torch.testing.assert_close(out.float(), exact, atol=1e-5, rtol=2**-7)


# -- quantized linear -----------------------------------------------------------------------


def test_quantize_round_trips_within_half_a_step():
    w = torch.randn(40, 96)
    q8 = quantize_int8(w)
    assert q8.qweight.dtype == torch.int8 and q8.scales.shape == (40,)
    assert ((dequantize_int8(q8) - w).abs() <= q8.scales.unsqueeze(1) / 2 + 1e-6).all()
    q4 = quantize_int4(w, group_size=32)
    assert q4.packed.shape == (40, 48) and q4.scales.shape == (40, 3) and q4.shape == w.shape
    assert unpack_int4(q4).max() <= 15
    step = q4.scales.repeat_interleave(32, dim=1)
    assert ((dequantize_int4(q4) - w).abs() <= step / 2 + 1e-5).all()


def test_int4_packing_puts_the_group_halves_in_the_two_nibbles():
    w = torch.arange(32, dtype=torch.float32).view(1, 32) / 31 * 15  # q = 0..15 twice, in order
    q4 = quantize_int4(w, group_size=32)
    expected = [round(i / 31 * 15) for i in range(32)]
    assert unpack_int4(q4)[0].tolist() == expected
    assert q4.packed[0, 0].item() == expected[0] | (expected[16] << 4)


def _float16_scales(qw: Int4Weight) -> Int4Weight:
    """The weight with its scales and minimums rounded to float16, as a GGUF stores them."""
    return replace(qw, scales=qw.scales.half(), mins=qw.mins.half())


def _check_quantized_linear(
    ext, rows, out_features, in_features, group_size, bits, bias, seed, float16_scales=False
):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group_size)
    if float16_scales and bits == 4:
        qw = _float16_scales(qw)
    torch.testing.assert_close(
        quantized_linear(x, qw, b, kernels=ext), reference_linear(x, qw, b), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_every_row_count_from_0_to_40(ext, bits):
    """No rows (the output layer of a step where no request samples) give no rows; batch 1
    takes the fused path; 2..40 rows the register tiles (4 rows × a few channels), so
    every remainder of rows modulo the tile shows up, with output channels that end mid-tile and
    mid-work-item (37) and, for int8, an input width that ends mid-vector (83 = 5 × 16 + 3); for
    int4 odd numbers of groups (3 × 16, and 5 × 6 whose half-groups of 3 nibbles are odd) and
    groups of 32, whose one-row case runs in tiles of 8 channels (37 = 4 × 8 + 5), also with
    float16 scales and minimums (a GGUF's)."""
    for rows in range(41):
        if bits == 8:
            _check_quantized_linear(ext, rows, 37, 83, 0, 8, rows % 2 == 0, seed=rows)
        else:
            _check_quantized_linear(ext, rows, 37, 48, 16, 4, rows % 2 == 0, seed=rows)
            _check_quantized_linear(ext, rows, 37, 96, 32, 4, rows % 2 == 1, seed=rows + 50)
            _check_quantized_linear(ext, rows, 37, 96, 32, 4, rows % 2 == 0, rows + 70, True)
            _check_quantized_linear(ext, rows, 21, 30, 6, 4, rows % 3 == 0, seed=rows + 100)


@HYPOTHESIS
@given(
    rows=st.integers(1, 40),
    out_features=st.integers(1, 300),
    groups=st.integers(1, 25),
    group_size=st.sampled_from([32, 64, 16, 6, 2]),
    bits=st.sampled_from([8, 4]),
    int8_width=st.integers(1, 400),
    with_bias=st.booleans(),
    float16_scales=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantized_linear_matches_dequantize_then_matmul(
    ext, rows, out_features, groups, group_size, bits, int8_width, with_bias, float16_scales, seed
):
    """Random shapes: row counts 1..40 (tile remainders), odd and even group counts, int8 input
    widths that are no multiple of the vector width, int4 scales in float32 or float16."""
    in_features = groups * group_size if bits == 4 else int8_width
    _check_quantized_linear(
        ext, rows, out_features, in_features, group_size, bits, with_bias, seed, float16_scales
    )


def test_quantized_linear_keeps_leading_dimensions(ext):
    w = torch.randn(24, 64)
    x = torch.randn(2, 3, 64)
    for qw in (quantize_int8(w), quantize_int4(w)):
        y = quantized_linear(x, qw, kernels=ext)
        assert y.shape == (2, 3, 24)
        torch.testing.assert_close(y, reference_linear(x, qw), atol=1e-4, rtol=1e-4)


# -- which path runs ------------------------------------------------------------------------


def test_q8_rounding_is_llama_cpps_int8_blocks():
    """Each block of 32: scale = max |x| / 127, values round to the nearest multiple (ties to
    even), the largest lands on ±127 exactly, an all-zero block stays zero."""
    x = torch.cat([torch.randn(32) * 3, torch.zeros(32), torch.arange(32.0) - 16]).view(1, 96)
    r = round_activations_q8(x)
    d = x.view(3, 32).abs().amax(dim=1) / 127
    assert torch.equal(r.view(3, 32)[1], torch.zeros(32))
    for b in (0, 2):
        steps = r.view(3, 32)[b] / d[b]
        assert torch.allclose(steps, steps.round(), atol=1e-4)  # integers times the scale
        assert (r.view(3, 32)[b] - x.view(3, 32)[b]).abs().max() <= d[b] / 2 + 1e-6
        assert steps.abs().max().round() == 127


@pytest.mark.parametrize("rows", [1, 2, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("float16_scales", [False, True])
def test_int4_with_q8_activations_matches_its_reference(ext, rows, bias, float16_scales):
    """The GGUF path's kernel: integer dot products at one row (channels 37: tiles of 8 and a
    remainder; 3 groups: a pair and an odd one), the float kernel on the rounded rows above that;
    against rounding in torch, then dequantize-and-matmul; scales in float32 or float16."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, 96, generator=g) * 0.05
    x = torch.randn(rows, 96, generator=g) * 2
    b = torch.randn(37, generator=g) if bias else None
    qw = replace(quantize_int4(w, 32), q8_activations=True)
    if float16_scales:
        qw = _float16_scales(qw)
    out = quantized_linear(x, qw, b, kernels=ext)
    torch.testing.assert_close(out, reference_linear(x, qw, b), atol=1e-4, rtol=1e-4)
    # and it is not the weight-only product: the rounding of x shows
    assert not torch.allclose(out, reference_linear(x, replace(qw, q8_activations=False), b))


@HYPOTHESIS
@given(
    out_features=st.integers(1, 70),
    groups=st.integers(1, 20),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    float16_scales=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int4_q8_one_row_on_random_shapes(ext, out_features, groups, scale, float16_scales, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, 32 * groups, generator=g)
    x = torch.randn(1, 32 * groups, generator=g) * scale
    qw = replace(quantize_int4(w, 32), q8_activations=True)
    if float16_scales:
        qw = _float16_scales(qw)
    ref = reference_linear(x, qw)
    torch.testing.assert_close(
        quantized_linear(x, qw, kernels=ext), ref, atol=1e-4 * scale, rtol=1e-4
    )


def test_int4_kernels_refuse_scales_they_cannot_read(ext):
    """Mixed float32/float16 scales and minimums, another dtype, or a count that is not one per
    group: a clear error from the kernel, never a read past the end."""
    qw = quantize_int4(torch.randn(8, 64), 32)
    x = torch.randn(1, 64)
    bad = [
        (qw.scales.half(), qw.mins, "both float32 or both float16"),
        (qw.scales.double(), qw.mins.double(), "both float32 or both float16"),
        (qw.scales[:4], qw.mins[:4], "one scale and one min per group"),
    ]
    for name in ("int4_linear", "int4_q8_linear"):
        for scales, mins, message in bad:
            with pytest.raises(RuntimeError, match=message):
                getattr(ext, name)(x, qw.packed, scales, mins, 32, None)


@HYPOTHESIS
@given(
    rows=st.integers(1, 130),
    width=st.integers(1, 700),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_matches_the_torch_reference(ext, rows, width, scale, seed):
    """Row counts below and above the kernel's 64-row parallel grain, widths that are no multiple
    of the vector width, tiny and large activations (eps matters for the tiny ones)."""
    from engine.layers.ops import RMSNorm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * scale
    norm = RMSNorm(torch.randn(width, generator=g), 1e-5, kernels=ext)
    assert norm.forward == norm.forward_cpu  # chosen once, at construction
    torch.testing.assert_close(norm(x), norm.forward_native(x), atol=1e-5, rtol=1e-5)


@HYPOTHESIS
@given(
    rows=st.integers(1, 130),
    width=st.integers(1, 700),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_matches_the_torch_reference(ext, rows, width, scale, seed):
    """The residual add fused with the next norm: the sum exactly (one float addition per
    element either way), the norm as closely as rms_norm's."""
    from engine.layers.ops import RMSNorm

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, width, generator=g) * scale
    delta = torch.randn(rows, width, generator=g) * scale
    norm = RMSNorm(torch.randn(width, generator=g), 1e-5, kernels=ext)
    total, normed = norm.forward_cpu(delta, residual=h)
    ref_total, ref_normed = norm.forward_native(delta, residual=h)
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(normed, ref_normed, atol=1e-5, rtol=1e-5)


@HYPOTHESIS
@given(
    rows=st.integers(1, 70),
    half=st.integers(1, 400),
    scale=st.sampled_from([1e-2, 1.0, 8.0, 100.0]),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_matches_the_torch_reference(ext, rows, half, scale, seed):
    """silu(gate) * up from the two halves of each row: negative and positive gates, large ones
    (sigmoid saturates to 0 or 1), widths no multiple of the vector width."""
    from engine.layers.ops import SiluAndMul

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * half, generator=g) * scale
    act = SiluAndMul(kernels=ext)
    torch.testing.assert_close(
        act.forward_cpu(gate_up), act.forward_native(gate_up), atol=1e-6, rtol=1e-5
    )


@HYPOTHESIS
@given(
    tokens=st.integers(1, 80),
    heads=st.integers(1, 12),
    half=st.integers(1, 40),
    extra=st.integers(0, 70),
    seed=st.integers(0, 2**16),
)
def test_rope_matches_the_torch_reference(ext, tokens, heads, half, extra, seed):
    """Queries and keys as the model rotates them: a view of the fused qkv rows (`extra` more
    columns per row, the values), heads contiguous, positions anywhere up to 4096."""
    from engine.layers.ops import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    qkv = torch.randn(tokens, heads * d + extra, generator=g)
    x = qkv[:, : heads * d].view(tokens, heads, d)
    freqs = torch.randint(0, 4096, (tokens, 1), generator=g).float() * torch.rand(half, generator=g)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    cos, sin = angles.cos(), angles.sin()
    rope = RotaryEmbedding(torch.ones(half), kernels=ext)
    torch.testing.assert_close(
        rope.forward_cpu(x, cos, sin), rope.forward_native(x, cos, sin), atol=1e-5, rtol=1e-5
    )


def test_torch_mode_and_other_devices_never_use_the_kernels():
    assert kernels.resolve("torch", torch.device("cpu"), torch.float32) == "torch"
    assert kernels.resolve("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    assert kernels.resolve("auto", torch.device("cpu"), torch.float16) == "torch"
    with pytest.raises(ValueError):
        kernels.resolve("fast", torch.device("cpu"), torch.float32)


def test_attention_kernel_serves_float32_and_bfloat16_on_a_cpu(ext):
    for dtype in (torch.float32, torch.bfloat16):
        assert kernels.resolve("auto", torch.device("cpu"), dtype) == "cpu"


def test_a_failed_build_falls_back_to_torch(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("g++: command not found")

    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_error", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert kernels.load() is None
    assert "g++: command not found" in kernels.build_error()
    assert "did not build" in caplog.text
    assert kernels.resolve("auto", torch.device("cpu"), torch.float32) == "torch"
    assert "torch" in kernels.describe("torch")
    caplog.clear()
    assert kernels.load() is None  # not tried again, not logged again
    assert caplog.text == ""


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of the quantized linears' torch reference (dequantize, then matmul)."""
    from engine.kernels import quant

    calls = {"reference_linear": 0}
    real = quant.reference_linear

    def counting(*args, **kwargs):
        calls["reference_linear"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(quant, "reference_linear", counting)
    return calls


def _greedy_batch(engine, prompts: list[str], n: int) -> list[list[int]]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in requests]


PROMPTS = ["모델의 가중치는", "The KV cache holds", "블록 테이블"]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_kernels_setting_reaches_the_quantized_linears(ext, spy, make_engine, quantization):
    """kernels="torch" and "auto" engines side by side in one process, sharing one quantized
    model: the torch one runs the reference, the auto one never does (its layers hold our C++
    kernels, bound once, and run as fused blocks), and running the auto engine does not switch
    the torch one over (no process-wide setting)."""
    torch_engine = make_engine(quantization=quantization, kernels="torch")
    auto_engine = make_engine(quantization=quantization, kernels="auto")
    torch_model = torch_engine.executor.worker.model
    auto_model = auto_engine.executor.worker.model
    assert torch_model.w["0.qkv"] is auto_model.w["0.qkv"]  # the same packed weights
    assert (torch_model.linear_kernel_path, auto_model.linear_kernel_path) == ("torch", "cpu")
    for model, ours in ((torch_model, False), (auto_model, True)):
        attention, mlp = model.layers[0].attention, model.layers[0].mlp
        linears = (attention.qkv, attention.o, mlp.gate_up, mlp.down, model.lm_head)
        assert all((linear.kernel is not None) == ours for linear in linears)
        assert (attention.block is not None, mlp.block is not None) == (ours, ours)

    _greedy_batch(torch_engine, PROMPTS, 4)
    after_torch = spy["reference_linear"]
    assert after_torch > 0
    _greedy_batch(auto_engine, PROMPTS, 4)
    assert spy["reference_linear"] == after_torch
    _greedy_batch(torch_engine, PROMPTS[:1], 4)
    assert spy["reference_linear"] > after_torch


def test_int8_engine_greedy_tokens_equal_on_both_paths(ext, make_engine):
    """The tiny model in int8: a batch of three (prefill and decode through the register tiles)
    and one request alone (the fused one-row path): the same greedy tokens on both paths."""
    outputs = {}
    for mode in ("torch", "auto"):
        engine = make_engine(quantization="int8", kernels=mode)
        path = engine.executor.worker.model.linear_kernel_path
        assert path == ("cpu" if mode == "auto" else "torch")
        outputs[mode] = _greedy_batch(engine, PROMPTS, 16) + _greedy_batch(engine, PROMPTS[:1], 16)
    assert outputs["auto"] == outputs["torch"]
    assert all(len(tokens) == 16 for tokens in outputs["auto"])


def test_resolve_linear_serves_bfloat16_on_a_cpu_and_nothing_in_torch_mode():
    assert kernels.resolve_linear("torch", torch.device("cpu"), torch.float32) == "torch"
    assert kernels.resolve_linear("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    expected = "cpu" if kernels.load() is not None else "torch"
    assert kernels.resolve_linear("auto", torch.device("cpu"), torch.bfloat16) == expected
    with pytest.raises(ValueError):
        kernels.resolve_linear("fast", torch.device("cpu"), torch.float32)


# -- the whole engine -----------------------------------------------------------------------


@pytest.mark.slow
def test_engine_greedy_tokens_equal_with_and_without_kernels(ext, default_model_dir, tokenizer):
    """Prefix caching and a small token budget, so that decodes, chunks after a cached prefix and
    prefix-cache hits all go through the kernel."""
    from engine import LLM, SamplingParams

    system = "You are a patient teacher of inference systems. Explain each term you use. " * 6
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        for question in ("What is a KV cache?", "Why are blocks paged?", "What is a block table?")
    ] + ["The history of the printing press begins", "1, 2, 3,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode in ("torch", "auto"):
        llm = LLM(
            model=str(default_model_dir),
            device="cpu",
            kernels=mode,
            max_num_batched_tokens=64,
            num_kv_blocks=256,
            max_model_len=2048,
        )
        expected_path = "cpu" if mode == "auto" else "torch"
        assert llm.engine.executor.worker.model.kernel_path == expected_path
        outputs[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["auto"] == outputs["torch"]


def test_a_build_lock_is_waited_for_until_it_goes_or_grows_stale(tmp_path, monkeypatch):
    """A killed process leaves torch's lock file, and cpp_extension.load would wait on it with
    no limit: we wait while a build could still be running, then remove it. (A process killed
    while loading once left one that hung the app server of a whole test run.)"""
    import threading

    lock = tmp_path / "lock"
    kernels._wait_out_lock(tmp_path)  # nothing there: nothing to wait for
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()  # a live build that finishes
    start = time.monotonic()
    kernels._wait_out_lock(tmp_path, poll_s=0.05)
    assert not lock.exists() and 0.25 < time.monotonic() - start < 5
    lock.touch()  # a dead one: kept while it is young, removed once it is stale
    monkeypatch.setattr(kernels, "STALE_LOCK_S", 0.4)
    start = time.monotonic()
    kernels._wait_out_lock(tmp_path, poll_s=0.05)
    assert not lock.exists() and 0.35 < time.monotonic() - start < 5
    old = time.time() - kernels.STALE_LOCK_S - 5
    lock.touch()
    os.utime(lock, (old, old))
    kernels._wait_out_lock(tmp_path)  # already stale: removed at once
    assert not lock.exists()


def test_kernel_arch_builds_for_another_target_in_a_folder_of_its_own(monkeypatch):
    """LLM_LAB_KERNEL_ARCH=x86-64-v3 builds the AVX2 kernels on any x86 machine (docs/
    performance.md measures that class against llama.cpp built alike); its build folder differs
    from the native one, and the log line says which target it is. Nothing is compiled here."""
    from engine import kernels

    monkeypatch.delenv(kernels.ARCH_ENV, raising=False)
    native = kernels.build_dir()
    assert kernels.kernel_arch() == "native" and "built for" not in kernels.cpu_isa()
    monkeypatch.setenv(kernels.ARCH_ENV, "x86-64-v3")
    assert kernels.kernel_arch() == "x86-64-v3"
    assert kernels.cpu_isa() == "AVX2, built for -march=x86-64-v3"
    assert kernels.build_dir() != native


def test_two_checkouts_build_in_folders_of_their_own(monkeypatch, tmp_path):
    """The same sources in another folder (a second clone) get another build folder: ninja's
    build file names the sources by path, so one shared folder rebuilt on every switch between
    the clones. Nothing is compiled here."""
    import shutil

    from engine import kernels

    monkeypatch.delenv(kernels.ARCH_ENV, raising=False)
    here = kernels.build_dir()
    other = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, other)
    monkeypatch.setattr(kernels, "CSRC", other)
    assert kernels.build_dir() != here
