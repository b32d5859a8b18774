"""A float32 model whose linear layers hold bfloat16 weights (linear_precision "bfloat16",
engine/kernels/linear_precision.py): q/k/v, o, gate/up, down and the lm_head. The embedding
table stays float32: the default artifact stores float32 values (rounding them to bfloat16
changes 28 M of them), so a tied lm_head gets a bfloat16 copy (57 MB) beside the float32 table
(113 MB) instead of sharing it; the model still reads about half the bytes of float32 per decode
step (every linear matrix at 2 bytes)."""

from __future__ import annotations

import torch

from engine.kernels import huge_pages
from engine.kernels.bfloat16_tiles import can_tile, tiled_in
from engine.kernels.linear_precision import PREPACKED, TILES, bfloat16_library, prepacked
from engine.models.llama import LlamaModel, is_layer_matrix


def layer_matrices(model: LlamaModel) -> list[torch.Tensor]:
    """The matrices a decode step multiplies by (the lm_head aside): what "auto" times."""
    return [t for name, t in model.w.items() if is_layer_matrix(name, t)]


def with_bfloat16_linears(model: LlamaModel, why: str) -> LlamaModel:
    """`model` (float32 weights, untouched) with bfloat16 copies of its linear matrices and
    lm_head in the layout of the bfloat16 library (engine/kernels/linear_precision.py), layers
    rebuilt on them (engine/layers/linear.py); `linear_precision` records the choice, the
    library and `why`."""
    weights, arena, library = dict(model.w), huge_pages.Arena(), bfloat16_library()
    for name, t in model.w.items():
        if name == "lm_head" or is_layer_matrix(name, t):
            weights[name] = in_layout(t.to(torch.bfloat16), library, arena)
    choice = {"precision": "bfloat16", "library": library, "why": why}
    return model.rebuilt(w=weights, linear_precision=choice)


def in_layout(bf16: torch.Tensor, library: str, arena: huge_pages.Arena):
    """A bfloat16 matrix as `library` reads it, once, here: cut into tiles (in `arena`'s
    huge pages), reordered for oneDNN, or as it is (in the huge pages)."""
    if library == TILES and can_tile(bf16.shape):
        return tiled_in(bf16, arena)
    if library == PREPACKED:
        return prepacked(bf16)
    return arena.copy(bf16)


def linear_precision_of(model) -> dict:
    """What the model's linears run in and why (float32 when nothing chose bfloat16)."""
    return getattr(model, "linear_precision", None) or {"precision": "float32", "why": "float32"}
