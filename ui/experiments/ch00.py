"""Chapter 00 · 코스 안내: the first lab's request and how many engine steps it gets.

The first prediction asks how many steps a request of max_tokens=N takes alone. The engine's rule:
the prefill step(s) compute the prompt and sample the first token, then one decode step per further
token, so N tokens take ⌈prompt / token budget⌉ + N − 1 steps. A request may stop before N at the
end token (EOS); the lab's workload sets ignore_eos (vLLM's meaning: keep going to max_tokens), so
its request takes exactly the steps the question asks about, and a comparison of any other request
states why it stopped early.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core import EngineCore
from engine.request import Request
from engine.trace import StepRecord
from engine.utils import cdiv
from ui.experiments.common import RequestSpec, Workload

FIRST_PROMPT = "What is the capital of France?"  # the lab's preset "프랑스의 수도 (영어)"
FIRST_MAX_TOKENS = 24


def chat_prompt_ids(engine: EngineCore, prompt: str) -> list[int]:
    """The prompt as the lab's preset sends it: the chat template applied, then tokenized."""
    text = prompt
    if engine.tokenizer.chat_template:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return engine.tokenizer.encode(text)


def first_workload(
    engine: EngineCore, max_tokens: int = FIRST_MAX_TOKENS, prompt: str = FIRST_PROMPT
) -> Workload:
    """One request, the preset's prompt, exactly `max_tokens` output tokens (the feeder sets
    ignore_eos), arriving at once."""
    ids = chat_prompt_ids(engine, prompt)
    return Workload([RequestSpec(len(ids), int(max_tokens), prompt_token_ids=ids)])


def predicted_steps(num_prompt_tokens: int, max_tokens: int, token_budget: int) -> int:
    """The rule the prediction tests (계산값): prefill steps + one decode step per later token."""
    return cdiv(num_prompt_tokens, max(token_budget, 1)) + max_tokens - 1


@dataclass
class StepCount:
    """How many steps one request got, split by phase, and why it ended (measured)."""

    request_id: str
    steps: int
    prefill_steps: int
    decode_steps: int
    output_tokens: int
    max_tokens: int
    finish_reason: str | None
    num_prompt_tokens: int

    @property
    def stopped_early(self) -> bool:
        """It ended before max_tokens (at the end token or a stop string)."""
        return self.finish_reason == "stop" and self.output_tokens < self.max_tokens

    @property
    def full_length_steps(self) -> int:
        """Steps it would have taken had it gone on to max_tokens (계산값)."""
        return self.prefill_steps + self.max_tokens - 1


def step_count(records: list[StepRecord], request: Request) -> StepCount:
    """Count the steps that scheduled `request` in `records` (its prefill chunks and decodes)."""
    phases = [
        s.phase
        for record in records
        for s in record.scheduled
        if s.request_id == request.request_id
    ]
    decode = sum(1 for p in phases if p == "decode")
    return StepCount(
        request_id=request.request_id,
        steps=len(phases),
        prefill_steps=len(phases) - decode,
        decode_steps=decode,
        output_tokens=request.num_output_tokens,
        max_tokens=request.sampling_params.max_tokens,
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
    )
