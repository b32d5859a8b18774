"""Linear layers that own their tensor-parallel shard (Megatron-LM's split, as vLLM and
nano-vllm's layers/linear.py do it). At tensor parallel 1 each one is the plain layer,
y = x @ Wᵀ (+ bias), with W as checkpoints store it: [out, in].

- column-parallel (`QKVParallelLinear` for the fused q/k/v, `MergedColumnParallelLinear` for the
  fused gate/up): the matrix is cut by output rows, so each rank computes a complete slice of
  the activations (its heads, its columns of the MLP). No communication.
- row-parallel (`RowParallelLinear` for o and down): the matrix is cut by input columns, so each
  rank's output is a partial sum of the full result; one all-reduce makes it whole.
- `ReplicatedLinear` (lm_head): every rank holds the whole matrix.

Each class cuts its own shard from the full matrix (`shard`), by the ranges of
engine/layers/sharding.py. How the matmul runs is chosen once per layer (`choose_matmul`): our
int8/int4 kernel or its reference for a quantized weight (engine/kernels/quant.py), the faster
float32 library on a CPU (engine/kernels/float32_linear.py), a bfloat16 matrix on a CPU in a
float32 engine (linear_precision "bfloat16": engine/kernels/linear_precision.py) casts the
activations to bfloat16 and the result back, else F.linear.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels.bfloat16_tiles import BFloat16TiledWeight, tiled_kernel, tiled_linear
from engine.kernels.float32_linear import float32_kernel, float32_linear, library_linear
from engine.kernels.linear_precision import bfloat16_matmul, bfloat16_prepacked_linear
from engine.kernels.quant import QUANTIZED_TYPES, kernel_linear, quantized_linear
from engine.layers.sharding import head_ranges, mlp_range
from engine.models.config import LlamaConfig

Matmul = Callable[[torch.Tensor, object, torch.Tensor | None], torch.Tensor]


def choose_matmul(weight, kernels=None, kernel=None) -> Matmul:
    """How x @ Wᵀ (+ bias) runs for this weight, decided once: a weight-only quantized matrix
    goes to our C++ kernel (`kernels`, the compiled extension; `kernel`, that kernel already
    bound to the weight: quant.py `kernel_linear`) or, with None, to the reference
    (dequantize + matmul); a float32 matrix on a CPU to the library timed faster here (MKL or
    oneDNN, once per process; with `kernel`, our C++ linear: up to 8 rows on our own kernel,
    more rows on that library: float32_linear.py `float32_kernel`); a bfloat16 matrix
    on a CPU to the bfloat16 linear (float32 activations cast for the matmul, the result cast
    back; plain F.linear for bfloat16 ones), oneDNN's where the matrix was prepacked for it at
    load, our kernel where it was cut into tiles (`kernel`: engine/kernels/bfloat16_tiles.py,
    rounding the activations itself); anything else to F.linear."""
    if isinstance(weight, QUANTIZED_TYPES):
        return partial(quantized_linear, kernels=kernels, linear=kernel)
    if isinstance(weight, BFloat16TiledWeight):  # a bfloat16 weight cut into tiles at load
        return partial(tiled_linear, kernel=kernel)
    if weight.is_mkldnn:  # a bfloat16 weight reordered for oneDNN at load
        return bfloat16_prepacked_linear
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        return bfloat16_matmul()
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return partial(float32_linear, kernel=kernel) if kernel is not None else library_linear()
    return F.linear


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, kernels=None) -> torch.Tensor:
    """One y = x @ Wᵀ (+ bias), the way a layer holding `w` computes it (for measurements and
    tests; the model's layers make the choice once)."""
    return choose_matmul(w, kernels, bound_kernel(w, kernels))(x, w, bias)


def bound_kernel(weight, kernels):
    """`weight`'s C++ kernel with the weight bound, where `kernels` (the compiled extension)
    has one for it: a weight-only quantized matrix, a bfloat16 one in tiles, or a float32 one
    on our float32 linear (up to 8 rows on our kernel, more on the library); else None."""
    if kernels is None:
        return None
    if isinstance(weight, QUANTIZED_TYPES):
        return kernel_linear(weight, kernels)
    if isinstance(weight, BFloat16TiledWeight):
        return tiled_kernel(weight, kernels)
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        return float32_kernel(weight, kernels)
    return None


class ReplicatedLinear:
    """The whole matrix on every rank; the base of the parallel layers below, which hold a
    shard instead."""

    def __init__(self, weight, bias: torch.Tensor | None = None, kernels=None):
        self.weight, self.bias = weight, bias
        # A quantized or tiled matrix on our kernels: its C++ kernel with the weight bound, once
        # (also what a fused block calls: engine/models/llama.py); else None.
        self.kernel = bound_kernel(weight, kernels)
        self.matmul = choose_matmul(weight, kernels, self.kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output rows cut across the tensor-parallel ranks: this rank's rows give a complete slice
    of the output."""

    @staticmethod
    def shard(full: torch.Tensor, rows: range) -> torch.Tensor:
        return full[rows.start : rows.stop].contiguous()


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked into one (gate and up: one matmul instead of
    two); each is cut by the same columns of the MLP, and the rank's parts are stacked again."""

    @staticmethod
    def shard(full: torch.Tensor, cfg: LlamaConfig, tp: int, tp_rank: int) -> torch.Tensor:
        columns = mlp_range(cfg, tp, tp_rank)
        return torch.cat([part[columns.start : columns.stop] for part in full.chunk(2)])


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v matrix cut by heads: each rank computes its query heads and the KV heads
    they read (a KV head is replicated when there are more ranks than KV heads)."""

    @staticmethod
    def shard(full: torch.Tensor, cfg: LlamaConfig, tp: int, tp_rank: int) -> torch.Tensor:
        """This rank's rows of q, k and v, stacked (a weight [out, in] or a bias [out])."""
        d = cfg.head_dim
        q_heads, kv_heads = head_ranges(cfg, tp, tp_rank)
        q, k, v = full.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        qs = slice(q_heads.start * d, q_heads.stop * d)
        kvs = slice(kv_heads.start * d, kv_heads.stop * d)
        return torch.cat([q[qs], k[kvs], v[kvs]]).contiguous()


class RowParallelLinear(ReplicatedLinear):
    """Input columns cut across the ranks: each rank multiplies its slice of the activations by
    its columns, a partial sum of the result; `all_reduce` (the tensor-parallel group's, None
    at tp 1) adds the partial sums of all ranks. A bias is added once, after the sum."""

    def __init__(self, weight, bias=None, kernels=None, all_reduce=None):
        super().__init__(weight, bias, kernels)
        self.all_reduce = all_reduce

    @staticmethod
    def shard(full: torch.Tensor, columns: range) -> torch.Tensor:
        return full[:, columns.start : columns.stop].contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:  # tensor parallel 1: the plain layer
            return self.matmul(x, self.weight, self.bias)
        y = self.all_reduce(self.matmul(x, self.weight, None))
        return y if self.bias is None else y + self.bias
