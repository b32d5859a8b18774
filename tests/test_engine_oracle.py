"""The whole engine (LLM.generate: scheduler, KV-cache manager, runner, sampler, output processing)
on the real SmolLM2-135M in float32 against transformers' greedy generate: plain continuous
batching, a KV cache small enough to preempt, chunked prefill, prefix caching on and off, a shared
system prompt served from the prefix cache, and a seeded sampled request inside a batch.

Slow: transformers is loaded once (the `hf_reference` fixture); engines share the weights
(engine.worker.load_model caches them), only their small KV caches are per instance."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
TIE_MARGIN = 1e-3  # a divergence is excused only where the reference's top-2 logits are this close
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True
)

NOTES = (
    "A paged KV cache keeps the keys and values of every token in fixed-size blocks, and a block "
    "table maps each request's logical blocks to physical ones, so memory is handed out on demand "
    "and reused at once. "
)
SYSTEM = (
    "You are a careful teaching assistant for a course on LLM inference systems. Answer in two or "
    "three short sentences, define every technical term you use, prefer concrete numbers over "
    "vague words, and say so plainly when you are not sure. Never invent citations. Use simple "
    "English suitable for a beginner. When a question mixes several ideas, such as memory, latency "
    "and throughput, take them one at a time, and end with a single sentence that a student could "
    "repeat to a friend without notes."
)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, str]:
    def chat(text, system=None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return tokenizer.apply_chat_template(messages)

    long_text = "Summarize these notes in one sentence.\n\n"
    while len(tokenizer.encode(long_text)) < 310:
        long_text += NOTES
    out = {
        "long": chat(long_text),  # first, so that FCFS preemption picks the short ones
        "english": "The history of the printing press begins",
        "korean": "대한민국의 수도는 서울이며, 서울은",
        "code": 'def is_prime(n):\n    """Return True if n is prime."""\n',
        "chat_en": chat("What is the tallest mountain in the world?"),
        "chat_ko": chat("한국의 수도는 어디인가요? 짧게 답해 주세요."),
        "numbers": "1, 2, 3, 4, 5,",
        "short": "Hi",
    }
    assert len(tokenizer.encode(out["long"])) > 300
    return out


@pytest.fixture(scope="module")
def system_prompts(tokenizer) -> dict[str, str]:
    def chat(question):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages)

    return {"q1": chat("What is a KV cache?"), "q2": chat("Why does batching raise throughput?")}


def hf_greedy(hf_model, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        gen = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=None,
            pad_token_id=2,
        )
    out = gen[0, len(ids) :].tolist()
    assert len(out) == n
    return out


@pytest.fixture(scope="module")
def reference(hf_reference, tokenizer, prompts, system_prompts) -> dict[str, list[int]]:
    """transformers' greedy continuations (past EOS on both sides), keyed like the prompts."""
    texts = {**prompts, "q2": system_prompts["q2"]}
    return {name: hf_greedy(hf_reference, tokenizer.encode(text)) for name, text in texts.items()}


def assert_same_greedy(hf_model, tokenizer, name, prompt_ids, ours, ref):
    """Equal token for token; a difference is tolerated only at a near-tie of the reference
    (computed)."""
    assert len(ours) == len(ref) == NEW_TOKENS, name
    diverge = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if diverge is None:
        return
    with torch.no_grad():
        last = hf_model(torch.tensor([prompt_ids + ref[:diverge]])).logits[0, -1].float()
    top2 = last.topk(2)
    margin = (top2.values[0] - top2.values[1]).item()
    detail = (
        f"{name}: first divergence at generated token {diverge} (ours {ours[diverge]}, "
        f"reference {ref[diverge]}), reference top-2 margin {margin:.2e}\n"
        f" ours: {tokenizer.decode(ours)!r}\n  ref: {tokenizer.decode(ref)!r}"
    )
    assert margin < TIE_MARGIN, detail
    assert ours[diverge] in top2.indices.tolist(), detail


def check_batch(llm, outputs, names, hf_model, tokenizer, reference):
    for name, out in zip(names, outputs):
        assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS
        assert out.prompt_token_ids == tokenizer.encode(out.prompt)
        assert_same_greedy(
            hf_model, tokenizer, name, out.prompt_token_ids, out.token_ids, reference[name]
        )
        assert out.text == tokenizer.decode(out.token_ids)
    assert llm.engine.kv_cache_manager.snapshot().num_used == 0


def make_llm(default_model_dir, **kwargs) -> LLM:
    return LLM(model=str(default_model_dir), device="cpu", dtype="float32", **kwargs)


# -- plain continuous batching (with seeded and unseeded sampled requests alongside) ---------------


@pytest.fixture(scope="module")
def big_llm(default_model_dir):
    return make_llm(default_model_dir, num_kv_blocks=64, max_model_len=1024)


@pytest.fixture(scope="module")
def batch_run(big_llm, prompts, system_prompts):
    names = list(prompts)
    extra = {
        "sys_q1": (system_prompts["q1"], GREEDY),  # leaves the system prompt in the prefix cache
        "seeded": ("Write a short poem about the sea.", SEEDED),
        "other_seeded": (
            "Tell me a fact about Seoul.",
            SamplingParams(max_tokens=12, temperature=1.0, seed=7),
        ),
        "unseeded": (
            "List three colors:",
            SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, top_k=50),
        ),
    }
    texts = [prompts[n] for n in names] + [text for text, _ in extra.values()]
    params = [GREEDY] * len(names) + [p for _, p in extra.values()]
    outputs = big_llm.generate(texts, params, use_tqdm=False)
    return names, outputs[: len(names)], dict(zip(extra, outputs[len(names) :]))


def test_batch_greedy_matches_transformers(big_llm, batch_run, hf_reference, tokenizer, reference):
    names, outputs, _ = batch_run
    check_batch(big_llm, outputs, names, hf_reference, tokenizer, reference)
    records = big_llm.step_records
    assert big_llm.engine.scheduler.num_preemptions == 0
    assert max(len(r.scheduled) for r in records) == len(names) + 4  # all in one continuous batch


def test_seeded_request_gives_the_same_text_alone_and_in_a_batch(big_llm, batch_run):
    _, _, extra = batch_run
    (alone,) = big_llm.generate(["Write a short poem about the sea."], SEEDED, use_tqdm=False)
    assert alone.token_ids == extra["seeded"].token_ids and alone.text == extra["seeded"].text
    assert len(alone.token_ids) == NEW_TOKENS


def test_prefix_cache_serves_a_shared_system_prompt(
    big_llm, batch_run, system_prompts, hf_reference, tokenizer, reference
):
    first = batch_run[2]["sys_q1"]  # computed in the batch; its blocks are now cached-free
    (second,) = big_llm.generate([system_prompts["q2"]], GREEDY, use_tqdm=False)
    ids = second.prompt_token_ids
    shared = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, ids)) if a != b)
    assert shared >= 100
    (admission,) = [s for r in big_llm.step_records for s in r.scheduled if s.phase != "decode"]
    assert admission.num_prefix_hit_tokens == (shared // 16) * 16 >= 2 * 16
    assert admission.num_prefix_hit_tokens + admission.num_tokens == len(
        ids
    )  # only the rest was computed
    assert admission.num_computed_tokens == admission.num_prefix_hit_tokens
    assert second.metrics.num_cached_tokens == admission.num_prefix_hit_tokens
    # the same greedy output as without any prefix cache
    assert_same_greedy(hf_reference, tokenizer, "q2", ids, second.token_ids, reference["q2"])


# -- small caches: preemption, chunked prefill, prefix caching on and off --------------------------


@pytest.mark.parametrize(
    "caching, budget, mode",
    [(False, 64, "recompute"), (True, 128, "recompute"), (True, 128, "swap")],
    ids=["no_prefix_caching", "prefix_caching", "swap"],
)
def test_preemption_and_chunked_prefill_keep_greedy_outputs(
    default_model_dir, prompts, hf_reference, tokenizer, reference, caching, budget, mode
):
    # 25 blocks of 16 = 400 tokens: one long request fits, the whole batch does not
    llm = make_llm(
        default_model_dir,
        num_kv_blocks=25,
        max_model_len=400,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        preemption_mode=mode,
    )
    names = list(prompts)
    outputs = llm.generate([prompts[n] for n in names], GREEDY, use_tqdm=False)
    check_batch(llm, outputs, names, hf_reference, tokenizer, reference)
    records = llm.step_records
    assert llm.engine.scheduler.num_preemptions > 0 and any(r.preempted for r in records)
    assert any(s.phase == "chunked_prefill" for r in records for s in r.scheduled)
    assert all(r.total_tokens <= budget for r in records)
    assert sum(o.metrics.num_preemptions for o in outputs) == llm.engine.scheduler.num_preemptions
    hits = sum(s.num_prefix_hit_tokens for r in records for s in r.scheduled)
    assert (hits > 0) == caching
    stats = llm.engine.stats
    if mode == "swap":  # the swap space is as large as the cache: nothing is ever recomputed
        assert (
            stats["swapped_out_blocks"] > 0
            and stats["swapped_in_blocks"] == stats["swapped_out_blocks"]
        )
        assert stats["recomputed_tokens"] == 0 and stats["swap_seconds"] > 0
    else:
        assert stats["recomputed_tokens"] > 0 and stats["swapped_out_blocks"] == 0
