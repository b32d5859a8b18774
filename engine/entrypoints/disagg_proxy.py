"""The disaggregated-serving proxy: one OpenAI endpoint in front of a prefill server and a
decode server (`python -m engine proxy --prefill URL --decode URL --port P`).

    client ──► proxy ──(1) the request with max_tokens=1, not streamed──► prefill server
                                                                      (serve --kv-role kv_producer)
                       ◄── its answer, with kv_transfer_params {remote_request_id, num_tokens};
                           meanwhile its worker has sent the prompt's K/V to the consumer
                 ──(2) the original request + those kv_transfer_params──► decode server
                                                                      (serve --kv-role kv_consumer)
           ◄── the decode server's answer, streamed through as it comes

What vLLM's disaggregation proxies do (examples/online_serving/disaggregated_serving*/ and
disagg_proxy_p2p_nccl_xpyd.py): the first output token is the prefill server's, computed again
by the decode server from the loaded K/V plus the last prompt token, so greedy output equals one
engine's. Errors come back in OpenAI's shape: an upstream's own error (a 400 for a bad request)
is passed through; an upstream that cannot be reached, or a prefill answer without
kv_transfer_params (a server not started as kv_producer), is a 502 naming the server.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from engine.entrypoints.server.app import make_server
from engine.entrypoints.server.protocol import APIError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
UPSTREAM_TIMEOUT_S = 600.0  # a long prompt's prefill, a long answer's gaps
HEALTH_TIMEOUT_S = 5.0
FORWARDED_HEADERS = ("authorization", "content-type")


def upstream_error(which: str, url: str, error: BaseException) -> APIError:
    return APIError(
        502,
        f"the {which} server at {url} could not be reached: {type(error).__name__}: {error}",
        "server_error",
        code="upstream_unreachable",
    )


def prefill_body(body: dict) -> dict:
    """The prefill server's request: one token, no stream, the K/V kept for a remote decode
    (vLLM's do_remote_decode; this engine's kv_producer sends every request's K/V)."""
    first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    first["max_tokens"] = 1
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    first["kv_transfer_params"] = {"do_remote_decode": True}
    return first


class DisaggProxy:
    """The proxy's state: the two upstreams and one shared HTTP client."""

    def __init__(self, prefill_url: str, decode_url: str):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        timeout = httpx.Timeout(UPSTREAM_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self.client = httpx.AsyncClient(timeout=timeout)
        self.counts = {"requests": 0, "prefill_errors": 0, "decode_errors": 0}

    async def prefill(self, path: str, body: dict, headers: dict) -> dict | Response:
        """The producer's answer's kv_transfer_params, or the Response to give the client."""
        url = self.prefill_url + path
        try:
            answer = await self.client.post(url, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as error:
            self.counts["prefill_errors"] += 1
            raise upstream_error("prefill", self.prefill_url, error) from None
        if answer.status_code != 200:  # the client's error (or the server's), as it said it
            self.counts["prefill_errors"] += 1
            return Response(answer.content, answer.status_code, media_type="application/json")
        params = answer.json().get("kv_transfer_params")
        if not params:
            self.counts["prefill_errors"] += 1
            raise APIError(
                502,
                f"the prefill server at {self.prefill_url} answered without kv_transfer_params: "
                "start it with --kv-role kv_producer",
                "server_error",
                code="not_a_kv_producer",
            )
        return params

    async def decode(self, path: str, body: dict, headers: dict) -> Response:
        """The consumer's answer, streamed through (or its error, whole)."""
        request = self.client.build_request(
            "POST", self.decode_url + path, json=body, headers=headers
        )
        try:
            answer = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            self.counts["decode_errors"] += 1
            raise upstream_error("decode", self.decode_url, error) from None
        if answer.status_code != 200:
            self.counts["decode_errors"] += 1
            content = await answer.aread()
            await answer.aclose()
            return Response(content, answer.status_code, media_type="application/json")
        return StreamingResponse(
            self._relay(answer),
            media_type=answer.headers.get("content-type", "application/json"),
            background=BackgroundTask(answer.aclose),
        )

    async def _relay(self, answer: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as error:  # the decode server died mid-answer
            self.counts["decode_errors"] += 1
            failure = upstream_error("decode", self.decode_url, error)
            yield f"data: {json.dumps(failure.body())}\n\n".encode()

    async def handle(self, path: str, raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except ValueError:
            raise APIError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        self.counts["requests"] += 1
        headers = {k: v for k, v in raw_request.headers.items() if k in FORWARDED_HEADERS}
        params = await self.prefill(path, body, headers)
        if isinstance(params, Response):
            return params
        return await self.decode(path, {**body, "kv_transfer_params": params}, headers)

    async def health(self) -> Response:
        """200 when both upstreams answer their /health with 200; else 503 naming which not."""
        down = []
        for which, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                answer = await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
                if answer.status_code != 200:
                    down.append(f"the {which} server at {url} answered {answer.status_code}")
            except httpx.HTTPError as error:
                down.append(f"the {which} server at {url} is unreachable: {error}")
        if down:
            return JSONResponse({"status": "unhealthy", "reasons": down}, status_code=503)
        return JSONResponse({"status": "ok", **self.counts})


def build_proxy_app(prefill_url: str, decode_url: str) -> FastAPI:
    proxy = DisaggProxy(prefill_url, decode_url)
    app = FastAPI(title="engine disaggregation proxy")
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await proxy.handle("/v1/completions", raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", raw_request)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    return app


def serve_proxy(prefill_url: str, decode_url: str, host: str, port: int, log_level: str) -> int:
    """Serve the proxy in the foreground until Ctrl-C / SIGTERM."""
    app = build_proxy_app(prefill_url, decode_url)
    server = make_server(app, host=host, port=port, log_level=log_level)
    server.run()
    return 0
