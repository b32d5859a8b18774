"""Chapter 02 · 토큰화, prefill, decode: the timing lab's defaults and its engine settings.

The lab times one request alone per prompt length: its prefill step and its decode steps
(ui.measure.measure_prefill_decode), on an engine whose token budget holds the longest prompt in
one step (so a prefill is one step, never chunks) and with prefix caching off (so no length
reuses another's K/V).
"""

from __future__ import annotations

from engine.utils import cdiv

PROMPT_LENGTHS = [16, 64, 128, 256, 512]  # the choices (tokens)
DEFAULT_LENGTHS = [16, 128, 512]
DEFAULT_NUM_DECODE = 8
TIMING_BUDGET = 1024  # tokens per step: the longest prompt prefills in one step


def timing_overrides(num_kv_blocks: int, block_size: int) -> dict:
    """EngineConfig overrides of the timing engine (the sidebar's block count, raised so that
    TIMING_BUDGET tokens fit). No per-request chunk cap (the engine's default cuts prompts to
    64 tokens a step): each prompt's prefill is one step, the step this lab times."""
    return dict(
        max_num_batched_tokens=TIMING_BUDGET,
        long_prefill_token_threshold=0,
        max_model_len=TIMING_BUDGET,
        num_kv_blocks=max(num_kv_blocks, cdiv(TIMING_BUDGET, block_size)),
        enable_prefix_caching=False,
    )
