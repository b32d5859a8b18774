"""`speculative_config`: the same dict vLLM takes, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to draft and how much. Names follow vLLM's `speculative_config` keys."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: draft tokens proposed per request per step
    prompt_lookup_max: int = 3  # longest n-gram looked up
    prompt_lookup_min: int = 1  # shortest n-gram looked up (tried last)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method must be one of {METHODS}, got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config: {name} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_value(cls, value: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """None (speculation off), a SpeculativeConfig, or vLLM's dict. Unknown keys are refused,
        so a typo does not silently turn speculation into something else."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative_config: 'method' is required (e.g. \"ngram\")")
        return cls(**value)
