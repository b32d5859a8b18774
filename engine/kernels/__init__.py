"""Kernels of our own: a small C++ extension for the CPU, built the first time it is needed.

What it holds (engine/kernels/csrc/cpu_kernels.cpp):
- `paged_attention`: attention that reads K/V blocks where they lie in the paged cache, through
  the block table, instead of first copying every request's context into one tensor;
- `int8_linear`, `int4_linear`: weight-only quantized matrix × (a few) vectors, the formats being
  defined in engine/kernels/quant.py next to their pure-torch reference;
- `int4_q8_tiled_linear` (csrc/q8_tiles.cpp): a GGUF's Q4_1 blocks repacked at load into tiles
  of 16 channels, multiplied in integers as llama.cpp's repacked kernels do;
- `LayerStack` (csrc/fused_blocks.cpp): all the layers as one call a step; a decode step of a
  tiled, float32, weight-only int8/int4 or bfloat16-linear model as one team of threads in one
  parallel region;
- `f32_linear` (csrc/f32_rows.cpp): a float32 linear, at up to 8 rows (a decode step's) on a
  kernel of our own that streams a copy of the weights packed at load (`f32_pack`: 4 channels'
  weights together, one stream) at the memory's speed (the libraries' kernels did not there),
  its channels split over the threads; at more rows on the library the engine chose.

The pure-torch code stays the reference and the fallback. `EngineConfig(kernels="auto")` uses the
compiled kernels when they build (attention: CPU, float32 or bfloat16; the quantized linears: CPU,
any float activation dtype); "torch" never does. The choice is made per engine (`resolve`,
`resolve_linear`; engine/models/llama.py `LlamaModel.with_kernels` keeps the result on the
engine's model), never by a process-wide switch: the app runs "auto" and "torch" engines side by
side. A machine without a compiler still works: the failed build is logged once and the torch
path runs.

The build uses torch.utils.cpp_extension (g++ and ninja) with -O3 -march=native, in a cache
directory keyed by the CPU's instruction-set flags and the torch version, so a binary built on an
AVX-512 machine is never loaded on one without AVX-512. First build: about a minute on 2 cores;
later processes load the cached .so in well under a second. LLM_LAB_KERNEL_ARCH=x86-64-v3 builds
for another target instead of -march=native (x86-64-v3: AVX2, the class of CPU without AVX-512),
so a machine can measure the kernels a smaller CPU would run (docs/performance.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "torch")
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "cpu_kernels.cpp"  # holds the module's definition (PYBIND11_MODULE)
SOURCES = (
    SOURCE,
    CSRC / "q8_rows.cpp",
    CSRC / "q8_tiles.cpp",
    CSRC / "bf16_tiles.cpp",
    CSRC / "fused_blocks.cpp",
    CSRC / "sampling.cpp",
    CSRC / "f32_rows.cpp",
)

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None  # why the build failed (then we never try again in this process)


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux /proc/cpuinfo), else the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + platform.processor()


ARCH_ENV = "LLM_LAB_KERNEL_ARCH"
ARCH_ISA = {
    "x86-64": "baseline",
    "x86-64-v2": "baseline",
    "x86-64-v3": "AVX2",
    "x86-64-v4": "AVX-512",
}


def kernel_arch() -> str:
    """The -march the extension is built for: "native" (this CPU), or LLM_LAB_KERNEL_ARCH."""
    return os.environ.get(ARCH_ENV, "").strip() or "native"


def cpu_isa() -> str:
    """The widest vector instruction set the compiler will target here (for the log line)."""
    arch = kernel_arch()
    if arch != "native":
        return f"{ARCH_ISA.get(arch, arch)}, built for -march={arch}"
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:  # VNNI: the int4 x Q8 dot in one instruction (cpu_kernels.cpp)
        return "AVX-512 VNNI" if {"avx512_vnni", "avx512vl"} <= flags else "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "baseline"


def build_dir() -> Path:
    """~/.cache/llm-inference-lab/kernels/<torch version>-<hash of target, CPU flags, source and
    its folder>. The folder is in the key because ninja's build file names the sources by path:
    two checkouts sharing one build folder would each rebuild whenever the other had loaded."""
    from engine.artifact import cache_dir

    texts = [p.read_text() for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".h")]
    arch = kernel_arch()
    target = "" if arch == "native" else arch
    key_text = target + _cpu_flags() + str(CSRC.resolve()) + "".join(texts)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:12]
    return cache_dir() / "kernels" / f"torch{torch.__version__.replace('+', '_')}-{key}"


def load() -> ModuleType | None:
    """The compiled extension, building it on first use; None (logged once) if it cannot build."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        if os.environ.get("LLM_LAB_NO_KERNELS"):
            _error = "disabled by LLM_LAB_NO_KERNELS"
            logger.warning("kernels: %s; using the torch path", _error)
            return None
        try:
            from torch.utils import cpp_extension

            _put_venv_tools_on_path()
            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            _wait_out_lock(directory)
            arch = kernel_arch()
            tune = [] if arch == "native" else ["-mtune=native"]
            flags = ["-O3", f"-march={arch}", *tune, "-fopenmp", "-std=c++17"]
            _module = cpp_extension.load(
                name="llm_lab_cpu_kernels",
                sources=[str(p) for p in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
            logger.info("kernels: C++ CPU kernels loaded (%s, built in %s)", cpu_isa(), directory)
        except Exception as exc:  # noqa: BLE001 — no compiler, no ninja, a compile error: fall back
            last_line = (str(exc).strip().splitlines() or [""])[-1]
            _error = f"{type(exc).__name__}: {last_line}"
            logger.warning(
                "kernels: the C++ extension did not build (%s); using the torch path", _error
            )
        return _module


STALE_LOCK_S = 600  # a build takes about a minute on 2 cores; a lock this old has no builder


def _wait_out_lock(directory: Path, poll_s: float = 0.5) -> None:
    """torch's build lock is a file that the process holding it removes when done: every load
    holds it for a moment, a build for a minute. A process killed meanwhile (Ctrl-C, a timeout)
    leaves it, and cpp_extension.load then waits on it with no limit. So wait here instead, while
    the lock is younger than any build takes, and remove it once it is older."""
    lock, said = directory / "lock", False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            logger.warning("kernels: removing a build lock left %.0f s ago by a killed build", age)
            lock.unlink(missing_ok=True)
            return
        if not said:
            logger.warning(
                "kernels: another process holds the build lock (%.0f s old); waiting for it, "
                "at most until it is %.0f s old",
                age,
                STALE_LOCK_S,
            )
            said = True
        time.sleep(poll_s)


def _put_venv_tools_on_path() -> None:
    """pip's `ninja` lands next to this interpreter, which is not on PATH unless the venv is
    activated (run.sh calls .venv/bin/python directly); cpp_extension looks for it on PATH."""
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")


def build_error() -> str | None:
    """Why the extension is unavailable (None if it loaded or was never tried)."""
    return _error


ATTENTION_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def resolve(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which attention runs: "cpu" (our C++ kernel) or "torch". The kernel reads and writes a
    float32 or bfloat16 cache on a CPU (RMSNorm and RoPE in C++: float32 only)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {mode!r}")
    if mode == "torch" or device.type != "cpu" or dtype not in ATTENTION_KERNEL_DTYPES:
        return "torch"
    return "cpu" if load() is not None else "torch"


LINEAR_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_linear(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which path the weight-only int8/int4 linears take: "cpu" (our C++ kernels) or "torch"
    (dequantize, then an ordinary matmul: engine/kernels/quant.py `reference_linear`). The
    kernels compute in float32, so on a CPU they also serve bfloat16 and float16 activations
    (widened on the way in, narrowed on the way out)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {mode!r}")
    if mode == "torch" or device.type != "cpu" or dtype not in LINEAR_KERNEL_DTYPES:
        return "torch"
    return "cpu" if load() is not None else "torch"


def describe(path: str) -> str:
    """One line for logs and the bench header."""
    if path == "cpu":
        ext = load()
        bf16 = ext.bf16_tiles_kernel() if ext is not None else ""
        tiles = f", bfloat16 tiles on {bf16}" if bf16 else ""  # AMX, else AVX512-BF16
        return (
            f"cpu (C++ paged attention + int8/int4 linear{tiles}, {cpu_isa()}, "
            f"{torch.get_num_threads()} threads)"
        )
    reason = f": {_error}" if _error else ""
    return f"torch (reference path{reason})"
