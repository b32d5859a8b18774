"""Section 7 (only with `--speculative ngram`): the same requests with and without n-gram drafts,
on a repetitive workload (where prompt lookup pays off) and on the random-token one."""

from __future__ import annotations

import random

from engine.tools.bench.config import BenchConfig, side_engine_kv_cache_memory
from engine.tools.bench.decode import decode_rate_batch1
from engine.tools.bench.offline import run_engine_offline
from engine.tools.bench.timing import ratio
from engine.tools.workload import WorkItem, make_workload

DEFAULT_SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


SPEC_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "lamp",
    "tiger",
    "paper",
    "glass",
    "orange",
    "window",
    "garden",
    "silver",
    "bridge",
    "candle",
    "forest",
    "rocket",
]


def repetitive_prompts(tokenizer, num_requests: int, seed: int) -> list[list[int]]:
    """Chat prompts that ask the model to copy a numbered list: the answer repeats the prompt,
    which is where prompt lookup pays off (editing code or quoting a document are alike)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        lines = [
            f"{i + 1}. {rng.choice(SPEC_WORDS)} {rng.choice(SPEC_WORDS)} {rng.randint(10, 99)}"
            for i in range(12)
        ]
        text = "Repeat this list exactly, one item per line:\n" + "\n".join(lines)
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompts.append(tokenizer.encode(chat))
    return prompts


def spec_workloads(engine, config: "BenchConfig", specials) -> dict[str, list[WorkItem]]:
    n, out = config.spec_num_requests, config.spec_output_len
    copying = repetitive_prompts(engine.tokenizer, n, config.seed + 500)
    return {
        "repetitive": [WorkItem(p, out) for p in copying],
        "random": make_workload(
            n,
            (config.probe_prompt_len, config.probe_prompt_len),
            (out, out),
            config.seed + 600,
            engine.model_config.vocab_size,
            specials,
        ),
    }


def _spec_counts(engine, before: dict) -> dict:
    after = engine.spec_decode_metrics()
    proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafts = after["num_drafts"] - before["num_drafts"]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


def run_spec_decode(llm, config: "BenchConfig", specials) -> dict:
    """Batch-1 decode tokens/s and offline throughput, without and with n-gram speculation, on a
    repetitive workload and on the random-token one; the two engines share the weights."""
    from engine.entrypoints.llm import LLM

    spec_config = config.speculative_config or DEFAULT_SPEC_CONFIG
    base = llm.engine.config
    spec_llm = LLM(
        model=str(llm.engine.model_dir),
        device=base.device,
        dtype=base.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory=side_engine_kv_cache_memory(base.device),
        max_model_len=llm.engine.max_model_len,
        speculative_config=spec_config,
    )
    rows = {}
    for name, workload in spec_workloads(llm.engine, config, specials).items():
        row = {}
        for label, runner in (("plain", llm), ("ngram", spec_llm)):
            before = runner.engine.spec_decode_metrics()
            batch1 = decode_rate_batch1(runner.engine, workload)
            offline = run_engine_offline(runner, workload)
            row[label] = {
                "decode_batch1_tokens_per_s": batch1["tokens_per_s"],
                "offline_output_tokens_per_s": offline["output_tokens_per_s"],
                "offline_steps": offline["steps"],
                "tokens": offline["tokens"],
            }
            if label == "ngram":
                row[label]["spec"] = _spec_counts(runner.engine, before)
        row["identical_outputs"] = row["plain"].pop("tokens") == row["ngram"].pop("tokens")
        row["speedup_decode_batch1"] = ratio(
            row["ngram"]["decode_batch1_tokens_per_s"], row["plain"]["decode_batch1_tokens_per_s"]
        )
        row["speedup_offline"] = ratio(
            row["ngram"]["offline_output_tokens_per_s"], row["plain"]["offline_output_tokens_per_s"]
        )
        rows[name] = row
    return {
        "speculative_config": spec_config,
        "num_requests": config.spec_num_requests,
        "output_len": config.spec_output_len,
        "sampling": "greedy, ignore_eos",
        "workloads": rows,
    }
