"""Serving: one HTTP request's way through the engine, whichever endpoint. `OpenAIServer` holds
what every request shares (the AsyncLLM, the metrics, the model's name), checks what a schema
cannot say (the model name, the prompt's length, the context), tokenizes in a worker thread, hands
the job to the engine, and answers with one JSON body or a stream of server-sent events (the
`ResponseShape` of each endpoint words the JSON)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

from engine.entrypoints.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TOKENS,
    MAX_CHARS_PER_TOKEN,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    bad_request,
    engine_failed,
    engine_not_running,
    refuse_lone_surrogates,
    refuse_too_many_stop_strings,
    refuse_unrecognized,
    refuse_unsupported,
)
from engine.entrypoints.server.structured_outputs import GrammarCompiler, structured_outputs_of
from engine.metrics import ServerMetrics
from engine.output import RequestOutput
from engine.sample.sampler import finite_logprob
from engine.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)


# A text longer than TOKENIZE_CHUNK_CHARS is counted chunk by chunk before it is tokenized whole,
# and refused once the count passes FAR_TOO_LONG_FACTOR × the context: chunk boundaries can change
# a count by a token or so, never by a factor of two, so only a prompt that surely cannot fit is
# refused this way (the exact check follows the real tokenizing).
TOKENIZE_CHUNK_CHARS = 4096
FAR_TOO_LONG_FACTOR = 2


def count_tokens_up_to(tokenizer, texts: list[str], limit: int) -> int:
    """The texts' tokens, counted chunk by chunk; stops as soon as the count passes `limit`."""
    counted = 0
    for text in texts:
        for start in range(0, len(text), TOKENIZE_CHUNK_CHARS):
            counted += len(tokenizer.encode_plain(text[start : start + TOKENIZE_CHUNK_CHARS]))
            if counted > limit:
                return counted
    return counted


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
    kv_transfer_params: dict | None = None  # a consumer's remote K/V (docs/kv_connector.md)


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
        """vLLM's body; with kv_transfer_params when a kv_producer saved the request's K/V
        (what a proxy hands to the consumer)."""
        kv = {"kv_transfer_params": final.kv_transfer_params} if final.kv_transfer_params else {}
        return {
            **self.base,
            "object": self.response_object,
            "choices": [self.final_choice(final)],
            "usage": usage_of(final),
            **kv,
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

    def visible(self, entries: list[dict]) -> list[dict]:
        """The logprob entries of tokens the text shows: with skip_special_tokens (the default)
        the closing `<|im_end|>` is not in the message, so its logprob is not either."""
        if not self.job.params.skip_special_tokens:
            return entries
        special = self.server.tokenizer.special_token_ids
        return [e for e in entries if e["token_id"] not in special]

    def delta_choice(self, output: RequestOutput) -> dict | None:
        entries = self.visible(new_logprob_entries(output)) if self.want_logprobs else None
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
        logprobs = (
            self.server.chat_logprobs(self.visible(output.logprobs or []))
            if self.want_logprobs
            else None
        )
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
        from engine.entrypoints.llm import LLM, AsyncLLM

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
        self.closing = asyncio.Event()  # set when the shutdown grace period is over
        self.grammars = GrammarCompiler(self.engine)  # structured outputs, off the event loop

    def end_open_requests(self) -> None:
        """The shutdown's grace period is over: every open stream ends with an error event and
        `[DONE]`, every waiting non-stream request gets a 503 (their requests are aborted). Call
        it on the server's event loop."""
        logger.warning("shutdown grace period over: ending the requests still open")
        self.closing.set()

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.async_llm.step_listeners.remove(self.metrics.on_step)
        self.grammars.close()
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
        """Only the served name: accepting the model's path too would let a client confirm a
        guessed path on this machine."""
        if name is None or name == self.model_name:
            return
        raise APIError(
            404,
            f"the model `{name[:200]}` does not exist; this server serves `{self.model_name}`",
            param="model",
            code="model_not_found",
        )

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"{num_chars} characters in `{param}`; with a context of "
                f"{self.engine.max_model_len} tokens this server takes at most "
                f"{self.max_prompt_chars}",
                param,
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
        kwargs["structured_outputs"], source = structured_outputs_of(body)
        try:
            params = SamplingParams(**kwargs)
        except InvalidRequestError as exc:  # named as the client sent it
            exc.param = source if exc.param == "structured_outputs" else exc.param
            raise
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
            await self.refuse_far_too_long([prompt], "prompt")
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
        contents = [m["content"] for m in messages]
        self.check_prompt_chars(sum(map(len, contents)), "messages")
        await self.refuse_far_too_long(contents, "messages")
        try:
            prompt, token_ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages)
        except jinja2.TemplateError as exc:  # the template's own refusal, written for users
            raise bad_request(
                f"the chat template rejected these messages: {exc.message}", "messages"
            ) from None
        self.check_prompt_tokens(len(token_ids), "messages")
        return prompt, token_ids

    def check_message_count(self, count: int) -> None:
        """Every message takes at least one token of the context (its role marker), so more
        messages than the context has tokens cannot fit: refused before rendering any."""
        if count > self.engine.max_model_len:
            raise bad_request(
                f"{count} messages cannot fit this model's maximum context length of "
                f"{self.engine.max_model_len} tokens: send at most {self.engine.max_model_len}",
                "messages",
                "context_length_exceeded",
            )

    async def refuse_far_too_long(self, texts: list[str], param: str) -> None:
        """A text that passes the character check can still be far too many tokens ("안" is three
        byte tokens): count it in bounded chunks and stop as soon as it surely cannot fit, so a
        refused prompt costs a few thousand tokens of work, not the whole text's."""
        if sum(map(len, texts)) <= TOKENIZE_CHUNK_CHARS:
            return  # short: the real tokenizing below is as cheap as any bound
        limit = FAR_TOO_LONG_FACTOR * self.engine.max_model_len
        counted = await asyncio.to_thread(count_tokens_up_to, self.tokenizer, texts, limit)
        if counted > limit:
            raise bad_request(
                f"the {param} has more than {limit} tokens (counting stopped there); this "
                f"model's maximum context length is {self.engine.max_model_len} tokens",
                param,
                "context_length_exceeded",
            )

    # -- the endpoints -------------------------------------------------------------------------

    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Response:
        """POST /v1/completions."""
        arrival = arrival_time(raw_request)
        self.check_engine()
        self.check_model(body.model)
        refuse_unrecognized(body)
        refuse_unsupported(body)
        refuse_lone_surrogates(body)
        refuse_too_many_stop_strings(body)
        prompt, token_ids = await self.completion_prompt(body)
        params = self.sampling_params(body, len(token_ids), body.max_tokens, body.logprobs)
        await self.grammars.compile(body, params)
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
        self.check_message_count(len(body.messages))  # first: the checks below walk them all
        refuse_unrecognized(body)
        refuse_unsupported(body)
        refuse_lone_surrogates(body)
        refuse_too_many_stop_strings(body)
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
        await self.grammars.compile(body, params)
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
        kv_params = body.kv_transfer_params
        kv = kv_params.model_dump(exclude_none=True) if kv_params is not None else {}
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
            kv or None,
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
                kv_transfer_params=job.kv_transfer_params,
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
            final = await final_output(raw_request, outputs, self.closing)
        except ServerClosing:
            self.metrics.count_abort()
            raise shutting_down() from None
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
    events = until_closing(outputs, server.closing)
    try:
        for choice in shape.opening_choices():
            yield sse(shape.chunk([choice]))
        async for output in events:
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
    except ServerClosing:
        failed = True
        server.metrics.count_abort()
        yield sse(shutting_down().body())
    except Exception:  # noqa: BLE001 - the stream has started: report in-band, keep serving
        failed = True
        logger.exception("stream %s failed", shape.job.request_id)
        yield sse(APIError(500, "generation failed: the engine stopped", "server_error").body())
    finally:
        await events.aclose()
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
    raw_request: Request,
    outputs: AsyncIterator[RequestOutput],
    closing: asyncio.Event | None = None,
) -> RequestOutput | None:
    """Run a request to the end, unless the client hangs up first (then abort it: None) or the
    server's shutdown grace period ends first (then abort it: ServerClosing)."""

    async def consume() -> RequestOutput | None:
        final = None
        async for output in outputs:
            final = output
        return final

    generation = asyncio.ensure_future(consume())
    watchers = {asyncio.ensure_future(_wait_for_disconnect(raw_request))}
    if closing is not None:
        watchers.add(asyncio.ensure_future(closing.wait()))
    try:
        await asyncio.wait({generation, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
        if not generation.done():  # client gone, server closing (or we were cancelled): abort
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await generation
    if generation.cancelled():
        if closing is not None and closing.is_set():
            raise ServerClosing
        return None
    return generation.result()


class ServerClosing(Exception):
    """The server's shutdown grace period ended while this request was still running."""


def shutting_down() -> APIError:
    return APIError(
        503, "the server is shutting down; this request was not finished", "server_error"
    )


_END = object()


async def until_closing(
    outputs: AsyncIterator[RequestOutput], closing: asyncio.Event
) -> AsyncIterator[RequestOutput]:
    """`outputs`, until the server's shutdown grace period ends: then ServerClosing (the engine
    request is aborted when the caller closes `outputs`). Works whatever the engine is doing,
    a hung step included: the wait is on the server's event, not on the engine."""
    closed = asyncio.ensure_future(closing.wait())

    async def next_output():
        return await anext(outputs, _END)

    try:
        while True:
            pending = asyncio.ensure_future(next_output())
            try:
                await asyncio.wait({pending, closed}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # closing, or this task was cancelled: stop the pending read first
                if not pending.done():
                    pending.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pending
            if pending.cancelled():
                raise ServerClosing
            output = pending.result()
            if output is _END:
                return
            yield output
    finally:
        closed.cancel()


def arrival_time(raw_request: Request) -> float:
    return getattr(raw_request.state, "arrival_time", None) or time.perf_counter()
