"""A bfloat16 matrix repacked into tiles for our kernel (engine/kernels/csrc/bf16_tiles.cpp), the
layout a float32 engine's bfloat16 linears take on a CPU with amx_bf16 or avx512_bf16
(linear_precision "bfloat16": engine/kernels/linear_precision.py, library `TILES`).

An AMX instruction multiplies 16 rows × 32 inputs of the activations by a tile of 16 output
channels × 32 inputs stored in pairs (row r of the tile holds each channel's inputs 2r and
2r + 1), so the weight is cut once, at load, into such tiles: `tiles[t, g]` is channels
16t .. 16t + 15 × inputs 32g .. 32g + 31, 1 KB, and a thread reads its channels' tiles front to
back. Against oneDNN on the same prepacked-at-load bfloat16 matrices (the default model's 120
layer matrices, 2-vCPU AMX Xeon, 2026-12-05): one row 8.0-8.2 ms against 13.9-14.3, 32 rows
11.2-11.5 against 17.9-19.1, 512 rows 80.8-82.6 against 87.2-90.9.

A row of such a tile (16 channels × one pair of inputs, 64 bytes) is also the operand of
AVX512-BF16's VDPBF16PS, so on a CPU without AMX (AMD's Zen 4 and 5) a second kernel walks the
same tiles pair by pair, 4 rows × 4 tiles of channels in registers. Same matrices against
oneDNN prepacked (2-vCPU AMD EPYC Zen 5, 2026-12-06, best of 5): one row 4.87 ms against 7.41,
4 rows 5.59 against 7.51, 32 rows 11.7 against 15.2, 256 rows 62.1 against 68.4.

The kernel rounds each float32 activation to bfloat16 itself and writes float32 results, so a
layer pays no cast on either side of its matmul, and it is one of our kernels, so the fused
blocks run it (engine/kernels/csrc/fused_blocks.cpp: a whole step as one C++ call). `reference`
is the same product in torch, from the matrix untiled (for the torch path and the tests).

A bfloat16 engine (dtype="bfloat16" on such a CPU) multiplies on the same tiles
(engine/models/llama.py `with_kernels`, `with_tiles`): its rows are read as they are and each
result rounded to bfloat16 once, as torch's bfloat16 linear does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.huge_pages import Arena
from engine.kernels.quant import once_per_weight

CHANNELS, DEPTH = 16, 32  # output channels × inputs per tile


@dataclass
class BFloat16TiledWeight:
    """A bfloat16 matrix [out, in] as tiles [out / 16, in / 32, 16, 32] (the layout above)."""

    tiles: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        t, g, _, _ = self.tiles.shape
        return torch.Size((t * CHANNELS, g * DEPTH))

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    def nbytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the matrix ([len, in]), read from their tiles: a tied embedding looks its
        tokens up here (row n: tile n // 16, pair n % 16 of every row of the tile)."""
        t, g, _, _ = self.tiles.shape
        pairs = self.tiles.view(t, g, DEPTH // 2, CHANNELS, 2)
        return pairs[ids // CHANNELS, :, :, ids % CHANNELS].reshape(len(ids), g * DEPTH)

    def to_rows(self) -> torch.Tensor:
        """The matrix [out, in] again."""
        t, g, _, _ = self.tiles.shape
        pairs = self.tiles.view(t, g, DEPTH // 2, CHANNELS, 2).permute(0, 3, 1, 2, 4)
        return pairs.reshape(t * CHANNELS, g * DEPTH)


def can_tile(shape) -> bool:
    """Whether a matrix [out, in] cuts into whole tiles (every layer of the Llama family we load:
    head_dim, hidden and MLP sizes and vocabularies are multiples of 32; a matrix that is not
    keeps the oneDNN layout)."""
    out, inputs = shape
    return out % CHANNELS == 0 and inputs % DEPTH == 0 and out > 0 and inputs > 0


def tile_bfloat16(w: torch.Tensor) -> BFloat16TiledWeight:
    """`w` [out, in] bfloat16 (`can_tile`) cut into tiles."""
    n, k = w.shape
    pairs = w.view(n // CHANNELS, CHANNELS, k // DEPTH, DEPTH // 2, 2).permute(0, 2, 3, 1, 4)
    return BFloat16TiledWeight(pairs.reshape(n // CHANNELS, k // DEPTH, CHANNELS, DEPTH))


def tiled_in(w: torch.Tensor, arena: Arena) -> BFloat16TiledWeight:
    """`w` [out, in] bfloat16 (`can_tile`) cut into tiles held in `arena`'s huge pages."""
    return BFloat16TiledWeight(arena.copy(tile_bfloat16(w).tiles))


def with_tiles(weights: dict, names: list[str]) -> dict:
    """`weights` with the bfloat16 matrices `names` cut into tiles (those that `can_tile`; each
    once while it lives, so the engines of a process share one copy): a bfloat16 engine's linear
    layers on our kernel where the CPU has AMX or AVX512-BF16. A weight shared with another name
    (a tied embedding) is replaced there too, so it stays shared (`rows` looks tokens up in the
    tiles)."""
    arena, tiled = Arena(), {}
    for name in names:
        w = weights[name]
        if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and can_tile(w.shape):
            tiled[id(w)] = once_per_weight(w, lambda matrix: tiled_in(matrix, arena))
    return {name: tiled.get(id(w), w) for name, w in weights.items()}


def tiles_available(kernels) -> bool:
    """Whether `kernels` (the compiled extension, or None) runs the tiles on this CPU (AMX or
    AVX512-BF16)."""
    return kernels is not None and kernels.bf16_tiles_available()


def tiled_kernel(w: BFloat16TiledWeight, kernels):
    """`w`'s kernel with its tiles bound (what a layer and a fused block call), linear(x, bias)
    on [rows, in] contiguous float32 or bfloat16 rows."""
    return kernels.QuantLinear("bf16_tiles", [w.tiles], 0)


def reference(x: torch.Tensor, w: BFloat16TiledWeight, bias=None) -> torch.Tensor:
    """The kernel's product in torch: x rounded to bfloat16 times the untiled matrix, the result
    in float32 (+ bias, unrounded), then in x's dtype."""
    y = F.linear(x.to(torch.bfloat16).float(), w.to_rows().float())
    return y.to(x.dtype) if bias is None else (y + bias).to(x.dtype)


def tiled_linear(x: torch.Tensor, w: BFloat16TiledWeight, bias=None, kernel=None) -> torch.Tensor:
    """y = x @ Wᵀ (+ bias) through the bound `kernel` (`tiled_kernel`) on float32 or bfloat16
    rows of any leading shape (y in x's dtype), else `reference`."""
    if kernel is None or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_cpu:
        return reference(x, w, bias)
    flat = x.dim() == 2 and x.is_contiguous()
    y = kernel(x if flat else x.reshape(-1, x.shape[-1]).contiguous(), bias)
    return y if flat else y.view(*x.shape[:-1], y.shape[-1])
