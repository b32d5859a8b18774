"""Measurement helpers for the labs: they drive the real engine through its public API and time it.
(No Streamlit here; pages show the results with evidence labels.)"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.trace import StepRecord


def prompt_of_length(
    engine: EngineCore,
    n: int,
    text: str = "서울은 한국의 수도이고, Seoul is the capital of Korea. ",
) -> list[int]:
    """Exactly n prompt token ids made by repeating a sentence's tokens."""
    ids = engine.tokenizer.encode(text)
    out = []
    while len(out) < n:
        out.extend(ids)
    return out[:n]


def run_until_done(engine: EngineCore, max_steps: int = 10_000) -> list[StepRecord]:
    records = []
    while engine.has_unfinished_requests() and len(records) < max_steps:
        records.append(engine.step())
    return records


@dataclass
class PrefillDecodeResult:
    num_prompt_tokens: int
    prefill_ms: float  # the step(s) that computed the prompt (its whole forward)
    prefill_steps: int
    decode_ms: list[float]  # each decode step (one token)
    ttft_ms: float | None
    tpot_ms: float | None

    @property
    def decode_ms_mean(self) -> float:
        return sum(self.decode_ms) / len(self.decode_ms) if self.decode_ms else float("nan")


def measure_prefill_decode(
    engine: EngineCore, num_prompt_tokens: int, num_decode: int = 8
) -> PrefillDecodeResult:
    """One request alone: time its prefill step(s) and its decode steps (StepRecord.duration)."""
    params = SamplingParams(max_tokens=num_decode + 1, temperature=0.0, ignore_eos=True)
    request = engine.add_request(
        prompt_token_ids=prompt_of_length(engine, num_prompt_tokens), sampling_params=params
    )
    records = run_until_done(engine)
    prefill = [r for r in records if any(s.phase != "decode" for s in r.scheduled)]
    decode = [r for r in records if r.scheduled and all(s.phase == "decode" for s in r.scheduled)]
    m = request.metrics(clock="engine")
    return PrefillDecodeResult(
        num_prompt_tokens=num_prompt_tokens,
        prefill_ms=1000 * sum(r.duration for r in prefill),
        prefill_steps=len(prefill),
        decode_ms=[1000 * r.duration for r in decode],
        ttft_ms=1000 * m.ttft if m.ttft is not None else None,
        tpot_ms=1000 * m.tpot if m.tpot is not None else None,
    )


@dataclass
class CacheComparison:
    prompt_tokens: int
    tokens_cached: list[int]
    tokens_uncached: list[int]
    step_ms_cached: list[float] = field(default_factory=list)  # per generated token
    step_ms_uncached: list[float] = field(default_factory=list)
    tokens_computed_cached: list[int] = field(
        default_factory=list
    )  # tokens through the model per token
    tokens_computed_uncached: list[int] = field(default_factory=list)

    @property
    def total_ms_cached(self) -> float:
        return sum(self.step_ms_cached)

    @property
    def total_ms_uncached(self) -> float:
        return sum(self.step_ms_uncached)

    @property
    def same_tokens(self) -> bool:
        return self.tokens_cached == self.tokens_uncached


def compare_kv_cache(
    cached_engine: EngineCore,
    uncached_engine: EngineCore,
    prompt_ids: list[int],
    num_new: int,
    on_token=None,
) -> CacheComparison:
    """Greedy generation of num_new tokens two ways, on the real model:

    - with the KV cache: one request; prefill once, then each decode step feeds one token;
    - without: for every new token a fresh request with the whole sequence so far (prompt +
      generated) and max_tokens=1 on an engine with prefix caching off, so all K/V are recomputed.
    """
    result = CacheComparison(len(prompt_ids), [], [])
    request = cached_engine.add_request(
        prompt_token_ids=list(prompt_ids),
        sampling_params=SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True),
    )
    for record in run_until_done(cached_engine):
        if record.new_tokens.get(request.request_id):
            result.step_ms_cached.append(1000 * record.duration)
            result.tokens_computed_cached.append(record.total_tokens)
        elif (
            result.step_ms_cached == [] and record.scheduled
        ):  # a chunked prefill without a token yet
            result.tokens_computed_cached.append(record.total_tokens)
    result.tokens_cached = list(request.output_token_ids)

    sequence = list(prompt_ids)
    for _ in range(num_new):
        req = uncached_engine.add_request(
            prompt_token_ids=list(sequence),
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        start = time.perf_counter()
        records = run_until_done(uncached_engine)
        result.step_ms_uncached.append(1000 * (time.perf_counter() - start))
        result.tokens_computed_uncached.append(sum(r.total_tokens for r in records))
        token = req.output_token_ids[0]
        if on_token is not None:
            on_token()
        result.tokens_uncached.append(token)
        sequence.append(token)
    return result


def kv_allocated_bytes(engine: EngineCore) -> int | None:
    """Bytes of the K/V tensors the worker really allocated (measured by the engine)."""
    try:
        return engine.kv_cache_bytes() or None
    except (AttributeError, NotImplementedError):  # an executor without a real cache
        return None


def read_config(engine: EngineCore) -> dict:
    return json.loads((engine.model_dir / "config.json").read_text())
