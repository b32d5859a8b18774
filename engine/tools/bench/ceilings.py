"""Section 1: the machine's ceilings (memory bandwidth, matmul FLOP/s, the engine's own matrix ×
vector rate) and the rooflines derived from them and the model's size."""

from __future__ import annotations

import torch

from engine.kernels import huge_pages
from engine.tools.bench.timing import best_time


def _matmul_kernels(device: torch.device, dtype: torch.dtype) -> dict:
    """The ways this process can multiply matrices: torch's default (`a @ b`, BLAS on a CPU) and,
    on a CPU in float32, oneDNN's linear (the engine runs one of the two: engine/models/llama.py
    `float32_linear_backend`). A ceiling is the best of them."""
    from engine.kernels.float32_linear import ONEDNN_LINEAR, onednn_linear

    kernels = {"torch.matmul": lambda a, b: a @ b}
    if device.type == "cpu" and dtype == torch.float32 and ONEDNN_LINEAR:
        kernels["oneDNN linear"] = lambda a, b: onednn_linear(a, b)  # a @ bᵀ: the same FLOPs
    return kernels


GPU_BANDWIDTH_BYTES = 1 << 30  # a GPU reads 256 MiB in ~0.1 ms: too short to time alone
GPU_MATMUL_SIZE = 8192  # 2048² takes ~20 µs on an H100, about what launching it costs
GPU_INNER_CALLS = 10  # calls back to back per timing on a GPU (timing.best_time)


def inner_calls(device: torch.device) -> int:
    return GPU_INNER_CALLS if device.type == "cuda" else 1


def bandwidth_bytes(device: torch.device, num_bytes: int) -> int:
    return max(num_bytes, GPU_BANDWIDTH_BYTES) if device.type == "cuda" else num_bytes


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> tuple[float, float]:
    """(read, copy) GB/s: sum of a large float32 tensor reads every byte once; copy_ reads and
    writes. On a CPU the tensors sit in huge pages where the OS gives them, as the engine's
    weights do (engine/kernels/huge_pages.py): 4 KiB pages read slower (25 against 30 GB/s on
    the Xeon VM of docs/performance.md, 2026-12-05), and the ceiling is the faster kind. On a
    GPU at least 1 GiB, each timing ten calls back to back."""
    if device.type == "cpu":
        arena = huge_pages.Arena()
        x = arena.zeros((num_bytes // 4,), torch.float32).fill_(1.0)
        y = arena.zeros((num_bytes // 4,), torch.float32)
    else:
        num_bytes = bandwidth_bytes(device, num_bytes)
        x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
    inner = inner_calls(device)
    read_s = best_time(lambda: x.sum(), device, repeats, inner=inner)
    copy_s = best_time(lambda: y.copy_(x), device, repeats, inner=inner)
    return num_bytes / read_s / 1e9, 2 * num_bytes / copy_s / 1e9


def measure_ceilings(
    device: torch.device,
    num_bytes: int,
    matmul_size: int,
    repeats: int,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    budget_s: float = 20.0,
) -> dict:
    """Memory bandwidth (GB/s) and matmul rate (GFLOP/s for each of `dtypes`), each the best of
    `repeats`, a matmul's repeats cut short past `budget_s` seconds (timing.best_time): on a CPU
    without bfloat16 instructions one 1024² bfloat16 matmul took 2 s (a Zen 3 EPYC, 2026-12-07)."""
    read, copy = measure_bandwidth(device, num_bytes, repeats)
    matmul, by_kernel = {}, {}
    n = matmul_size if device.type != "cuda" else max(matmul_size, GPU_MATMUL_SIZE)
    inner = inner_calls(device)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        by_kernel[name] = {
            kernel: 2 * n**3 / best_time(lambda: fn(a, b), device, repeats, budget_s, inner) / 1e9
            for kernel, fn in _matmul_kernels(device, dtype).items()
        }
        matmul[name] = max(by_kernel[name].values())
    num_bytes = bandwidth_bytes(device, num_bytes)
    return {
        "memory_read_gb_s": read,
        "memory_read_gb_s_samples": [
            read
        ],  # a second sample is taken later in the run (see run_benchmark)
        "memory_copy_gb_s": copy,
        "matmul_gflop_s": matmul,
        "matmul_gflop_s_by_kernel": by_kernel,
        "method": (
            f"read: sum of a {num_bytes >> 20} MiB float32 tensor (in huge pages on a CPU, as the "
            f"weights are; sampled at the start and again "
            f"before the batch-1 decode, the best kept); copy: copy_ of it (read + write "
            f"counted); matmul: {n}×{n} @ {n}×{n} per dtype (2n³ FLOP), the best kernel; "
            f"best of {repeats} each" + (f", {inner} calls back to back per timing" * (inner > 1))
        ),
        "kind": "measured",
    }


def measure_matvec(model, device: torch.device, repeats: int) -> dict:
    """The engine's own linear kernel at batch 1 over every weight matrix of the model: how fast
    a decode step's matmuls can stream the weights, with nothing else in the step."""
    from engine.kernels.quant import weight_nbytes
    from engine.layers.linear import linear

    w = model.w

    # the embedding is looked up (a tied one is the lm_head matrix, counted there)
    # (a matrix: a 2-D tensor, or a quantized or tiled weight)
    names = [k for k, t in w.items() if (not torch.is_tensor(t) or t.dim() == 2) and k != "embed"]
    matrices = [w[k] for k in names]
    inputs = {
        m.shape[1]: torch.randn(1, m.shape[1], device=device, dtype=model.dtype) for m in matrices
    }
    nbytes = sum(weight_nbytes(m) for m in matrices)
    kernels = getattr(model, "linear_kernels", None)  # the path the model's own steps take
    seconds = best_time(
        lambda: [linear(inputs[m.shape[1]], m, kernels=kernels) for m in matrices], device, repeats
    )
    return {
        "matvec_gb_s": nbytes / seconds / 1e9,
        "matvec_ms": seconds * 1e3,
        "kind": "measured",
        "method": (
            f"the engine's linear, 1 token × each of the {len(matrices)} weight matrices, "
            f"best of {repeats}"
        ),
    }


def model_numbers(model) -> dict:
    """What one token costs the model: weights read per decode step (the bytes actually stored:
    quantized matrices with their scales), FLOP per token."""
    import math

    from engine.worker.quantization import _is_tied, decode_bytes_per_step

    w = model.w
    params = model.num_parameters()
    # An untied model's input embedding is looked up (one row per token), never multiplied.
    untied_embedding = 0 if _is_tied(w) else math.prod(w["embed"].shape)
    matmul_params = params - untied_embedding
    step_bytes = decode_bytes_per_step(model)
    return {
        "num_parameters": params,
        "matmul_parameters": matmul_params,
        "element_bytes": step_bytes / matmul_params,  # average bytes per weight read
        "weight_bytes_per_step": step_bytes,
        "flop_per_token": 2 * matmul_params,
    }


def rooflines(ceilings: dict, numbers: dict, dtype: torch.dtype) -> dict:
    bandwidth = ceilings["memory_read_gb_s"] * 1e9
    flops = ceilings["matmul_gflop_s"].get(str(dtype).removeprefix("torch."))
    matvec = ceilings.get("matvec_gb_s")
    return {
        "decode_tokens_per_s": bandwidth / numbers["weight_bytes_per_step"],
        "decode_formula": (
            "memory read bandwidth ÷ weight bytes read per step (batch 1: one token per step)"
        ),
        # What the matmul kernel itself allows at batch 1, before attention and everything else.
        "decode_matvec_tokens_per_s": matvec * 1e9 / numbers["weight_bytes_per_step"]
        if matvec
        else None,
        "decode_matvec_formula": (
            "matrix-vector GB/s of the engine's linear ÷ weight bytes per step"
        ),
        "compute_tokens_per_s": flops * 1e9 / numbers["flop_per_token"] if flops else None,
        "compute_formula": (
            "matmul FLOP/s ÷ (2 × matmul parameters) FLOP per token (attention not counted)"
        ),
        # Below this batch, a decode step is limited by reading the weights; above it, by the
        # matmuls.
        "balance_batch": (flops * 1e9 / numbers["flop_per_token"])
        / (bandwidth / numbers["weight_bytes_per_step"])
        if flops
        else None,
        "kind": "derived",
    }
