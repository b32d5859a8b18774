"""The OpenAI-compatible server (engine/entrypoints/server/), tested as a client sees it.

A real uvicorn runs in a background thread on a free 127.0.0.1 port; tests talk to it with the
official `openai` package (non-empty api_key, max_retries=0) and, for raw HTTP details (malformed
JSON, dropped connections), with httpx. Answers are checked against `LLM.generate`'s greedy
output for the same prompt on a separately loaded engine. The tiny random model keeps this fast;
one slow test repeats the key check on the real SmolLM2 artifact.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core import EngineConfig, EngineCore
from engine.entrypoints.llm import LLM, AsyncLLM
from engine.entrypoints.server.app import build_app, start_server_in_thread
from engine.entrypoints.server.protocol import DEFAULT_MAX_TOKENS
from engine.sampling_params import SamplingParams

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPTS = [f"Request number {i}: tell me something about the number {i * 7}." for i in range(16)]
CHAT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is a KV cache?"},
]


# -- fixtures ----------------------------------------------------------------------------------


class StepLog:
    """A step listener: which requests each engine step scheduled; can also slow steps down."""

    def __init__(self):
        self.scheduled: list[list[str]] = []
        self.delay = 0.0
        self.lock = threading.Lock()

    def __call__(self, record):
        with self.lock:
            self.scheduled.append([s.request_id for s in record.scheduled])
        if self.delay:
            time.sleep(self.delay)

    def clear(self):
        with self.lock:
            self.scheduled.clear()


@pytest.fixture(scope="module")
def engine_kwargs(tiny_model_dir):
    # CPU and float32 on any machine: greedy answers must not depend on how requests were batched
    return dict(
        model=tiny_model_dir,
        device="cpu",
        dtype="float32",
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def step_log():
    return StepLog()


@pytest.fixture(scope="module")
def async_llm(engine_kwargs, step_log):
    llm = AsyncLLM(EngineCore(EngineConfig(**engine_kwargs)))
    llm.step_listeners.append(step_log)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(async_llm):
    handle = start_server_in_thread(build_app(async_llm, api_key=API_KEY))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(engine_kwargs):
    """A second, independent engine on the same artifact: the greedy reference."""
    return LLM(**engine_kwargs)


@pytest.fixture(scope="module")
def model_name(tiny_model_dir):
    return tiny_model_dir.name


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture()
def step_delay(step_log):
    """Slow each engine step a little, so a long request is surely still running when we look."""
    step_log.delay = 0.003
    yield
    step_log.delay = 0.0


def greedy(reference: LLM, prompts: list[str], max_tokens: int) -> list[str]:
    outs = reference.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    return [o.text for o in outs]


def greedy_chat(reference: LLM, messages: list[dict], max_tokens: int) -> str:
    return reference.chat(
        [messages], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )[0].text


def scrape(server) -> dict[str, float]:
    """/metrics as {sample name: value} (labels dropped; one model per server)."""
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") or "finished_reason" in sample.labels:
                continue
            values[sample.name] = sample.value
    return values


def wait_until_idle(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = scrape(server)
        idle = (
            values["vllm:kv_cache_usage_perc"] == 0.0
            and values["vllm:num_requests_running"] == 0
            and values["vllm:num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


# -- the happy paths ---------------------------------------------------------------------------


def test_health_and_models(server, client, model_name, tiny_model_dir):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    # the served name is the artifact directory's name; the full path is not accepted (it would
    # let a client confirm a guessed path)
    out = client.completions.create(model=model_name, prompt="Hi", max_tokens=2, temperature=0)
    assert out.model == model_name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=str(tiny_model_dir), prompt="Hi", max_tokens=2)


def test_completions_streamed_equals_non_streamed_equals_greedy(client, reference, model_name):
    prompt = "The three parts of an inference server are"
    (expected,) = greedy(reference, [prompt], 24)
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0)
    assert full.object == "text_completion"
    assert full.choices[0].text == expected
    assert full.usage.completion_tokens <= 24
    assert full.usage.prompt_tokens == len(reference.get_tokenizer().encode(prompt))

    stream = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_streamed_equals_non_streamed_equals_greedy(client, reference, model_name):
    expected = greedy_chat(reference, CHAT, 32)
    full = client.chat.completions.create(
        model=model_name, messages=CHAT, max_completion_tokens=32, temperature=0
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == expected

    stream = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_without_usage_and_raw_sse_format(server, model_name):
    body = {
        "model": model_name,
        "prompt": "Hello",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert all("usage" not in c for c in chunks)  # include_usage not asked for
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_sixteen_concurrent_streaming_clients_are_batched(server, reference, step_log, model_name):
    max_tokens = 32
    expected = greedy(reference, PROMPTS, max_tokens)

    async def one(client, prompt):
        stream = await client.completions.create(
            model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        request_id, parts, finish = None, [], None
        async for chunk in stream:
            request_id = chunk.id
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return request_id, "".join(parts), finish

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60
        ) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    step_log.clear()
    results = asyncio.run(main())
    assert [text for _, text, _ in results] == expected
    assert all(finish in ("stop", "length") for _, _, finish in results)
    ids = {request_id for request_id, _, _ in results}
    assert len(ids) == 16
    together = max(len(ids.intersection(step)) for step in step_log.scheduled)
    assert together >= 2, "the concurrent requests never shared an engine step"
    assert together >= 8, f"only {together} of 16 concurrent requests ever shared a step"
    print(f"at most {together} of the 16 concurrent requests shared one engine step")


def test_sampling_parameters(client, reference, model_name):
    prompt = "Sampling parameters decide"
    (ref,) = greedy(reference, [prompt], 20)
    # stop strings cut the text (taken from the greedy answer, so one surely appears)
    stop = ref.strip()[3:6] if len(ref.strip()) >= 6 else None
    if stop:
        out = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=20, temperature=0, stop=[stop]
        )
        assert out.choices[0].text == ref[: ref.find(stop)]
        assert out.choices[0].finish_reason == "stop"
    # ignore_eos + max_tokens: exactly that many tokens, finish_reason "length"
    out = client.completions.create(
        model=model_name,
        prompt=prompt,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    # a seed makes sampling reproducible
    kwargs = dict(
        model=model_name,
        prompt=prompt,
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True},
    )
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b


def test_default_max_tokens_is_capped_by_the_context(client, model_name, reference):
    tokenizer = reference.get_tokenizer()
    per_word = len(tokenizer.encode("word " * 100)) / 100
    prompt = "word " * int((MAX_MODEL_LEN - DEFAULT_MAX_TOKENS // 2) / per_word)
    n = len(tokenizer.encode(prompt))
    assert 0 < MAX_MODEL_LEN - n < DEFAULT_MAX_TOKENS
    out = client.completions.create(
        model=model_name, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == n
    assert out.usage.completion_tokens == MAX_MODEL_LEN - n


def test_logprobs(client, model_name):
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        # greedy picks the most likely token: its logprob is the top one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.logprob <= 0.0

    comp = client.completions.create(
        model=model_name, prompt="Logprobs", max_tokens=5, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == comp.usage.completion_tokens
    )
    assert all(len(top) <= 2 for top in lp.top_logprobs)

    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        item
        for c in stream
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    assert [i.token for i in streamed] == [i.token for i in content]


# -- honest errors -----------------------------------------------------------------------------


def post(
    server, path: str, body=None, content: bytes | None = None, headers=AUTH
) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, content=content, headers=headers, timeout=30
    )


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ],
)
def test_bad_requests_get_400_in_openai_shape(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_malformed_json_is_400(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = assert_error(post(server, path, content=b'{"prompt": "hi", '), 400)
        assert "JSON" in error["message"]
    assert_error(post(server, "/v1/completions", content=b"[1, 2]"), 400)


def test_context_length_error_names_both_numbers(server, client, model_name, reference):
    prompt = "token " * 100
    n = len(reference.get_tokenizer().encode(prompt))
    error = assert_error(
        post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_MODEL_LEN}),
        400,
        "max_tokens",
    )
    assert str(n) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert error["code"] == "context_length_exceeded"
    # the prompt alone too long: named as the prompt's fault
    error = assert_error(
        post(server, "/v1/completions", {"prompt": "token " * 2000}), 400, "prompt"
    )
    assert str(MAX_MODEL_LEN) in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=MAX_MODEL_LEN)
    assert info.value.status_code == 400 and str(MAX_MODEL_LEN) in info.value.message
    error = assert_error(
        post(server, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5000}),
        400,
        "max_completion_tokens",
    )
    assert "5000" in error["message"]


def test_unknown_model_is_404(server, client):
    error = assert_error(
        post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "model"
    )
    assert "gpt-9" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)


def test_api_key_is_required(server, model_name):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 2}
    assert_error(post(server, "/v1/completions", body, headers={}), 401)
    assert_error(
        post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401
    )
    assert_error(
        post(
            server, "/v1/chat/completions", {"messages": CHAT}, headers={"Authorization": API_KEY}
        ),
        401,
    )
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    with openai.OpenAI(base_url=server.base_url, api_key="not-the-key", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=model_name, prompt="hi", max_tokens=2)
    # health stays open (a load balancer probes it); metrics and the API's docs follow the key
    assert httpx.get(f"{server.url}/health").status_code == 200
    for path in ("/metrics", "/openapi.json", "/docs"):
        assert_error(httpx.get(f"{server.url}{path}"), 401)
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200


def test_docs_and_metrics_can_be_opted_out_of_the_key(async_llm):
    app = build_app(async_llm, api_key=API_KEY, public_docs_and_metrics=True)
    with start_server_in_thread(app) as handle:
        for path in ("/metrics", "/openapi.json", "/docs"):
            assert httpx.get(f"{handle.url}{path}").status_code == 200
        assert_error(httpx.get(f"{handle.url}/v1/models"), 401)


def test_unknown_route_and_method_use_the_error_shape(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405)


def test_server_survives_errors(server, client, model_name):
    for _ in range(3):
        post(server, "/v1/completions", content=b"\xff\xfe not json")
        post(server, "/v1/chat/completions", {"messages": "not a list"})
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert client.completions.create(
        model=model_name, prompt="still there?", max_tokens=3
    ).usage.completion_tokens


def test_chat_content_parts_equal_plain_content(client, model_name):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is a "},
                {"type": "text", "text": "KV cache?"},
            ],
        }
    ]
    plain = [{"role": "user", "content": "What is a KV cache?"}]
    a, b = (
        client.chat.completions.create(model=model_name, messages=m, max_tokens=8, temperature=0)
        for m in (parts, plain)
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_engine_failure_is_reported_not_hidden(engine_kwargs, model_name):
    """If the engine loop dies, requests get a 5xx in the error shape and /health says so."""
    llm = AsyncLLM(EngineCore(EngineConfig(**engine_kwargs)))

    def explode():
        raise RuntimeError("simulated engine failure")

    llm.engine.step = (
        explode  # the loop's next step raises (a failing listener would only be logged)
    )
    try:
        with start_server_in_thread(build_app(llm, api_key=API_KEY)) as handle:
            body = {"model": model_name, "prompt": "hi", "max_tokens": 4}
            assert_error(post(handle, "/v1/completions", body), 500)
            with httpx.stream(
                "POST",
                f"{handle.url}/v1/completions",
                json={**body, "stream": True},
                headers=AUTH,
                timeout=30,
            ) as r:
                assert r.status_code == 503 or "error" in r.read().decode()
            assert_error(httpx.get(f"{handle.url}/health"), 503)
            assert_error(post(handle, "/v1/completions", body), 503)
    finally:
        llm.shutdown()


# -- clients that leave ------------------------------------------------------------------------


def test_client_dropping_mid_stream_aborts_and_frees_kv(server, async_llm, model_name, step_delay):
    body = {
        "model": model_name,
        "prompt": "Tell me a very long story.",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = []
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers=AUTH
        ) as response:
            assert response.status_code == 200
            lines = (
                response.iter_lines()
            )  # not a for loop: leaving one closes the connection (httpcore)
            while len(chunks) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
            request = async_llm.engine.get_request(chunks[0]["id"])
            assert request is not None and not request.is_finished
            assert scrape(server)["vllm:kv_cache_usage_perc"] > 0
            assert scrape(server)["vllm:num_requests_running"] == 1
            # the engine steps in its own thread: the event loop still answers at once
            t0 = time.perf_counter()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            assert time.perf_counter() - t0 < 1.0
            # the journey starts at HTTP arrival
            kinds = [e.kind for e in request.journey]
            assert kinds[:2] == ["arrival", "tokenized"] and "first_token" in kinds
        # leaving the block closes the connection mid-stream
    values = wait_until_idle(server)
    assert values["vllm:kv_cache_usage_perc"] == 0.0
    assert values["vllm:num_requests_running"] == 0
    request = async_llm.engine.get_request(chunks[0]["id"])
    assert request.finish_reason == "abort"
    assert request.num_output_tokens < 900


def test_client_dropping_non_streaming_request_aborts_it(server, async_llm, model_name, step_delay):
    before = {r.request_id for r in async_llm.engine.all_requests()}
    body = {
        "model": model_name,
        "messages": CHAT,
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=0.5)
    deadline = time.monotonic() + 10
    new = []
    while time.monotonic() < deadline:
        new = [r for r in async_llm.engine.all_requests() if r.request_id not in before]
        if new and all(r.is_finished for r in new):
            break
        time.sleep(0.05)
    assert len(new) == 1
    assert new[0].finish_reason == "abort" and new[0].num_output_tokens < 900
    assert wait_until_idle(server)["vllm:kv_cache_usage_perc"] == 0.0


# -- metrics -----------------------------------------------------------------------------------


def test_metrics_are_prometheus_text_with_vllm_names(server, client, model_name):
    client.completions.create(model=model_name, prompt="count me", max_tokens=4, temperature=0)
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_success",
    ):
        assert name in families, name
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:prompt_tokens"].type == "counter"
    values = scrape(server)
    assert values["vllm:prompt_tokens_total"] > 0 and values["vllm:generation_tokens_total"] > 0
    assert values["vllm:time_to_first_token_seconds_count"] > 0
    assert values["vllm:inter_token_latency_seconds_count"] > 0
    assert values["vllm:e2e_request_latency_seconds_count"] > 0
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"] >= 0
    assert 0.0 <= values["vllm:kv_cache_usage_perc"] <= 1.0
    labels = {
        s.labels.get("model_name")
        for f in families.values()
        for s in f.samples
        if "model_name" in s.labels
    }
    assert labels == {model_name}


def test_prefix_cache_hits_show_in_metrics(client, server, model_name):
    shared = "A long shared system prompt that many requests repeat word for word. " * 8
    before = scrape(server)
    for question in ("first?", "second?"):
        client.completions.create(
            model=model_name, prompt=shared + question, max_tokens=2, temperature=0
        )
    after = scrape(server)
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 16
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_several_servers_in_one_process_have_their_own_registries(async_llm):
    apps = [build_app(async_llm), build_app(async_llm)]
    try:
        texts = [app.state.server.metrics.render().decode() for app in apps]
        assert all("vllm:num_requests_running" in t for t in texts)
    finally:
        for app in apps:
            app.state.server.close()


# -- the command line --------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess that imports everything and loads a model: ~45 s under load
def test_cli_serve(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--num-kv-blocks",
        "32",
        "--max-model-len",
        "256",
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    from engine.entrypoints.cli import SERVE_API_KEY_ENV
    from engine.entrypoints.server.app import API_KEY_ENV

    assert SERVE_API_KEY_ENV == API_KEY_ENV == "LLM_LAB_API_KEY"
    env = {**os.environ, API_KEY_ENV: API_KEY}  # the key from the environment, not argv
    proc = subprocess.Popen(
        cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180  # a loaded 2-core box took over 90 s
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as c:
            assert [m.id for m in c.models.list().data] == [tiny_model_dir.name]
            out = c.chat.completions.create(model=tiny_model_dir.name, messages=CHAT, max_tokens=3)
            assert out.usage.completion_tokens <= 3
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the real model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_streamed_equals_non_streamed_equals_llm_generate(default_model_dir):
    llm = LLM(model=str(default_model_dir), dtype="float32")
    messages = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    prompt = "The capital of South Korea is"
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected_chat = llm.chat([messages], params, use_tqdm=False)[0].text
    expected_completion = llm.generate([prompt], params, use_tqdm=False)[0].text
    assert expected_chat.strip()
    async_llm = AsyncLLM(llm.engine)  # the same engine, now driven by the server's loop
    try:
        with start_server_in_thread(build_app(async_llm, api_key=API_KEY)) as handle:
            name = default_model_dir.name
            with openai.OpenAI(
                base_url=handle.base_url, api_key=API_KEY, max_retries=0, timeout=120
            ) as c:
                full = c.chat.completions.create(
                    model=name, messages=messages, max_tokens=40, temperature=0
                )
                streamed = "".join(
                    chunk.choices[0].delta.content or ""
                    for chunk in c.chat.completions.create(
                        model=name, messages=messages, max_tokens=40, temperature=0, stream=True
                    )
                    if chunk.choices
                )
                completion = c.completions.create(
                    model=name, prompt=prompt, max_tokens=40, temperature=0
                )
            assert full.choices[0].message.content == streamed == expected_chat
            assert completion.choices[0].text == expected_completion
    finally:
        async_llm.shutdown()
