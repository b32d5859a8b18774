"""Which precision a float32 CPU engine's linear layers run in: float32, or bfloat16.

A CPU with bfloat16 instructions (AMX's amx_bf16 tiles, or AVX512-BF16's avx512_bf16 dot
products) multiplies bfloat16 matrices faster than float32 ones: on our 2-vCPU AMD EPYC (Zen 4,
avx512_bf16) F.linear ran 1.1-1.2× faster at one row, 2.3× at 32 rows and 2.8× on the
49,152 × 576 lm_head (2026-12-04); issue 37 measured AMX at 2,218 GFLOP/s against float32's 339.
`EngineConfig.linear_precision` = "bfloat16" keeps the linear layers' weights (lm_head included)
in bfloat16: cut once at load into tiles for our kernel where the CPU has either set
(engine/kernels/bfloat16_tiles.py, `TILES`: on AMX 1.6-1.7× oneDNN's speed at 1 and 32 rows, with
AVX512-BF16 on a Zen 5 1.5× at one row and 1.3× at 32; it rounds the activations itself), else
reordered once at load into oneDNN's blocked layout where this PyTorch can (`prepacked`, the
difference between 0.8× and 1.2-1.4× float32's speed at one row on an AMX Xeon), each float32
activation cast to bfloat16 for the matmul and the result back;
everything else (embedding lookup, attention, norms, KV cache, sampler) stays float32. "auto"
decides at load, once per process, like the float32 library (engine/kernels/float32_linear.py):
bfloat16 when the CPU has the instructions and a timing over the model's own layer matrices
shows it at least 1.3× faster at 32 rows and not slower at one row. One precision for every row
count, so a request's precision does not depend on the size of its batch. The environment variable
LLM_LAB_LINEAR_PRECISION=float32|bfloat16 skips the timing (tensor- and pipeline-parallel
workers get the driver's choice through their spec: engine/executor/multiproc.py).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from engine import kernels as kernel_lib
from engine.config import check_linear_precision
from engine.kernels import _cpu_flags
from engine.kernels.bfloat16_tiles import can_tile, tile_bfloat16, tiles_available
from engine.kernels.float32_linear import (
    float32_kernel,
    float32_linear_backend,
    onednn_linear,
    time_linears,
)

logger = logging.getLogger(__name__)

LINEAR_PRECISION_ENV = "LLM_LAB_LINEAR_PRECISION"  # "float32" or "bfloat16": skip the timing
MIN_SPEEDUP_AT_32_ROWS = 1.3  # bfloat16 must win by this much to be worth its rounding
_choice: dict | None = None  # "auto"'s choice and the timings behind it, once per process


def bfloat16_isa(flags: str | None = None) -> str | None:
    """The CPU's bfloat16 matrix instructions, "amx_bf16" or "avx512_bf16" (from `flags`, else
    /proc/cpuinfo), or None when it has neither."""
    present = set((_cpu_flags() if flags is None else flags).split())
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in present), None)


def bfloat16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ Wᵀ (+ bias) for a bfloat16 W: a float32 x is cast to bfloat16 for the matmul and the
    result back to float32 (a float32 bias is added after, unrounded); a bfloat16 x (a
    bfloat16 engine) takes the plain F.linear."""
    if x.dtype == w.dtype:
        return F.linear(x, w, bias)
    y = F.linear(x.to(w.dtype), w).to(x.dtype)
    return y if bias is None else y + bias


def bfloat16_onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """`bfloat16_linear` through oneDNN's linear kernel (the same casts)."""
    if x.dtype == w.dtype:
        return F.linear(x, w, bias)
    y = onednn_linear(x.to(w.dtype), w).to(x.dtype)
    return y if bias is None else y + bias


def prepacked(w: torch.Tensor) -> torch.Tensor:
    """A bfloat16 matrix [out, in] in oneDNN's blocked layout for its linear kernel, reordered
    once at load: given the plain layout, oneDNN reorders the weight on every call. On a 2-vCPU
    AMX Xeon (2026-12-05, the default model's 120 layer matrices) one row took 17.0 ms plain and
    11.4 prepacked (float32: 16.3), 32 rows 19.9 and 14.0-15.5 (float32: 48-53), with the same
    outputs bit for bit. An opaque tensor: its dtype and shape are the matrix's, it has no
    storage pointer, and only `bfloat16_prepacked_linear` multiplies by it."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


@functools.cache
def onednn_bfloat16_works() -> bool:
    """True if oneDNN multiplies bfloat16 here (tried once): its bfloat16 kernels need AVX-512
    or AMX, and on an AVX2 CPU (a Zen 3 EPYC, 2026-12-07) it cannot build one."""
    try:
        w = torch.ones(3, 2, dtype=torch.bfloat16)
        return bfloat16_onednn_linear(torch.ones(1, 2), w).shape == (1, 3)
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def prepacking_works() -> bool:
    """True if this PyTorch build can prepack a bfloat16 weight for oneDNN (tried once)."""
    try:
        w = torch.ones(3, 2, dtype=torch.bfloat16)
        return bfloat16_prepacked_linear(torch.ones(1, 2), prepacked(w)).shape == (1, 3)
    except (AttributeError, RuntimeError):
        return False


def bfloat16_prepacked_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`bfloat16_linear` with a `prepacked` weight (the same casts)."""
    y = torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), w, None, "none", [], "").to(x.dtype)
    return y if bias is None else y + bias


PREPACKED = "oneDNN prepacked"  # the library whose weights are reordered at load
TILES = "our bf16 tiles"  # our kernel (AMX or AVX512-BF16) on weights cut into tiles at load
BFLOAT16_LIBRARIES = {
    "F.linear": bfloat16_linear,
    "oneDNN": bfloat16_onednn_linear,
    PREPACKED: bfloat16_prepacked_linear,
}
LIBRARIES = (*BFLOAT16_LIBRARIES, TILES)


def bfloat16_library() -> str:
    """The bfloat16 library the layers use: the one "auto" timed fastest; without a timing
    (the precision set, not timed) our tiles where this CPU runs them, else oneDNN on
    prepacked weights where it works, else F.linear."""
    library = (_choice or {}).get("library")
    if library:
        return library
    if tiles_available(kernel_lib.load()):
        return TILES
    return PREPACKED if prepacking_works() else "F.linear"


def bfloat16_matmul():
    """The bfloat16 linear a layer with a plain bfloat16 weight calls (a prepacked weight always
    takes `bfloat16_prepacked_linear`, a tiled one our kernel; a matrix the chosen layout does
    not take stays plain, on oneDNN where it multiplies bfloat16, else on F.linear)."""
    library = bfloat16_library()
    if library in (PREPACKED, TILES):
        library = "oneDNN" if onednn_bfloat16_works() else "F.linear"
    return BFLOAT16_LIBRARIES[library]


def choose_precision(ms: dict | None, isa: str | None) -> dict:
    """The rule, on timings `ms` ({rows: {"float32": ms, "F.linear": ms, "oneDNN": ms}}, the two
    bfloat16 libraries by name) and the CPU's bfloat16 instructions `isa`: bfloat16 (through
    its faster library over 1 + 32 rows) when `isa` is present, it is at least 1.3× faster at 32
    rows and not slower at one row; else float32, with the reason."""
    if isa is None:
        why = "this CPU has no bfloat16 instructions (neither amx_bf16 nor avx512_bf16)"
        return {"precision": "float32", "library": None, "why": why, "ms": ms}
    timed = [name for name in LIBRARIES if name in ms[1]]
    library = min(timed, key=lambda name: ms[1][name] + ms[32][name])
    speedup = {rows: t["float32"] / t[library] for rows, t in ms.items()}
    faster = speedup[32] >= MIN_SPEEDUP_AT_32_ROWS and speedup[1] >= 1.0
    timings = "; ".join(
        f"{rows} row{'s' * (rows > 1)} float32 {t['float32']:.1f} ms, bfloat16 ({library}) "
        f"{t[library]:.1f} ms ({speedup[rows]:.2f}×)"
        for rows, t in ms.items()
    )
    rule = f"needs ≥ {MIN_SPEEDUP_AT_32_ROWS}× at 32 rows and ≥ 1× at 1 row"
    return {
        "precision": "bfloat16" if faster else "float32",
        "library": library if faster else None,
        "why": f"{isa}; {timings}" + ("" if faster else f" ({rule})"),
        "ms": ms,
    }


def _time_precisions(matrices: list[torch.Tensor]) -> dict:
    """float32 (as a float32 layer runs it: on our kernels where they build, up to 8 rows on our
    own kernel; else, and at more rows, on the float32 library chosen for this CPU)
    and the bfloat16 libraries over `matrices` and their bfloat16 copies (prepacked ones where
    this PyTorch can), side by side under the same load."""
    f32 = F.linear if float32_linear_backend(matrices)["backend"] == "mkl" else onednn_linear
    kernels = kernel_lib.load()
    if kernels is not None:
        bound = {id(m): float32_kernel(m, kernels) for m in matrices}
        f32 = lambda x, w: bound[id(w)](x, None)  # noqa: E731 — the matrix's bound kernel
    bf16 = [m.to(torch.bfloat16) for m in matrices]
    candidates = {"float32": (f32, matrices)}
    candidates["F.linear"] = (bfloat16_linear, bf16)
    if onednn_bfloat16_works():
        candidates["oneDNN"] = (bfloat16_onednn_linear, bf16)
    if prepacking_works():
        candidates[PREPACKED] = (bfloat16_prepacked_linear, [prepacked(m) for m in bf16])
    if tiles_available(kernels) and all(can_tile(m.shape) for m in bf16):
        tiles = [tile_bfloat16(m) for m in bf16]
        candidates[TILES] = (lambda x, w: kernels.bf16_tiled_linear(x, w.tiles, None), tiles)
    return time_linears(candidates)


def linear_precision_choice(matrices=None) -> dict:
    """What "auto" runs the linears in on this CPU, "float32" or "bfloat16", with the bfloat16
    library and the timings behind the choice, over `matrices` (the first model's own layer
    weights, or a function that returns them, called only when the timing runs; else 8
    synthetic 2048 × 2048 ones). Measured once per process (about half a second for the default
    model), or set by LLM_LAB_LINEAR_PRECISION."""
    global _choice
    if _choice is not None:
        return _choice
    forced = os.environ.get(LINEAR_PRECISION_ENV, "").strip().lower()
    isa = bfloat16_isa()
    if forced in ("float32", "bfloat16"):
        _choice = {"precision": forced, "library": None, "why": f"{LINEAR_PRECISION_ENV}={forced}"}
    elif isa is None:
        _choice = choose_precision(None, None)
    else:
        matrices = matrices() if callable(matrices) else matrices
        synthetic = [torch.full((2048, 2048), 0.01) for _ in range(8)]
        _choice = choose_precision(_time_precisions(matrices or synthetic), isa)
    logger.info("linear precision on this CPU: %s (%s)", _choice["precision"], _choice["why"])
    return _choice


def resolve_linear_precision(precision: str, device, dtype, matrices=None) -> dict:
    """What an engine's `linear_precision` setting runs, on its resolved device and dtype:
    {"precision": "float32" | "bfloat16", "why": ...}. "auto" outside a float32 CPU engine is
    float32 (a device "auto" that became a GPU); an explicit "bfloat16" there is refused."""
    device, dtype = torch.device(device), dtype
    if precision == "float32":
        return {"precision": "float32", "why": "linear_precision='float32' (the default)"}
    if precision == "auto" and (device.type != "cpu" or dtype != torch.float32):
        why = f"auto: not a float32 CPU engine ({device.type}, {dtype})"
        return {"precision": "float32", "why": why}
    check_linear_precision(precision, device, dtype)
    if precision == "bfloat16":
        return {"precision": "bfloat16", "why": "linear_precision='bfloat16'"}
    choice = linear_precision_choice(matrices)
    return {"precision": choice["precision"], "why": f"auto: {choice['why']}"}
