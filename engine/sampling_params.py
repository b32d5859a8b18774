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
# Bounds on a structured-output constraint (the grammar engine's own limits bound the rest):
# a schema, regex or grammar beyond these is refused before any compilation.
MAX_STRUCTURED_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


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


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output's shape (vLLM's StructuredOutputsParams): a JSON schema
    (`json`, a dict or its text), a `regex`, a `choice` among strings, a Lark / GBNF `grammar`,
    or any JSON object (`json_object=True`). Exactly one is set. Whether the grammar engine can
    compile it is checked when the engine takes the request (engine/structured_output/)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (vLLM's option)

    @property
    def kind(self) -> str:
        """The one constraint set (verify() makes sure there is exactly one)."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self):
        return getattr(self, self.kind)

    def verify(self) -> None:
        param = "structured_outputs"
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        require(
            len(kinds) == 1,
            param,
            f"structured outputs take exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
            f"got {', '.join(kinds) or 'none'}",
        )
        spec = getattr(self, kinds[0])
        expected = {"json": (dict, str), "regex": (str,), "choice": (list,), "grammar": (str,)}
        expected["json_object"] = (bool,)
        require(
            isinstance(spec, expected[kinds[0]]) and spec not in ("", []),
            param,
            f"structured outputs: {kinds[0]} must be a non-empty "
            f"{' or '.join(t.__name__ for t in expected[kinds[0]])}",
        )
        if kinds[0] == "choice":
            require(
                len(spec) <= MAX_CHOICES and all(isinstance(c, str) and c for c in spec),
                param,
                f"structured outputs: choice takes at most {MAX_CHOICES} non-empty strings",
            )
        require(
            spec_chars(spec) <= MAX_STRUCTURED_SPEC_CHARS,
            param,
            f"structured outputs: the {kinds[0]} has {spec_chars(spec)} characters; at most "
            f"{MAX_STRUCTURED_SPEC_CHARS} are accepted",
        )


def spec_chars(spec) -> int:
    """A constraint's size in characters (a schema dict counts as its JSON text)."""
    import json

    if isinstance(spec, str):
        return len(spec)
    try:
        return len(json.dumps(spec))
    except (TypeError, ValueError, RecursionError):
        return MAX_STRUCTURED_SPEC_CHARS + 1  # not JSON text at all: refused as too large


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
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    # Per step, this many most likely tokens before and after the grammar mask and the probability
    # mass the mask removed (StepRecord's mask_report; chapter 16's lab). 0: off, costs nothing.
    report_top_tokens: int = 0

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
        self._verify_structured_outputs()

    def _verify_structured_outputs(self) -> None:
        require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "structured_outputs must be a StructuredOutputsParams",
        )
        require(
            _in_range(self.report_top_tokens, 0, MAX_LOGPROBS),
            "report_top_tokens",
            f"report_top_tokens must be in [0, {MAX_LOGPROBS}], got {self.report_top_tokens!r}",
        )
        if self.structured_outputs is not None:
            self.structured_outputs.verify()


def require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)
