"""Structured outputs at the API (issue 36): OpenAI's response_format (json_object, json_schema)
and vLLM's structured_outputs (choice, regex, json, grammar) on both endpoints; a constraint the
backend refuses gets a 400 naming it; hostile schemas and regexes get a bounded 400 while another
client is served; the openai client's `parse()` returns a parsed object (@slow, real model).
A real uvicorn on 127.0.0.1, as in tests/test_server.py."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine.core import EngineConfig, EngineCore
from engine.entrypoints.llm import AsyncLLM
from engine.entrypoints.server.app import build_app, start_server_in_thread

CHAT = [{"role": "user", "content": "Describe a pet."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["kind", "age"],
    "additionalProperties": False,
}
DEADLINE_S = 15.0  # generous: a refused constraint costs milliseconds to a fraction of a second


def serve(model_dir, **overrides):
    config = dict(model=model_dir, device="cpu", dtype="float32", max_model_len=512)
    llm = AsyncLLM(EngineCore(EngineConfig(**{"num_kv_blocks": 64, **config, **overrides})))
    return llm, start_server_in_thread(build_app(llm))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    llm, handle = serve(tiny_model_dir)
    with handle:
        yield handle
    llm.shutdown()


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def chat(server, **body) -> httpx.Response:
    body = {"messages": CHAT, "max_tokens": 48, "temperature": 0, **body}
    return post(server, "/v1/chat/completions", body)


def completion(server, **body) -> httpx.Response:
    body = {"prompt": "The answer is", "max_tokens": 48, "temperature": 0, **body}
    return post(server, "/v1/completions", body)


def error_of(response: httpx.Response, param: str) -> str:
    """OpenAI's error shape with a 400 naming `param`; the message."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error["message"]


def test_constraints_on_both_endpoints_and_their_errors(server):
    """Each kind of constraint shapes the answer and ends it with "stop"; what the backend
    cannot compile, or a request that asks twice, gets a 400 naming the field."""
    answer = completion(server, structured_outputs={"choice": ["yes", "no"]}).json()["choices"][0]
    assert answer["text"] in ("yes", "no") and answer["finish_reason"] == "stop"
    answer = completion(server, structured_outputs={"regex": r"\d{2}-[ab]"}).json()["choices"][0]
    assert re.fullmatch(r"[0-9]{2}-[ab]", answer["text"]) and answer["finish_reason"] == "stop"
    grammar = 'root ::= "(" [0-9] ")"'
    message = chat(server, structured_outputs={"grammar": grammar}).json()["choices"][0]
    assert re.fullmatch(r"\([0-9]\)", message["message"]["content"])
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for response in (
        chat(server, response_format=response_format, max_tokens=320),  # bounded whitespace
        completion(server, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
    ):
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert choice["finish_reason"] == "stop"

    both = chat(server, response_format={"type": "json_object"}, structured_outputs={"regex": "a"})
    assert "not both" in error_of(both, "response_format")
    assert "regex cannot be compiled" in error_of(
        completion(server, structured_outputs={"regex": "(unclosed"}), "structured_outputs"
    )
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    assert "cannot be compiled" in error_of(
        chat(server, response_format=bad_schema), "response_format"
    )
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert "json_schema.schema" in error_of(
        chat(server, response_format=no_schema), "response_format"
    )
    assert "exactly one" in error_of(
        completion(server, structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"
    )


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_hostile_constraints_get_a_bounded_400_while_another_client_is_served(server):
    """Deep nesting, a huge enum, nested counted repetitions in a regex: each a 400 within the
    deadline, while a long request of another client runs to its end."""
    result = {}
    normal = threading.Thread(
        target=lambda: result.setdefault("r", chat(server, max_tokens=64, ignore_eos=True))
    )
    normal.start()
    hostile = [
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "deep", "schema": deep_schema(80)},
                }
            },
        ),  # fmt: skip
        ("structured_outputs", {"structured_outputs": {"json": {"enum": list(range(20_000))}}}),
        ("structured_outputs", {"structured_outputs": {"regex": "((((a{100}){100}){100}){100})"}}),
        ("structured_outputs", {"structured_outputs": {"choice": ["x"] * 5000}}),
    ]
    why = ["cannot be compiled: recursion", "at most 65536", "too many expressions", "at most 1024"]
    for (param, body), reason in zip(hostile, why):
        start = time.monotonic()
        assert reason in error_of(chat(server, **body), param)
        assert time.monotonic() - start < DEADLINE_S
    normal.join(120)
    answer = result["r"].json()
    assert answer["usage"]["completion_tokens"] == 64, answer


class Pet(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)


@pytest.mark.slow
def test_openai_parse_returns_a_parsed_object(default_model_dir):
    """The official client's `chat.completions.parse(response_format=PydanticModel)` against
    the real model: a Pet instance; json_object gives a JSON object."""
    llm, handle = serve(default_model_dir, num_kv_blocks=64)
    with handle, openai.OpenAI(base_url=handle.base_url, api_key="x", max_retries=0) as client:
        messages = [{"role": "user", "content": "Invent a pet with a name and an age."}]
        completion = client.chat.completions.parse(
            model=default_model_dir.name,
            messages=messages,
            response_format=Pet,
            temperature=0,
            max_tokens=80,
        )
        assert isinstance(completion.choices[0].message.parsed, Pet)
        reply = client.chat.completions.create(
            model=default_model_dir.name,
            messages=messages,
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=80,
        )
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    llm.shutdown()
