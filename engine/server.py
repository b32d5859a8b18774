"""The API server: where a request's journey begins (chapter 01), put under load in chapter 14.

An OpenAI-compatible HTTP front end on FastAPI + uvicorn. For each HTTP request it

1. notes the arrival time (time.perf_counter(), the start of the request's journey) and refuses a
   body over the size cap before reading it,
2. checks the API key; FastAPI validates the JSON body against a pydantic model (so that
   /openapi.json describes every field and its bounds); the server then checks what a schema
   cannot say (unsupported fields, the model name, the prompt's length, the context), answering
   every mistake with OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` and a
   4xx status, before any work,
3. tokenizes (or renders the chat template) in a worker thread, so the event loop keeps answering
   other clients and /health meanwhile,
4. hands the request to the one shared `AsyncLLM`, whose engine loop runs in its own thread and
   batches every concurrent request together, step by step (continuous batching),
5. streams each text delta back as a server-sent event (`data: {...}`, ending with
   `data: [DONE]`), or waits for the end and answers with one JSON body.

No request can take the server down: a request the engine fails (finish_reason "error") gets a
500 (or, mid-stream, an error event) while every other client goes on, and error bodies never
carry exception text or file paths. If the engine loop itself dies, /health answers 503 and
`serve()` returns 1, so `python -m engine serve` exits non-zero and a supervisor restarts it.

A client that goes away aborts its request at once, freeing its KV blocks: the streaming body is
an async generator whose `finally` closes the engine stream (which aborts an unfinished request),
and a non-streaming request races the generation against the connection's `http.disconnect`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics (Prometheus text; see engine/metrics.py), GET /docs and /openapi.json. With an API
key set, everything but /health needs it (/metrics and the docs too, unless opted out).

Defaults worth knowing:
- max_tokens, when absent, is DEFAULT_MAX_TOKENS (256) capped by the room left in the context
  (vLLM would allow everything up to the context limit; OpenAI's legacy completions default is 16).
- temperature defaults to 1.0 and top_p to 1.0, as in OpenAI's API; send temperature=0 for greedy.
- one prompt and n=1 per request; fields this engine does not implement (logit_bias, tools,
  response_format, penalties, echo, suffix, best_of, ...) are refused with a 400 that names them
  rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Literal

import h11
import jinja2
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.metrics import ServerMetrics
from engine.output import RequestOutput
from engine.sampler import finite_logprob
from engine.sampling_params import (
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    InvalidRequestError,
    SamplingParams,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # 2 MiB: far above any prompt that fits the context
# A prompt longer than max_model_len × this many characters cannot fit the context whatever the
# tokenizer does (a token rarely covers more than a few characters), so it is refused before
# tokenizing: a 10 MB prompt costs a length check, not seconds of a worker thread.
MAX_CHARS_PER_TOKEN = 32
API_KEY_ENV = "LLM_LAB_API_KEY"  # `python -m engine serve` reads it when --api-key is not given
# uvicorn's limits, stated: a header block that grows past 16 KiB unfinished gets a 400; idle
# keep-alive connections close after 5 s; shutdown waits 3 s for open streams. uvicorn has no
# header-read timeout of its own, so the protocol below adds one (HEADER_READ_TIMEOUT_S).
UVICORN_LIMITS = dict(
    h11_max_incomplete_event_size=16 * 1024,
    timeout_keep_alive=5,
    timeout_graceful_shutdown=3,
)
HEADER_READ_TIMEOUT_S = 10.0


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header-read deadline (nginx's client_header_timeout).

    A client must finish a request's header block within `header_timeout` seconds of connecting
    (or of the previous response on a kept-alive connection); otherwise the connection is closed.
    Without it a client that trickles one header byte every few seconds (slowloris) holds a
    connection forever, and enough of them exhaust the server's sockets. The deadline runs from
    the start, not from the last byte, so trickling does not extend it."""

    header_timeout: float = HEADER_READ_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request head has arrived
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()  # the next request on this connection gets a deadline too

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_deadline(self) -> None:
        deadline = getattr(self, "_header_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _header_timed_out(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection that sent no complete request head in time")
            self.transport.close()


def uvicorn_config(app, header_timeout: float = HEADER_READ_TIMEOUT_S, **kwargs) -> uvicorn.Config:
    """uvicorn's Config with our limits and the header-read timeout."""
    protocol = type(
        "HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": header_timeout}
    )
    return uvicorn.Config(app, http=protocol, **UVICORN_LIMITS, **kwargs)


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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
    "response_format",
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
    "structured_outputs",
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


class _Body(BaseModel):
    # strict: "0.5" is not a number and 1 is not a boolean, as in OpenAI's API; NaN and ±inf are
    # refused. Unknown fields are kept aside (model_extra): ignored (user, metadata, ...) unless
    # they are in UNSUPPORTED_FIELDS.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """The fields both endpoints share: sampling, stopping, streaming, scheduling."""

    model: str | None = Field(None, max_length=4096)
    temperature: float | None = Field(
        None, ge=0, le=MAX_TEMPERATURE, description="0 (greedy) or in [0.01, 2]; default 1"
    )
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32, description="vLLM extension")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
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


class CompletionRequest(SamplingFields):
    prompt: str | list[Count] | list[str] | list[list[Count]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


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


# -- one request, whichever endpoint ----------------------------------------------------------


@dataclass
class GenerationJob:
    """Everything the engine needs for one HTTP request, checked and tokenized."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    cache_salt: str | None
    stream: bool
    include_usage: bool


def usage_of(output: RequestOutput) -> dict:
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.metrics.num_cached_tokens},
    }


def new_logprob_entries(output: RequestOutput) -> list[dict]:
    """The logprobs of the tokens this output added (the engine sends the whole list each time)."""
    entries = output.logprobs or []
    return entries[len(entries) - len(output.delta_token_ids) :]


class ResponseShape:
    """How one endpoint words its answer: the streamed chunks and the final JSON body.

    Both endpoints share everything else (checks, the engine call, the SSE generator); only the
    JSON differs, so each endpoint has a subclass with three small methods."""

    chunk_object = ""
    response_object = ""

    def __init__(self, server: "OpenAIServer", job: GenerationJob, want_logprobs: bool):
        self.server, self.job, self.want_logprobs = server, job, want_logprobs
        self.base = {"id": job.request_id, "created": int(time.time()), "model": server.model_name}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        extra = {"usage": usage} if self.job.include_usage else {}
        return {**self.base, "object": self.chunk_object, "choices": choices, **extra}

    def opening_choices(self) -> list[dict]:
        return []

    def delta_choice(self, output: RequestOutput) -> dict | None:
        raise NotImplementedError

    def final_choice(self, output: RequestOutput) -> dict:
        raise NotImplementedError

    def response(self, final: RequestOutput) -> dict:
        return {
            **self.base,
            "object": self.response_object,
            "choices": [self.final_choice(final)],
            "usage": usage_of(final),
        }


class CompletionShape(ResponseShape):
    chunk_object = response_object = "text_completion"

    def __init__(self, server: "OpenAIServer", job: GenerationJob, want_logprobs: bool):
        super().__init__(server, job, want_logprobs)
        self.text_offset = 0

    def delta_choice(self, output: RequestOutput) -> dict | None:
        if not (output.delta_text or self.want_logprobs or output.finished):
            return None  # nothing to say yet (text held back at a UTF-8 or stop boundary)
        choice = {
            "index": 0,
            "text": output.delta_text,
            "logprobs": None,
            "finish_reason": output.finish_reason if output.finished else None,
        }
        if self.want_logprobs:
            choice["logprobs"] = self.server.completion_logprobs(
                new_logprob_entries(output), self.text_offset
            )
            self.text_offset += sum(len(token) for token in choice["logprobs"]["tokens"])
        if output.finished:
            choice["stop_reason"] = output.stop_reason
        return choice

    def final_choice(self, output: RequestOutput) -> dict:
        logprobs = (
            self.server.completion_logprobs(output.logprobs or [], 0)
            if self.want_logprobs
            else None
        )
        return {
            "index": 0,
            "text": output.text,
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }


class ChatShape(ResponseShape):
    chunk_object, response_object = "chat.completion.chunk", "chat.completion"

    def opening_choices(self) -> list[dict]:
        return [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]

    def delta_choice(self, output: RequestOutput) -> dict | None:
        entries = new_logprob_entries(output) if self.want_logprobs else None
        if not (output.delta_text or entries or output.finished):
            return None  # nothing to say yet (text held back at a UTF-8 or stop boundary)
        choice = {
            "index": 0,
            "delta": {"content": output.delta_text} if output.delta_text else {},
            "logprobs": self.server.chat_logprobs(entries) if entries else None,
            "finish_reason": output.finish_reason if output.finished else None,
        }
        if output.finished:
            choice["stop_reason"] = output.stop_reason
        return choice

    def final_choice(self, output: RequestOutput) -> dict:
        logprobs = self.server.chat_logprobs(output.logprobs or []) if self.want_logprobs else None
        return {
            "index": 0,
            "message": {"role": "assistant", "content": output.text},
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }


# -- the server --------------------------------------------------------------------------------


class OpenAIServer:
    """State shared by every request (the engine, its AsyncLLM, the metrics, the model's name)
    and the two generation endpoints, as methods a test can call."""

    def __init__(
        self,
        engine_or_async_llm,
        api_key: str | None = None,
        served_model_name: str | None = None,
        public_docs_and_metrics: bool = False,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        from engine.llm import LLM, AsyncLLM

        if isinstance(engine_or_async_llm, AsyncLLM):
            self.async_llm, self.owns_async_llm = engine_or_async_llm, False
        else:
            engine = (
                engine_or_async_llm.engine
                if isinstance(engine_or_async_llm, LLM)
                else engine_or_async_llm
            )
            self.async_llm, self.owns_async_llm = AsyncLLM(engine), True
        self.engine = self.async_llm.engine
        self.tokenizer = self.engine.tokenizer
        self.api_key = api_key or None
        self.public_docs_and_metrics = public_docs_and_metrics
        self.max_body_bytes = max_body_bytes
        self.model_dir = self.engine.model_dir
        self.model_name = served_model_name or self.model_dir.name  # never the path: not disclosed
        self.max_prompt_chars = self.engine.max_model_len * MAX_CHARS_PER_TOKEN
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.engine, self.model_name)
        self.async_llm.step_listeners.append(self.metrics.on_step)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.async_llm.step_listeners.remove(self.metrics.on_step)
        if self.owns_async_llm:
            self.async_llm.shutdown()

    # -- checks --------------------------------------------------------------------------------

    def check_api_key(self, credentials: HTTPAuthorizationCredentials | None) -> None:
        if self.api_key is None:
            return
        if credentials is None:
            raise APIError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if not secrets.compare_digest(credentials.credentials.encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    def check_engine(self) -> None:
        if not self.async_llm.is_running:
            raise engine_not_running()

    def check_model(self, name: str | None) -> None:
        if name is None or name in (self.model_name, self.model_dir.name, str(self.model_dir)):
            return
        raise APIError(
            404,
            f"the model `{name[:200]}` does not exist; this server serves `{self.model_name}`",
            param="model",
            code="model_not_found",
        )

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"the prompt has {num_chars} characters; with a context of "
                f"{self.engine.max_model_len} tokens this server takes at most "
                f"{self.max_prompt_chars}",
                "prompt",
                "context_length_exceeded",
            )

    def check_prompt_tokens(self, num_tokens: int, param: str = "prompt") -> None:
        if num_tokens >= self.engine.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.engine.max_model_len} tokens, "
                f"but the prompt has {num_tokens} tokens",
                param,
                "context_length_exceeded",
            )

    def sampling_params(
        self,
        body: SamplingFields,
        num_prompt_tokens: int,
        max_tokens: int | None,
        logprobs: int | None,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams:
        """Map the body onto SamplingParams (whose verify() checks every value); an error names
        the field as the client called it (`max_tokens_param`, e.g. max_completion_tokens)."""
        try:
            return self._sampling_params(body, num_prompt_tokens, max_tokens, logprobs)
        except InvalidRequestError as exc:
            param = max_tokens_param if exc.param == "max_tokens" else exc.param
            code = "context_length_exceeded" if "context length" in str(exc) else None
            raise bad_request(str(exc), param, code) from None

    def _sampling_params(
        self,
        body: SamplingFields,
        num_prompt_tokens: int,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        if max_tokens is None:  # the documented default: 256, capped by the room in the context
            room = self.engine.max_model_len - num_prompt_tokens
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
        kwargs: dict[str, Any] = dict(
            n=body.n,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            seed=body.seed,
        )
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
        params = SamplingParams(**kwargs)
        self.engine.check_length(num_prompt_tokens, params.max_tokens)
        return params

    # -- prompts (tokenized in a worker thread: never on the event loop) ----------------------

    async def completion_prompt(self, body: CompletionRequest) -> tuple[str | None, list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(
                    "this server takes one prompt per request; send a string, not a batch", "prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
            token_ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise bad_request("the prompt is empty", "prompt")
        self.check_prompt_tokens(len(token_ids))
        return (prompt if isinstance(prompt, str) else None), token_ids

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        messages = []
        for message in body.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": content or ""})
        self.check_prompt_chars(sum(len(m["content"]) for m in messages))
        try:
            prompt, token_ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        except jinja2.TemplateError as exc:  # the template's own refusal, written for users
            raise bad_request(
                f"the chat template rejected these messages: {exc.message}", "messages"
            ) from None
        self.check_prompt_tokens(len(token_ids), "messages")
        return prompt, token_ids

    # -- the endpoints -------------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Response:
        """POST /v1/completions."""
        arrival = arrival_time(raw_request)
        self.check_engine()
        self.check_model(body.model)
        refuse_unsupported(body)
        prompt, token_ids = await self.completion_prompt(body)
        params = self.sampling_params(body, len(token_ids), body.max_tokens, body.logprobs)
        job = self.make_job(body, "cmpl", prompt, token_ids, params, arrival)
        return await self.respond(
            job, CompletionShape(self, job, body.logprobs is not None), raw_request
        )

    async def create_chat_completion(
        self, body: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        """POST /v1/chat/completions."""
        arrival = arrival_time(raw_request)
        self.check_engine()
        self.check_model(body.model)
        refuse_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        prompt, token_ids = await self.chat_prompt(body)
        use_completion_tokens = body.max_completion_tokens is not None
        max_tokens = body.max_completion_tokens if use_completion_tokens else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(
            body,
            len(token_ids),
            max_tokens,
            logprobs,
            "max_completion_tokens" if use_completion_tokens else "max_tokens",
        )
        job = self.make_job(body, "chatcmpl", prompt, token_ids, params, arrival)
        return await self.respond(job, ChatShape(self, job, body.logprobs), raw_request)

    def show_available_models(self) -> dict:
        """GET /v1/models: the served name only (the model's path on disk stays private)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "engine",
                    "root": self.model_name,
                    "parent": None,
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    @staticmethod
    def make_job(
        body: SamplingFields,
        prefix: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        arrival: float,
    ) -> GenerationJob:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return GenerationJob(
            f"{prefix}-{uuid.uuid4().hex}",
            prompt,
            token_ids,
            params,
            body.priority,
            arrival,
            body.cache_salt,
            body.stream,
            include_usage,
        )

    async def respond(
        self, job: GenerationJob, shape: ResponseShape, raw_request: Request
    ) -> Response:
        """Hand the job to the engine; stream it, or wait for the end and answer once."""
        outputs = self.start(job)
        if job.stream:
            return SSEResponse(stream_events(self, outputs, shape))
        final = await self.run_to_end(raw_request, outputs)
        if final is None:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if final.finish_reason == "error":
            raise engine_failed(final)
        return JSONResponse(shape.response(final))

    def start(self, job: GenerationJob) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate runs the engine's own checks at once: a bad request gets its 400
        here, before any streaming."""
        try:
            return self.async_llm.generate(
                job.prompt,
                job.params,
                job.request_id,
                prompt_token_ids=job.prompt_token_ids,
                priority=job.priority,
                arrival_time=job.arrival_time,
                cache_salt=job.cache_salt,
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param) from None
        except RuntimeError:  # the engine loop died between the check and now
            raise engine_not_running() from None

    async def run_to_end(
        self, raw_request: Request, outputs: AsyncIterator[RequestOutput]
    ) -> RequestOutput | None:
        """The final output, or None if the client left first (the request is then aborted)."""
        try:
            final = await final_output(raw_request, outputs)
        except Exception:  # noqa: BLE001 - e.g. the engine loop died mid-request
            logger.exception("generation failed")
            raise APIError(500, "generation failed: the engine stopped", "server_error") from None
        if final is None:
            self.metrics.count_abort()
        return final

    # -- logprobs ------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob_item(self, token_id: int, logprob: float) -> dict:
        """One chat logprob: `bytes` are the token's raw bytes, exact even for half a character."""
        return {
            "token": self.token_text(token_id),
            "logprob": finite_logprob(logprob),
            "bytes": list(self.tokenizer.token_bytes(token_id)),
        }

    def chat_logprobs(self, entries: list[dict]) -> dict:
        return {
            "content": [
                {
                    **self.logprob_item(e["token_id"], e["logprob"]),
                    "top_logprobs": [
                        self.logprob_item(t, lp) for t, lp in (e.get("top_logprobs") or {}).items()
                    ],
                }
                for e in entries
            ]
        }

    def completion_logprobs(self, entries: list[dict], text_offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e["token_id"])
            tokens.append(text)
            token_logprobs.append(finite_logprob(e["logprob"]))
            top.append(
                {
                    self.token_text(t): finite_logprob(lp)
                    for t, lp in (e.get("top_logprobs") or {}).items()
                }
            )
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }


# -- streaming ---------------------------------------------------------------------------------


def sse(data: dict | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def stream_events(
    server: OpenAIServer, outputs: AsyncIterator[RequestOutput], shape: ResponseShape
) -> AsyncIterator[str]:
    """The SSE body of both endpoints: chunks as the engine produces them, then `[DONE]`.

    If the engine fails the request, the client gets an error event (OpenAI's shape) and the
    stream ends. If the client leaves, the generator is closed mid-way: `finally` closes the
    engine stream, which aborts the request and frees its KV blocks."""
    final: RequestOutput | None = None
    failed = False
    try:
        for choice in shape.opening_choices():
            yield sse(shape.chunk([choice]))
        async for output in outputs:
            final = output
            if output.finish_reason == "error":
                failed = True
                yield sse(engine_failed(output).body())
                break
            choice = shape.delta_choice(output)
            if choice is not None:
                yield sse(shape.chunk([choice]))
        if shape.job.include_usage and final is not None and not failed:
            yield sse(shape.chunk([], usage_of(final)))
    except Exception:  # noqa: BLE001 - the stream has started: report in-band, keep serving
        failed = True
        logger.exception("stream %s failed", shape.job.request_id)
        yield sse(APIError(500, "generation failed: the engine stopped", "server_error").body())
    finally:
        await outputs.aclose()  # aborts the request if it has not finished
        if not failed and (final is None or not final.finished):
            server.metrics.count_abort()
    yield sse("[DONE]")


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body generator, whatever ended the stream.

    If the client leaves while a chunk is being sent, Starlette stops iterating and would leave
    the generator suspended until garbage collection; closing it here runs its `finally` (the
    abort) at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_output(
    raw_request: Request, outputs: AsyncIterator[RequestOutput]
) -> RequestOutput | None:
    """Run a request to the end, unless the client hangs up first (then abort it: None)."""

    async def consume() -> RequestOutput | None:
        final = None
        async for output in outputs:
            final = output
        return final

    generation = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not generation.done():  # client gone (or we were cancelled): abort the request
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await generation
    if generation.cancelled():
        return None
    return generation.result()


# -- the HTTP edge: body cap, API key ---------------------------------------------------------


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes")


class BodySizeLimit:
    """Pure ASGI middleware: a body over `max_bytes` gets a 413 before it is read.

    A declared Content-Length is checked before reading anything; a chunked body is counted as
    it arrives and stopped at the limit. A declared body up to DRAIN_FACTOR times the limit is
    read and dropped before the 413 goes out: the client is still sending it, and a server that
    closes a connection with unread bytes resets it, which can destroy the answer on its way (a
    10 MB body lost its 413 that way under load). Larger ones, or a body still arriving after
    DRAIN_TIMEOUT_S, are answered at once. It also stamps the request's arrival time, the first
    moment of its journey."""

    DRAIN_FACTOR = 8
    DRAIN_TIMEOUT_S = 5.0

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival_time"] = time.perf_counter()
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if length.isdigit() and int(length) <= self.DRAIN_FACTOR * self.max_bytes:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(receive), self.DRAIN_TIMEOUT_S)
            return await _send_error(send, APIError(413, BodyTooLarge(self.max_bytes).detail))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # FastAPI re-raises it → the 413 handler
            return message

        await self.app(scope, limited_receive, send)


async def _drain(receive) -> None:
    """Read the request body to its end (or the client's disconnect), keeping none of it."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def arrival_time(raw_request: Request) -> float:
    return getattr(raw_request.state, "arrival_time", None) or time.perf_counter()


def get_server(raw_request: Request) -> OpenAIServer:
    return raw_request.app.state.server


bearer = HTTPBearer(auto_error=False, description="the server's API key, if it has one")


async def require_api_key(
    raw_request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> None:
    get_server(raw_request).check_api_key(credentials)


async def require_api_key_for_docs(
    raw_request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> None:
    """/metrics, /docs and /openapi.json follow the key, unless the server opted them out."""
    server = get_server(raw_request)
    if not server.public_docs_and_metrics:
        server.check_api_key(credentials)


# -- routes: thin functions over OpenAIServer's methods ---------------------------------------

router = APIRouter()
AUTH = [Depends(require_api_key)]
DOCS_AUTH = [Depends(require_api_key_for_docs)]


@router.get("/health", responses={503: ERROR_RESPONSES[503]})
async def health(raw_request: Request) -> Response:
    """200 while the engine loop runs; 503 once it has died (restart the server)."""
    if not get_server(raw_request).async_llm.is_running:
        return engine_not_running().response()
    return JSONResponse({"status": "ok"})


@router.get("/metrics", dependencies=DOCS_AUTH, response_class=Response)
async def metrics(raw_request: Request) -> Response:
    server = get_server(raw_request)
    return Response(server.metrics.render(), media_type=server.metrics.content_type)


@router.get("/v1/models", dependencies=AUTH, responses={401: ERROR_RESPONSES[401]})
async def show_available_models(raw_request: Request) -> dict:
    return get_server(raw_request).show_available_models()


@router.post("/v1/completions", dependencies=AUTH, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
    return await get_server(raw_request).create_completion(body, raw_request)


@router.post("/v1/chat/completions", dependencies=AUTH, responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
    return await get_server(raw_request).create_chat_completion(body, raw_request)


@router.get("/openapi.json", dependencies=DOCS_AUTH, include_in_schema=False)
async def openapi(raw_request: Request) -> JSONResponse:
    return JSONResponse(raw_request.app.openapi())


@router.get("/docs", dependencies=DOCS_AUTH, include_in_schema=False)
async def docs(raw_request: Request) -> Response:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=raw_request.app.title)


# -- error handlers: everything leaves in OpenAI's shape, nothing takes the server down -------


async def on_api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def on_invalid_request(request: Request, exc: InvalidRequestError) -> Response:
    return bad_request(str(exc), exc.param).response()


async def on_request_validation(request: Request, exc: RequestValidationError) -> Response:
    return validation_error(exc).response()


async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    return APIError(exc.status_code, str(exc.detail)).response()


async def on_unexpected(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error on %s", request.url.path)
    return APIError(500, "internal server error", "server_error").response()


def build_app(
    engine_or_async_llm,
    api_key: str | None = None,
    served_model_name: str | None = None,
    *,
    public_docs_and_metrics: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The FastAPI app over an EngineCore (wrapped in a new AsyncLLM that the app shuts down when
    it stops), an existing AsyncLLM (left running), or an LLM (its engine)."""
    server = OpenAIServer(
        engine_or_async_llm, api_key, served_model_name, public_docs_and_metrics, max_body_bytes
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.close()

    # FastAPI's own /docs and /openapi.json are off: the router serves them behind the key. A body
    # without a Content-Type is read as JSON (strict_content_type=False), as curl users expect.
    app = FastAPI(
        title="engine: OpenAI-compatible server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        strict_content_type=False,
    )
    app.state.server = server
    app.include_router(router)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


# -- running it --------------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A uvicorn server running in a background thread (for the Streamlit app and tests)."""

    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What the openai client wants: the URL with /v1."""
        return f"{self.url}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server_in_thread(
    app_or_engine,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    log_level: str = "warning",
    startup_timeout: float = 30.0,
    header_timeout: float = HEADER_READ_TIMEOUT_S,
) -> ServerHandle:
    """Serve `app_or_engine` (a FastAPI app, or anything build_app takes) with uvicorn in a daemon
    thread. port=0 picks a free port; the handle's .url says which."""
    app = (
        app_or_engine
        if isinstance(app_or_engine, FastAPI)
        else build_app(app_or_engine, api_key=api_key)
    )
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, header_timeout, log_level=log_level, lifespan="on"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    return ServerHandle(app, server, thread, host, port)


def serve(
    engine_or_async_llm,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    **app_options,
) -> int:
    """Serve in the foreground until Ctrl-C (what `python -m engine serve` runs).

    Returns the process's exit status: 0 after a normal stop, 1 if the engine loop died. A dead
    loop cannot be revived in-process, so the server stops and lets a supervisor (systemd,
    Docker's restart policy, Kubernetes) start a fresh one, rather than answer 503 forever."""
    app = build_app(engine_or_async_llm, api_key=api_key, **app_options)
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level))
    async_llm = app.state.server.async_llm
    watchdog = threading.Thread(
        target=_stop_when_engine_dies, args=(async_llm, server), name="engine-watchdog", daemon=True
    )
    watchdog.start()
    server.run()
    if async_llm.errored is not None:
        logger.error(
            "the engine loop died (%s); exiting with status 1", type(async_llm.errored).__name__
        )
        return 1
    return 0


def _stop_when_engine_dies(async_llm, server: uvicorn.Server, interval: float = 0.2) -> None:
    while not server.should_exit:
        if async_llm.errored is not None:
            server.should_exit = True
            return
        time.sleep(interval)
