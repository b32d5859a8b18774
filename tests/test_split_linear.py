"""A float32 linear at one row with its output channels split over the threads
(csrc/split_linear.cpp, engine/kernels/float32_linear.py `float32_kernel`): each range is one
call of the same library (oneDNN or MKL) on the same inputs, so the result is the library's own,
bit for bit, however the channels are cut; more than one row goes to the library whole; bad
arguments are refused; and a float32 engine on kernels="auto" runs its linears this way, one on
"torch" never does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.float32_linear import library_linear, onednn_linear, onednn_linear_works

# SmolLM2's matrices, and widths that are not a multiple of 16 x threads (the last range is longer)
SHAPES = ((960, 576), (576, 1536), (3072, 576), (130, 64), (1000, 48), (2048, 64))


def libraries():
    yield "mkl", F.linear, False
    if onednn_linear_works():
        yield "onednn", onednn_linear, True


@pytest.fixture
def threads():
    """Run with 2 and 3 threads (3 cuts the channels unevenly), then restore the count."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_one_row_split_is_the_library_bit_for_bit(ext, threads, num_threads, shape):
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen)
    x = torch.randn(1, shape[1], generator=gen)
    for name, library, onednn in libraries():
        for b in (None, bias):
            expected = library(x, w, b)
            got = ext.split_linear(x, w, b, onednn)
            assert got.shape == expected.shape == (1, shape[0])
            assert torch.equal(got, expected), (name, b is not None)


def test_more_rows_and_other_shapes_go_to_the_library_whole(ext, threads):
    torch.set_num_threads(2)
    w = torch.randn(960, 576)
    for x in (torch.randn(4, 576), torch.randn(2, 3, 576), torch.randn(576)):
        for _, library, onednn in libraries():
            assert torch.equal(ext.split_linear(x, w, None, onednn), library(x, w))


def test_a_float32_layer_on_our_kernels_is_its_library_bit_for_bit(ext, threads):
    """A layer holding a float32 matrix binds our C++ linear where the engine runs our kernels
    (`float32_kernel`: the library, one row split), the plain library where it does not; both
    give the library's numbers at one row and at several."""
    from engine.layers.linear import ReplicatedLinear

    torch.set_num_threads(2)
    w, bias = torch.randn(960, 576), torch.randn(960)
    ours, plain = ReplicatedLinear(w, bias, ext), ReplicatedLinear(w, bias, None)
    assert ours.kernel is not None and plain.kernel is None
    for rows in (1, 5):
        x = torch.randn(rows, 576)
        assert torch.equal(ours(x), plain(x)) and torch.equal(
            plain(x), library_linear()(x, w, bias)
        )


def test_the_kernel_refuses_what_it_cannot_run(ext):
    w = torch.randn(256, 64)
    with pytest.raises(RuntimeError, match="float32"):
        ext.split_linear(torch.randn(1, 64, dtype=torch.float64), w, None, False)
    with pytest.raises(RuntimeError, match="float32"):
        ext.split_linear(torch.randn(1, 64), w.bfloat16(), None, False)
    with pytest.raises(RuntimeError, match=r"\[out, in\]"):
        ext.split_linear(torch.randn(1, 32), w, None, False)
    with pytest.raises(RuntimeError, match="bias"):
        ext.split_linear(torch.randn(1, 64), w, torch.randn(255), False)


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
