"""Section 2: offline throughput. The engine (`LLM.generate`, continuous batching) against
transformers `generate` in padded static batches, both counting only useful tokens."""

from __future__ import annotations

import statistics
import time

import torch

from engine.tools.bench.timing import sync
from engine.tools.workload import WorkItem


def greedy_params(item: WorkItem):
    from engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True)


def run_engine_offline(llm, workload: list[WorkItem]) -> dict:
    """All requests at once through LLM.generate; output tokens/s over the whole run."""
    start = time.perf_counter()
    outputs = llm.generate(
        prompt_token_ids=[w.prompt_token_ids for w in workload],
        sampling_params=[greedy_params(w) for w in workload],
        use_tqdm=False,
    )
    seconds = time.perf_counter() - start
    records = llm.step_records
    output_tokens = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = sum(len(w.prompt_token_ids) for w in workload)
    return {
        "seconds": seconds,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / seconds,
        "requests_per_s": len(workload) / seconds,
        "steps": len(records),
        "preemptions": sum(len(r.preempted) for r in records),
        "tokens": [o.token_ids for o in outputs],
    }


def run_transformers_static(
    model_dir,
    workload: list[WorkItem],
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype,
    pad_token_id: int,
) -> dict:
    """transformers `generate` over padded static batches of `batch_size`, in workload order.

    Each batch is left-padded to its longest prompt (with an attention mask) and runs greedy for
    its longest output with eos_token_id=None: EOS neither stops a row nor is masked, which is
    what ignore_eos means to the engine (and to vLLM). min_new_tokens, the obvious alternative,
    masks EOS out of the logits: three of the 64 requests then differed from the engine exactly
    where the engine's greedy choice was EOS (2026-12-02; transformers alone agreed with us).
    Only each request's own output tokens count as useful."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def generate(batch: list[WorkItem]) -> list[list[int]]:
        width = max(len(w.prompt_token_ids) for w in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            ids[row, width - len(w.prompt_token_ids) :] = torch.tensor(w.prompt_token_ids)
            mask[row, width - len(w.prompt_token_ids) :] = 1
        new = max(w.output_len for w in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=new,
                eos_token_id=None,
                pad_token_id=pad_token_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        sync(device)
        return [out[row, width : width + w.output_len].tolist() for row, w in enumerate(batch)]

    generate([WorkItem(workload[0].prompt_token_ids[:8], 2)])  # warm-up
    batches = [workload[i : i + batch_size] for i in range(0, len(workload), batch_size)]
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for batch in batches:
        tokens += generate(batch)
    seconds = time.perf_counter() - start
    useful = sum(w.output_len for w in workload)
    computed_prompt = sum(len(b) * max(len(w.prompt_token_ids) for w in b) for b in batches)
    computed_output = sum(len(b) * max(w.output_len for w in b) for b in batches)
    model = None  # free the weights before the engine runs again
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "output_tokens_per_s": useful / seconds,
        "requests_per_s": len(workload) / seconds,
        "batches": len(batches),
        "batch_size": batch_size,
        # what a static batch computes beyond the useful work: padding and finished members
        "prompt_tokens_computed": computed_prompt,
        "prompt_tokens_useful": sum(len(w.prompt_token_ids) for w in workload),
        "output_slots_computed": computed_output,
        "output_slots_useful": useful,
        "tokens": tokens,
    }


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How long the two greedy outputs stay identical (float rounding can flip near-ties)."""
    same_prefix = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        same_prefix.append(n / max(len(a), 1))
    return {
        "identical_requests": sum(1 for a, b in zip(ours, theirs) if a == b),
        "requests": len(same_prefix),
        "mean_matching_prefix": statistics.mean(same_prefix) if same_prefix else None,
    }
