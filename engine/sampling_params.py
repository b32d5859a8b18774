"""How a request wants its tokens chosen and when it wants to stop (vLLM's SamplingParams).

`verify()` is the one place where every field is checked, for the library and the HTTP server
alike: a value the sampler cannot handle must be refused here, at the edge, with a message that
names the field, never discovered later inside the engine loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Dividing logits by a tiny temperature overflows float32 (max about 3.4e38): logits of size 10
# divided by 1e-40 are inf, softmax of inf is NaN, and sampling from NaN fails. Below 0.01 the
# distribution is already all but greedy, so smaller positive values are refused (send 0).
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # vLLM's range; torch.Generator.manual_seed takes any value in [0, 2**64)
MAX_INT32 = 2**31 - 1  # the bound of every count and token id (they become int32/int64 tensors)
MAX_STOP_STRINGS = 16


class InvalidRequestError(ValueError):
    """A request the engine refuses up front; `param` names the offending field (as in the API's
    error shape)."""

    def __init__(self, message: str, param: str | None = None, **details: int):
        super().__init__(message)
        self.param = param
        self.details = details  # the numbers in the message, for callers that explain it their way


def _is_int(value) -> bool:
    """An int that is not a bool (True is an int in Python, but not a token count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


def _is_number(value) -> bool:
    """A finite int or float (NaN and ±inf are refused everywhere)."""
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy; otherwise in [MIN_TEMPERATURE, MAX_TEMPERATURE]
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def verify(self) -> None:
        """Raise InvalidRequestError for any wrong type or out-of-range value, naming the field.

        Each test checks the type first (`and` stops there), so a string or a NaN never reaches
        a comparison that would raise TypeError or quietly pass."""
        t = self.temperature
        require(
            _is_int(self.n) and self.n == 1,
            "n",
            f"n must be 1 (one answer per request), got {self.n!r}",
        )
        require(
            _is_number(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
            "temperature",
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {t!r}",
        )
        require(
            _is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        require(
            _is_int(self.top_k) and -1 <= self.top_k <= MAX_INT32,
            "top_k",
            f"top_k must be -1, 0 (disabled) or positive up to {MAX_INT32}, got {self.top_k!r}",
        )
        require(
            _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
            "min_p",
            f"min_p must be in [0, 1], got {self.min_p!r}",
        )
        require(
            self.seed is None or _in_range(self.seed, 0, MAX_SEED),
            "seed",
            f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}",
        )
        require(
            self.max_tokens is None or _in_range(self.max_tokens, 1, MAX_INT32),
            "max_tokens",
            f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}",
        )
        require(
            _in_range(self.min_tokens, 0, MAX_INT32),
            "min_tokens",
            f"min_tokens must be an integer in [0, {MAX_INT32}], got {self.min_tokens!r}",
        )
        require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        require(
            self.logprobs is None or _in_range(self.logprobs, 0, MAX_LOGPROBS),
            "logprobs",
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "stop strings must be non-empty strings",
        )
        require(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        require(
            all(_in_range(i, 0, MAX_INT32) for i in self.stop_token_ids),
            "stop_token_ids",
            f"stop_token_ids must be integers in [0, {MAX_INT32}]",
        )


def require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
