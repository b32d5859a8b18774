"""llama.cpp as a peer in the benchmark: the same GGUF file, the same prompts, batch-1 decode.

The default artifact was built from a llama.cpp GGUF file (Q4_1 blocks), so llama.cpp can run
literally the weights `quantization="gguf"` runs. This measures it the way the benchmark measures
the engine (engine/tools/bench/ section 8): prompt token ids in, greedy tokens out, one request,
the median time between two generated tokens. It is optional: `llama-cpp-python` compiles
llama.cpp from source when pip installs it (several minutes on 2 cores):

    pip install llama-cpp-python==0.3.36

Without it (or without the GGUF file) the peer row says why it is missing. llama.cpp runs in a
child process (`python -m engine.tools.peers.llama_cpp`): it brings its own threads and native
code, and a crash there must cost the peer row, not the benchmark around it.

On an Intel Xeon with AMX (a Sapphire Rapids VM, 2026-12-01 and 12-02; again on 2026-12-05) a
native build crashed in its first prompt of more than one token: `ggml_backend_amx_mul_mat`, the
kernel of its AMX weight buffers (gdb). Those "extra buffer types" hold repacked copies of the
weights for such kernels, and with a one-token prompt they run (230 tokens/s there, against 87
without them). A child that dies of a signal is therefore run twice more: with the extra buffers
on one-token prompts (each probe prompt's first token: its decode steps then attend to fewer
keys), and without them (`use_extra_bufts = False`, llama.cpp's own CPU kernels on the file's
blocks, as on a CPU without AMX) on the same prompts. The row is the faster of the two, llama.cpp's
best configuration on this CPU, and it says which it is and what the other measured.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

NOT_INSTALLED = "llama-cpp-python is not installed (pip install llama-cpp-python)"


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, or None when it cannot be imported."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", "unknown")


def unavailable() -> dict:
    """The peer's row when llama_cpp cannot be imported: not installed, or installed without
    what it imports (a `pip install --no-deps` leaves out diskcache, for one)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        if error.name not in (None, "llama_cpp"):
            return {"skipped": f"llama-cpp-python cannot be imported: {error}"}
    return {"skipped": NOT_INSTALLED}


def measure_llama_cpp(
    gguf_path: str | Path,
    prompts: list[list[int]],
    output_len: int,
    threads: int,
    extra_buffers: bool = True,
) -> dict:
    """Batch-1 greedy decode of each prompt with llama.cpp: decode tokens/s (median gap between
    two generated tokens over all prompts) and prefill tokens/s (prompt length ÷ the time to the
    first token). Every run starts from an empty cache (`reset=True`), so nothing is reused."""
    version = llama_cpp_version()
    if version is None:
        return unavailable()
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    if not extra_buffers:  # Llama() takes no such argument: it starts from these defaults
        defaults = bindings.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers

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
        "extra_buffers": extra_buffers,
        "prompt_lengths": sorted({len(p) for p in prompts}),
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
    """measure_llama_cpp in a child process; a crash or a hang there is a "skipped" row here.
    A child killed by a signal is measured again as the module docstring says."""
    if llama_cpp_version() is None:
        return unavailable()
    job = {"gguf": str(gguf_path), "prompts": prompts, "output_len": output_len, "threads": threads}
    row = _run_child(job, timeout_s)
    if row.pop("signal", False):
        row = _after_a_crash(job, row["skipped"], timeout_s)
    return row


def _after_a_crash(job: dict, crash: str, timeout_s: float) -> dict:
    """The faster of: extra buffers on one-token prompts, no extra buffers on the prompts."""
    one_token = {**job, "prompts": [p[:1] for p in job["prompts"]]}
    tries = {
        "with its extra buffers (AMX / repacked weights) on one-token prompts": one_token,
        "without them (use_extra_bufts=False) on the same prompts": {**job, "extra_buffers": False},
    }
    rows = {how: _run_child(child, timeout_s) for how, child in tries.items()}
    for row in rows.values():
        row.pop("signal", None)
    measured = {how: row for how, row in rows.items() if "skipped" not in row}
    if not measured:
        return {"skipped": f"{crash}; " + "; ".join(r["skipped"] for r in rows.values())}
    how, best = max(measured.items(), key=lambda item: item[1]["decode_tokens_per_s"])
    others = "; ".join(
        f"{other}: "
        + (row["skipped"] if "skipped" in row else f"{row['decode_tokens_per_s']:.1f} tokens/s")
        for other, row in rows.items()
        if other != how
    )
    which = "this row, the faster" if len(measured) > 1 else "this row"
    best["note"] = (
        f"{crash} with its extra buffers on the prompts; measured again {how} ({which}) and "
        f"{others}"
    )
    return best


def _run_child(job: dict, timeout_s: float) -> dict:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "engine.tools.peers.llama_cpp"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"skipped": f"llama.cpp did not finish within {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        message = f"llama.cpp's process failed (exit code {done.returncode}) {tail}"
        row = {"skipped": message.strip()}
        return row | {"signal": True} if done.returncode < 0 else row
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # the child: a job as JSON on stdin, the result as JSON on stdout
    job = json.loads(sys.stdin.read())
    extra_buffers = job.get("extra_buffers", True)
    result = measure_llama_cpp(
        job["gguf"], job["prompts"], job["output_len"], job["threads"], extra_buffers
    )
    print(json.dumps(result))
