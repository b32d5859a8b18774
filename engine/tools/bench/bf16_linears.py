"""Section 2's further engines (issue 37): where linear_precision="auto" picks bfloat16 linears on
this CPU, the offline workload runs once more on an engine with them, and once more on one whose
KV cache also holds bfloat16 (kv_cache_dtype="bfloat16": half the bytes each decode step streams
from the cache). For each the report gives its output tokens/s, the ratio to the float32 engine
(the target is 2× on a CPU with AMX) and its greedy agreement with the float32 engine's outputs:
identical requests, and each divergence classified by the project's near-tie rule
(engine/tools/near_tie.py `compare_greedy`, with the bfloat16 margin)."""

from __future__ import annotations

import torch

from engine.tools.bench.offline import greedy_params, run_engine_offline
from engine.tools.bench.targets import TARGETS
from engine.tools.workload import WorkItem


def auto_choice(model) -> dict:
    """What linear_precision="auto" runs the linears in here (timed once per process, on the
    engine under test's own layer matrices)."""
    from engine.kernels.linear_precision import linear_precision_choice
    from engine.worker.bfloat16_linears import layer_matrices

    return linear_precision_choice(lambda: layer_matrices(model))


def near_tie_agreement(model_dir, workload: list[WorkItem], ours, reference) -> dict:
    """How the bfloat16-linear engine's greedy outputs (`ours`) agree with the float32 engine's
    (`reference`): identical requests, and each first divergence a near tie (float32's top-2
    logits, from transformers' float32 model, closer than the bfloat16 margin, and ours its
    runner-up) or not. transformers is loaded only when something diverged."""
    from engine.tools.near_tie import TIE_MARGIN, compare_greedy, summarize

    hf = None
    if any(a != b for a, b in zip(ours, reference)):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    comparisons = [
        compare_greedy(hf, f"request {i}", w.prompt_token_ids, a, b, TIE_MARGIN[torch.bfloat16])
        for i, (w, a, b) in enumerate(zip(workload, ours, reference))
    ]
    _, line, data = summarize(comparisons)
    return {
        "requests": len(comparisons),
        "identical_requests": sum(c.equal for c in comparisons),
        "near_ties": sum(c.near_tie for c in comparisons),
        "not_near_ties": sum(not c.ok for c in comparisons),
        "tie_margin": TIE_MARGIN[torch.bfloat16],
        "line": line,
        "divergences": [c for c in data["comparisons"] if not c["equal"]],
    }


def run_bfloat16_linears(run, workload: list[WorkItem], float32_run: dict) -> dict:
    """The offline workload on a linear_precision="auto" engine, when auto picks bfloat16 here
    and the engine under test runs float32 linears, then on one whose KV cache also holds
    bfloat16 (kv_cache_dtype, under "with_bfloat16_kv_cache"); else why not, in one line."""
    from engine.kernels.linear_precision import bfloat16_isa
    from engine.worker.bfloat16_linears import linear_precision_of

    if linear_precision_of(run.model)["precision"] != "float32":
        return {"ran": False, "why": "the engine under test already runs bfloat16 linears"}
    choice = auto_choice(run.model)
    isa = bfloat16_isa()
    amx = "not an AMX machine" if isa != "amx_bf16" else "AMX"
    if choice["precision"] != "bfloat16":
        return {"ran": False, "why": f"auto chooses float32: {choice['why']}", "amx": amx}
    result = {
        "ran": True,
        "why": choice["why"],
        "amx": amx,
        "target_ratio_on_amx": TARGETS["bf16_linears_offline_on_amx"],
        "float32_weight_bytes": run.engine.weight_bytes(),
        **offline_variant(run, workload, float32_run, "auto"),
    }
    if run.engine.kv_cache_dtype != torch.bfloat16:
        result["with_bfloat16_kv_cache"] = offline_variant(run, workload, float32_run, "bfloat16")
    return result


def offline_variant(run, workload: list[WorkItem], float32_run: dict, kv_cache_dtype: str) -> dict:
    """The offline workload on an "auto" engine with this KV cache dtype: its run, its ratio to
    the float32 engine's and its greedy agreement with it."""
    llm = open_auto_engine(run, kv_cache_dtype)
    try:
        llm.generate(
            prompt_token_ids=[w.prompt_token_ids[:16] for w in workload[:2]],  # warm-up
            sampling_params=[greedy_params(WorkItem([], 4))] * 2,
            use_tqdm=False,
        )
        auto_run = run_engine_offline(llm, workload)
        weight_bytes = llm.engine.weight_bytes()
        cache_dtype = str(llm.engine.kv_cache_dtype).removeprefix("torch.")
    finally:
        llm.shutdown()
    tokens = auto_run["tokens"], float32_run["tokens"]
    return {
        "engine": {k: v for k, v in auto_run.items() if k != "tokens"},
        "kv_cache_dtype": cache_dtype,
        "ratio": auto_run["output_tokens_per_s"] / float32_run["output_tokens_per_s"],
        "weight_bytes": weight_bytes,
        "agreement": near_tie_agreement(run.model_dir, workload, *tokens),
    }


def open_auto_engine(run, kv_cache_dtype: str = "auto"):
    """An engine like the one under test (its batch limits, kernels, KV blocks) with
    linear_precision="auto" and this KV cache dtype."""
    from engine.entrypoints.llm import LLM

    config, engine = run.config, run.engine
    return LLM(
        model=str(run.model_dir),
        device=str(engine.device),
        dtype=str(engine.dtype).removeprefix("torch."),
        num_kv_blocks=engine.num_blocks,
        max_model_len=engine.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kernels=config.kernels,
        linear_precision="auto",
        kv_cache_dtype=kv_cache_dtype,
    )
