"""Property-based fuzzing of every endpoint from the server's own OpenAPI schema (tiny model).

`from_schema` below turns each request-body schema into a hypothesis generator of bodies the
schema allows (it covers the part of JSON Schema that pydantic emits; hypothesis-jsonschema
0.23.1 does not run on this hypothesis, and schemathesis brings a large dependency tree); a
second generator breaks one field of such a body (any JSON value in its place), and a third
sends arbitrary JSON. Whatever arrives, the server must answer below 500, in OpenAI's
error shape when it refuses, with a complete stream when it streams, and be idle afterwards
(no request left running, no KV block held).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import API_KEY, AUTH, wait_until_idle

from engine.core import EngineConfig, EngineCore
from engine.entrypoints.llm import AsyncLLM
from engine.entrypoints.server.app import build_app, start_server_in_thread

# About 300 cases: 30-60 s on a busy 2-core machine, hence `slow` (not for quick runs).
pytestmark = pytest.mark.slow

POST_PATHS = ("/v1/completions", "/v1/chat/completions")
GET_PATHS = ("/health", "/metrics", "/v1/models", "/openapi.json", "/docs")
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # A short context keeps every generated answer short (the default max_tokens is capped by it).
    llm = AsyncLLM(
        EngineCore(
            EngineConfig(
                model=tiny_model_dir,
                device="cpu",
                dtype="float32",
                num_kv_blocks=64,
                max_model_len=128,
            )
        )
    )
    with start_server_in_thread(build_app(llm, api_key=API_KEY)) as handle:
        with httpx.Client(base_url=handle.url, headers=AUTH, timeout=60) as http:
            handle.http = http
            yield handle
        assert httpx.get(f"{handle.url}/health").status_code == 200
        values = wait_until_idle(handle)
        assert values["vllm:kv_cache_usage_perc"] == 0.0
        assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0
    llm.shutdown()


def openapi_schema() -> dict:
    """The server's own OpenAPI document (the app is built without an engine: routes only)."""
    from fastapi import FastAPI

    from engine.entrypoints.server.app import router

    app = FastAPI()
    app.include_router(router)
    return app.openapi()


SCHEMA = openapi_schema()


def body_schema(path: str) -> dict:
    return SCHEMA["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


# Values the schema allows but the server refuses anyway (n > 1, penalties, min_tokens above the
# clamped max_tokens, token ids outside the vocabulary) would turn most generated bodies into
# 400s; these fields also draw from servable values, so that most bodies reach the engine.
SERVABLE = {
    "n": st.just(1),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0),
    "min_tokens": st.integers(0, 2),
    "prompt": st.text(max_size=30) | st.lists(st.integers(0, 49151), min_size=1, max_size=8),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
}


ABSENT = object()  # an optional field left out (drawn about half the time)


def integers(low: float | None, high: float | None) -> st.SearchStrategy:
    """Integers in [low, high], with the boundaries and other classic troublemakers drawn often."""
    low = None if low is None else int(low)
    high = None if high is None else int(high)
    edges = [low, high, -1, 0, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**64 - 1]
    inside = [
        e
        for e in edges
        if e is not None and (low is None or e >= low) and (high is None or e <= high)
    ]
    return st.sampled_from(inside) | st.integers(low, high)


def numbers(low: float | None, high: float | None, exclusive_low: bool) -> st.SearchStrategy:
    """Floats (and ints) in range, with the tiny, huge and boundary values drawn often."""
    edges = [low, high, 5e-324, 1e-46, 1e-40, 1e-8, 0.009, 0.5, 1.0, 1 - 1e-16]
    inside = [
        e
        for e in edges
        if e is not None
        and (low is None or e > low or (e == low and not exclusive_low))
        and (high is None or e <= high)
    ]
    floats = st.floats(low, high, exclude_min=exclusive_low, allow_nan=False, allow_infinity=False)
    return (
        st.sampled_from(inside)
        | floats
        | integers(
            None
            if low is None
            else (int(low) + 1 if exclusive_low or low != int(low) else int(low)),
            high,
        )
    )


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values that `schema` allows, for the JSON Schema subset pydantic writes into OpenAPI."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(SCHEMA["components"]["schemas"][name]))
    if "anyOf" in schema:
        return st.one_of([from_schema(option) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        exclusive = "exclusiveMinimum" in schema
        return numbers(
            schema.get("exclusiveMinimum", schema.get("minimum")), schema.get("maximum"), exclusive
        )
    if kind == "string":
        return st.text(max_size=min(schema.get("maxLength", 30), 30))
    if kind == "array":
        return st.lists(
            from_schema(schema.get("items", {})),
            min_size=schema.get("minItems", 0),
            max_size=min(schema.get("maxItems", 5), 5),
        )
    if kind == "object":
        required = set(schema.get("required", ()))
        fields = {}
        for name, sub in schema.get("properties", {}).items():
            values = SERVABLE.get(name, st.nothing()) | from_schema(sub)
            fields[name] = values if name in required else st.just(ABSENT) | values
        return st.fixed_dictionaries(fields).map(
            lambda body: {k: v for k, v in body.items() if v is not ABSENT}
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON_VALUES  # no constraint: anything


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def valid_bodies(path: str) -> st.SearchStrategy:
    return from_schema(body_schema(path))


def broken_bodies(path: str) -> st.SearchStrategy:
    """A schema-valid body with one field (known or not) replaced by any JSON value."""
    fields = sorted(
        SCHEMA["components"]["schemas"][
            "CompletionRequest" if "chat" not in path else "ChatCompletionRequest"
        ]["properties"]
    )
    return st.builds(
        lambda body, key, value: {**body, key: value},
        valid_bodies(path),
        st.sampled_from(fields) | st.text(max_size=12),
        JSON_VALUES,
    )


def short(body):
    """Keep answers short so a few hundred cases run in seconds (a bound, not a value change
    for the checks: the server sees an ordinary max_tokens)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = min(body[key], 3)
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 2
    return body


def check_response(server, path: str, body) -> None:
    with server.http.stream("POST", path, content=json.dumps(body).encode()) as response:
        raw = response.read()
    assert response.status_code < 500, (body, raw[:500])
    if response.status_code >= 400:
        error = json.loads(raw)
        assert set(error) == {"error"}
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert isinstance(error["error"]["message"], str) and error["error"]["message"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    else:
        answer = json.loads(raw)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", POST_PATHS)
@FUZZ
@given(data=st.data())
def test_schema_valid_bodies_never_get_a_5xx(server, path, data):
    check_response(server, path, short(data.draw(valid_bodies(path))))


@pytest.mark.parametrize("path", POST_PATHS)
@settings(FUZZ, max_examples=50)
@given(data=st.data())
def test_broken_bodies_get_a_4xx_in_openai_shape(server, path, data):
    check_response(server, path, short(data.draw(broken_bodies(path))))


@pytest.mark.parametrize("path", POST_PATHS)
@settings(FUZZ, max_examples=25)
@given(body=JSON_VALUES)
def test_any_json_never_gets_a_5xx(server, path, body):
    check_response(server, path, body)


@settings(FUZZ, max_examples=20)
@given(
    path=st.sampled_from(GET_PATHS),
    authorization=st.none()
    | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip),
)
def test_get_endpoints_with_any_authorization(server, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    response = httpx.get(f"{server.url}{path}", headers=headers, timeout=30)
    assert response.status_code in (200, 401), response.text
    if response.status_code == 401:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
