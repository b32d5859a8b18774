"""bfloat16 matrices in tiles (engine/kernels/bfloat16_tiles.py, csrc/bf16_tiles.cpp): the layout
holds the matrix; the kernel (AMX's, else AVX512-BF16's: whichever this CPU runs) multiplies
float32 rows rounded to bfloat16 (to nearest even, exactly as torch rounds them) by it,
accumulating in float32; each row's result is the same bit for bit whatever the batch around it;
bad arguments are refused; and the bfloat16 engine cuts its matrices into tiles where the CPU
runs them."""

from __future__ import annotations

import pytest
import torch

import engine.kernels.linear_precision as lp
from engine.kernels.bfloat16_tiles import (
    BFloat16TiledWeight,
    can_tile,
    reference,
    tile_bfloat16,
    tiled_linear,
)

SHAPES = ((16, 32), (48, 64), (80, 96), (1728, 576), (576, 1536))
ROWS = (1, 3, 16, 17, 31, 32, 33, 70, 300)


@pytest.fixture(scope="module")
def bf16(ext):
    """The kernels, where this CPU runs the tiles (else the test skips)."""
    if not ext.bf16_tiles_available():
        pytest.skip("this CPU (or build) has neither AMX nor AVX512-BF16")
    return ext


def test_the_kernel_is_the_one_this_cpu_has(bf16):
    from engine.kernels import _cpu_flags, describe

    flags = set(_cpu_flags().split())
    assert "avx512_bf16" in flags
    expected = ("AMX", "AVX512-BF16") if "amx_bf16" in flags else ("AVX512-BF16",)
    assert bf16.bf16_tiles_kernel() in expected  # AMX where Linux grants the tiles
    assert f"bfloat16 tiles on {bf16.bf16_tiles_kernel()}" in describe("cpu")  # logs, bench


def test_tiles_hold_the_matrix():
    torch.manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k).bfloat16()
        tiled = tile_bfloat16(w)
        assert tiled.tiles.shape == (n // 16, k // 32, 16, 32) and tiled.tiles.is_contiguous()
        assert tiled.shape == w.shape and tiled.dtype == torch.bfloat16
        assert tiled.nbytes() == 2 * n * k and torch.equal(tiled.to_rows(), w)
        # tile t, group g, row r holds the pairs (2r, 2r + 1) of channels 16t .. 16t + 15
        t, g, r = n // 16 - 1, k // 32 - 1, 5
        pairs = w[16 * t : 16 * t + 16, 32 * g + 2 * r : 32 * g + 2 * r + 2].reshape(-1)
        assert torch.equal(tiled.tiles[t, g, r], pairs)
    assert can_tile((1728, 576)) and can_tile((49152, 576))
    assert not can_tile((40, 64)) and not can_tile((48, 80)) and not can_tile((0, 32))


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far a float32 sum of the products may stray from the exact one: k roundings of at
    most 2^-24 of the running sum of magnitudes."""
    k = x.shape[1]
    return k * 2.0**-24 * (x.bfloat16().double().abs() @ w.double().abs().T) + 1e-30


def test_the_kernel_multiplies_rows_rounded_to_bfloat16(bf16):
    torch.manual_seed(0)
    for n, k in SHAPES:
        w, bias = torch.randn(n, k).bfloat16(), torch.randn(n)
        tiles = tile_bfloat16(w).tiles
        for rows in ROWS:
            x = torch.randn(rows, k)
            y = bf16.bf16_tiled_linear(x, tiles, None)
            exact = x.bfloat16().double() @ w.double().T
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert ((y.double() - exact).abs() <= bound(x, w)).all()
            assert torch.equal(bf16.bf16_tiled_linear(x, tiles, bias), y + bias)
            assert torch.allclose(y, reference(x, BFloat16TiledWeight(tiles)), rtol=1e-5, atol=1e-4)
    no_rows = bf16.bf16_tiled_linear(torch.zeros(0, k), tiles, None)
    assert no_rows.shape == (0, n)


def test_the_kernel_rounds_to_nearest_even_as_torch_does(bf16):
    """Values exactly halfway between two bfloat16 numbers (with both parities), just off
    halfway, and huge ones: the kernel rounds as torch's .to(torch.bfloat16) does. A float32
    subnormal (below 1.2e-38) counts as zero, as AMX and VDPBF16PS read bfloat16 subnormals."""
    torch.manual_seed(0)
    k = 64
    bits = torch.randint(0x00800000, 0x7F000000, (8, k), dtype=torch.int64) & ~0xFFFF
    halfway = bits | 0x8000  # exactly between two bfloat16 values
    ties = torch.cat([halfway, halfway | 0x10000, halfway + 1, halfway - 1]).to(torch.int32)
    x = ties.view(torch.float32) * torch.randn(32, k).sign()
    x[0, :2] = torch.tensor([-3e38, 2e-38])
    w = torch.eye(k).bfloat16()  # y = x rounded, column by column
    y = bf16.bf16_tiled_linear(x, tile_bfloat16(w).tiles, None)
    assert torch.equal(y, x.bfloat16().float())
    tiny = torch.tensor([[1e-39, -1e-40] + [1.0] * (k - 2)])
    assert bf16.bf16_tiled_linear(tiny, tile_bfloat16(w).tiles, None)[0, :3].tolist() == [0, 0, 1]


def test_a_rows_result_does_not_depend_on_its_batch(bf16):
    torch.manual_seed(0)
    w = torch.randn(576, 1536).bfloat16()
    tiles = tile_bfloat16(w).tiles
    x = torch.randn(300, 1536)
    whole = bf16.bf16_tiled_linear(x, tiles, None)
    for start, rows in ((0, 1), (7, 1), (5, 16), (20, 17), (40, 32), (100, 70), (299, 1)):
        part = bf16.bf16_tiled_linear(x[start : start + rows].contiguous(), tiles, None)
        assert torch.equal(part, whole[start : start + rows])


def test_the_kernel_refuses_what_it_cannot_run(bf16):
    tiles = tile_bfloat16(torch.ones(32, 64).bfloat16()).tiles
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        bf16.bf16_tiled_linear(torch.ones(2, 32), tiles, None)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        bf16.bf16_tiled_linear(torch.ones(2, 64).half(), tiles, None)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        bf16.bf16_tiled_linear(torch.ones(64, 2).t(), tiles, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        bf16.bf16_tiled_linear(torch.ones(2, 64), tiles.float(), None)
    with pytest.raises(RuntimeError, match="takes 1 tensors"):
        bf16.QuantLinear("bf16_tiles", [tiles, tiles], 0)


def test_a_tiled_layer_runs_any_leading_shape_and_the_reference_without_kernels(bf16):
    from engine.layers.linear import ReplicatedLinear

    torch.manual_seed(0)
    w, bias = torch.randn(48, 64).bfloat16(), torch.randn(48)
    tiled, x = tile_bfloat16(w), torch.randn(2, 3, 64)
    layer = ReplicatedLinear(tiled, bias, bf16)
    assert layer.kernel is not None
    y = layer(x)
    assert y.shape == (2, 3, 48) and torch.equal(y[1], layer(x[1].contiguous()))
    without = ReplicatedLinear(tiled, bias, None)
    assert without.kernel is None
    assert torch.allclose(without(x), y, rtol=1e-5, atol=1e-5)
    assert torch.allclose(tiled_linear(x, tiled, bias), y, rtol=1e-5, atol=1e-5)


def test_the_bfloat16_engine_cuts_its_matrices_into_tiles(bf16, make_engine, monkeypatch):
    from engine.kernels.quant import weight_nbytes

    monkeypatch.setattr(lp, "_choice", None)
    monkeypatch.delenv(lp.LINEAR_PRECISION_ENV, raising=False)
    assert lp.bfloat16_library() == lp.TILES  # not timed: the tiles, where they run
    engine = make_engine(linear_precision="bfloat16")
    model = engine.executor.worker.model
    assert all(
        isinstance(model.w[f"{i}.{m}"], BFloat16TiledWeight)
        for i in range(model.cfg.num_layers)
        for m in ("qkv", "o", "gate_up", "down")
    )
    assert isinstance(model.w["lm_head"], BFloat16TiledWeight)  # 2048 words: whole tiles
    assert model.stack is not None  # every layer in one C++ call a step
    assert weight_nbytes(model.w["0.qkv"]) == 2 * model.w["0.qkv"].shape.numel()


def test_auto_picks_the_tiles_when_they_are_faster():
    ms = {
        1: {"float32": 16.0, "F.linear": 17.0, "oneDNN": 17.0, lp.PREPACKED: 11.4, lp.TILES: 8.0},
        32: {"float32": 50.0, "F.linear": 20.0, "oneDNN": 20.0, lp.PREPACKED: 14.0, lp.TILES: 11.0},
    }
    choice = lp.choose_precision(ms, "amx_bf16")
    assert (choice["precision"], choice["library"]) == ("bfloat16", lp.TILES)
    assert f"bfloat16 ({lp.TILES}) 8.0 ms (2.00×)" in choice["why"]


def test_bfloat16_rows_are_read_as_they_are_and_the_result_rounded_once(bf16):
    """A bfloat16 engine's rows: the product of the same values given as float32, plus the bias,
    rounded to bfloat16 once."""
    torch.manual_seed(0)
    w, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    tiles = tile_bfloat16(w).tiles
    for rows in (1, 17, 40):
        x = torch.randn(rows, 64).bfloat16()
        y = bf16.bf16_tiled_linear(x, tiles, bias)
        wide = bf16.bf16_tiled_linear(x.float(), tiles, None)
        assert y.dtype == torch.bfloat16 and torch.equal(y, (wide + bias.float()).bfloat16())
        ref = tiled_linear(x, BFloat16TiledWeight(tiles), bias)  # no kernel: the reference
        assert ref.dtype == torch.bfloat16
        assert torch.allclose(ref.float(), y.float(), rtol=1e-2, atol=1e-2)


def test_a_tied_table_stays_tied_and_is_looked_up_in_its_tiles():
    from engine.kernels.bfloat16_tiles import with_tiles

    torch.manual_seed(0)
    table, layer = torch.randn(64, 32).bfloat16(), torch.randn(48, 32).bfloat16()
    odd = torch.randn(40, 32).bfloat16()  # 40 channels: not whole tiles, stays as it is
    weights = {"embed": table, "lm_head": table, "0.qkv": layer, "0.o": odd, "norm": torch.ones(32)}
    tiled = with_tiles(weights, ["lm_head", "0.qkv", "0.o"])
    assert isinstance(tiled["lm_head"], BFloat16TiledWeight) and tiled["embed"] is tiled["lm_head"]
    assert isinstance(tiled["0.qkv"], BFloat16TiledWeight) and tiled["0.o"] is odd
    assert tiled["norm"] is weights["norm"]
    assert with_tiles(weights, ["lm_head"])["lm_head"] is tiled["lm_head"]  # once per matrix
    ids = torch.tensor([0, 5, 17, 63, 5])
    assert torch.equal(tiled["embed"].rows(ids), table[ids])


def test_a_bfloat16_engine_multiplies_on_the_tiles(bf16, make_engine):
    from engine.kernels.quant import weight_nbytes

    engine = make_engine(dtype="bfloat16")
    model = engine.executor.worker.model
    assert isinstance(model.w["0.gate_up"], BFloat16TiledWeight)
    assert model.w["embed"] is model.w["lm_head"]  # still tied: the same bytes as before
    plain = make_engine(dtype="bfloat16", kernels="torch").executor.worker.model
    assert isinstance(plain.w["0.gate_up"], torch.Tensor)  # the torch path keeps the matrices
    assert model.weight_bytes() == plain.weight_bytes()
    assert weight_nbytes(model.w["lm_head"]) == weight_nbytes(plain.w["lm_head"])
