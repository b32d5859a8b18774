"""The server's traps (issue 32), each tried as a client or an attacker would, on 127.0.0.1 with
the tiny model: slow bodies and connection floods, work done before a refusal, lone surrogates,
unknown and misspelled fields, shutdown mid-stream, and the smaller ones (key before body,
model path, stop limit, 405's Allow, chat logprobs)."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import time

import httpx
import pytest
from test_server import API_KEY, post

from engine.core import EngineConfig, EngineCore
from engine.entrypoints.llm import AsyncLLM
from engine.entrypoints.server import app as app_module
from engine.entrypoints.server.app import build_app, start_server_in_thread

MAX_MODEL_LEN = 1024
CHAT = [{"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def async_llm(tiny_model_dir):
    config = EngineConfig(
        model=tiny_model_dir,
        device="cpu",
        dtype="float32",
        num_kv_blocks=256,
        max_model_len=MAX_MODEL_LEN,
    )
    llm = AsyncLLM(EngineCore(config))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(async_llm):
    with start_server_in_thread(build_app(async_llm, api_key=API_KEY)) as handle:
        yield handle


def completion(server, **body) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})


def chat(server, **body) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **body})


def read_reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 5 s pass)."""
    sock.settimeout(5)
    reply = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


# -- 1. slow bodies, connection floods, accept errors ------------------------------------------


def test_a_trickling_body_is_cut_off_by_the_body_deadline(async_llm):
    """A full head with Content-Length: 100, then one body byte a second: the connection is
    closed once the body deadline passes, and /health answers fast meanwhile."""
    app = build_app(async_llm, api_key=API_KEY)
    with start_server_in_thread(app, body_timeout=1.5) as handle:
        with socket.create_connection((handle.host, handle.port), timeout=10) as slow:
            slow.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
            )
            start = time.monotonic()
            closed = False
            while time.monotonic() - start < 8 and not closed:
                try:
                    slow.sendall(b" ")
                except OSError:
                    closed = True
                    break
                assert httpx.get(f"{handle.url}/health", timeout=2).status_code == 200
                slow.settimeout(1.0)
                with contextlib.suppress(socket.timeout):
                    closed = slow.recv(1024) == b""
            assert closed, "the trickling body kept its connection"
            assert time.monotonic() - start < 6


def test_a_connection_over_the_cap_gets_503(async_llm):
    """With the cap at 2, two idle connections are held and a third one's request gets a 503 in
    OpenAI's error shape; once they close, requests are served again."""
    app = build_app(async_llm, api_key=API_KEY)
    with start_server_in_thread(app, max_connections=2) as handle:
        held = [socket.create_connection((handle.host, handle.port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.2)  # let the server accept both
            with socket.create_connection((handle.host, handle.port), timeout=5) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = read_reply(extra)
            assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
            assert b'"error"' in reply and b"connections" in reply
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if httpx.get(f"{handle.url}/health", timeout=2).status_code == 200:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server did not serve again after the connections closed")


def test_accept_errors_are_logged_once_per_interval(caplog):
    """asyncio reports every failed accept() ("Too many open files"); the loop's handler keeps
    one line per interval instead of a traceback per attempt."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        app_module._last_warning.clear()
        app_module.throttle_accept_errors(loop)
        error = OSError(errno.EMFILE, "Too many open files")
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": error}
                )
        lines = [r for r in caplog.records if "Too many open files" in r.getMessage()]
        assert len(lines) == 1, len(lines)
        assert not any(r.exc_info for r in caplog.records)
    finally:
        loop.close()
