"""llama.cpp as a peer in the benchmark: the same GGUF file, the same prompts, batch-1 decode.

The default artifact was built from a llama.cpp GGUF file (Q4_1 blocks), so llama.cpp can run
literally the weights `quantization="gguf"` runs. This measures it the way the benchmark measures
the engine (engine/bench.py section 10): prompt token ids in, greedy tokens out, one request,
the median time between two generated tokens. It is optional: `llama-cpp-python` compiles
llama.cpp from source when pip installs it (several minutes on 2 cores):

    pip install llama-cpp-python==0.3.36

Without it (or without the GGUF file) the peer row says why it is missing. llama.cpp runs in a
child process (`python -m engine.llama_cpp_peer`): it brings its own threads and native code, and
a crash there must cost the peer row, not the benchmark around it. (On the Intel Xeon VM of
2026-12-01 a native build segfaulted at its first eval, alone as well as beside torch: the CPU
reports AMX, which the build uses, and the VM most likely does not grant it; docs/quantization.md.)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
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


def measure_llama_cpp_isolated(
    gguf_path: str | Path,
    prompts: list[list[int]],
    output_len: int,
    threads: int,
    timeout_s: float = 600,
) -> dict:
    """measure_llama_cpp in a child process; a crash or a hang there is a "skipped" row here."""
    if llama_cpp_version() is None:
        return {"skipped": "llama-cpp-python is not installed (pip install llama-cpp-python)"}
    job = {"gguf": str(gguf_path), "prompts": prompts, "output_len": output_len, "threads": threads}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "engine.llama_cpp_peer"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"llama.cpp did not finish within {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        return {"skipped": f"llama.cpp's process failed (exit code {done.returncode}) {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the child: a job as JSON on stdin, the result as JSON on stdout
    job = json.loads(sys.stdin.read())
    result = measure_llama_cpp(job["gguf"], job["prompts"], job["output_len"], job["threads"])
    print(json.dumps(result))
