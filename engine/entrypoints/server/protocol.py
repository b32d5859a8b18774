"""The OpenAI API as this server speaks it: request bodies (pydantic models, so /openapi.json
describes every field and its bounds), the fields it refuses, and OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` (engine/entrypoints/server/app.py serves them,
serving.py answers them)."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.output import RequestOutput
from engine.sampling_params import (
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # 2 MiB: far above any prompt that fits the context
# A prompt longer than max_model_len × this many characters cannot fit the context whatever the
# tokenizer does (a token rarely covers more than a few characters), so it is refused before
# tokenizing: a 10 MB prompt costs a length check, not seconds of a worker thread.
MAX_CHARS_PER_TOKEN = 32

# -- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    """An error the client sees, in OpenAI's shape. Its message is written for the client:
    never an exception's text, never a path."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_not_running() -> APIError:
    return APIError(503, "the engine is not running; the server must be restarted", "server_error")


def engine_failed(output: RequestOutput) -> APIError:
    """The engine failed this request (finish_reason "error"); others were not affected.
    `output.error` is the engine's short message, e.g. "sampling failed (RuntimeError)"."""
    return APIError(
        500,
        f"the engine failed this request: {output.error or 'unknown error'}",
        "server_error",
        code="engine_error",
    )


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Pydantic's error list → one 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON", code="invalid_json")
    messages: dict[str, list[str]] = {}
    for error in errors:
        messages.setdefault(_error_path(error), []).append(str(error.get("msg", "invalid")))
    text = "; ".join(
        f"{p}: {m[0] if len(m) == 1 else 'Input has none of the allowed types'}"
        for p, m in list(messages.items())[:5]
    )
    param = _error_path(first).split(".")[0]
    return bad_request(text, None if param == "body" else param)


def _error_path(error: dict) -> str:
    """A field's path, without "body" and the union member pydantic tried ("str", "list[int]")."""
    parts = [str(p) for p in error.get("loc", ()) if p != "body"]
    parts = [p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or "body"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for /openapi.json."""

    error: ErrorInfo


ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (500, "the engine failed this request"),
        (503, "the engine is not running"),
    ]
}


# -- request bodies ----------------------------------------------------------------------------

Count = Annotated[int, Field(ge=0, le=MAX_INT32)]

# Fields of OpenAI's (or vLLM's) API that this engine does not implement. Sent with a value that
# would change the answer, they get a 400 naming them instead of being silently ignored.
UNSUPPORTED_FIELDS = (
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "echo",
    "suffix",
    "best_of",
    "repetition_penalty",
    "length_penalty",
    "use_beam_search",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "prediction",
    "audio",
    "modalities",
    "web_search_options",
    "reasoning_effort",
    "logits_processors",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
HARMLESS_VALUES: dict[str, tuple] = {"best_of": (1,), "tool_choice": ("none",)}
# Fields of OpenAI's API that do not change the answer: accepted and ignored. Any other field a
# schema does not name gets OpenAI's 400 "Unrecognized request argument supplied".
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)
IGNORED_MESSAGE_FIELDS = ("tool_call_id", "refusal")


class _Body(BaseModel):
    # strict: "0.5" is not a number and 1 is not a boolean, as in OpenAI's API; NaN and ±inf are
    # refused. Fields the model does not declare are kept aside (model_extra): `allowed_extras`
    # are checked by refuse_unsupported (or ignored: user, metadata, ...), any other one gets
    # refuse_unrecognized's 400.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    allowed_extras: ClassVar[tuple[str, ...]] = ()


class StreamOptions(_Body):
    include_usage: bool = False


class KVTransferParams(BaseModel):
    """vLLM's kv_transfer_params, as disaggregated prefill uses them (docs/kv_connector.md): a
    kv_consumer loads the K/V its producer sent under `remote_request_id` (`num_tokens` of the
    prompt) instead of computing them; a kv_producer answers with the params for its request.
    A dict of connector-specific keys in vLLM, so other keys (vLLM's NIXL fields such as
    do_remote_decode) are ignored; they never change the answer, only where the K/V come from."""

    model_config = ConfigDict(strict=True, extra="ignore")
    remote_request_id: str | None = Field(None, min_length=1, max_length=256)
    num_tokens: int | None = Field(None, ge=1, le=MAX_INT32)


class JSONSchemaFormat(_Body):
    """OpenAI's response_format.json_schema. The schema is always enforced (strict or not)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(_Body):
    """The fields both endpoints share: sampling, stopping, streaming, scheduling."""

    allowed_extras: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS + IGNORED_FIELDS

    model: str | None = Field(None, max_length=4096)
    temperature: float | None = Field(
        None, ge=0, le=MAX_TEMPERATURE, description="0 (greedy) or in [0.01, 2]; default 1"
    )
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32, description="vLLM extension")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP_STRINGS} strings")
    stop_token_ids: Annotated[list[Count], Field(max_length=1024)] | None = None
    n: int = Field(1, ge=1, le=MAX_INT32, description="only 1 is supported")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32, description="vLLM extension")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="only 0 is supported")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="only 0 is supported")
    priority: int = Field(
        0,
        ge=-MAX_INT32 - 1,
        le=MAX_INT32,
        description="vLLM extension: lower runs first under the priority policy",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="vLLM extension: prefix-cache namespace; only requests "
        "with the same salt share cached blocks",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's structured outputs: json_object or json_schema"
    )
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="vLLM extension: one of json, regex, choice, grammar, json_object"
    )
    kv_transfer_params: KVTransferParams | None = Field(
        None, description="vLLM extension: disaggregated prefill (python -m engine proxy)"
    )


class CompletionRequest(SamplingFields):
    prompt: str | list[Count] | list[str] | list[list[Count]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    allowed_extras: ClassVar[tuple[str, ...]] = ("tool_calls",) + IGNORED_MESSAGE_FIELDS
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def refuse_unrecognized(body: BaseModel, path: str = "") -> None:
    """OpenAI's 400 for a field no schema here names, with the known name it is closest to
    (`max_token` → max_tokens, `temprature` → temperature): a misspelling is never silently
    ignored. Message fields are checked too; tool calls are refused (no tools here)."""
    for name, value in (body.model_extra or {}).items():
        if name not in body.allowed_extras:
            known = list(type(body).model_fields) + list(body.allowed_extras)
            hint = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            raise bad_request(
                f"Unrecognized request argument supplied: {path}{name[:100]}"
                + (f" (did you mean {hint[0]}?)" if hint else ""),
                (path.split("[")[0] or name)[:100],
                "unrecognized_argument",
            )
        if name == "tool_calls" and value:
            raise bad_request(
                f"{path}tool_calls: not supported by this engine (it has no tools)",
                path.split("[")[0],
                "unsupported_parameter",
            )
    for i, message in enumerate(getattr(body, "messages", None) or []):
        refuse_unrecognized(message, f"messages[{i}].")
    if getattr(body, "stream_options", None) is not None:
        refuse_unrecognized(body.stream_options, "stream_options.")
    if getattr(body, "stream_options", None) is not None and not getattr(body, "stream", True):
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )


def refuse_unsupported(body: BaseModel) -> None:
    """A 400 naming every field this engine would otherwise have silently ignored."""
    extra = body.model_extra or {}
    named = [
        name
        for name in UNSUPPORTED_FIELDS
        if name in extra
        and extra[name] not in (None, False, "", [], {}) + HARMLESS_VALUES.get(name, ())
    ]
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name, None):
            named.append(name)
    if named:
        raise bad_request(
            f"not supported by this engine: {', '.join(named)} (remove "
            f"{'it' if len(named) == 1 else 'them'} from the request)",
            named[0],
            "unsupported_parameter",
        )


def refuse_lone_surrogates(body: BaseModel) -> None:
    """A 400 naming the field that holds a lone UTF-16 surrogate ("\\ud800" in the JSON): such
    a string has no UTF-8 form, so the tokenizer (and every hash and log) would fail on it."""
    path = _surrogate_path(body)
    if path is not None:
        raise bad_request(
            f"{path}: the string holds a lone UTF-16 surrogate, which is not valid Unicode text",
            path.split(".")[0].split("[")[0],
            "invalid_unicode",
        )


def _surrogate_path(value, path: str = "") -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, BaseModel):
        items = list(value)  # the fields, then the extras
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for key, item in items:
        if not isinstance(key, str) or not key.startswith("["):
            key = f"{'.' if path else ''}{key}"
        found = _surrogate_path(item, f"{path}{key}")
        if found is not None:
            return found
    return None


def refuse_too_many_stop_strings(body: SamplingFields) -> None:
    """More than MAX_STOP_STRINGS stop strings: a 400 that says the limit (SamplingParams words
    it the same way), before the prompt is tokenized."""
    if isinstance(body.stop, list) and len(body.stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(body.stop)}", "stop")
