"""Chapter 03 · KV 캐시: one request's cache growing block by block during decode.

The lab's workload is chapter 00's request with a longer output: the preset's prompt (chat
template applied) and GROWTH_MAX_TOKENS output tokens with ignore_eos, so decode runs long enough
to fill several new 16-token blocks (the preset alone stops at its end token after a few tokens
and its cache never leaves the blocks its prefill took).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core import EngineCore
from engine.trace import StepRecord
from engine.utils import cdiv
from ui.experiments.ch00 import FIRST_PROMPT, first_workload
from ui.experiments.common import Workload

GROWTH_MAX_TOKENS = 48


def growth_workload(engine: EngineCore, max_tokens: int = GROWTH_MAX_TOKENS) -> Workload:
    """One request whose decode writes `max_tokens` − 1 more tokens into its cache."""
    return first_workload(engine, max_tokens, FIRST_PROMPT)


@dataclass
class BlockGrowth:
    """One request's KV blocks after each step it was scheduled in (measured from the steps'
    KV snapshots), and what the block rule predicts (계산값)."""

    request_id: str
    steps: list[int]  # step numbers
    blocks: list[int]  # blocks in its table after that step (0 once it finished)
    tokens: list[int]  # tokens whose K/V are in the cache after that step
    phases: list[str]  # prefill / chunked_prefill / decode
    block_size: int

    @property
    def after_prefill(self) -> int:
        """Blocks held once the whole prompt is in the cache (after its last prefill step)."""
        prefill = [b for b, p in zip(self.blocks, self.phases) if p != "decode"]
        return prefill[-1] if prefill else 0

    @property
    def peak(self) -> int:
        return max(self.blocks, default=0)

    @property
    def grown(self) -> int:
        """New blocks taken during decode (peak − what the prefill took)."""
        return self.peak - self.after_prefill

    def rule(self, tokens: int) -> int:
        """Blocks that `tokens` cached tokens need: ⌈tokens ÷ block size⌉."""
        return cdiv(tokens, self.block_size)


def block_growth(records: list[StepRecord], request_id: str) -> BlockGrowth | None:
    """The blocks of `request_id` step by step, from the records that scheduled it."""
    steps, blocks, tokens, phases = [], [], [], []
    block_size = 16
    for record in records:
        mine = [s for s in record.scheduled if s.request_id == request_id]
        if not mine:
            continue
        block_size = record.kv.block_size
        steps.append(record.step)
        blocks.append(len(record.kv.block_tables.get(request_id, [])))
        tokens.append(mine[0].num_computed_tokens + mine[0].num_tokens)
        phases.append(str(mine[0].phase))
    if not steps:
        return None
    return BlockGrowth(request_id, steps, blocks, tokens, phases, block_size)
