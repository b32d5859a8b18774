"""Bench section 9: tensor / pipeline parallel against tp 1, on the same requests, in one run.

`python -m engine bench --tensor-parallel-size N [--pipeline-parallel-size M]` adds it. Both
engines get the same KV block count and context, so they schedule the same steps; the figures
are offline output tokens/s, batch-1 decode tokens/s, and the workers' communication share of
the step (measured in each worker: all-reduce and send/recv seconds ÷ step seconds, waiting for
a slower peer included), with the all-reduce count per step measured beside the derived one
(2 per layer a rank runs).
"""

from __future__ import annotations

import time

import torch

from engine.layers.sharding import all_reduces_per_step
from engine.tools.bench.decode import decode_rate_batch1
from engine.tools.bench.offline import run_engine_offline


def worker_share(records) -> dict:
    """Sums over the steps that ran a forward and over all ranks: compute vs communication."""
    steps = [r for r in records if r.scheduled and r.workers]
    compute = sum(w["compute_s"] for r in steps for w in r.workers)
    comm = sum(w["comm_s"] for r in steps for w in r.workers)
    counts = [r.workers[0]["all_reduce_count"] for r in steps]
    return {
        "steps": len(steps),
        "compute_s": compute,
        "comm_s": comm,
        "comm_share": comm / (compute + comm) if compute + comm else None,
        "all_reduces_per_step": sum(counts) / len(counts) if counts else 0.0,
        "all_reduce_bytes": sum(w["all_reduce_bytes"] for r in steps for w in r.workers),
        "p2p_bytes": sum(w["p2p_bytes"] for r in steps for w in r.workers),
    }


def measure(llm, workload, decode_workload) -> dict:

    offline = run_engine_offline(llm, workload)
    share = worker_share(llm.step_records)
    batch1 = decode_rate_batch1(llm.engine, decode_workload)
    return {
        "offline_output_tokens_per_s": offline["output_tokens_per_s"],
        "offline_steps": offline["steps"],
        "decode_batch1_tokens_per_s": batch1["tokens_per_s"],
        "weight_bytes": llm.engine.weight_bytes(),
        "kv_cache_bytes": llm.engine.kv_cache_bytes(),
        **share,
        "tokens": offline["tokens"],
    }


def run_parallel(llm, config, log=print) -> dict:
    """The baseline `llm` (tp 1) and a tp × pp engine on the same requests."""
    from engine.entrypoints.llm import LLM
    from engine.tools.workload import make_workload

    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    specials = sorted(engine.tokenizer.special_token_ids)
    n = min(config.num_requests, 16)
    workload = make_workload(
        n, config.prompt_len, config.output_len, config.seed + 900, vocab, specials
    )
    decode = make_workload(
        2,
        (config.probe_prompt_len, config.probe_prompt_len),
        (config.probe_output_len, config.probe_output_len),
        config.seed + 901,
        vocab,
        specials,
    )
    start = time.perf_counter()
    parallel = LLM(
        model=str(engine.model_dir),
        device=engine.config.device,
        dtype=engine.config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        num_kv_blocks=engine.num_blocks,
        max_model_len=engine.max_model_len,
        kernels=config.kernels,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    startup = time.perf_counter() - start
    try:
        rows = {"tp1": measure(llm, workload, decode)}
        rows[f"tp{tp}_pp{pp}"] = measure(parallel, workload, decode)
        layout = parallel.engine.executor.layout()
    finally:
        parallel.shutdown()
    threads = torch.get_num_threads()
    rows["tp1"]["threads_per_process"] = threads
    rows[f"tp{tp}_pp{pp}"]["threads_per_process"] = max(1, threads // (tp * pp))
    base, par = rows["tp1"], rows[f"tp{tp}_pp{pp}"]
    identical = base.pop("tokens") == par.pop("tokens")
    return {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "num_requests": n,
        "startup_s": startup,
        "derived_all_reduces_per_step": all_reduces_per_step(engine.model_config, tp, pp),
        "identical_outputs": identical,
        "rows": rows,
        "speedup_offline": _ratio(
            par["offline_output_tokens_per_s"], base["offline_output_tokens_per_s"]
        ),
        "speedup_decode_batch1": _ratio(
            par["decode_batch1_tokens_per_s"], base["decode_batch1_tokens_per_s"]
        ),
        "layout": layout,
    }


def _ratio(a, b):
    return a / b if a and b else None
