"""The engine's forward pass on the real SmolLM2-135M (float32) against transformers: the oracle.

Slow (tens of seconds): one transformers model and one engine model are loaded for the module."""

from __future__ import annotations

import pytest
import torch
from _paged import PagedRunner, blocks_needed, greedy_alone, greedy_batched, rel_err

from engine.models.llama import LlamaModel

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
CHUNK = 64
LONG_PROMPT = 128  # prompts longer than this are prefilled in chunks of CHUNK tokens
TIE_MARGIN = 1e-3  # a divergence is excused only where the reference's top-2 logits are this close

PARAGRAPH = (
    "Paged attention stores the key and value vectors of every token in fixed-size blocks. "
    "A block table maps each request's logical blocks to physical ones, so memory is allocated "
    "on demand and freed blocks are reused by other requests without copying. "
)


@pytest.fixture(scope="module")
def base_model(default_model_dir):
    return LlamaModel.from_pretrained(default_model_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module", params=["torch", "auto"], ids=["kernels=torch", "kernels=auto"])
def engine_model(base_model, request):
    """The same weights with attention on the torch reference, then on our C++ kernels."""
    model = base_model.with_kernels(request.param)
    if request.param == "auto" and model.kernel_path != "cpu":
        from engine import kernels

        pytest.skip(f"C++ kernels unavailable: {kernels.build_error()}")
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    chat = lambda *msgs: tokenizer.encode(tokenizer.apply_chat_template(list(msgs)))  # noqa: E731
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    long_text = "Summarize the following notes in one sentence.\n\n"
    while len(tokenizer.encode(long_text)) < 330:
        long_text += PARAGRAPH
    out = {
        "english": tokenizer.encode("The history of the printing press begins"),
        "korean": tokenizer.encode("대한민국의 수도는 서울이며, 서울은"),
        "code": tokenizer.encode('def is_prime(n):\n    """Return True if n is prime."""\n'),
        "chat english": chat(user("What is the tallest mountain in the world?")),
        "chat korean": chat(user("한국의 수도는 어디인가요? 짧게 답해 주세요.")),
        "chat system": chat(
            {"role": "system", "content": "You are a poet."}, user("Write a haiku about the sea 🌊")
        ),
        "chat short answer": chat(user("What is 2+2?")),
        "long": chat(user(long_text)),
    }
    assert len(out["long"]) > 300
    assert all(len(ids) <= LONG_PROMPT for name, ids in out.items() if name != "long")
    return out


@pytest.fixture(scope="module")
def reference(hf_reference, prompts) -> dict[str, list[int]]:
    """transformers' greedy continuations, NEW_TOKENS each, ignoring EOS (it may appear and
    generation goes on past it, on both sides)."""
    out = {}
    for name, ids in prompts.items():
        with torch.no_grad():
            gen = hf_reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=2,
            )
        out[name] = gen[0, len(ids) :].tolist()
        assert len(out[name]) == NEW_TOKENS, name
    return out


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_same_greedy(hf_model, tokenizer, name, prompt, ours, ref):
    """Equal token for token; a difference is tolerated only at a near-tie of the reference."""
    assert len(ours) == len(ref) == NEW_TOKENS
    diverge = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if diverge is None:
        return
    last = reference_logits(hf_model, prompt + ref[:diverge])[-1]
    top2 = last.topk(2)
    margin = (top2.values[0] - top2.values[1]).item()
    detail = (
        f"{name}: first divergence at generated token {diverge} (ours {ours[diverge]}, reference "
        f"{ref[diverge]}), reference top-2 margin {margin:.2e}\n"
        f" ours: {tokenizer.decode(ours)!r}\n"
        f"  ref: {tokenizer.decode(ref)!r}"
    )
    assert margin < TIE_MARGIN, detail
    assert ours[diverge] in top2.indices.tolist(), detail


@pytest.mark.parametrize("name", ["english", "chat korean", "code", "long"])
def test_prefill_logits_match_transformers(engine_model, hf_reference, prompts, name):
    ids = prompts[name]
    runner = PagedRunner(engine_model, blocks_needed([len(ids)], 16), 16)
    (ours,) = runner.step([("x", ids)], all_logits=True)
    ref = reference_logits(hf_reference, ids)
    assert rel_err(ours, ref) <= 1e-4


def test_greedy_alone_matches_transformers_generate(
    engine_model, hf_reference, tokenizer, prompts, reference
):
    for name, ids in prompts.items():
        ours = greedy_alone(engine_model, ids, NEW_TOKENS)
        assert_same_greedy(hf_reference, tokenizer, name, ids, ours, reference[name])


def test_greedy_flat_batch_with_chunked_prefill_matches_transformers(
    engine_model, hf_reference, tokenizer, prompts, reference
):
    names = list(prompts)
    # put the long prompt in the middle so decode rows sit on both sides of its chunks
    names.insert(len(names) // 2, names.pop(names.index("long")))
    outputs, schedule = greedy_batched(
        engine_model,
        [prompts[n] for n in names],
        NEW_TOKENS,
        chunk=CHUNK,
        long_prompt=LONG_PROMPT,
        block_size=16,
        shuffle_seed=0,
    )
    long_index = names.index("long")
    long_chunks = -(-len(prompts["long"]) // CHUNK)
    assert long_chunks >= 5
    # step 0: every prompt's prefill (the long one's first chunk); then the long prompt goes on in
    # chunks of 64 while all the others decode one token per step in the same flat batch
    assert schedule[0][long_index] == CHUNK
    for step in schedule[1:long_chunks]:
        assert step[long_index] > 1 and all(n == 1 for i, n in enumerate(step) if i != long_index)
    for name, ours in zip(names, outputs):
        assert_same_greedy(hf_reference, tokenizer, name, prompts[name], ours, reference[name])


def test_short_answer_reaches_eos_and_continues(tokenizer, reference):
    """The comparison really runs past EOS (ignore-EOS on both sides)."""
    assert tokenizer.eos_token_id in reference["chat short answer"][:-1]
