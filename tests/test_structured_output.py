"""Structured outputs in the engine (issue 36): the constraint checked at the edge, the mask
applied before sampling, the grammar advancing with each accepted token and ending the request,
under batching, chunked prefill, preemption, prefix caching and fork; the real model's outputs
validate against a set of schemas (@slow)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from _tiny import run_engine

from engine.sample.sampler import Sampler, apply_grammar_bitmask
from engine.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from engine.structured_output import bitmask_allowed_count

S = StructuredOutputsParams

# Bounded constraints: a random tiny model must finish them well within max_tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["kind", "n"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-[a-c]{2}"
CHOICES = ["yes", "no", "maybe"]
GBNF = 'root ::= "(" [0-9] ("+" [0-9])? ")"'


def pack(allowed: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_constraint_checked_at_the_edge():
    """Exactly one constraint, of its type, bounded in size: refused with the field named."""
    assert SamplingParams(structured_outputs=S(regex="a+")).structured_outputs.kind == "regex"
    for bad in [{}, {"regex": "a", "choice": ["x"]}, {"choice": []}, {"choice": ["a", 1]}]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(structured_outputs=S(**bad))
        assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="at most 65536"):
        SamplingParams(structured_outputs=S(json={"enum": ["x" * 100] * 1000}))
    with pytest.raises(InvalidRequestError, match="at most 1024"):
        SamplingParams(structured_outputs=S(choice=[f"c{i}" for i in range(1025)]))


def test_mask_comes_before_greedy_temperature_and_top_k():
    """Greedy picks the best allowed token, seeded sampling (also under top-k/top-p) draws only
    allowed ones, a row without a mask is untouched, and logprobs see the masked distribution."""
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [3, 17, 64, 99]
    masks = [pack(allowed, vocab), None, pack([5], vocab)]
    assert bitmask_allowed_count(masks[0]) == 4
    masked = apply_grammar_bitmask(logits, masks)
    assert torch.equal(masked[1], logits[1])  # the free row, and the input is left as it was
    assert torch.isinf(masked[0]).sum() == vocab - len(allowed)
    wider = apply_grammar_bitmask(torch.zeros(2, 140), masks[:2])  # past the grammar's vocab
    assert torch.isinf(wider[0]).sum() == 140 - len(allowed) and not torch.isinf(wider[1]).any()
    sampler = Sampler()
    greedy = SamplingParams(temperature=0, logprobs=2)
    out = sampler(logits, ["a", "b", "c"], [greedy] * 3, masks)
    assert out[0].token_id == max(allowed, key=lambda t: logits[0, t].item())
    assert out[1].token_id == int(logits[1].argmax())
    assert out[2].token_id == 5 and out[2].logprob == pytest.approx(0.0, abs=1e-6)
    seeded = SamplingParams(temperature=1.5, top_k=50, top_p=0.9, seed=7)
    for i in range(20):
        token = sampler(logits[:1], [f"s{i}"], [seeded], masks[:1])[0].token_id
        assert token in allowed


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SMALL_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-c]{2}", text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([0-9](\+[0-9])?\)", text) is not None


CONSTRAINTS = {
    "json": S(json=SMALL_SCHEMA, disable_any_whitespace=True),
    "regex": S(regex=REGEX),
    "choice": S(choice=CHOICES),
    "grammar": S(grammar=GBNF),
}


def add_mixed_batch(engine, prompts: list[str]) -> dict[str, str]:
    """Constrained requests (greedy and seeded) between free ones; their kinds by id."""
    kinds = {}
    for i, prompt in enumerate(prompts):
        for kind, constraint in CONSTRAINTS.items():
            sampling = dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, seed=i)
            params = SamplingParams(max_tokens=48, structured_outputs=constraint, **sampling)
            kinds[engine.add_request(prompt, params).request_id] = kind
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24), f"free-{i}")
    return kinds


PROMPTS = [
    "The scheduler decides which requests run in each step of the engine loop. " * 3,
    "Paged attention keeps the KV cache in blocks.",
    "def step(self):",
]


def test_tiny_engine_constrained_and_free_requests_side_by_side(make_engine):
    """Every constrained output is complete and valid ("stop"), under a tiny KV cache that
    preempts, chunked prefill of 16 tokens and prefix caching; greedy free requests are exactly
    what they are alone; the step records carry the mask time and each allowed-token count; a
    fork in the middle finishes with the same tokens as the original."""
    alone = make_engine()
    for i, prompt in enumerate(PROMPTS):
        alone.add_request(prompt, SamplingParams(temperature=0, max_tokens=24), f"free-{i}")
    _, reference, _ = run_engine(alone)

    engine = make_engine(
        num_kv_blocks=10,
        max_model_len=128,
        long_prefill_token_threshold=16,
        enable_prefix_caching=True,
    )
    kinds = add_mixed_batch(engine, PROMPTS)
    records = [engine.step() for _ in range(6)]
    early = {o.request_id: o for r in records for o in r.outputs if o.finished}
    twin = engine.fork()
    more, final, _ = run_engine(engine)
    records += more
    _, twin_final, _ = run_engine(twin)
    final, twin_final = {**early, **final}, {**early, **twin_final}

    assert engine.stats["preemptions"] > 0
    for request_id, kind in kinds.items():
        out = final[request_id]
        assert out.finish_reason == "stop" and valid(kind, out.text), (kind, out.text)
        assert twin_final[request_id].token_ids == out.token_ids
    for i in range(len(PROMPTS)):
        assert final[f"free-{i}"].token_ids == reference[f"free-{i}"].token_ids
    masked = [r for r in records if r.num_masked_requests]
    assert masked and all(r.grammar_mask_seconds > 0 for r in masked)
    counts = {s.request_id: s.num_allowed_tokens for r in masked for s in r.scheduled}
    assert all(counts.get(rid, 1) >= 1 for rid in kinds)
    assert all(
        s.num_allowed_tokens is None for r in records for s in r.scheduled if "free" in s.request_id
    )


def test_length_first_keeps_the_partial_output_and_bad_grammars_are_refused(make_engine):
    """max_tokens before the grammar ends: "length" and the partial output as it is (a prefix of
    a valid one, never repaired). A constraint the backend cannot compile is refused when the
    request is added, naming the problem; speculative decoding drafts nothing for a constrained
    request, and the engine serves on."""
    engine = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=S(regex=r"\d{10}"))
    request = engine.add_request("count: 1 2 3 1 2 3 1 2 3", params)
    for bad, match in [
        (S(regex="(unclosed"), "regex cannot be compiled"),
        (S(grammar="start: undefined_rule"), "grammar cannot be compiled"),
        (S(json={"type": "nonsense"}), "json cannot be compiled"),
        (S(json="{not json"), "invalid json"),
    ]:
        with pytest.raises(InvalidRequestError, match=match) as info:
            engine.add_request("x", SamplingParams(structured_outputs=bad))
        assert info.value.param == "structured_outputs"
    records, final, _ = run_engine(engine)
    out = final[request.request_id]
    assert out.finish_reason == "length" and re.fullmatch(r"[0-9]{1,10}", out.text), out.text
    assert not any(s.draft_token_ids for r in records for s in r.scheduled)


SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },  # fmt: skip
    "number_range": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow
def test_real_model_outputs_validate_against_every_schema(default_model_dir):
    """The default model, greedy and seeded, all schemas in one batch under chunked prefill and
    preemption: every output parses and validates against its schema."""
    from engine.core import EngineConfig, EngineCore

    engine = EngineCore(
        EngineConfig(
            model=str(default_model_dir),
            device="cpu",
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=24,
            long_prefill_token_threshold=16,
        )
    )
    schemas = {}
    for name, schema in SCHEMAS.items():
        prompt = engine.tokenizer.encode_chat(
            [{"role": "user", "content": f"Answer in JSON with this schema: {json.dumps(schema)}"}]
        )[1]
        for seed in (None, 1):
            sampling = dict(temperature=0) if seed is None else dict(temperature=0.8, seed=seed)
            params = SamplingParams(max_tokens=96, structured_outputs=S(json=schema), **sampling)
            request = engine.add_request(prompt_token_ids=prompt, sampling_params=params)
            schemas[request.request_id] = schema
    _, final, _ = run_engine(engine)
    assert engine.stats["preemptions"] > 0
    for request_id, schema in schemas.items():
        out = final[request_id]
        assert out.finish_reason == "stop", (request_id, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_bench_part_reports_the_mask_time_per_step(make_engine):
    """`python -m engine bench` (section 4): free and JSON-schema decode side by side, the mask's
    median time per step, the allowed-token count, the schema's compile time cold and cached."""
    from engine.tools.bench.structured import BATCHES, format_structured_outputs
    from engine.tools.bench.structured import run_structured_outputs as run

    result = run(make_engine(max_model_len=256, num_kv_blocks=64), output_len=6)
    rows = result["rows"]
    assert set(rows) == {f"{kind} × {b}" for kind in ("free", "json_schema") for b in BATCHES}
    for b in BATCHES:
        assert rows[f"free × {b}"]["mask_ms"] == 0 and rows[f"json_schema × {b}"]["mask_ms"] > 0
        assert rows[f"json_schema × {b}"]["allowed_tokens_median"] >= 1
    assert result["compile"]["cached_ms"] < result["compile"]["cold_ms"]
    text = "\n".join(format_structured_outputs(result))
    assert "structured outputs (llguidance" in text and "json_schema × 4" in text


def test_compiled_grammars_are_cached_least_recently_used_first(tiny_model_dir):
    """A constraint compiles once (the same schema written in another key order too); the cache
    keeps `cache_size` grammars and drops the least recently used; each request gets its own
    matcher over the shared compiled grammar."""
    from engine.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(tiny_model_dir / "tokenizer.json", 2048, 2, cache_size=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = manager.make_request(S(json=schema))
    second = manager.make_request(S(json=dict(reversed(list(schema.items())))))
    assert manager.num_compiled == 1 and first.compiled is second.compiled
    assert first.matcher is not second.matcher
    manager.compile(S(regex="a+"))
    manager.compile(S(json=schema))  # used again: now the most recent
    manager.compile(S(choice=["x"]))  # evicts the regex, not the schema
    manager.compile(S(json=schema))
    assert manager.num_compiled == 3
    manager.compile(S(regex="a+"))
    assert manager.num_compiled == 4
