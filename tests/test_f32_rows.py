"""A float32 linear (csrc/f32_rows.cpp, engine/kernels/float32_linear.py `float32_kernel`): at
up to 8 rows our own kernel, each output summed in the order the C++ file states (checked bit
for bit against that order written in torch, on inputs whose products are exact, so a fused
multiply-add and a product then a sum agree), close to float64, and the same whatever the thread
count, the channels beside it or the other rows; more rows go to the library whole; bad
arguments are refused; and a float32 engine on kernels="auto" runs its linears this way, one on
"torch" never does."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.float32_linear import library_linear, onednn_linear, onednn_linear_works

# SmolLM2's matrices; widths that are no multiple of 16 (the last lanes count 0 x 0), one of
# them over several of the 5-8-row pass's chunks of 128 inputs, and channel counts that are no
# multiple of 4 (the last channels run one at a time)
SHAPES = (
    (960, 576), (576, 1536), (3072, 576), (130, 70), (36, 300), (1000, 48), (37, 5), (3, 16)
)  # fmt: skip
MAX_ROWS = 8  # csrc/kernels.h F32_MAX_ROWS
ROW_COUNTS = (1, 2, 3, 5, 6, 7, MAX_ROWS)  # 4 rows at once; 5-8 in one pass of two sets


def libraries():
    yield "mkl", F.linear, False
    if onednn_linear_works():
        yield "onednn", onednn_linear, True


@pytest.fixture
def threads():
    """Tests change the thread count; restore it after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def in_stated_order(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's sums as f32_rows.cpp states them, each row of x alone: 16 lanes, lane j
    adding the products of inputs j, j + 16, ... in turn (past the end 0 x 0); lanes j + 8,
    j + 4, j + 2, j + 1 folded in; then the bias. Exact only where each product is (the test's
    inputs are powers of two)."""
    (n, k), m = w.shape, x.shape[0]
    padded = -(-k // 16) * 16
    products = torch.zeros(m, n, padded)
    products[:, :, :k] = w[None] * x[:, None, :]
    lanes = torch.zeros(m, n, 16)
    for i in range(0, padded, 16):
        lanes = lanes + products[:, :, i : i + 16]
    for half in (8, 4, 2, 1):
        lanes = lanes[:, :, :half] + lanes[:, :, half : 2 * half]
    total = lanes[:, :, 0]
    return total if bias is None else total + bias


def exact_product_inputs(shape, rows, gen):
    """Weights from a normal distribution and `rows` rows of ±2^e inputs (e in -3 .. 3): every
    product is exact in float32, the sums are not, so their order shows in the result."""
    n, k = shape
    w, bias = torch.randn(shape, generator=gen), torch.randn(n, generator=gen)
    powers = 2.0 ** torch.randint(-3, 4, (rows, k), generator=gen).float()
    signs = torch.where(torch.rand(rows, k, generator=gen) < 0.5, -1.0, 1.0)
    return w, bias, powers * signs


@pytest.mark.parametrize("shape", SHAPES)
def test_up_to_eight_rows_sum_in_the_stated_order(ext, shape):
    for rows in ROW_COUNTS:
        w, bias, x = exact_product_inputs(shape, rows, torch.Generator().manual_seed(rows))
        for b in (None, bias):
            for _, _, onednn in libraries():
                got = ext.f32_linear(x, w, b, onednn)
                assert got.shape == (rows, shape[0])
                assert torch.equal(got, in_stated_order(x, w, b)), (rows, b is not None)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_close_to_float64_and_the_same_in_any_step(ext, threads, shape):
    """The same numbers for a row on 1, 2 or 3 threads, beside other channels (a slice of the
    matrix: other groups of four) and beside other rows (the step's other requests)."""
    gen = torch.Generator().manual_seed(sum(shape))
    w, bias = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
    x = torch.randn(MAX_ROWS, shape[1], generator=gen)
    torch.set_num_threads(1)
    alone = torch.cat([ext.f32_linear(x[r : r + 1], w, bias, True) for r in range(MAX_ROWS)])
    exact = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(alone.double(), exact, rtol=1e-5, atol=1e-4)
    for num_threads in (1, 2, 3):
        torch.set_num_threads(num_threads)
        for rows in ROW_COUNTS:
            assert torch.equal(ext.f32_linear(x[:rows], w, bias, True), alone[:rows])
    lo, hi = 1, shape[0] - 1
    part = ext.f32_linear(x[:3], w[lo:hi], bias[lo:hi], True)
    assert torch.equal(part, alone[:3, lo:hi])


def test_more_rows_and_other_shapes_go_to_the_library_whole(ext, threads):
    torch.set_num_threads(2)
    w = torch.randn(960, 576)
    for x in (torch.randn(MAX_ROWS + 1, 576), torch.randn(2, 3, 576), torch.randn(576)):
        for _, library, onednn in libraries():
            assert torch.equal(ext.f32_linear(x, w, None, onednn), library(x, w))
    x, strided = torch.randn(1, 576), w.T.contiguous().T  # a weight not in rows: the library
    assert torch.equal(ext.f32_linear(x, strided, None, False), F.linear(x, strided))


def test_a_float32_layer_on_our_kernels_is_ours_at_few_rows_and_the_library_at_more(ext, threads):
    """A layer holding a float32 matrix binds our C++ linear where the engine runs our kernels
    (`float32_kernel`), the plain library where it does not: up to 8 rows ours, above that both
    give the library's numbers."""
    from engine.layers.linear import ReplicatedLinear

    torch.set_num_threads(2)
    w, bias = torch.randn(960, 576), torch.randn(960)
    ours, plain = ReplicatedLinear(w, bias, ext), ReplicatedLinear(w, bias, None)
    assert ours.kernel is not None and plain.kernel is None
    for rows in (1, 5):
        x = torch.randn(rows, 576)
        assert torch.equal(ours(x), ext.f32_linear(x, w, bias, True))
        assert torch.equal(plain(x), library_linear()(x, w, bias))
    x = torch.randn(MAX_ROWS + 1, 576)
    assert torch.equal(ours(x), plain(x)) and torch.equal(plain(x), library_linear()(x, w, bias))


def test_the_kernel_refuses_what_it_cannot_run(ext):
    w = torch.randn(256, 64)
    with pytest.raises(RuntimeError, match="float32"):
        ext.f32_linear(torch.randn(1, 64, dtype=torch.float64), w, None, False)
    with pytest.raises(RuntimeError, match="float32"):
        ext.f32_linear(torch.randn(1, 64), w.bfloat16(), None, False)
    with pytest.raises(RuntimeError, match=r"\[out, in\]"):
        ext.f32_linear(torch.randn(1, 32), w, None, False)
    with pytest.raises(RuntimeError, match="bias"):
        ext.f32_linear(torch.randn(1, 64), w, torch.randn(255), False)
    with pytest.raises(RuntimeError, match="bias .* on the CPU"):  # our kernel reads it in place
        ext.f32_linear(torch.randn(1, 64), w, torch.empty(256, device="meta"), True)


def test_a_float32_engine_runs_its_linears_on_our_kernels_only(ext, make_engine):
    """An "auto" engine's float32 layers hold our C++ linears (and so run as fused blocks and one
    layer stack), a "torch" engine's hold none; both produce the same greedy tokens."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode in ("torch", "auto"):
        engine = make_engine(kernels=mode)
        model = engine.executor.worker.model
        ours = mode == "auto"
        assert (model.lm_head.kernel is not None, model.stack is not None) == (ours, ours)
        request = engine.add_request(prompt_token_ids=[5, 6, 7, 8], sampling_params=params)
        while engine.has_unfinished_requests():
            engine.step()
        tokens[mode] = list(request.output_token_ids)
    assert tokens["auto"] == tokens["torch"]
    assert len(tokens["auto"]) == 8


@pytest.mark.parametrize("shape", ((10, 20), (8, 32), (3, 16)))
def test_the_packed_copy_puts_four_channels_weights_together(ext, shape):
    """f32_pack's layout (csrc/kernels.h): for each 16 inputs, 4 channels' 16 weights one after
    another, the last out % 4 channels alone, inputs past the end as zero weights."""
    n, k = shape
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k) + 1
    width = ext.f32_packed_width(k)
    assert width == -(-k // 16) * 16
    packed = torch.full((n, width), float("nan"))
    ext.f32_pack(w, packed)
    padded = torch.zeros(n, width)
    padded[:, :k] = w
    grouped = n // 4 * 4
    together = padded[:grouped].reshape(grouped // 4, 4, width // 16, 16).transpose(1, 2)
    expected = torch.cat([together.reshape(grouped, width), padded[grouped:]])
    assert torch.equal(packed, expected)


def test_a_weight_is_packed_once_and_its_layers_share_the_copy(ext):
    from engine.kernels.float32_linear import packed_copy

    w, other = torch.randn(64, 48), torch.randn(64, 48)
    first = packed_copy(w, ext)
    assert packed_copy(w, ext) is first and packed_copy(other, ext) is not first
    assert packed_copy(w.T, ext).numel() == 0  # not in rows: the library's alone
    # the cache does not keep a copy that no kernel holds (a precision timing's, say)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    again = torch.empty(64, 48)
    ext.f32_pack(w, again)
    assert torch.equal(packed_copy(w, ext), again)  # made again when asked
