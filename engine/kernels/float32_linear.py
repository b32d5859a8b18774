"""Which library runs float32 linear layers on this CPU: MKL (F.linear) or oneDNN.

On a CPU, F.linear in float32 goes to the BLAS library PyTorch ships (MKL). oneDNN, the CPU
library PyTorch uses for convolutions (and torch.compile for linear layers), ran the same float32
matmuls 1.5-2× faster on our 2-core AMD EPYC at every batch size from 1 to 512 tokens; on a
2-core Intel Xeon (AMX, 2026-12-02) it was the other way round at one row: MKL 16.8 ms for the
120 layer matrices, oneDNN 25.0 ms, and the same within 5 % from 8 rows up. Which is faster
depends on the CPU, so the first float32 model on a CPU times both (`float32_linear_backend`),
once per process; every linear layer built after that takes the winner
(engine/layers/linear.py).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref

import torch
import torch.nn.functional as F

from engine.kernels import huge_pages

logger = logging.getLogger(__name__)

FLOAT32_LINEAR_ENV = "LLM_LAB_FLOAT32_LINEAR"  # "mkl" or "onednn": skip the timing, use that one
_float32_linear: dict | None = None  # the choice and the timings behind it, once per process


@functools.cache
def onednn_linear_works() -> bool:
    """True if this PyTorch build can call oneDNN's linear kernel directly (CPU builds with
    oneDNN). Tried once, on first use."""
    try:
        x = torch.ones(1, 2)
        return torch.ops.mkldnn._linear_pointwise(
            x, torch.ones(3, 2), None, "none", [], ""
        ).shape == (1, 3)
    except (AttributeError, RuntimeError):
        return False


def __getattr__(name: str):
    if name == "ONEDNN_LINEAR":  # a constant to its readers, measured on first use
        return onednn_linear_works()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def time_linears(candidates: dict) -> dict:
    """Each candidate (name → (fn(x, w), matrices)) over its matrices at 1 row (decode at batch
    1) and at 32 rows of float32 activations, best of a few runs, in milliseconds:
    {rows: {name: ms}}. The candidates take turns within each repeat, so a load that comes and
    goes on a shared machine falls on all of them alike. The one timing helper for the float32
    library and the linears' precision (engine/kernels/linear_precision.py)."""
    ms = {}
    for rows, repeats in ((1, 3), (32, 2)):
        calls = {name: _call_over(fn, mats, rows) for name, (fn, mats) in candidates.items()}
        for call in calls.values():
            call()  # warm up (oneDNN prepares its kernel on the first call)
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
        ms[rows] = {name: 1e3 * seconds for name, seconds in best.items()}
    return ms


def _call_over(fn, matrices: list[torch.Tensor], rows: int):
    """One call of `fn` on each matrix, with `rows` float32 activations of its width."""
    inputs = {k: torch.full((rows, k), 0.01) for k in {m.shape[1] for m in matrices}}
    return lambda: [fn(inputs[m.shape[1]], m) for m in matrices]


def _choose(matrices: list[torch.Tensor]) -> dict:
    """oneDNN stays (it was the faster where this was first measured) unless MKL is at least
    15 % faster at one row and no more than 10 % slower at 32: one library for every row count
    (an engine on our kernels runs up to 8 rows on its own kernel, csrc/f32_rows.cpp; one row
    and several sum in different orders in either library too)."""
    ms = time_linears({"mkl": (F.linear, matrices), "onednn": (onednn_linear, matrices)})
    mkl_wins = ms[1]["mkl"] < 0.85 * ms[1]["onednn"] and ms[32]["mkl"] < 1.1 * ms[32]["onednn"]
    size = sum(m.numel() for m in matrices) * 4 / 1e6
    return {
        "backend": "mkl" if mkl_wins else "onednn",
        "why": f"timed over {len(matrices)} matrices, {size:.0f} MB: "
        + "; ".join(
            f"{rows} row{'s' * (rows > 1)} MKL {t['mkl']:.1f} ms, oneDNN {t['onednn']:.1f} ms"
            for rows, t in ms.items()
        ),
        "ms": ms,
    }


def float32_linear_backend(matrices: list[torch.Tensor] | None = None) -> dict:
    """Which library runs float32 linears on this CPU, "mkl" (F.linear) or "onednn", with the
    timings behind the choice, over `matrices` (the first model's own layer weights, as a decode
    step reads them; else 8 synthetic 2048 × 2048 ones). Measured once per process (about half
    a second for the default model), or set by the environment variable
    LLM_LAB_FLOAT32_LINEAR."""
    global _float32_linear
    if _float32_linear is not None:
        return _float32_linear
    forced = os.environ.get(FLOAT32_LINEAR_ENV, "").strip().lower()
    if not onednn_linear_works():
        _float32_linear = {"backend": "mkl", "why": "this PyTorch build has no oneDNN linear"}
    elif forced in ("mkl", "onednn"):
        _float32_linear = {"backend": forced, "why": f"{FLOAT32_LINEAR_ENV}={forced}"}
    else:
        _float32_linear = _choose(matrices or [torch.full((2048, 2048), 0.01) for _ in range(8)])
    logger.info(
        "float32 linear on this CPU: %s (%s)", _float32_linear["backend"], _float32_linear["why"]
    )
    return _float32_linear


def library_linear():
    """The float32 library chosen above, as a function y = f(x, W, bias)."""
    return onednn_linear if float32_linear_backend()["backend"] == "onednn" else F.linear


def float32_kernel(w: torch.Tensor, kernels):
    """`w`'s C++ linear (`kernels.QuantLinear`, engine/kernels/csrc/fused_blocks.cpp, also what
    the fused layers call): at up to 8 rows (a decode step's) a kernel of our own, its channels
    split over the threads, each output summed in one stated order whatever the other rows; at
    more rows the library chosen above (csrc/f32_rows.cpp). The libraries streamed the weights
    well below the memory's speed there (a Zen 5, 2026-12-06: the model's matrices 1.6× faster
    on ours at one row, 1.3-2× at 2-8: docs/performance.md, nineteenth session).

    Our kernel reads a copy of `w` packed at load, 4 channels' weights together (`packed_copy`),
    so a float32 matrix on our kernels takes twice its bytes: the library's rows need `w` as it
    is, and reading 4 of its rows side by side was half as fast (twenty-first session)."""
    name = f"float32_{float32_linear_backend()['backend']}"
    return kernels.QuantLinear(name, [w, packed_copy(w, kernels)], 0)


_packed_arena = huge_pages.Arena()  # the packed copies, in huge pages as the weights are
_packed: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(w) → (w, its packed copy)
_packing = threading.Lock()


def packed_copy(w: torch.Tensor, kernels) -> torch.Tensor:
    """`w` in our float32 kernel's layout (csrc/f32_rows.cpp `f32_pack`), in huge pages, made
    once per weight while a kernel holds it (the engines of a process share their weights, and so
    the copies; the copies a precision timing made go with its kernels); an empty tensor for a
    weight not in rows (a transposed view), which stays with the library alone."""
    if not w.is_contiguous():
        return torch.empty(0)
    with _packing:
        known = _packed.get(id(w))
        packed = known[1]() if known is not None and known[0]() is w else None
        if packed is None:
            width = kernels.f32_packed_width(w.shape[1])
            packed = _packed_arena.zeros((w.shape[0], width), w.dtype)
            kernels.f32_pack(w, packed)
            forget = lambda _, key=id(w): _packed.pop(key, None)  # noqa: E731
            _packed[id(w)] = (weakref.ref(w, forget), weakref.ref(packed))
        return packed


def float32_linear(x: torch.Tensor, w: torch.Tensor, bias=None, *, kernel) -> torch.Tensor:
    """y = x @ Wᵀ (+ bias) for a float32 W on a CPU through its bound `kernel`
    (`float32_kernel`), as a layer's matmul on an engine running our kernels (an engine that
    does not runs `library_linear()` at every row count)."""
    return kernel(x, bias)
