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
  rather than silently ignored; a field no schema names gets OpenAI's "Unrecognized request
  argument supplied" with the closest known name (max_token → max_tokens).
- the API key is checked before the body, so a client without it learns nothing from the body's
  check; the model is the served name only, never the model's path.
- a slow client cannot hold a connection: the head must arrive within 10 s, the body within
  30 s after it; connections over the cap get a 503; a shutdown ends what is still open after
  its grace period with an error event and `[DONE]`, or a 503 (ConnectionLimits, DrainingServer).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import resource
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.entrypoints.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    ERROR_RESPONSES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    engine_not_running,
    validation_error,
)
from engine.entrypoints.server.serving import OpenAIServer
from engine.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

API_KEY_ENV = "LLM_LAB_API_KEY"  # `python -m engine serve` reads it when --api-key is not given
# uvicorn's limits, stated: a header block that grows past 16 KiB unfinished gets a 400; idle
# keep-alive connections close after 5 s. Shutdown waits `shutdown_grace` (3 s) for open
# requests, then ends them (an error event and [DONE], or a 503) and gives those answers
# SHUTDOWN_WRITE_S to leave before uvicorn cancels what remains (DrainingServer). uvicorn has no
# header-read or body-read timeout and no connection cap that answers before the app, so the
# protocol below adds them (ConnectionLimits).
UVICORN_LIMITS = dict(h11_max_incomplete_event_size=16 * 1024, timeout_keep_alive=5)
SHUTDOWN_GRACE_S = 3.0
SHUTDOWN_WRITE_S = 1.0
HEADER_READ_TIMEOUT_S = 10.0
BODY_READ_TIMEOUT_S = 30.0
HEADER_TIMEOUT_ENV = "LLM_LAB_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "LLM_LAB_BODY_TIMEOUT_S"
MAX_CONNECTIONS_ENV = "LLM_LAB_MAX_CONNECTIONS"
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0


def default_max_connections() -> int:
    """Half the process's file-descriptor limit, at most 1000: the cap is reached (and answered
    with 503) well before accept() fails with "Too many open files"."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1000
    return max(8, min(1000, soft // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold (nginx's client_header_timeout, client_body_timeout
    and a worker_connections-like cap).

    - header_timeout: the request head must be complete this many seconds after the connection
      opened (or after the previous response on a kept-alive connection);
    - body_timeout: the request body must be complete this many seconds after its head;
    - max_connections: one connection more gets a 503 (OpenAI's error shape) and is closed;
    - shutdown_grace: how long a shutdown waits for open requests before ending them.

    Both deadlines run from their start, not from the last byte, so trickling does not extend
    them (slowloris, slow POST)."""

    header_timeout: float = HEADER_READ_TIMEOUT_S
    body_timeout: float = BODY_READ_TIMEOUT_S
    max_connections: int = 1000
    shutdown_grace: float = SHUTDOWN_GRACE_S

    @classmethod
    def from_env(cls, **overrides) -> "ConnectionLimits":
        """Defaults from LLM_LAB_HEADER_TIMEOUT_S, LLM_LAB_BODY_TIMEOUT_S and
        LLM_LAB_MAX_CONNECTIONS where set; arguments that are not None win."""
        env = os.environ
        limits = cls(
            float(env.get(HEADER_TIMEOUT_ENV, HEADER_READ_TIMEOUT_S)),
            float(env.get(BODY_TIMEOUT_ENV, BODY_READ_TIMEOUT_S)),
            int(env.get(MAX_CONNECTIONS_ENV, 0)) or default_max_connections(),
        )
        return replace(limits, **{k: v for k, v in overrides.items() if v is not None})


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus ConnectionLimits: a header-read deadline, a body-read
    deadline and a connection cap.

    Without the deadlines a client that trickles one header or body byte every few seconds
    holds a connection forever, and enough of them exhaust the server's sockets. A connection
    over the cap is not left waiting: its request gets a 503 at once and the connection closes."""

    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = self._deadline_kind = None
        if len(self.connections) > self.limits.max_connections:
            self.app = _over_capacity(self.app)
            _throttled_warning(
                "over_capacity",
                "%d connections open (the cap is %d): answering 503",
                len(self.connections),
                self.limits.max_connections,
            )
        self._arm_deadline(self.limits.header_timeout, self._header_timed_out)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:  # the head has arrived, the body has not (all) yet
            if self._deadline_kind != "body":
                self._arm_deadline(self.limits.body_timeout, self._body_timed_out)
        elif state is not h11.IDLE:  # the whole request has arrived
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self._deadline_kind == "body":
            return  # a body still arriving after an early answer keeps its own deadline
        self._arm_deadline(self.limits.header_timeout, self._header_timed_out)  # the next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _arm_deadline(self, seconds: float, on_timeout) -> None:
        self._cancel_deadline()
        self._deadline_kind = "body" if on_timeout == self._body_timed_out else "header"
        self._deadline = self.loop.call_later(seconds, on_timeout)

    def _cancel_deadline(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_kind = None, None

    def _header_timed_out(self) -> None:
        self._deadline = self._deadline_kind = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            logger.info("closing a connection that sent no complete request head in time")
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._deadline = self._deadline_kind = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            logger.info("closing a connection whose request body did not arrive in time")
            self.transport.close()


def _over_capacity(app):
    """The app on a connection over the cap: a 503 in OpenAI's shape, except for /health (a
    load balancer's probe, no engine work), which is answered; either way the connection then
    closes."""

    async def answer(scope, receive, send) -> None:
        if scope.get("path") != "/health":
            return await _send_error(
                send,
                APIError(
                    503, "the server has too many open connections; retry later", "server_error"
                ),
            )

        async def send_and_close(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await app(scope, receive, send_and_close)

    return answer


_last_warning: dict[str, float] = {}


def _throttled_warning(key: str, message: str, *args) -> None:
    """Log a warning at most once per ACCEPT_ERROR_LOG_INTERVAL_S for each `key`: under an
    attack the same line per connection would fill the disk."""
    now = time.monotonic()
    if now - _last_warning.get(key, -ACCEPT_ERROR_LOG_INTERVAL_S) >= ACCEPT_ERROR_LOG_INTERVAL_S:
        _last_warning[key] = now
        logger.warning(message, *args)


def throttle_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback for every failed accept() ("Too many open files"), once per
    pending connection per loop tick: hundreds of thousands a minute under a flood. Install a
    loop exception handler that logs those once per interval and passes the rest on."""
    previous = loop.get_exception_handler()

    def handler(loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in ACCEPT_RESOURCE_ERRORS:
            _throttled_warning(
                "accept",
                "accept() failed: %s (logged once per %.0f s)",
                exc.strerror,
                ACCEPT_ERROR_LOG_INTERVAL_S,
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


ACCEPT_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def uvicorn_config(app, limits: ConnectionLimits | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn's Config with our limits and the connection limits."""
    limits = limits or ConnectionLimits.from_env()
    protocol = type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"limits": limits})
    return uvicorn.Config(
        app,
        http=protocol,
        timeout_graceful_shutdown=limits.shutdown_grace + SHUTDOWN_WRITE_S,
        **UVICORN_LIMITS,
        **kwargs,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus an end for the requests still open when the grace period is over.

    uvicorn waits for open requests and then cancels their tasks: a stream stops with no error
    event and no `[DONE]` (the openai client raises APIConnectionError), a non-stream request
    gets no answer. Here, `limits.shutdown_grace` seconds into the shutdown, the app's server
    ends them: an error event plus `[DONE]` for each stream, a 503 for each waiting request."""

    def __init__(self, config: uvicorn.Config, limits: ConnectionLimits):
        super().__init__(config)
        self.limits = limits

    async def shutdown(self, sockets=None) -> None:
        openai_server = getattr(getattr(self.config.app, "state", None), "server", None)
        end = getattr(openai_server, "end_open_requests", None)
        handle = None
        if end is not None:
            handle = asyncio.get_running_loop().call_later(self.limits.shutdown_grace, end)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()


def make_server(app, limits: ConnectionLimits | None = None, **kwargs) -> DrainingServer:
    """The uvicorn server for `app` with the connection limits (from the environment if None)."""
    limits = limits or ConnectionLimits.from_env()
    return DrainingServer(uvicorn_config(app, limits, **kwargs), limits)


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
    """200 while the engine loop runs and makes progress; 503 once it has died (restart the
    server), or while a step has run past the engine iteration timeout (a hung worker)."""
    async_llm = get_server(raw_request).async_llm
    if not async_llm.is_running:
        return engine_not_running().response()
    stalled = async_llm.health()
    if stalled is not None:
        return APIError(503, stalled, "server_error", code="engine_not_progressing").response()
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
    """FastAPI reads and validates the body before the route's dependencies run; a client
    without the key learns nothing from the body's check: the key is checked first."""
    try:
        get_server(request).check_api_key(await bearer(request))
    except APIError as key_error:
        return key_error.response()
    return validation_error(exc).response()


async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """In OpenAI's shape, keeping the exception's headers (405's Allow, 401's WWW-Authenticate)."""
    return APIError(exc.status_code, str(exc.detail)).response(exc.headers)


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
        throttle_accept_errors(asyncio.get_running_loop())
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
    header_timeout: float | None = None,
    body_timeout: float | None = None,
    max_connections: int | None = None,
    shutdown_grace: float | None = None,
) -> ServerHandle:
    """Serve `app_or_engine` (a FastAPI app, or anything build_app takes) with uvicorn in a daemon
    thread. port=0 picks a free port; the handle's .url says which. Limits left None come from
    ConnectionLimits.from_env()."""
    app = (
        app_or_engine
        if isinstance(app_or_engine, FastAPI)
        else build_app(app_or_engine, api_key=api_key)
    )
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    limits = ConnectionLimits.from_env(
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        max_connections=max_connections,
        shutdown_grace=shutdown_grace,
    )
    server = make_server(app, limits, log_level=log_level, lifespan="on")
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
    limits: ConnectionLimits | None = None,
    **app_options,
) -> int:
    """Serve in the foreground until Ctrl-C (what `python -m engine serve` runs).

    Returns the process's exit status: 0 after a normal stop, 1 if the engine loop died. A dead
    loop cannot be revived in-process, so the server stops and lets a supervisor (systemd,
    Docker's restart policy, Kubernetes) start a fresh one, rather than answer 503 forever."""
    app = build_app(engine_or_async_llm, api_key=api_key, **app_options)
    server = make_server(app, limits, host=host, port=port, log_level=log_level)
    async_llm = app.state.server.async_llm
    watchdog = threading.Thread(
        target=_stop_when_engine_dies, args=(async_llm, server), name="engine-watchdog", daemon=True
    )
    watchdog.start()
    with _sigterm_raises_system_exit():
        server.run()
    if async_llm.errored is not None:
        logger.error(
            "the engine loop died (%s); exiting with status 1", type(async_llm.errored).__name__
        )
        return 1
    return 0


@contextlib.contextmanager
def _sigterm_raises_system_exit():
    """uvicorn re-raises a captured SIGTERM after its graceful shutdown; with the default
    handler that ends the process at once, before the caller's `finally` stops the engine's
    worker processes (a stopped worker would outlive it). SystemExit(143) lets cleanup run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_when_engine_dies(async_llm, server: uvicorn.Server, interval: float = 0.2) -> None:
    while not server.should_exit:
        if async_llm.errored is not None:
            server.should_exit = True
            return
        time.sleep(interval)
