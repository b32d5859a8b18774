"""Speculative decoding (chapter 13): propose a few tokens cheaply, verify them all in one forward.

- `config.py`: SpeculativeConfig, vLLM's `speculative_config` dict checked at start-up;
- `ngram.py`: the n-gram proposer (prompt lookup decoding): drafts from the request's own text.

Which drafts the target model accepts is the rejection sampler's job
(engine/sample/rejection_sampler.py), so that the output distribution is exactly the target
model's (greedy: draft == argmax; sampling: rejection sampling).
"""

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
