"""A compiled grammar and one request's matcher over it (llguidance's LLMatcher).

A matcher's state is the tokens it accepted: the request's output tokens so far. A preemption by
recompute keeps those tokens, so the matcher stays valid as it is; `rollback` undoes tokens that
were accepted and then dropped (the engine drops a step's tokens when their text fails).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CompiledGrammar:
    """A constraint compiled for this tokenizer: the llguidance grammar text and a matcher in its
    start state, copied for each request (LLMatcher.deep_copy is cheaper than compiling)."""

    kind: str
    grammar: str
    prototype: object = field(repr=False, compare=False)  # llguidance.LLMatcher

    def new_matcher(self):
        return self.prototype.deep_copy()


class StructuredOutputRequest:
    """One request's grammar state (vLLM's StructuredOutputRequest): the matcher that advances with
    each accepted token, and the facts of its last mask (for the step record)."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        self.num_accepted_tokens = 0
        self.num_allowed_tokens: int | None = None  # in the last mask

    def __deepcopy__(self, memo) -> "StructuredOutputRequest":
        """EngineCore.fork copies requests; a native matcher copies itself (its exact state)."""
        twin = StructuredOutputRequest.__new__(StructuredOutputRequest)
        twin.compiled = self.compiled
        twin.matcher = self.matcher.deep_copy()
        twin.num_accepted_tokens = self.num_accepted_tokens
        twin.num_allowed_tokens = self.num_allowed_tokens
        memo[id(self)] = twin
        return twin

    def fill_bitmask(self) -> bytes:
        """The allowed tokens now: bit t of the little-endian 32-bit words is token t."""
        mask = self.matcher.compute_bitmask()
        self.num_allowed_tokens = bitmask_allowed_count(mask)
        return mask

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the matcher then stays in
        its error state, and the request must fail)."""
        ok = self.matcher.consume_token(token_id)
        self.num_accepted_tokens += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        num_tokens = min(num_tokens, self.num_accepted_tokens)
        if num_tokens and self.matcher.rollback(num_tokens):
            self.num_accepted_tokens -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and accepted the end (EOS): nothing more may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error().strip() if self.matcher.is_error() else None


def bitmask_allowed_count(mask: bytes) -> int:
    """How many tokens a packed bitmask allows."""
    return int.from_bytes(mask, "little").bit_count()
