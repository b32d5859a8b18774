"""The server's traps (issue 32), each tried as a client or an attacker would, on 127.0.0.1 with
the tiny model: slow bodies and connection floods, work done before a refusal, lone surrogates,
unknown and misspelled fields, shutdown mid-stream, and the smaller ones (key before body,
model path, stop limit, 405's Allow, chat logprobs)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from test_server import API_KEY, AUTH, assert_error, post
from test_server_reliability import MAX_MODEL_LEN, chat, completion

from engine.core import EngineConfig, EngineCore
from engine.entrypoints.llm import AsyncLLM
from engine.entrypoints.server import app as app_module
from engine.entrypoints.server.app import build_app, start_server_in_thread


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


def read_reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 5 s pass)."""
    sock.settimeout(5)
    reply = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


# -- 1. slow bodies, connection floods, accept errors ------------------------------------------


def trickle_until_closed(handle, head: bytes) -> float:
    """Send `head`, then one body byte a second (checking /health each time) until the server
    closes the connection; the seconds that took (at most 8)."""
    with socket.create_connection((handle.host, handle.port), timeout=10) as slow:
        slow.sendall(head)
        start = time.monotonic()
        slow.settimeout(1.0)
        while time.monotonic() - start < 8:
            try:
                slow.sendall(b" ")
                assert httpx.get(f"{handle.url}/health", timeout=2).status_code == 200
                while chunk := slow.recv(4096):  # an early answer may come first
                    del chunk
                return time.monotonic() - start  # recv gave b"": closed by the server
            except socket.timeout:
                continue
            except OSError:
                return time.monotonic() - start
        pytest.fail("the trickling body kept its connection")


def test_a_trickling_body_is_cut_off_by_the_body_deadline(async_llm):
    """A full head with Content-Length: 100, then one body byte a second: the connection is
    closed once the body deadline passes, and /health answers fast meanwhile. Also when the
    server has already answered (a 404 that reads no body) and the body keeps trickling."""
    app = build_app(async_llm, api_key=API_KEY)
    with start_server_in_thread(app, body_timeout=1.5) as handle:
        for path in (b"/v1/completions", b"/v1/nothing-here"):
            head = (
                b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
            )
            assert trickle_until_closed(handle, head) < 6


def test_a_connection_over_the_cap_gets_503(async_llm):
    """With the cap at 2, two idle connections are held and a third one's request gets a 503 in
    OpenAI's error shape (a /health probe is still answered, and closed); once they close,
    requests are served again."""
    app = build_app(async_llm, api_key=API_KEY)
    with start_server_in_thread(app, max_connections=2) as handle:
        held = [socket.create_connection((handle.host, handle.port), timeout=5) for _ in range(2)]
        try:
            time.sleep(0.2)  # let the server accept both
            with socket.create_connection((handle.host, handle.port), timeout=5) as extra:
                extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = read_reply(extra)
            assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
            assert b'"error"' in reply and b"connections" in reply
            with socket.create_connection((handle.host, handle.port), timeout=5) as probe:
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                reply = read_reply(probe)  # answered, then closed (read_reply reads to the end)
            assert reply.startswith(b"HTTP/1.1 200") and b'"ok"' in reply, reply[:200]
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


# -- 4. work bounded before it is done ---------------------------------------------------------


@pytest.fixture()
def encoded_lengths(server, monkeypatch):
    """The length of every text the server's tokenizer is asked to encode (and -1 for each
    whole chat it renders), recorded, so a test can say what was never tokenized whole."""
    tokenizer = server.app.state.server.tokenizer
    lengths: list[int] = []
    for name in ("encode", "encode_plain"):
        original = getattr(tokenizer, name)

        def recorder(text, *args, _original=original, **kwargs):
            lengths.append(len(text))
            return _original(text, *args, **kwargs)

        monkeypatch.setattr(tokenizer, name, recorder)
    original_chat = tokenizer.encode_chat

    def record_chat(messages, *args, **kwargs):
        lengths.append(-1)
        return original_chat(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode_chat", record_chat)
    return lengths


@pytest.mark.parametrize("chars", [250_000, 30_000])
def test_a_prompt_of_many_tokens_is_refused_before_tokenizing_it_whole(
    server, encoded_lengths, chars
):
    """ "안" is three byte tokens: 250,000 of them fail the character check (no tokenizing at
    all); 30,000 pass it and are counted in bounded chunks until they surely cannot fit."""
    for response in (
        completion(server, prompt="안" * chars),
        chat(server, messages=[{"role": "user", "content": "안" * chars}]),
    ):
        error = assert_error(response, 400)
        assert error["code"] == "context_length_exceeded"
        assert error["param"] in ("prompt", "messages")
        assert str(MAX_MODEL_LEN) in error["message"] or "characters" in error["message"]
    assert -1 not in encoded_lengths  # no chat was rendered and tokenized
    assert all(n < chars for n in encoded_lengths), max(encoded_lengths)
    assert sum(encoded_lengths) <= 2 * 4096


def test_sixty_thousand_empty_messages_are_refused_by_count(server, encoded_lengths):
    messages = [{"role": "user", "content": ""}] * 60_000
    error = assert_error(chat(server, messages=messages), 400, "messages")
    assert "60000 messages" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert encoded_lengths == []


def test_a_prompt_that_fits_is_still_served(server, encoded_lengths):
    """The chunked count only refuses what surely cannot fit: 4,800 characters of one word (over
    one chunk, 600 tokens, under the context) are served; 1,800 tokens (under twice the context)
    get the exact count."""
    response = completion(server, prompt=" request" * 600)
    assert response.status_code == 200, response.text
    error = assert_error(completion(server, prompt=" number" * 600), 400, "prompt")
    assert "1800 tokens" in error["message"] or "1801 tokens" in error["message"], error


# -- 5. lone surrogates ------------------------------------------------------------------------


def test_lone_surrogates_get_a_400_naming_the_field(server):
    cases = [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["a\\udfffb"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages",
        ),
    ]
    for path, content, param in cases:
        response = post(server, path, content=content)
        error = assert_error(response, 400, param)
        assert "surrogate" in error["message"]
    assert completion(server, prompt="a\U0001f600b").status_code == 200  # a proper pair is fine


# -- 6. unknown and misspelled fields ----------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, hint",
    [
        ("max_token", 5, "max_tokens"),
        ("temprature", 0.5, "temperature"),
        ("top_pp", 0.5, "top_p"),
        ("completely_unknown", 1, None),
    ],
)
def test_unknown_fields_get_openais_400_with_a_hint(server, field, value, hint):
    for response in (completion(server, **{field: value}), chat(server, **{field: value})):
        error = assert_error(response, 400, field)
        assert error["message"].startswith(f"Unrecognized request argument supplied: {field}")
        if hint:
            assert f"did you mean {hint}?" in error["message"]


def test_fields_openai_documents_without_effect_pass(server):
    ignored = {"user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}
    assert completion(server, **ignored).status_code == 200
    assert chat(server, **ignored).status_code == 200


def test_stream_options_without_stream_is_refused(server):
    for response in (
        completion(server, stream_options={"include_usage": True}),
        chat(server, stream=False, stream_options={"include_usage": True}),
    ):
        assert "stream" in assert_error(response, 400, "stream_options")["message"]
    error = assert_error(
        completion(server, stream=True, stream_options={"include_usag": True}), 400
    )
    assert "stream_options.include_usag" in error["message"]


def test_message_fields_are_checked(server):
    tool_call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    error = assert_error(
        chat(server, messages=[{"role": "user", "content": "hi", "tool_calls": tool_call}]),
        400,
        "messages",
    )
    assert "tool_calls" in error["message"]
    error = assert_error(
        chat(server, messages=[{"role": "user", "contnet": "hi"}]), 400, "messages"
    )
    assert "messages[0].contnet" in error["message"] and "did you mean content?" in error["message"]


# -- 7. shutdown ends what is still open ---------------------------------------------------------


@pytest.fixture()
def slow_steps(async_llm):
    """Each engine step takes at least 50 ms, so a 200-token request outlives a short grace."""

    def slow(record):
        time.sleep(0.05)

    async_llm.step_listeners.append(slow)
    yield
    async_llm.step_listeners.remove(slow)


def test_shutdown_ends_streams_with_done_and_answers_waiting_requests_503(async_llm, slow_steps):
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    handle = start_server_in_thread(build_app(async_llm, api_key=API_KEY), shutdown_grace=0.5)
    results: dict = {}

    def stream():
        lines = []
        with httpx.stream(
            "POST",
            f"{handle.url}/v1/completions",
            json={**body, "stream": True},
            headers=AUTH,
            timeout=20,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    results.setdefault("streaming", time.monotonic())
        results["stream"] = lines

    def waiting():
        results["waiting"] = post(handle, "/v1/completions", body)

    threads = [threading.Thread(target=stream), threading.Thread(target=waiting)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while "streaming" not in results and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the waiting request is surely running too
    handle.stop(timeout=15)
    for thread in threads:
        thread.join(15)
    events = results["stream"]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "shutting down" in error["message"]
    assert len(events) < 200  # cut, not finished
    assert "shutting down" in assert_error(results["waiting"], 503)["message"]
    deadline = time.monotonic() + 5
    while async_llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not async_llm.engine.has_unfinished_requests()


# -- 8. the smaller ones ------------------------------------------------------------------------


def test_the_key_is_checked_before_the_body(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        for content in (b"not json at all", b'{"prompt": 12}', b"{"):
            assert_error(post(server, path, content=content, headers={}), 401)
            bad_key = {"Authorization": "Bearer wrong"}
            assert_error(post(server, path, content=content, headers=bad_key), 401)
        assert_error(post(server, path, content=b"not json at all"), 400)  # with the key


def test_only_the_served_name_is_a_model(server, tiny_model_dir):
    assert completion(server, model=tiny_model_dir.name).status_code == 200
    for guess in (str(tiny_model_dir), str(tiny_model_dir) + "/", "../" + tiny_model_dir.name):
        error = assert_error(completion(server, model=guess), 404, "model")
        assert str(tiny_model_dir.parent) not in error["message"].replace(guess[:200], "")


def test_a_thousand_stop_strings_are_refused_with_the_limit(server):
    for response in (
        completion(server, stop=[f"s{i}" for i in range(1000)]),
        chat(server, stop=[f"s{i}" for i in range(17)]),
    ):
        error = assert_error(response, 400, "stop")
        assert "at most 16 stop strings" in error["message"]
    assert completion(server, stop=[f"s{i}" for i in range(16)]).status_code == 200


def test_405_names_the_allowed_methods(server):
    response = httpx.get(f"{server.url}/v1/completions", headers=AUTH)
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"
    response = httpx.post(f"{server.url}/v1/models", headers=AUTH)
    assert_error(response, 405)
    assert response.headers["allow"] == "GET"


def test_chat_logprobs_leave_out_the_closing_special_token(server):
    """The message's text has no `<|im_end|>`; its logprobs must not have it either (nor its
    bytes). The engine's last output is built by hand: a random model rarely ends on it."""
    from types import SimpleNamespace

    from engine.entrypoints.server.serving import ChatShape, GenerationJob
    from engine.sampling_params import SamplingParams

    openai_server = server.app.state.server
    tokenizer = openai_server.tokenizer
    im_end = tokenizer.token_to_id("<|im_end|>")
    words = tokenizer.encode_plain("Hello there")
    entries = [{"token_id": t, "logprob": -0.5, "top_logprobs": {}} for t in [*words, im_end]]
    output = SimpleNamespace(
        text="Hello there",
        logprobs=entries,
        delta_token_ids=[im_end],
        delta_text="",
        finished=True,
        finish_reason="stop",
        stop_reason=None,
    )
    for skip, expected in ((True, words), (False, [*words, im_end])):
        params = SamplingParams(logprobs=0, skip_special_tokens=skip)
        job = GenerationJob("chatcmpl-x", None, [1], params, 0, 0.0, None, False, False)
        shape = ChatShape(openai_server, job, True)
        content = shape.final_choice(output)["logprobs"]["content"]
        assert [bytes(c["bytes"]) for c in content] == [tokenizer.token_bytes(t) for t in expected]
        last = shape.delta_choice(output)["logprobs"]
        assert (last is None) if skip else len(last["content"]) == 1
