"""llama.cpp as a peer in the benchmark: the same GGUF file, the same prompts, batch-1 decode.

The default artifact was built from a llama.cpp GGUF file (Q4_1 blocks), so llama.cpp can run
literally the weights `quantization="gguf"` runs. This measures it the way the benchmark measures
the engine (engine/bench.py section 10): prompt token ids in, greedy tokens out, one request,
the median time between two generated tokens. It is optional: `llama-cpp-python` compiles
llama.cpp from source when pip installs it (several minutes on 2 cores):

    pip install llama-cpp-python==0.3.36

Without it (or without the GGUF file) the peer row says why it is missing.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, or None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "unknown")


def measure_llama_cpp(
    gguf_path: str | Path,
    prompts: list[list[int]],
    output_len: int,
    threads: int,
) -> dict:
    """Batch-1 greedy decode of each prompt with llama.cpp: decode tokens/s (median gap between
    two generated tokens over all prompts) and prefill tokens/s (prompt length ÷ the time to the
    first token). Every run starts from an empty cache (`reset=True`), so nothing is reused."""
    version = llama_cpp_version()
    if version is None:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    from llama_cpp import Llama

    context = max(len(p) for p in prompts) + output_len + 8
    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=context,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    gaps: list[float] = []
    prefill_rates: list[float] = []
    for prompt in prompts:
        started = time.perf_counter()
        last = started
        for i, _token in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            now = time.perf_counter()
            if i == 0:
                prefill_rates.append(len(prompt) / (now - started))
            else:
                gaps.append(now - last)
            last = now
            if i + 1 >= output_len:
                break
    step = statistics.median(gaps)
    return {
        "name": "llama.cpp Q4_1 (peer)",
        "version": version,
        "gguf": Path(gguf_path).name,
        "threads": threads,
        "decode_tokens_per_s": 1.0 / step,
        "decode_step_ms": 1000 * step,
        "prefill_tokens_per_s": statistics.median(prefill_rates),
        "steps": len(gaps),
        "method": f"llama-cpp-python {version}, Llama.generate(top_k=1) on the same prompt ids; "
        f"median gap between generated tokens over {len(gaps)} steps",
    }
