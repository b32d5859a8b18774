"""Issue 32 item 3: with default settings one long prompt must not starve short requests.

Before, `long_prefill_token_threshold` defaulted to 0 (no cap): a long prompt took the whole
512-token budget of every step until its prefill was done, and a short request that arrived
meanwhile got its first token only then. These tests use the defaults as every entry point gets
them (EngineConfig for LLM / AsyncLLM / the app's labs, the serve command's flag) and check the
order of steps, never their duration."""

from __future__ import annotations

from _tiny import TINY_VOCAB_SIZE

from engine import SamplingParams
from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from engine.entrypoints.cli import build_parser, engine_config

LONG_PROMPT_LEN = 1000  # about two default budgets: its prefill spans several steps either way
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def token_ids(n: int, start: int) -> list[int]:
    return [3 + (start * 31 + 7 * i) % (TINY_VOCAB_SIZE - 3) for i in range(n)]


def test_default_threshold_is_a_cap_below_the_default_budget():
    """A cap (not 0) that leaves room in a default step for the requests behind a long prompt,
    the same in the library's config and the server's flag."""
    default = EngineConfig().long_prefill_token_threshold
    assert 0 < default < DEFAULT_MAX_NUM_BATCHED_TOKENS
    serve_args = build_parser().parse_args(["serve"])
    assert serve_args.long_prefill_token_threshold == default
    assert engine_config(serve_args).long_prefill_token_threshold == default
    generate_args = build_parser().parse_args(["generate", "hello"])
    assert engine_config(generate_args).long_prefill_token_threshold == default


def test_short_request_gets_its_first_token_before_a_long_prefill_ends(tiny_model_dir):
    """A long prompt is admitted, then a 4-token request arrives: with the default settings the
    short one is scheduled beside the long prompt's chunks and finishes its prefill (first
    token) in a step before the one that ends the long prefill."""
    from engine.core import EngineCore

    engine = EngineCore(
        EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=1024, num_kv_blocks=72)
    )
    engine.add_request(
        prompt_token_ids=token_ids(LONG_PROMPT_LEN, 1), sampling_params=GREEDY, request_id="long"
    )
    records = [engine.step()]  # the long prompt is running before the short one arrives
    engine.add_request(prompt_token_ids=token_ids(4, 2), sampling_params=GREEDY, request_id="short")
    while engine.has_unfinished_requests() and len(records) < 100:
        records.append(engine.step())

    def first_token_step(request_id: str) -> int:
        return next(r.step for r in records if r.new_tokens.get(request_id))

    long_prefill_steps = [
        r.step
        for r in records
        for s in r.scheduled
        if s.request_id == "long" and s.phase != "decode"
    ]
    assert sum(s.num_tokens for r in records for s in r.scheduled if s.request_id == "long") == (
        LONG_PROMPT_LEN + 1  # its prompt, then one decode step for the second token
    )
    assert first_token_step("long") == max(long_prefill_steps)
    assert first_token_step("short") < max(long_prefill_steps)
