"""The model's small ops, each with its implementation chosen once, when the model is built
(vLLM's CustomOp): `forward_native` is the torch reference, readable and correct everywhere;
`forward_cpu` calls our C++ kernel (engine/kernels/csrc) in one pass; `forward_cuda` is the
native one (we have no CUDA kernels of our own). A model built with our kernels loaded (CPU,
float32) takes the kernel; any other takes the reference. The forward never asks again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.kernels.bfloat16_tiles import BFloat16TiledWeight
from engine.kernels.quant import QUANTIZED_TYPES, Int8TiledWeight, dequantize_rows
from engine.models.config import LlamaConfig


class CustomOp:
    """`self.forward` is one of forward_native / forward_cpu / forward_cuda, picked here."""

    kernel_dtypes: tuple[torch.dtype, ...] = (torch.float32,)  # what our C++ kernel computes in

    def __init__(self, kernels=None, dtype: torch.dtype = torch.float32, device="cpu"):
        self.kernels = kernels  # the compiled extension (engine.kernels.load()), or None
        device = torch.device(device)
        if kernels is not None and device.type == "cpu" and dtype in self.kernel_dtypes:
            self.forward = self.forward_cpu
        elif device.type == "cuda":
            self.forward = self.forward_cuda
        else:
            self.forward = self.forward_native

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


class RMSNorm(CustomOp):
    """Scale each token's vector to unit root-mean-square, then by a learned per-channel weight,
    in float32 whatever the model dtype, as the reference implementation does. Given a
    `residual`, first add it (the residual connection) and return (sum, norm of the sum): the
    kernel does both in one pass over each row (vLLM's fused_add_rms_norm)."""

    def __init__(self, weight: torch.Tensor, eps: float, kernels=None, dtype=None):
        super().__init__(kernels, dtype or weight.dtype, weight.device)
        self.weight, self.eps = weight, eps

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            h = residual + x
            return h, self.forward_native(h)
        # F.rms_norm is x * rsqrt(mean(x²) + eps) in one fused call.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if not x.is_contiguous():
                return self.forward_native(x)
            return self.kernels.rms_norm(x, self.weight, self.eps)
        if not (x.is_contiguous() and residual.is_contiguous()):
            h = residual + x
            return h, self.forward_cpu(h)
        return self.kernels.add_rms_norm(residual, x, self.weight, self.eps)


class SiluAndMul(CustomOp):
    """SwiGLU's gate: silu(gate) * up, gate and up being the two halves of the fused gate_up
    projection's output (vLLM's silu_and_mul)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous():
            return self.forward_native(gate_up)
        return self.kernels.silu_and_mul(gate_up)


class ArgMax(CustomOp):
    """Each row's greedy token: the first index of its largest logit (a NaN counts as the
    largest, as torch.argmax has it). `forward_cpu` reads the row once in vector code: torch's
    CPU argmax takes about 43 µs for a 49,152-token vocabulary, 1 % of a 4-bit decode step; the
    kernel about 7."""

    def forward_native(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def forward_cpu(self, logits: torch.Tensor) -> torch.Tensor:
        plain = logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous()
        return self.kernels.argmax_rows(logits) if plain else self.forward_native(logits)


def rope_inverse_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """One rotation speed per pair of head dimensions, from the config's rope parameters."""
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    )
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":  # Llama 3.1: slow down only the long wavelengths
        factor, low = scaling["factor"], scaling["low_freq_factor"]
        high, old_len = scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind is not None:
        raise ValueError(f"unsupported rope_type {kind!r}")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(CustomOp):
    """RoPE: rotate each (i, i + d/2) pair of a head by its position's angle. The angles' cos
    and sin are found once per step (`cos_sin`) and shared by every layer."""

    def __init__(self, inv_freq: torch.Tensor, kernels=None, dtype=torch.float32):
        super().__init__(kernels, dtype, inv_freq.device)
        self.inv_freq, self.dtype = inv_freq, dtype
        # On a CPU, a table of the cos and sin of every position up to its end (vLLM's
        # cos_sin_cache): a step looks its positions up, two tensor operations instead of ten
        # (~20 µs of a 2.5 ms 4-bit decode step: docs/performance.md, fifteenth session).
        # Elsewhere they are computed each step: on a GPU a position past the table's end
        # would not be an error Python can catch.
        self.cos_sin = self.computed
        if inv_freq.device.type == "cpu":
            self.cos_table, self.sin_table = self.computed(torch.arange(256))
            self.cos_sin = self.looked_up

    def computed(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1 (all heads), d] of each position's angles."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [tokens, d/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [tokens, 1 (all heads), d]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def looked_up(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same numbers as `computed`, from the table; a position past its end first grows
        it (to twice its length at least), computing it again from position 0."""
        try:
            return self.cos_table.index_select(0, positions), self.sin_table.index_select(
                0, positions
            )
        except IndexError:
            if positions.numel() and int(positions.min()) < 0:
                raise ValueError("RoPE positions cannot be negative") from None
            length = max(int(positions.max()) + 1, 2 * len(self.cos_table))
            self.cos_table, self.sin_table = self.computed(torch.arange(length))
            return self.looked_up(positions)

    def forward_native(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [tokens, heads, d]."""
        return x * cos + rotate_half(x) * sin

    def forward_cpu(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.kernels.rope(x, cos, sin)


class VocabEmbedding:
    """Look up one row of the embedding table per token (replicated on every tensor-parallel
    rank). A quantized table (a tied embedding shares the output layer's int8/int4 matrix)
    dequantizes just those rows; one in tiles (a bfloat16 engine's) reads them from the
    tiles. `kernels` (the model's linear kernels, if any) read an int8 table in tiles (a GGUF's
    tied output layer) in one call instead of ten tensor operations."""

    def __init__(self, weight, dtype: torch.dtype, kernels=None):
        self.weight, self.dtype = weight, dtype
        self.quantized = isinstance(weight, QUANTIZED_TYPES)
        self.tiled = isinstance(weight, BFloat16TiledWeight)
        self.int8_tiles = kernels if isinstance(weight, Int8TiledWeight) else None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8_tiles is not None and ids.is_cpu:
            rows = self.int8_tiles.int8_tiled_rows(self.weight.tiles, self.weight.scales, ids)
            return rows.to(self.dtype)
        if self.quantized:
            return dequantize_rows(self.weight, ids).to(self.dtype)
        if self.tiled:  # a bfloat16 engine's tied table, in tiles
            return self.weight.rows(ids).to(self.dtype)
        return F.embedding(ids, self.weight)
