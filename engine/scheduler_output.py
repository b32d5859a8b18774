"""What the scheduler decides each step: plain data that crosses from the control path to the
data path (executor → worker → model runner), so those modules never import the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.kv_connector import KVConnectorMetadata
from engine.sampling_params import SamplingParams


class Phase(str, enum.Enum):
    """What a request does in a step. A str enum: it prints and compares as its value."""

    PREFILL = "prefill"  # the whole (uncached) prompt at once
    CHUNKED_PREFILL = "chunked_prefill"  # a part of the prompt (or of a recompute)
    DECODE = "decode"  # one new token (plus its draft tokens, with speculative decoding)

    def __str__(self) -> str:
        return self.value


@dataclass
class ScheduledRequest:
    """One request's share of a step: plain data, enough for a worker in another process."""

    request_id: str
    phase: Phase
    num_tokens: int
    num_computed_tokens: int  # tokens already in the cache before this step
    token_ids: list[int]  # the tokens to run now
    block_ids: list[int]  # the request's block table
    sampling_params: SamplingParams
    produces_token: bool  # False for a prefill chunk that does not reach the end of the prompt
    num_prefix_hit_tokens: int = 0  # tokens found in the prefix cache when admitted this step
    num_recomputed_tokens: int = (
        0  # of num_tokens, how many were computed before (a preemption lost them)
    )
    # Speculative decoding: guesses for the tokens after this one, verified in the same forward.
    # They are the last len(draft_token_ids) of token_ids and count in num_tokens; the model
    # runner returns logits for all of them, not only for the last token.
    draft_token_ids: list[int] = field(default_factory=list)
    # admitted this step with this many tokens loaded by the KV connector (after the prefix hits)
    num_external_tokens: int = 0


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    unscheduled: dict[str, str]  # request_id → reason
    preempted: list[str]
    token_budget: int
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step
    # Swap preemption: (device block, swap block) pairs to copy out, (swap block, device block) in.
    # The worker copies them before the forward, outs first: a block swapped out may be reused now.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The KV connector's copies for this step (engine/kv_connector.py); None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Structured outputs: per request that samples under a grammar this step, its packed token
    # bitmask (bit t of the little-endian 32-bit words allows token t); the sampler applies it.
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    grammar_num_allowed: dict[str, int] = field(default_factory=dict)  # tokens each mask allows
    grammar_mask_seconds: float = 0.0  # measured time to compute the masks

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
