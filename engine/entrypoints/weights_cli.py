"""The flags that say what the weights and the KV cache are stored and computed in, shared by
generate, serve and bench: weight-only quantization (engine/worker/quantization.py), the
linears' precision in a float32 engine (engine/kernels/linear_precision.py) and the KV cache's
dtype (engine/config.py KV_CACHE_DTYPES). The choices are spelled out here so that --help does
not load torch."""

from __future__ import annotations

import argparse


def add_quantization_args(p: argparse.ArgumentParser) -> None:
    """--quantization / --quantization-group-size, --linear-precision and --kv-cache-dtype."""
    p.add_argument(
        "--quantization",
        choices=["int8", "int4", "gguf"],
        default=None,
        help="weight-only quantization of the linears and lm_head: int8 (per output channel), "
        "int4 (group-wise scale + min), gguf (the default artifact's own Q4_1 blocks); "
        "default: off",
    )
    p.add_argument(
        "--quantization-group-size",
        type=int,
        default=32,
        help="input channels per int4 group (default 32; gguf: 32)",
    )
    p.add_argument(
        "--linear-precision",
        choices=["float32", "bfloat16", "auto"],
        default="float32",
        help="what a float32 CPU engine's linears (lm_head too) compute in: float32 (default), "
        "bfloat16 (bfloat16 weights, everything else float32), or auto (bfloat16 where the CPU "
        "has AMX / AVX512-BF16 and a load-time timing shows it faster)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16"],
        default="auto",
        help="what the KV cache holds: auto (the model's dtype, default) or bfloat16 (under a "
        "float32 model: half the bytes per token, K/V rounded as they are written)",
    )
