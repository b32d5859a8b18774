"""A float32 model whose linear layers hold bfloat16 weights (linear_precision "bfloat16",
engine/kernels/linear_precision.py): q/k/v, o, gate/up, down and the lm_head. The embedding
table stays float32: the default artifact stores float32 values (rounding them to bfloat16
changes 28 M of them), so a tied lm_head gets a bfloat16 copy (57 MB) beside the float32 table
(113 MB) instead of sharing it; the model still reads about half the bytes of float32 per decode
step (every linear matrix at 2 bytes)."""

from __future__ import annotations

import torch

from engine.kernels import huge_pages
from engine.kernels.linear_precision import PREPACKED, bfloat16_library, prepacked
from engine.models.llama import LlamaModel, is_layer_matrix


def layer_matrices(model: LlamaModel) -> list[torch.Tensor]:
    """The matrices a decode step multiplies by (the lm_head aside): what "auto" times."""
    return [t for name, t in model.w.items() if is_layer_matrix(name, t)]


def with_bfloat16_linears(model: LlamaModel, why: str) -> LlamaModel:
    """`model` (float32 weights, untouched) with bfloat16 copies of its linear matrices and
    lm_head, layers rebuilt on them (engine/layers/linear.py casts each activation);
    `linear_precision` records the choice and `why`."""
    weights, arena = dict(model.w), huge_pages.Arena()
    prepack = bfloat16_library() == PREPACKED  # reordered for oneDNN once, here
    for name, t in model.w.items():
        if name == "lm_head" or is_layer_matrix(name, t):
            bf16 = t.to(torch.bfloat16)
            weights[name] = prepacked(bf16) if prepack else arena.copy(bf16)
    choice = {"precision": "bfloat16", "why": why}
    return model.rebuilt(w=weights, linear_precision=choice)


def linear_precision_of(model) -> dict:
    """What the model's linears run in and why (float32 when nothing chose bfloat16)."""
    return getattr(model, "linear_precision", None) or {"precision": "float32", "why": "float32"}
