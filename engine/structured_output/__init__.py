"""Structured outputs: a grammar per request turns into a token mask at every step (control path).

The grammar engine is llguidance (vLLM's "guidance" backend), chosen by measurement
(docs/structured_outputs.md). The manager compiles a request's constraint once (cached), each
request keeps its own matcher, which advances with every accepted token, and before each step
the scheduler asks for the bitmask of the requests that will sample. The sampler (data path)
applies the mask to the logits; nothing here imports torch.
"""

from engine.structured_output.grammar import (
    CompiledGrammar,
    StructuredOutputRequest,
    bitmask_allowed_count,
)
from engine.structured_output.manager import (
    GrammarBitmask,
    StructuredOutputManager,
    grammar_bitmask,
)

__all__ = [
    "CompiledGrammar",
    "GrammarBitmask",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "bitmask_allowed_count",
    "grammar_bitmask",
]
