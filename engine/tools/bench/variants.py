"""Section 8 (`--compare-quantization`): dtype and weight-only quantization side by side, and the
llama.cpp peer on the same GGUF file."""

from __future__ import annotations

import torch

from engine.tools.bench.ceilings import measure_bandwidth, measure_matvec, model_numbers
from engine.tools.bench.config import BenchConfig, side_engine_kv_cache_memory
from engine.tools.bench.decode import batch1_probes, batch1_under_bandwidth
from engine.tools.bench.offline import run_engine_offline
from engine.tools.bench.timing import ratio
from engine.tools.workload import make_workload

DEFAULT_VARIANTS: tuple[tuple[str, str | None], ...] = (
    ("float32", None),
    ("bfloat16", None),
    ("float32", "int8"),
    ("bfloat16", "int8"),
    ("float32", "int4"),
    ("float32", "gguf"),
)


def measure_variants(
    model_dir, config: "BenchConfig", vocab: int, specials, bandwidth_gb_s: float, log=print
) -> dict:
    """Each (dtype, quantization) on the same probes, one after the other in this process: the
    weight bytes a decode step actually reads, batch-1 decode tokens/s and its fraction of the
    roofline those bytes allow, the linears' streaming rate, and offline throughput.

    The roofline of a variant is the read bandwidth sampled just before and just after its own
    decode (the better of the two): on a shared VM the bandwidth can swing 25 ↔ 50 GB/s within
    minutes (docs/performance.md, 2026-12-05), so a sample taken in another minute says little
    about the ceiling this decode ran under. The fraction of the run's best bandwidth
    (`bandwidth_gb_s`, the best of all samples) is reported beside it."""
    from engine.worker.quantization import gguf_source

    workload = make_workload(
        config.num_requests, config.prompt_len, config.output_len, config.seed, vocab, specials
    )
    rows = []
    for dtype, method in config.compare_variants or DEFAULT_VARIANTS:
        name = dtype + (f" + {method}" if method else "")
        if method == "gguf":
            try:
                gguf_source(model_dir)
            except ValueError as exc:
                rows.append({"name": name, "skipped": str(exc)})
                continue
        log(f"      {name}")
        row = measure_variant(model_dir, config, dtype, method, workload, (vocab, specials))
        rows.append({"name": name, **row})
    best = compare_rows(rows, bandwidth_gb_s)
    return {
        "bandwidth_gb_s": best,
        "rows": rows,
        "method": (
            f"one engine per variant, same process; batch-1 decode: median step over "
            f"{config.probe_repeats} probes of prompt {config.probe_prompt_len} + "
            f"{config.probe_output_len} tokens; offline: the section-2 workload "
            f"({config.num_requests} requests); roofline = read bandwidth sampled next to the "
            f"variant's decode (best of before and after) ÷ weight bytes per step; 'of best': "
            f"the same with the run's best bandwidth sample"
        ),
        "kind": "measured",
    }


def measure_variant(model_dir, config: "BenchConfig", dtype, method, workload, tokens) -> dict:
    """One engine of `dtype` and quantization `method`: its bytes, its batch-1 decode between two
    bandwidth samples, its matrix × vector rate and its offline throughput. `tokens`: (vocab size,
    special token ids) for the probes."""
    import gc

    from engine.entrypoints.llm import LLM
    from engine.worker.quantization import describe

    llm = LLM(
        model=str(model_dir),
        device=config.device,
        dtype=dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kernels=config.kernels,
        quantization=method,
        quantization_group_size=config.quantization_group_size,
        kv_cache_memory=side_engine_kv_cache_memory(config.device),
    )
    engine = llm.engine
    model = engine.executor.worker.model
    numbers = model_numbers(model)
    device = engine.device
    b1, roofline = batch1_under_bandwidth(
        engine,
        config,
        *tokens,
        lambda: measure_bandwidth(device, config.bandwidth_bytes, config.ceiling_repeats)[0],
        numbers["weight_bytes_per_step"],
    )
    row = {
        "dtype": dtype,
        "quantization": method,
        "describe": describe(model),
        "weight_bytes": engine.weight_bytes(),
        "weight_bytes_per_step": numbers["weight_bytes_per_step"],
        "matvec": measure_matvec(model, engine.device, config.ceiling_repeats),
        "decode_tokens_per_s": b1.get("tokens_per_s"),
        "decode_step_ms": b1.get("step_ms"),
        **roofline,
        **offline_of_variant(llm, workload, dtype),
    }
    del llm, engine, model
    gc.collect()
    return row


EMULATED_BFLOAT16 = (
    "not run: this CPU has neither AMX nor AVX512-BF16, so torch converts every bfloat16 matmul "
    "and a prefill runs several times slower than float32 (section 1's matmul rates); with these "
    "two rows a full run did not finish in 25 minutes on a 2-vCPU Zen 3, without them it took 22"
)


def offline_of_variant(llm, workload, dtype: str) -> dict:
    """The variant's offline throughput on the section-2 workload, unless its bfloat16 matmuls
    would be emulated (a CPU without bfloat16 instructions): then why it was not run. Its batch-1
    decode, the weight-streaming side of bfloat16, is measured either way."""
    from engine.kernels.linear_precision import bfloat16_isa

    if dtype == "bfloat16" and llm.engine.device.type == "cpu" and bfloat16_isa() is None:
        return {"offline_tokens_per_s": None, "offline_skipped": EMULATED_BFLOAT16}
    return {"offline_tokens_per_s": run_engine_offline(llm, workload)["output_tokens_per_s"]}


def compare_rows(rows: list[dict], bandwidth_gb_s: float) -> float:
    """Adds to each measured row its fraction of the run's best roofline and its ratios to the
    float32 row; returns that best bandwidth (the run's samples and the variants')."""
    measured = [r for r in rows if "skipped" not in r]
    best = max([bandwidth_gb_s, *(s for r in measured for s in r["bandwidth_samples_gb_s"])])
    base = next((r for r in measured if r["name"] == "float32"), None)
    for r in measured:
        best_roof = best * 1e9 / r["weight_bytes_per_step"]
        r["fraction_of_best_roofline"] = (
            r["decode_tokens_per_s"] / best_roof if r["decode_tokens_per_s"] else None
        )
        if base:
            r["decode_vs_float32"] = ratio(r["decode_tokens_per_s"], base["decode_tokens_per_s"])
            r["offline_vs_float32"] = ratio(r["offline_tokens_per_s"], base["offline_tokens_per_s"])
    return best


def llama_cpp_peer(model_dir, config: BenchConfig, vocab: int, specials) -> dict:
    """llama.cpp on the GGUF file the default artifact came from, on the prompts of the batch-1
    probe (engine/tools/peers/llama_cpp.py); a dict with "skipped" when it cannot run here."""
    from engine.tools.peers.llama_cpp import measure_llama_cpp_isolated
    from engine.worker.quantization import gguf_source

    if torch.device(config.device if config.device != "auto" else "cpu").type != "cpu":
        return {"skipped": "the llama.cpp peer runs on the CPU only"}
    try:
        path = gguf_source(model_dir)
    except ValueError as exc:
        return {"skipped": str(exc)}
    prompts = [item.prompt_token_ids for item in batch1_probes(config, vocab, specials)]
    return measure_llama_cpp_isolated(
        path, prompts, config.probe_output_len, torch.get_num_threads()
    )
