"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) on a paged KV cache.

Read it top to bottom like nanoGPT: embedding → N × (RMSNorm → attention → residual → RMSNorm →
SwiGLU MLP → residual) → final RMSNorm → logits from the (usually tied) embedding matrix.

Two things make it an *inference* model rather than a training one:
- the input is a flat batch of all scheduled tokens of all requests, so every linear layer runs
  once per step over all of them (the batching that makes serving efficient);
- K and V go to a paged cache and attention reads them back through block tables
  (engine/attention.py), so each step only computes the new tokens.
The model decides nothing: which tokens to run, and where their K/V go, come from outside.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from engine import kernels as kernel_lib
from engine.attention import AttentionMetadata, paged_attention
from engine.kernels.quant import Int4Weight, Int8Weight, dequantize_rows, quantized_linear
from engine.models.config import LlamaConfig

logger = logging.getLogger(__name__)


def _onednn_linear_works() -> bool:
    """True if this PyTorch build can call oneDNN's linear kernel directly (CPU builds with
    oneDNN)."""
    try:
        x = torch.ones(1, 2)
        return torch.ops.mkldnn._linear_pointwise(
            x, torch.ones(3, 2), None, "none", [], ""
        ).shape == (1, 3)
    except (AttributeError, RuntimeError):
        return False


# On a CPU, F.linear in float32 goes to the BLAS library PyTorch ships (MKL). oneDNN, the CPU
# library PyTorch uses for convolutions (and torch.compile for linear layers), ran the same float32
# matmuls 1.5-2× faster on our 2-core AMD EPYC at every batch size from 1 to 512 tokens; on a
# 2-core Intel Xeon (AMX, 2026-12-02) it was the other way round at one row: MKL 16.8 ms for the
# 120 layer matrices, oneDNN 25.0 ms, and the same within 5 % from 8 rows up. Which is faster
# depends on the CPU, so the first float32 model on a CPU times both (`float32_linear_backend`).
ONEDNN_LINEAR = _onednn_linear_works()
FLOAT32_LINEAR_ENV = "LLM_LAB_FLOAT32_LINEAR"  # "mkl" or "onednn": skip the timing, use that one
_float32_linear: dict | None = None  # the choice and the timings behind it, once per process


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def _best_ms(fn, repeats: int) -> float:
    fn()  # warm up (oneDNN prepares its kernel on the first call)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def float32_linear_backend(matrices: list[torch.Tensor] | None = None) -> dict:
    """Which library runs float32 linears on this CPU, "mkl" (F.linear) or "onednn", with the
    timings behind the choice: both libraries over `matrices` (the first model's own layer
    weights, as a decode step reads them; else 8 synthetic 2048 × 2048 ones) at 1 row (decode
    at batch 1) and at 32 rows. oneDNN stays (it was the faster where this was first measured)
    unless MKL is at least 15 % faster at one row and no more than 10 % slower at 32: one library
    for every row count, so that a request's numbers do not depend on the size of its batch.
    Measured once per process (about half a second for the default model), or set by the
    environment variable LLM_LAB_FLOAT32_LINEAR."""
    global _float32_linear
    if _float32_linear is not None:
        return _float32_linear
    forced = os.environ.get(FLOAT32_LINEAR_ENV, "").strip().lower()
    if not ONEDNN_LINEAR:
        _float32_linear = {"backend": "mkl", "why": "this PyTorch build has no oneDNN linear"}
    elif forced in ("mkl", "onednn"):
        _float32_linear = {"backend": forced, "why": f"{FLOAT32_LINEAR_ENV}={forced}"}
    else:
        if not matrices:
            matrices = [torch.full((2048, 2048), 0.01) for _ in range(8)]
        widths = {m.shape[1] for m in matrices}
        libraries = {"mkl": F.linear, "onednn": onednn_linear}
        ms = {}
        for rows, repeats in ((1, 3), (32, 2)):
            inputs = {k: torch.full((rows, k), 0.01) for k in widths}
            ms[rows] = {
                name: _best_ms(lambda f=f: [f(inputs[m.shape[1]], m) for m in matrices], repeats)
                for name, f in libraries.items()
            }
        mkl_wins = ms[1]["mkl"] < 0.85 * ms[1]["onednn"] and ms[32]["mkl"] < 1.1 * ms[32]["onednn"]
        size = sum(m.numel() for m in matrices) * 4 / 1e6
        _float32_linear = {
            "backend": "mkl" if mkl_wins else "onednn",
            "why": f"timed over {len(matrices)} matrices, {size:.0f} MB: "
            + "; ".join(
                f"{rows} row{'s' * (rows > 1)} MKL {t['mkl']:.1f} ms, oneDNN {t['onednn']:.1f} ms"
                for rows, t in ms.items()
            ),
            "ms": ms,
        }
    logger.info(
        "float32 linear on this CPU: %s (%s)", _float32_linear["backend"], _float32_linear["why"]
    )
    return _float32_linear


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, kernels=None) -> torch.Tensor:
    """A linear layer, y = x @ Wᵀ (+ bias), with W as checkpoints store it: [out, in].
    One matmul for all tokens of the step. W may also be a weight-only int8/int4 quantized matrix
    (engine/kernels/quant.py): then `kernels` (the compiled extension, or None) decides between
    our C++ kernel and the reference, dequantize + matmul. The model passes its own choice
    (`LlamaModel.linear_kernels`), made once per engine from EngineConfig(kernels=...)."""
    if isinstance(w, (Int8Weight, Int4Weight)):
        return quantized_linear(x, w, bias, kernels)
    if x.is_cpu and x.dtype == torch.float32 and float32_linear_backend()["backend"] == "onednn":
        return onednn_linear(x, w, bias)
    return F.linear(x, w, bias)


def embedding(ids: torch.Tensor, w, dtype: torch.dtype) -> torch.Tensor:
    """Look up one row of the embedding table per token. A quantized table (a tied embedding
    shares the output layer's int8/int4 matrix) dequantizes just those rows."""
    if isinstance(w, (Int8Weight, Int4Weight)):
        return dequantize_rows(w, ids).to(dtype)
    return F.embedding(ids, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels=None) -> torch.Tensor:
    """Scale each token's vector to unit root-mean-square, then by a learned per-channel weight.
    Computed in float32 whatever the model dtype, as the reference implementation does.
    `kernels` (the compiled extension, float32 on a CPU) computes the same in one C++ call."""
    if kernels is not None and x.dtype == torch.float32 and x.is_contiguous():
        return kernels.rms_norm(x, weight, eps)
    # F.rms_norm is x * rsqrt(mean(x²) + eps) in one fused call (the same numbers as spelling it
    # out).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, kernels=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual connection and the norm that follows it: (h + delta, rms_norm(h + delta)).
    `kernels` computes both in one pass over each row (vLLM's fused_add_rms_norm)."""
    if (
        kernels is not None
        and h.dtype == delta.dtype == torch.float32
        and h.is_contiguous()
        and delta.is_contiguous()
    ):
        return kernels.add_rms_norm(h, delta, weight, eps)
    h = h + delta
    return h, rms_norm(h, weight, eps, kernels)


def silu_and_mul(gate_up: torch.Tensor, kernels=None) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, gate and up being the two halves of the fused gate_up
    projection's output. `kernels` does it in one C++ call (vLLM's silu_and_mul)."""
    if kernels is not None and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
        factor, low, high = (
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
        )
        old_len = scaling["original_max_position_embeddings"]
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels=None):
    """Rotate each (i, i + d/2) pair of a head by its position's angle: x: [tokens, heads, d].
    `kernels` (the compiled extension, float32 on a CPU) computes the same in one C++ call."""
    if kernels is not None and x.dtype == torch.float32:
        return kernels.rope(x, cos, sin)
    return x * cos + rotate_half(x) * sin


class LlamaModel:
    """Weights as plain tensors and a forward function; no nn.Module machinery is needed to
    infer."""

    def __init__(
        self,
        cfg: LlamaConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.w = weights
        self.inv_freq = rope_inverse_frequencies(cfg).to(device)
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        if device.type == "cpu" and dtype == torch.float32:  # time MKL and oneDNN on them now
            float32_linear_backend(
                [
                    t
                    for k, t in weights.items()
                    if k.split(".")[0].isdigit() and isinstance(t, torch.Tensor) and t.dim() == 2
                ]
            )
        self.kernel_path = "torch"  # which attention runs: "torch" (reference) or "cpu" (C++)
        self.kernels = None  # the compiled extension when kernel_path == "cpu"
        # The same for the weight-only int8/int4 linears (they also take bfloat16 activations).
        self.linear_kernel_path = "torch"
        self.linear_kernels = None

    def with_kernels(self, mode: str) -> "LlamaModel":
        """This model (same weight tensors, no copy) with its attention and its quantized
        linears on our C++ kernels (mode "auto", when they build and apply: CPU; float32 for the
        attention) or on the torch reference ("torch"). A shallow copy, so that engines sharing
        one set of weights may each choose: the choice lives on the copy, not in a global."""
        model = copy.copy(self)
        model.kernel_path = kernel_lib.resolve(mode, self.device, self.dtype)
        model.kernels = kernel_lib.load() if model.kernel_path == "cpu" else None
        logger.info("kernels=%r: %s", mode, kernel_lib.describe(model.kernel_path))
        if getattr(self, "quantization", None):  # set by engine/quantization.py quantize_model
            model.linear_kernel_path = kernel_lib.resolve_linear(mode, self.device, self.dtype)
            model.linear_kernels = kernel_lib.load() if model.linear_kernel_path == "cpu" else None
            logger.info("kernels=%r: quantized linears on %s", mode, model.linear_kernel_path)
        else:  # float weights: no quantized linear to run (and nothing to build for bfloat16)
            model.linear_kernel_path, model.linear_kernels = "torch", None
        return model

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device="cpu", dtype=torch.float32
    ) -> "LlamaModel":
        """Load by tensor name from model.safetensors. Q/K/V are concatenated into one matrix and
        gate/up into another, so each layer runs 4 matmuls instead of 7 (vLLM does the same)."""
        model_dir = Path(model_dir)
        cfg = LlamaConfig.from_model_dir(model_dir)
        device = torch.device(device)
        weights: dict[str, torch.Tensor] = {}
        files = sorted(model_dir.glob("*.safetensors"))
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"weight {name!r} not found in {model_dir}")
            return tensors.pop(name).to(device=device, dtype=dtype).contiguous()

        weights["embed"] = take("model.embed_tokens.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            weights[f"{i}.input_norm"] = take(p + "input_layernorm.weight")
            weights[f"{i}.qkv"] = torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            if cfg.attention_bias:
                weights[f"{i}.qkv_bias"] = torch.cat(
                    [take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
                )
            weights[f"{i}.o"] = take(p + "self_attn.o_proj.weight")
            weights[f"{i}.post_norm"] = take(p + "post_attention_layernorm.weight")
            weights[f"{i}.gate_up"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            )
            weights[f"{i}.down"] = take(p + "mlp.down_proj.weight")
        weights["final_norm"] = take("model.norm.weight")
        if cfg.tie_word_embeddings:
            weights["lm_head"] = weights["embed"]  # tied: the output layer reuses the embedding
        else:
            weights["lm_head"] = take("lm_head.weight")
        return cls(cfg, weights, device, dtype)

    def distinct_weights(self) -> list:
        """Every weight once (a tied lm_head shares the embedding's storage); a weight-only
        quantized matrix (engine/kernels/quant.py, engine/quantization.py) counts as one."""
        seen, weights = set(), []
        for t in self.w.values():
            key = id(t) if isinstance(t, (Int8Weight, Int4Weight)) else t.data_ptr()
            if key not in seen:
                seen.add(key)
                weights.append(t)
        return weights

    def num_parameters(self) -> int:
        return sum(math.prod(t.shape) for t in self.distinct_weights())

    def weight_bytes(self) -> int:
        """Bytes the weights occupy on the device (what a decode step reads); a quantized
        matrix counts its packed values, scales and minimums."""
        return sum(
            t.nbytes() if isinstance(t, (Int8Weight, Int4Weight)) else t.numel() * t.element_size()
            for t in self.distinct_weights()
        )

    # -- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] all scheduled tokens of the step, flattened
        positions: torch.Tensor,  # [num_tokens] each token's position in its own request
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K blocks, V blocks)
        attn_meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose next token is wanted (the runner passes the last
        #                                token of each request that samples this step)
    ) -> torch.Tensor:
        """Return logits [len(logits_indices), vocab]: the output layer runs only on those rows."""
        cfg, w = self.cfg, self.w
        cos, sin = self.rope_cos_sin(positions)
        h = embedding(input_ids, w["embed"], self.dtype)
        eps, kernels = cfg.rms_norm_eps, self.kernels
        x = rms_norm(h, w["0.input_norm"], eps, kernels)  # h: the residual stream; x: normed
        for i in range(cfg.num_layers):
            # Each sublayer adds to the residual stream, then the next norm reads it.
            attn_out = self.attention(i, x, cos, sin, kv_caches[i], attn_meta)
            h, x = add_rms_norm(h, attn_out, w[f"{i}.post_norm"], eps, kernels)
            next_norm = w[f"{i + 1}.input_norm" if i + 1 < cfg.num_layers else "final_norm"]
            h, x = add_rms_norm(h, self.mlp(i, x), next_norm, eps, kernels)
        return linear(x[logits_indices], w["lm_head"], kernels=self.linear_kernels).float()

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [tokens, d/2]
        angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(
            1
        )  # [tokens, 1, d] (broadcast over heads)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def attention(
        self, i: int, x, cos, sin, kv_cache, attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        qkv = linear(x, w[f"{i}.qkv"], w.get(f"{i}.qkv_bias"), self.linear_kernels)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Queries and keys are rotated alike, so all their heads are rotated in one call.
        qk = qk.view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        qk = apply_rope(qk, cos, sin, self.kernels)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn_meta, self.scale, self.kernels)
        return linear(o.flatten(1), w[f"{i}.o"], kernels=self.linear_kernels)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU: down(silu(gate(x)) * up(x))."""
        gate_up = linear(x, self.w[f"{i}.gate_up"], kernels=self.linear_kernels)
        gated = silu_and_mul(gate_up, self.kernels)
        return linear(gated, self.w[f"{i}.down"], kernels=self.linear_kernels)

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K and V block tensors [num_blocks, block_size, kv_heads, head_dim]."""
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.cfg.num_layers)
        ]
