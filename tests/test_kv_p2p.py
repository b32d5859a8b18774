"""Prefill → decode across processes (engine/worker/kv_p2p.py): the K/V crosses a two-rank gloo
group between two processes on 127.0.0.1, arrives bit for bit, and a killed peer gives a clear
error within a deadline instead of a hang."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from engine.utils import free_port
from engine.worker.kv_p2p import KVTransferError, P2pGlooChannel, parse_peer

DEADLINE_S = 30.0

PRODUCER = textwrap.dedent(
    """
    import sys, time, torch
    from engine.worker.kv_p2p import P2pGlooChannel
    channel = P2pGlooChannel("kv_producer", "127.0.0.1", int(sys.argv[1]), send_timeout_s=20)
    torch.manual_seed(0)
    channel.send("req-a", torch.randn(2, 3, 4, 8), 5)
    channel.send("req-b", torch.randn(4, 16).to(torch.bfloat16), 9)
    channel.send("req-drop", torch.zeros(8), 1)
    channel.send("req-big", torch.zeros(1024), 1)
    print("sent", flush=True)
    time.sleep(60)
    """
)


def expected() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(2, 3, 4, 8), torch.randn(4, 16).to(torch.bfloat16)


@pytest.fixture
def producer_port():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc, port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_kv_crosses_processes_and_a_killed_producer_fails_the_wait(producer_port):
    proc, port = producer_port
    consumer = P2pGlooChannel(
        "kv_consumer", "127.0.0.1", port, connect_timeout_s=DEADLINE_S, buffer_bytes=2048
    )
    try:
        kv_a, kv_b = expected()
        got_a, tokens_a = consumer.recv("req-a", timeout_s=DEADLINE_S)
        got_b, tokens_b = consumer.recv("req-b", timeout_s=DEADLINE_S)
        assert (tokens_a, tokens_b) == (5, 9)
        assert got_a.dtype == torch.float32 and torch.equal(got_a, kv_a)
        assert got_b.dtype == torch.bfloat16 and torch.equal(got_b, kv_b)
        assert proc.stdout.readline().strip() == "sent"
        assert consumer.has("req-drop") and consumer.stats()["buffered_bytes"] == 32
        consumer.discard("req-drop")  # a key the consumer will not load frees its space
        assert not consumer.has("req-drop") and consumer.stats()["buffered_bytes"] == 0
        with pytest.raises(KVTransferError, match="dropped: 4096 bytes exceed"):
            consumer.recv("req-big", timeout_s=DEADLINE_S)  # over the 2 KiB buffer
        with pytest.raises(KVTransferError, match="did not arrive within 0.2 s"):
            consumer.recv("never-sent", timeout_s=0.2)
        assert consumer.stats()["connected"]
        proc.kill()
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="KV producer at 127.0.0.1:.* is gone"):
            consumer.recv("req-c", timeout_s=DEADLINE_S)
        assert time.monotonic() - start < DEADLINE_S / 2  # the death is seen, not waited out
        with pytest.raises(KVTransferError, match="is gone"):  # and later calls fail at once
            consumer.recv("req-d", timeout_s=DEADLINE_S)
        assert consumer.stats()["error"]
    finally:
        consumer.close()


CONSUMER = textwrap.dedent(
    """
    import sys, time
    from engine.worker.kv_p2p import P2pGlooChannel
    channel = P2pGlooChannel("kv_consumer", "127.0.0.1", int(sys.argv[1]))
    kv, num_tokens = channel.recv("req-a", timeout_s=30)
    print(f"got {kv.sum().item():g} {num_tokens}", flush=True)
    time.sleep(60)
    """
)


def test_a_killed_consumer_fails_the_producers_next_send_at_once():
    port = free_port()
    producer = P2pGlooChannel("kv_producer", "127.0.0.1", port, send_timeout_s=DEADLINE_S)
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        producer.send("req-a", torch.ones(3, 4), 7)
        assert consumer.stdout.readline().strip() == "got 12 7"
        consumer.kill()
        consumer.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="KV consumer at 127.0.0.1:.* failed"):
            for _ in range(3):  # the first send may still fit the closed socket's buffer
                producer.send("req-b", torch.ones(3, 4), 7)
                time.sleep(0.2)
        assert time.monotonic() - start < DEADLINE_S / 2
        assert producer.stats()["error"]
    finally:
        consumer.kill()
        producer.close()


OPEN_AT_EXIT = textwrap.dedent(
    """
    import torch
    from engine.utils import free_port
    from engine.worker.kv_p2p import P2pGlooChannel
    port = free_port()
    consumer = P2pGlooChannel("kv_consumer", "127.0.0.1", port)
    producer = P2pGlooChannel("kv_producer", "127.0.0.1", port)
    producer.send("k", torch.ones(2), 1)
    assert consumer.recv("k", timeout_s=30)[1] == 1
    print("connected", flush=True)
    """
)


def test_a_process_leaving_with_its_channels_open_exits_cleanly():
    """The listener still waits in its gloo group at interpreter exit: without the exit hook
    that closes open channels the process ends in std::terminate (status 134)."""
    done = subprocess.run(
        [sys.executable, "-c", OPEN_AT_EXIT], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip()) == (0, "connected"), done.stderr[-2000:]


def test_a_producer_with_no_consumer_fails_its_send_and_parse_peer_checks():
    producer = P2pGlooChannel(
        "kv_producer", "127.0.0.1", free_port(), connect_timeout_s=0.5, send_timeout_s=1
    )
    try:
        with pytest.raises(KVTransferError, match="KV consumer at 127.0.0.1:.*"):
            producer.send("req", torch.ones(4), 1)
    finally:
        producer.close()
    assert parse_peer("127.0.0.1:5000") == ("127.0.0.1", 5000)
    for bad in ("localhost", "host:x", "host:0", ":80"):
        with pytest.raises(ValueError, match="--kv-peer"):
            parse_peer(bad)


def test_the_proxy_names_an_unreachable_or_wrong_upstream_and_serve_checks_its_kv_flags():
    """OpenAI-shaped 502s naming the server, never a hang; --kv-role and --kv-peer together."""
    import httpx

    from engine.entrypoints.cli import build_parser, engine_config
    from engine.entrypoints.disagg_proxy import build_proxy_app
    from engine.entrypoints.server.app import start_server_in_thread

    closed = f"http://127.0.0.1:{free_port()}"
    not_a_producer = start_server_in_thread(_plain_upstream())
    producer = start_server_in_thread(_plain_upstream({"remote_request_id": "a", "num_tokens": 2}))
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    cases = (
        (closed, closed, "upstream_unreachable"),  # the prefill server is named
        (not_a_producer.url, not_a_producer.url, "not_a_kv_producer"),
        (producer.url, closed, "upstream_unreachable"),  # the decode server is named
    )
    try:
        for prefill, named, code in cases:
            with start_server_in_thread(build_proxy_app(prefill, closed)) as proxy:
                reply = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
                assert reply.status_code == 502
                error = reply.json()["error"]
                assert error["code"] == code and named in error["message"], error
                assert httpx.get(f"{proxy.url}/health", timeout=30).status_code == 503
    finally:
        not_a_producer.stop()
        producer.stop()
    serve = ["serve", "--kv-role", "kv_consumer"]
    with pytest.raises(ValueError, match="--kv-role and --kv-peer go together"):
        engine_config(build_parser().parse_args(serve))
    args = build_parser().parse_args(serve + ["--kv-peer", "127.0.0.1:29999"])
    config = engine_config(args).kv_transfer_config
    assert (config.kv_connector, config.kv_role) == ("P2pGlooConnector", "kv_consumer")
    assert config.kv_connector_extra_config == {"kv_peer": "127.0.0.1:29999"}
    assert engine_config(build_parser().parse_args(["serve"])).kv_transfer_config is None


def _plain_upstream(kv_transfer_params: dict | None = None):
    """A server that answers completions, with these kv_transfer_params (a kv_producer's) or
    none (not a kv_producer)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        params = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {}
        return {"choices": [{"text": "x"}], **params}

    return app


def _serve(model_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    """`python -m engine serve` on the tiny model, on 127.0.0.1; its URL once /health is 200."""
    import httpx

    port = free_port()
    command = [
        sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--device", "cpu",
        "--kernels", "torch", "--num-kv-blocks", "32", "--max-model-len", "128",
        "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning", *flags,
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.3)
    server.kill()
    raise AssertionError(f"serve {flags} did not start: {server.stderr.read().decode()[-2000:]}")


BODY = {"model": "tiny", "max_tokens": 12, "temperature": 0}
PROMPTS = ["The engine schedules every request", "Blocks of sixteen tokens hold the K/V"]


@contextlib.contextmanager
def _pair(model_dir):
    """A kv_producer and a kv_consumer `serve` process and the proxy in front of them:
    ((producer, consumer) processes, prefill URL, decode URL, proxy URL); every process killed
    at the end."""
    from engine.entrypoints.disagg_proxy import build_proxy_app
    from engine.entrypoints.server.app import start_server_in_thread

    peer = f"127.0.0.1:{free_port()}"
    servers = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            servers.append(_serve(model_dir, "--kv-role", role, "--kv-peer", peer))
        (producer, prefill_url), (consumer, decode_url) = servers
        with start_server_in_thread(build_proxy_app(prefill_url, decode_url)) as proxy:
            yield (producer, consumer), prefill_url, decode_url, proxy.url
    finally:
        for server, _ in servers:
            server.kill()
            server.wait(timeout=10)


def _one_engine(model_dir) -> dict[str, str]:
    """The greedy texts of PROMPTS from one engine, in this process."""
    from engine.core import EngineConfig, EngineCore
    from engine.sampling_params import SamplingParams
    from tests._tiny import run_engine

    config = EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=32, max_model_len=128, kernels="torch"
    )
    engine = EngineCore(config)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0), prompt)
    return {rid: out.text for rid, out in run_engine(engine)[1].items()}


def _check_through_proxy(proxy_url: str, expected: dict[str, str]) -> None:
    """Both prompts through the proxy (one whole, one streamed) give one engine's text; the
    consumer loaded every prompt token but the last (computed to sample the first token)."""
    import httpx

    reply = httpx.post(
        f"{proxy_url}/v1/completions", json={**BODY, "prompt": PROMPTS[0]}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == expected[PROMPTS[0]]
    usage = reply.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert _stream_text(proxy_url, {**BODY, "prompt": PROMPTS[1]}) == expected[PROMPTS[1]]


@pytest.mark.slow  # two engine processes and a proxy: 6-20 s on two shared cores
def test_prefill_and_decode_servers_through_the_proxy_equal_one_engine(tiny_model_dir):
    """Greedy text through kv_producer → kv_consumer equals one engine's; then the producer is
    killed: the proxy answers a 502 naming it, and the consumer still serves (a request whose
    K/V can no longer come is recomputed, same text), within a deadline, no hang; SIGTERM stops
    the consumer as it stops any server."""
    import httpx

    expected = _one_engine(tiny_model_dir)
    with _pair(tiny_model_dir) as ((producer, consumer), prefill_url, decode_url, proxy_url):
        _check_through_proxy(proxy_url, expected)
        producer.kill()
        producer.wait(timeout=10)
        start = time.monotonic()
        reply = httpx.post(
            f"{proxy_url}/v1/completions", json={**BODY, "prompt": PROMPTS[0]}, timeout=60
        )
        assert reply.status_code == 502 and prefill_url in reply.json()["error"]["message"]
        stale = {"remote_request_id": "cmpl-gone", "num_tokens": 5}
        reply = httpx.post(
            f"{decode_url}/v1/completions",
            json={**BODY, "prompt": PROMPTS[1], "kv_transfer_params": stale},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected[PROMPTS[1]]
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert time.monotonic() - start < DEADLINE_S
        consumer.terminate()  # stops as serve does: 128 + SIGTERM, not std::terminate's 134
        assert consumer.wait(timeout=DEADLINE_S) == 143


@pytest.mark.slow  # the real model in two server processes
def test_the_real_model_through_prefill_and_decode_servers_equals_one_engine(default_model_dir):
    expected = _one_engine(default_model_dir)
    with _pair(default_model_dir) as (_, _, _, proxy_url):
        _check_through_proxy(proxy_url, expected)


def _stream_text(url: str, body: dict) -> str:
    import json

    import httpx

    text = ""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text
