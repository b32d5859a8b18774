"""The whole run: build the engine under test, then run the sections in order (their progress
lines read [k/n], n the sections this run has), record the conditions, and report."""

from __future__ import annotations

import datetime
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.kernels import huge_pages
from engine.tools.bench.bf16_linears import run_bfloat16_linears
from engine.tools.bench.ceilings import (
    measure_bandwidth,
    measure_ceilings,
    measure_matvec,
    model_numbers,
    rooflines,
)
from engine.tools.bench.config import BenchConfig
from engine.tools.bench.decode import (
    batch1_under_bandwidth,
    probe_workload,
    run_steps,
    step_breakdown,
)
from engine.tools.bench.fidelity import simulator_fidelity
from engine.tools.bench.kernels import (
    measure_attention_kernel,
    measure_decode_both_paths,
    measure_linear_kernels,
)
from engine.tools.bench.latency import run_latency
from engine.tools.bench.offline import (
    greedy_agreement,
    greedy_params,
    run_engine_offline,
    run_transformers_static,
)
from engine.tools.bench.report import format_fidelity, format_results
from engine.tools.bench.results import LATEST_RESULTS, device_name, save_results
from engine.tools.bench.spec_decode import run_spec_decode
from engine.tools.bench.structured import run_structured_outputs
from engine.tools.bench.targets import evaluate_targets
from engine.tools.bench.variants import llama_cpp_peer, measure_variants
from engine.tools.fidelity import load_conditions
from engine.tools.workload import WorkItem, make_workload


@dataclass
class BenchRun:
    """What every section reads: the config, the engine under test, its model, and the log that
    numbers the sections as they start."""

    config: BenchConfig
    llm: object
    model_dir: Path
    log: Callable[[str], None]
    sections: list[str]
    results: dict = field(default_factory=dict)
    started: int = 0

    @property
    def engine(self):
        return self.llm.engine

    @property
    def model(self):
        return self.engine.executor.worker.model

    @property
    def vocab(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def specials(self) -> list[int]:
        return sorted(self.engine.tokenizer.special_token_ids)

    def section(self, text: str) -> None:
        """Log the next section's start as [k/n]."""
        self.started += 1
        self.log(f"[{self.started}/{len(self.sections)}] {text}")


def planned_sections(config: BenchConfig, device: torch.device, dtype, fidelity: bool) -> list:
    """The sections this run has, in the order they run (the optional ones only when asked)."""
    kernels = (
        config.kernel_section
        and device.type == "cpu"
        and dtype == torch.float32
        and config.quantization is None
    )
    optional = {
        "kernels": kernels,
        "speculative decoding": bool(config.speculative),
        "variants": bool(config.compare_variants),
        "llama.cpp peer": bool(config.compare_variants) or config.quantization in ("int4", "gguf"),
        "parallel": config.tensor_parallel_size * config.pipeline_parallel_size > 1,
        "simulator fidelity": fidelity,
    }
    always = ["ceilings", "offline", "decode at batch 1", "engine overhead", "latency"]
    return always + [name for name, runs in optional.items() if runs]


def open_engine(config: BenchConfig):
    """The engine under test, as `LLM`, and its artifact's folder."""
    from engine.artifact import resolve_model_path
    from engine.entrypoints.llm import LLM

    if config.threads:
        torch.set_num_threads(config.threads)
    model_dir = resolve_model_path(config.model)
    llm = LLM(
        model=str(model_dir),
        device=config.device,
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kernels=config.kernels,
        quantization=config.quantization,
        quantization_group_size=config.quantization_group_size,
        linear_precision=config.linear_precision,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    return llm, model_dir


def describe_paths(config: BenchConfig, engine, model) -> tuple[str, str]:
    """One line each: which kernels the engine runs, and how its weights are stored."""
    from engine import kernels as kernel_lib
    from engine.worker import quantization as quant_lib

    kernels_line = f"{config.kernels} → attention: {kernel_lib.describe(model.kernel_path)}"
    if config.quantization:
        kernels_line += f"; quantized linears: {kernel_lib.describe(model.linear_kernel_path)}"
    if engine.device.type == "cpu" and engine.dtype == torch.float32:
        from engine.kernels.float32_linear import float32_linear_backend
        from engine.worker.bfloat16_linears import linear_precision_of

        choice = float32_linear_backend()
        precision = linear_precision_of(model)
        if precision["precision"] == "bfloat16":
            library, why = precision["library"], precision["why"]
            kernels_line += f"; linears in bfloat16 on {library} ({why})"
        else:
            kernels_line += f"; float32 linears: {choice['backend']} ({choice['why']})"
    return kernels_line, quant_lib.describe(model)


def conditions(run: BenchRun, kernels_line: str, quantization_line: str) -> dict:
    """What the numbers were measured under: a number without its conditions is not one."""
    import transformers

    config, engine = run.config, run.engine
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "device": engine.device.type,
        "device_name": device_name(engine.device),
        "threads": torch.get_num_threads(),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."),
        "model": str(run.model_dir),
        "model_name": run.model_dir.name,
        **model_numbers(run.model),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "quick": config.quick,
        "seed": config.seed,
        "kernels": kernels_line,
        "quantization": quantization_line,
        "quantization_method": config.quantization,
        "pages": huge_pages.describe() if engine.device.type == "cpu" else None,
        "engine": {
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "block_size": engine.config.block_size,
            "num_kv_blocks": engine.num_blocks,
            "enable_prefix_caching": engine.config.enable_prefix_caching,
        },
        "workload": {
            "num_requests": config.num_requests,
            "prompt_len": list(config.prompt_len),
            "output_len": list(config.output_len),
            "prompt_tokens": "uniform random ids, seeded",
            "sampling": "greedy, ignore_eos",
        },
    }


def run_ceilings(run: BenchRun) -> None:
    config, device = run.config, run.engine.device
    run.section(
        f"ceilings of {run.results['conditions']['device_name']} ({device.type}, "
        f"{torch.get_num_threads()} threads)"
    )
    ceilings = measure_ceilings(
        device,
        config.bandwidth_bytes,
        config.matmul_size,
        config.ceiling_repeats,
        budget_s=config.ceiling_budget_s,
    )
    ceilings.update(measure_matvec(run.model, device, config.ceiling_repeats))
    run.results["ceilings"] = ceilings


def warm_up(run: BenchRun, workload: list[WorkItem]) -> None:
    """First calls cost what no later step pays: two short requests take that out of the timed
    run. With CUDA graphs (captured the first time a batch size and context bucket is met) a
    workload of the same shape runs once, so that the timed run replays graphs instead of
    capturing them; its prompts are other random ids (another seed), so the prefix cache holds
    nothing the timed run could reuse."""
    runner = getattr(getattr(run.engine.executor, "worker", None), "runner", None)
    graphs = getattr(runner, "cuda_graphs", None)
    if graphs is None:
        run.llm.generate(
            prompt_token_ids=[w.prompt_token_ids[:16] for w in workload[:2]],
            sampling_params=[greedy_params(WorkItem([], 4))] * 2,
            use_tqdm=False,
        )
        return
    config = run.config
    same_shape = make_workload(
        len(workload),
        config.prompt_len,
        config.output_len,
        config.seed + 1,
        run.vocab,
        run.specials,
    )
    run_engine_offline(run.llm, same_shape)
    run.results["conditions"]["cuda_graphs"] = (
        f"{run.engine.cuda_graphs}; {len(graphs.stats.captures)} captured in an untimed run of "
        "a workload of the offline one's shape"
    )
    run.log(f"      warm-up: {run.results['conditions']['cuda_graphs']}")


def run_offline(run: BenchRun) -> dict:
    """The engine, then transformers, on the same requests; the engine's run (with its tokens)."""
    config = run.config
    workload = make_workload(
        config.num_requests,
        config.prompt_len,
        config.output_len,
        config.seed,
        run.vocab,
        run.specials,
    )
    run.section(f"offline: {len(workload)} requests through the engine")
    warm_up(run, workload)
    engine_run = run_engine_offline(run.llm, workload)
    if config.trace:
        write_offline_trace(run, config.trace)
    offline = {"engine": {k: v for k, v in engine_run.items() if k != "tokens"}}
    if not config.skip_transformers:
        run.log(
            "      offline: the same requests through transformers, static batches of "
            f"{config.max_num_seqs}"
        )
        eos = run.engine.tokenizer.eos_token_id
        pad = eos if eos is not None else 0
        engine = run.engine
        hf = run_transformers_static(
            run.model_dir, workload, config.max_num_seqs, engine.device, engine.dtype, pad
        )
        offline["transformers"] = {k: v for k, v in hf.items() if k != "tokens"}
        offline["ratio"] = engine_run["output_tokens_per_s"] / hf["output_tokens_per_s"]
        offline["greedy_agreement"] = greedy_agreement(engine_run["tokens"], hf["tokens"])
    if run.engine.device.type == "cpu" and run.engine.dtype == torch.float32:
        if config.quantization is None:  # the same requests with auto's bfloat16 linears
            run.log("      offline: the same requests with linear_precision='auto'")
            offline["bfloat16_linears"] = run_bfloat16_linears(run, workload, engine_run)
    run.results["offline"] = offline
    return engine_run


def write_offline_trace(run: BenchRun, path: str) -> None:
    """The offline engine run (all requests at once, continuous batching) as a Perfetto trace:
    its steps and the journeys of its requests (not the warm-up's)."""
    from engine.tools.trace_export import write_trace

    records = run.llm.step_records
    seen = {s.request_id for r in records for s in r.scheduled}
    requests = [q for q in run.engine.all_requests() if q.request_id in seen]
    write_trace(path, [("bench offline", records, requests)])
    run.log(f"      offline: trace written to {path} (ui.perfetto.dev, chrome://tracing)")


def resample_bandwidth(run: BenchRun) -> float:
    """On a shared machine the bandwidth can change within minutes (on the 2-vCPU VM of
    docs/performance.md, 30 ↔ 66 GB/s): sample it again, add the sample to the run's, whose best
    is the run's roofline. Returns this sample."""
    config, ceilings = run.config, run.results["ceilings"]
    read, _ = measure_bandwidth(run.engine.device, config.bandwidth_bytes, config.ceiling_repeats)
    ceilings["memory_read_gb_s_samples"].append(read)
    ceilings["memory_read_gb_s"] = max(ceilings["memory_read_gb_s_samples"])
    numbers = model_numbers(run.model)
    run.results["rooflines"] = rooflines(ceilings, numbers, run.engine.dtype)
    return read


def run_decode_batch1(run: BenchRun) -> dict:
    """Batch-1 decode against the roofline of the bandwidth sampled just before and just after it
    (the better of the two: the ceiling it ran under), and against the run's best sample."""
    config = run.config
    run.section("decode at batch 1")
    batch1, roofline = batch1_under_bandwidth(
        run.engine,
        config,
        run.vocab,
        run.specials,
        lambda: resample_bandwidth(run),
        model_numbers(run.model)["weight_bytes_per_step"],
    )
    best_roof = run.results["rooflines"]["decode_tokens_per_s"]
    tokens_per_s = batch1.get("tokens_per_s") if batch1.get("steps") else None
    run.results["decode_batch1"] = {
        "tokens_per_s": batch1.get("tokens_per_s"),
        "step_ms": batch1.get("step_ms"),
        **roofline,
        "fraction_of_best_roofline": tokens_per_s / best_roof if tokens_per_s else None,
        "context": f"prompt {config.probe_prompt_len} + up to {config.probe_output_len} tokens; "
        f"median over {batch1.get('steps', 0)} decode steps",
    }
    return batch1


def run_overhead(run: BenchRun, batch1: dict) -> None:
    config = run.config
    run.section(f"engine overhead at batch 1 and batch {config.max_num_seqs}")
    full = probe_workload(
        config.max_num_seqs,
        config.probe_prompt_len,
        max(8, config.probe_output_len // 2),
        config.seed + 200,
        run.vocab,
        run.specials,
    )
    run.results["overhead"] = {
        "batch_1": batch1,
        "full_batch": step_breakdown(run_steps(run.engine, full), config.max_num_seqs),
    }
    run.log("  structured outputs: free and JSON-schema decode, the mask's time per step")
    run.results["structured_outputs"] = run_structured_outputs(run.engine, config.probe_output_len)


def run_latency_section(run: BenchRun, offline_requests_per_s: float) -> None:
    config = run.config
    rates = list(config.latency_rates or [])
    if not rates:
        rates = [round(f * offline_requests_per_s, 4) for f in config.latency_rate_fractions]
    run.section(
        f"latency under load: Poisson arrivals at {', '.join(f'{r:.3g}' for r in rates)} requests/s"
    )
    workload = make_workload(
        config.latency_requests,
        config.prompt_len,
        config.output_len,
        config.seed + 300,
        run.vocab,
        run.specials,
    )
    run.results["latency"] = {
        "requests_per_rate": config.latency_requests,
        "rates_from": "given"
        if config.latency_rates
        else f"fractions {list(config.latency_rate_fractions)} of the offline request rate",
        "runs": run_latency(run.engine, workload, rates, config.seed + 400),
    }


def run_kernels(run: BenchRun) -> None:
    config = run.config
    run.section("kernels: linear kernels, attention alone, decode steps with torch and auto")
    run.results["kernels"] = {
        "linear": measure_linear_kernels(run.model, config.ceiling_repeats),
        "attention": measure_attention_kernel(
            run.model, config.max_num_seqs, (350, 450), config.ceiling_repeats, config.seed + 700
        ),
        "decode": measure_decode_both_paths(run.model_dir, config, run.vocab, run.specials),
    }


def run_optional_sections(run: BenchRun) -> None:
    """Sections 6-9, each only when this run asked for it (see `planned_sections`)."""
    config, sections = run.config, run.sections
    if "kernels" in sections:
        run_kernels(run)
    if "speculative decoding" in sections:
        run.section(
            f"speculative decoding ({config.speculative}): with and without, same workloads"
        )
        run.results["spec_decode"] = run_spec_decode(run.llm, config, run.specials)
    args = (run.model_dir, config, run.vocab, run.specials)
    if "variants" in sections:
        run.section("dtype and quantization side by side: batch-1 decode, offline throughput")
        best = run.results["ceilings"]["memory_read_gb_s"]  # the run's best sample so far
        run.results["variants"] = measure_variants(*args, best, run.log)
    if "llama.cpp peer" in sections:
        run.section("llama.cpp peer: the same GGUF file, batch-1 decode")
        run.results["llama_cpp"] = llama_cpp_peer(*args)
    if "parallel" in sections:
        from engine.tools.bench.parallel import run_parallel

        run.section(
            f"parallel: tp {config.tensor_parallel_size} × pp "
            f"{config.pipeline_parallel_size} worker processes against tp 1"
        )
        run.results["parallel"] = run_parallel(run.llm, config, run.log)


def run_fidelity(run: BenchRun, calibration_path: Path) -> None:
    """Section 10: the cost model describes the float engine; a quantized run skips it."""
    if run.config.quantization is not None:
        run.log(
            "      simulator fidelity: skipped (the cost model is calibrated for float weights)"
        )
        return
    run.section("simulator fidelity: calibrate on one workload, compare on the benchmark's")
    try:
        fidelity = simulator_fidelity(run.config, calibration_path, run.log)
    except Exception as exc:  # noqa: BLE001 — the last section: its failure costs its row only
        fidelity = {"error": f"{type(exc).__name__}: {exc}"}
        run.log(f"      simulator fidelity failed: {fidelity['error']}")
    run.results["simulator_fidelity"] = fidelity


def run_benchmark(
    config: BenchConfig, log=print, calibration_path: str | Path | None = None
) -> dict:
    """Every section of the benchmark, in order; the results with their conditions. With a
    `calibration_path`, section 10 (simulator fidelity) runs too, calibrating into that file."""
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    llm, model_dir = open_engine(config)
    engine = llm.engine
    fidelity = calibration_path is not None and config.quantization is None
    sections = planned_sections(config, engine.device, engine.dtype, fidelity)
    run = BenchRun(config, llm, model_dir, log, sections)
    kernels_line, quantization_line = describe_paths(config, engine, run.model)
    log(f"kernels: {kernels_line}")
    log(f"quantization: {quantization_line}")
    run.results = {"schema": 1, "conditions": conditions(run, kernels_line, quantization_line)}
    run_ceilings(run)
    engine_run = run_offline(run)
    run_overhead(run, run_decode_batch1(run))
    run_latency_section(run, engine_run["requests_per_s"])
    run_optional_sections(run)
    run.results["targets"] = evaluate_targets(run.results)
    run.results["conditions"]["bench_seconds"] = time.perf_counter() - started
    threads = run.results["conditions"]["threads"]
    run.results["conditions"].update(load_conditions(load_before, os.getloadavg()[0], threads))
    if calibration_path is not None:
        run_fidelity(run, Path(calibration_path))
    return run.results


def bench_and_report(config: BenchConfig, json_path: str | None = None) -> int:
    """`python -m engine bench`: run every section, save the results, print the report."""
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    calibration_path = (
        Path(json_path) if json_path else LATEST_RESULTS
    ).parent / "calibration.json"
    results = run_benchmark(config, log=log, calibration_path=calibration_path)
    path = save_results(results, json_path)
    print()
    print(format_results(results))
    if "simulator_fidelity" in results:
        print(format_fidelity(results["simulator_fidelity"]))
    print(f"\nresults written to {path}")
    return 0
