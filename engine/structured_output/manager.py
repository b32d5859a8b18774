"""StructuredOutputManager: compiles constraints (cached), makes each request's matcher, and
computes the step's token masks (vLLM's StructuredOutputManager, on the control path)."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from engine.sampling_params import InvalidRequestError, StructuredOutputsParams
from engine.structured_output.grammar import CompiledGrammar, StructuredOutputRequest

PARAM = "structured_outputs"
DEFAULT_CACHE_SIZE = 128  # compiled grammars kept (LRU)
# llguidance's own bounds on one grammar (its defaults are 1,000,000 fuel and 500,000 symbols):
# a hostile schema or regex fails compilation quickly instead of running for seconds.
INITIAL_LEXER_FUEL = 200_000  # about 4 ms of regex analysis
MAX_GRAMMAR_SIZE = 200_000  # symbols in the grammar's productions
# JSON whitespace between tokens, bounded: with llguidance's default (any run of whitespace) a
# weak model can fill max_tokens with blank lines and never close the object. 32 characters
# still fit pretty-printed JSON (a newline and the indentation of eight levels of four).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"


@dataclass
class GrammarBitmask:
    """The step's masks: per request that samples under a grammar, the packed bitmask (bytes,
    plain data that crosses to the worker), how many tokens it allows, and the time it took."""

    masks: dict[str, bytes] = field(default_factory=dict)
    num_allowed: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class StructuredOutputManager:
    """One per engine. Compiling needs llguidance's view of the tokenizer (about 0.25 s to build),
    made on the first constrained request only. Thread-safe: the server compiles off its event
    loop while the engine thread steps."""

    def __init__(
        self,
        tokenizer_file: Path | None,
        vocab_size: int,
        eos_token_id: int | None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self.num_compiled = 0  # compilations done (cache misses)

    def __deepcopy__(self, memo) -> "StructuredOutputManager":
        return self  # compiled grammars are immutable and shared by a fork

    def _ll_tokenizer(self):
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                if self.tokenizer_file is None:
                    raise InvalidRequestError(
                        "structured outputs need the model's tokenizer; this engine has none",
                        PARAM,
                    )
                self._tokenizer = llguidance.LLTokenizer(
                    str(self.tokenizer_file), n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of a constraint (cached). Raises InvalidRequestError naming what
        the grammar engine refused."""
        params.verify()
        key = cache_key(params)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        tokenizer = self._ll_tokenizer()
        try:
            grammar = to_guidance_grammar(params)
        except (ValueError, TypeError, RecursionError) as error:
            raise InvalidRequestError(
                f"structured outputs: invalid {params.kind}: {short(error)}", PARAM
            ) from None
        limits = llguidance.LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL,
            max_grammar_size=MAX_GRAMMAR_SIZE,
            verbose_errors=False,
        )
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        error = matcher.get_error() if matcher.is_error() else self._probe(matcher)
        if error:
            raise InvalidRequestError(
                f"structured outputs: the {params.kind} cannot be compiled: {short(error)}", PARAM
            )
        self.num_compiled += 1
        return CompiledGrammar(params.kind, grammar, matcher)

    def _probe(self, matcher) -> str | None:
        """llguidance builds its lexer lazily, as tokens arrive: a hostile regex (nested counted
        repetitions) runs out of its limits in the first steps, not at construction. Two masks
        and one token on a copy, here off the engine's step, find most of them: the request
        gets a 400 instead of failing later. The grammar engine's error, or None."""
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        token = first_allowed_token(mask, skip=self.eos_token_id)
        if token is not None and probe.consume_token(token):
            probe.compute_bitmask()
        return probe.get_error() if probe.is_error() else None

    def make_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.compile(params))


def grammar_bitmask(requests: dict[str, StructuredOutputRequest]) -> GrammarBitmask:
    """The masks for the requests that sample this step under a grammar (called by the scheduler
    once the step's decision is final)."""
    start = time.perf_counter()
    result = GrammarBitmask()
    for request_id, so_request in requests.items():
        result.masks[request_id] = so_request.fill_bitmask()
        result.num_allowed[request_id] = so_request.num_allowed_tokens
    result.seconds = time.perf_counter() - start if requests else 0.0
    return result


def to_guidance_grammar(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (as vLLM's guidance backend serializes it)."""
    import llguidance

    options = {"whitespace_flexible": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        options["whitespace_pattern"] = JSON_WHITESPACE
    kind, spec = params.kind, params.spec
    if kind == "json":
        schema = json.loads(spec) if isinstance(spec, str) else spec
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":  # \d and \w mean ASCII digits and word characters, as in JSON schema
        return llguidance.grammar_from("lark", f"start: /{llguidance.regex_to_lark(spec, 'dw')}/")
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark


def first_allowed_token(mask: bytes, skip: int | None = None) -> int | None:
    """The lowest token a packed bitmask allows, other than `skip`."""
    for index, byte in enumerate(mask):
        for bit in range(8) if byte else ():
            token = index * 8 + bit
            if byte >> bit & 1 and token != skip:
                return token
    return None


def cache_key(params: StructuredOutputsParams) -> tuple:
    spec = params.spec
    if isinstance(spec, (dict, list)):
        spec = json.dumps(spec, sort_keys=True)
    return (params.kind, spec, params.disable_any_whitespace)


def short(message: str | Exception, limit: int = 300) -> str:
    """An error message cut to a readable length (a grammar engine may quote the whole grammar)."""
    text = str(message).replace("<non-verbose/>", "").strip()
    return text if len(text) <= limit else text[:limit] + " …"
