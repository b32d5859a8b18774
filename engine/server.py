"""The API server: where a request's journey begins (chapter 01) and what chapter 14 puts under load.

An OpenAI-compatible HTTP front end on FastAPI + uvicorn. For each HTTP request it

1. notes the arrival time (time.perf_counter(), the start of the request's journey),
2. checks the API key, parses the JSON body and checks every field, the model name and the
   length (prompt + max_tokens must fit the context), answering mistakes with OpenAI's error
   shape `{"error": {"message", "type", "param", "code"}}` and a 4xx status, before any work,
3. hands the request to the one shared `AsyncLLM`, whose engine loop runs in its own thread and
   batches every concurrent request together, step by step (continuous batching),
4. streams each text delta back as a server-sent event (`data: {...}`, ending with
   `data: [DONE]`), or waits for the end and answers with one JSON body.

A client that goes away aborts its request at once, freeing its KV blocks: the streaming body is
an async generator whose `finally` closes the engine stream (which aborts an unfinished request),
and a non-streaming request races the generation against the connection's `http.disconnect`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics (Prometheus text; see engine/metrics.py).

Defaults worth knowing:
- max_tokens, when absent, is DEFAULT_MAX_TOKENS (256) capped by the room left in the context
  (vLLM would allow everything up to the context limit; OpenAI's legacy completions default is 16).
- temperature defaults to 1.0 and top_p to 1.0, as in OpenAI's API; send temperature=0 for greedy.
- one prompt and n=1 per request; penalties, echo, suffix and best_of are refused with a 400
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
from pathlib import Path
from typing import Any, AsyncIterator, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.metrics import ServerMetrics
from engine.output import RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
MAX_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


# -- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    """An error the client sees, in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Pydantic's error list → one 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    # A field's path, without "body" and without the union member pydantic tried ("str", "list[int]").
    def path(error: dict) -> str:
        parts = [str(p) for p in error.get("loc", ()) if p != "body"]
        parts = [p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool")]
        return ".".join(parts) or "body"

    messages: dict[str, list[str]] = {}
    for error in errors:
        messages.setdefault(path(error), []).append(error.get("msg", "invalid"))
    text = "; ".join(f"{p}: {msgs[0] if len(msgs) == 1 else 'Input has none of the allowed types'}"
                     for p, msgs in list(messages.items())[:5])
    param = path(first).split(".")[0]
    return bad_request(text, None if param == "body" else param)


# -- request bodies ----------------------------------------------------------------------------


class _Body(BaseModel):
    # strict: "0.5" is not a number and 1 is not a boolean, as in OpenAI's API; fields we do not
    # know (user, metadata, ...) are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# -- the server --------------------------------------------------------------------------------


class OpenAIServer:
    """State shared by every request: the engine, its AsyncLLM, the metrics, the model's names."""

    def __init__(self, engine_or_async_llm, api_key: str | None = None, served_model_name: str | None = None):
        from engine.llm import LLM, AsyncLLM

        if isinstance(engine_or_async_llm, AsyncLLM):
            self.async_llm, self.owns_async_llm = engine_or_async_llm, False
        else:
            engine = engine_or_async_llm.engine if isinstance(engine_or_async_llm, LLM) else engine_or_async_llm
            self.async_llm, self.owns_async_llm = AsyncLLM(engine), True
        self.engine = self.async_llm.engine
        self.tokenizer = self.engine.tokenizer
        self.api_key = api_key or None
        model_dir = Path(self.engine.model_dir)
        self.model_name = served_model_name or model_dir.name
        self.model_dir = model_dir
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.engine, self.model_name)
        self.async_llm.step_listeners.append(self.metrics.on_step)

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.async_llm.step_listeners.remove(self.metrics.on_step)
        if self.owns_async_llm:
            self.async_llm.shutdown()

    # -- checks --------------------------------------------------------------------------------

    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           param=None, code="invalid_api_key")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "incorrect API key provided", param=None, code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is None or name in (self.model_name, self.model_dir.name, str(self.model_dir)):
            return
        with contextlib.suppress(OSError, ValueError):
            if Path(name).expanduser().resolve() == self.model_dir.resolve():
                return
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                       param="model", code="model_not_found")

    def sampling_params(self, body: _SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                        logprobs: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
        """Map the body onto SamplingParams; every out-of-range value raises a 400 naming it
        (`max_tokens_param`: what the client called max_tokens, e.g. max_completion_tokens)."""
        try:
            return self._sampling_params(body, num_prompt_tokens, max_tokens, logprobs)
        except APIError as exc:
            if exc.param == "max_tokens":
                exc.param = max_tokens_param
            raise

    def _sampling_params(self, body: _SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                         logprobs: int | None) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise bad_request(f"{name} is not supported by this engine (only 0)", name)
        if max_tokens is None:  # the documented default: 256, capped by the room left in the context
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, self.engine.max_model_len - num_prompt_tokens))
        kwargs: dict[str, Any] = dict(
            n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos, logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output,
            seed=body.seed,
        )
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
        try:
            params = SamplingParams(**kwargs)  # verifies every range
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param) from exc
        try:
            self.engine.check_length(num_prompt_tokens, params.max_tokens)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param, "context_length_exceeded") from exc
        return params

    # -- prompts -------------------------------------------------------------------------------

    def completion_prompt(self, body: CompletionRequest) -> tuple[str | None, list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) == 0:
                raise bad_request("the prompt is empty", "prompt")
            if isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise bad_request("this server takes one prompt per request; send a string, not a batch",
                                      "prompt")
                prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        messages = []
        for i, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            role = "system" if message.role == "developer" else message.role
            messages.append({"role": role, "content": content or ""})
        try:
            prompt = self.tokenizer.apply_chat_template(messages)
        except Exception as exc:  # the template itself may refuse a conversation
            raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
        return prompt, self.tokenizer.encode(prompt)

    # -- logprobs ------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(self, entries: list[dict]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode("utf-8"))}

        return {"content": [
            {**item(e["token_id"], e["logprob"]),
             "top_logprobs": [item(t, lp) for t, lp in (e.get("top_logprobs") or {}).items()]}
            for e in entries
        ]}

    def completion_logprobs(self, entries: list[dict], text_offset: int) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e["token_id"])
            tokens.append(text)
            token_logprobs.append(max(e["logprob"], LOGPROB_FLOOR))
            top.append({self.token_text(t): max(lp, LOGPROB_FLOOR) for t, lp in (e.get("top_logprobs") or {}).items()})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def usage_of(output: RequestOutput) -> dict:
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": output.metrics.num_cached_tokens}}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


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


class ClientDisconnected(Exception):
    pass


async def _final_output(http_request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Run a request to the end, unless the client hangs up first (then abort it)."""

    async def consume() -> RequestOutput:
        final = None
        async for output in outputs:
            final = output
        return final

    generation = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not generation.done():  # client gone (or we were cancelled): abort the request
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await generation
    if generation.cancelled():
        raise ClientDisconnected()
    return generation.result()


# -- the app -----------------------------------------------------------------------------------


def build_app(engine_or_async_llm, api_key: str | None = None, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app over an EngineCore (wrapped in a new AsyncLLM that the app shuts down when
    it stops), an existing AsyncLLM (left running), or an LLM (its engine)."""
    server = OpenAIServer(engine_or_async_llm, api_key, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.close()

    app = FastAPI(title="engine: OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server

    # -- error handlers: everything leaves in OpenAI's shape, nothing takes the server down ----

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(request: Request, exc: InvalidRequestError):
        return bad_request(str(exc), exc.param).response()

    @app.exception_handler(RequestValidationError)
    async def on_request_validation(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return APIError(500, f"internal server error: {exc!r}", "server_error").response()

    async def parse(request: Request, model: type[BaseModel]):
        server.check_api_key(request)
        if server.async_llm.errored is not None:
            raise APIError(503, f"engine loop died: {server.async_llm.errored!r}", "server_error")
        raw = await request.body()
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    # -- endpoints -----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if server.async_llm.errored is not None:
            return APIError(503, f"engine loop died: {server.async_llm.errored!r}", "server_error").response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_api_key(request)
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "engine",
            "root": str(server.model_dir), "max_model_len": server.engine.max_model_len,
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()  # the journey starts here
        body: CompletionRequest = await parse(request, CompletionRequest)
        server.check_model(body.model)
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise bad_request("best_of must be 1", "best_of")
        prompt, prompt_ids = server.completion_prompt(body)
        params = server.sampling_params(body, len(prompt_ids), body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        # generate() runs the engine's own checks at once, so a bad request gets its 400 here.
        outputs = server.async_llm.generate(prompt, params, request_id, prompt_token_ids=prompt_ids,
                                            arrival_time=arrival)
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": server.model_name}
        want_logprobs = body.logprobs is not None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def stream() -> AsyncIterator[str]:
                text_offset = 0
                async with managed(outputs) as tracker:
                    async for output in tracker:
                        if not (output.delta_text or want_logprobs or output.finished):
                            continue  # nothing to say yet (text held back at a UTF-8 or stop boundary)
                        choice = {"index": 0, "text": output.delta_text, "logprobs": None,
                                  "finish_reason": output.finish_reason if output.finished else None}
                        if want_logprobs:
                            entries = output.logprobs[len(output.logprobs) - len(output.delta_token_ids):]
                            choice["logprobs"] = server.completion_logprobs(entries, text_offset)
                            text_offset += sum(len(token) for token in choice["logprobs"]["tokens"])
                        if output.finished:
                            choice["stop_reason"] = output.stop_reason
                        yield sse({**base, "choices": [choice], **({"usage": None} if include_usage else {})})
                    if tracker.error is not None:
                        yield sse(tracker.error.body())
                    elif include_usage and tracker.final is not None:
                        yield sse({**base, "choices": [], "usage": usage_of(tracker.final)})
                yield sse("[DONE]")

            return SSEResponse(stream())

        final = await run_to_end(request, outputs)
        if isinstance(final, Response):
            return final
        logprobs = server.completion_logprobs(final.logprobs, 0) if want_logprobs else None
        return {**base, "choices": [{"index": 0, "text": final.text, "logprobs": logprobs,
                                     "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}],
                "usage": usage_of(final)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()  # the journey starts here
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        server.check_model(body.model)
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
            if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
                                  "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt, prompt_ids = server.chat_prompt(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = server.sampling_params(body, len(prompt_ids), max_tokens, logprobs,
                                        "max_completion_tokens" if body.max_completion_tokens is not None
                                        else "max_tokens")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # generate() runs the engine's own checks at once, so a bad request gets its 400 here.
        outputs = server.async_llm.generate(prompt, params, request_id, prompt_token_ids=prompt_ids,
                                            arrival_time=arrival)
        base = {"id": request_id, "created": int(time.time()), "model": server.model_name}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunk = {**base, "object": "chat.completion.chunk"}
            usage_none = {"usage": None} if include_usage else {}

            async def stream() -> AsyncIterator[str]:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield sse({**chunk, "choices": [first], **usage_none})
                async with managed(outputs) as tracker:
                    async for output in tracker:
                        entries = None
                        if body.logprobs:
                            entries = output.logprobs[len(output.logprobs) - len(output.delta_token_ids):]
                        if not (output.delta_text or entries or output.finished):
                            continue  # nothing to say yet (text held back at a UTF-8 or stop boundary)
                        choice = {"index": 0, "delta": {"content": output.delta_text} if output.delta_text else {},
                                  "logprobs": server.chat_logprobs(entries) if entries else None,
                                  "finish_reason": output.finish_reason if output.finished else None}
                        if output.finished:
                            choice["stop_reason"] = output.stop_reason
                        yield sse({**chunk, "choices": [choice], **usage_none})
                    if tracker.error is not None:
                        yield sse(tracker.error.body())
                    elif include_usage and tracker.final is not None:
                        yield sse({**chunk, "choices": [], "usage": usage_of(tracker.final)})
                yield sse("[DONE]")

            return SSEResponse(stream())

        final = await run_to_end(request, outputs)
        if isinstance(final, Response):
            return final
        return {**base, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": final.text},
            "logprobs": server.chat_logprobs(final.logprobs) if body.logprobs else None,
            "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}],
            "usage": usage_of(final)}

    # -- helpers that need the server ----------------------------------------------------------

    async def run_to_end(http_request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput | Response:
        try:
            return await _final_output(http_request, outputs)
        except ClientDisconnected:
            server.metrics.count_abort()
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. the engine loop died: say so, keep serving
            logger.error("generation failed: %r", exc)
            raise APIError(500, f"generation failed: {exc}", "server_error") from exc

    @contextlib.asynccontextmanager
    async def managed(outputs: AsyncIterator[RequestOutput]):
        """Iterate an engine stream for SSE; close it (aborting an unfinished request) on exit."""
        tracker = _StreamTracker(outputs)
        try:
            yield tracker
        finally:
            await outputs.aclose()  # aborts the request if it has not finished
            if tracker.final is None or not tracker.final.finished:
                server.metrics.count_abort()

    return app


class _StreamTracker:
    """Wraps an engine stream: remembers the last output, turns an engine failure into an error."""

    def __init__(self, outputs: AsyncIterator[RequestOutput]):
        self.outputs = outputs
        self.final: RequestOutput | None = None
        self.error: APIError | None = None

    async def __aiter__(self):
        try:
            async for output in self.outputs:
                self.final = output
                yield output
        except InvalidRequestError as exc:
            self.error = bad_request(str(exc), exc.param)
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            logger.exception("stream failed")
            self.error = APIError(500, f"generation failed: {exc!r}", "server_error")


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


def start_server_in_thread(app_or_engine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                           log_level: str = "warning", startup_timeout: float = 30.0) -> ServerHandle:
    """Serve `app_or_engine` (a FastAPI app, or anything build_app takes) with uvicorn in a daemon
    thread. port=0 picks a free port; the handle's .url says which."""
    app = app_or_engine if isinstance(app_or_engine, FastAPI) else build_app(app_or_engine, api_key=api_key)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    return ServerHandle(app, server, thread, host, port)


def serve(engine_or_async_llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "info") -> None:
    """Serve in the foreground until Ctrl-C (what `python -m engine serve` runs)."""
    app = build_app(engine_or_async_llm, api_key=api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
