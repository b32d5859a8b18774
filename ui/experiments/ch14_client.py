"""Chapter 14 · one simulated user: a /v1/completions request sent over real HTTP (httpx), its
chunks timed on the client's clock from the moment it was sent; and the thread runner that lets a
Streamlit page update its progress bar while the requests run (no Streamlit here)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ClientResult:
    """One simulated user's request, times in seconds from the measurement's start."""

    index: int
    arrival_s: float  # when it was due (Poisson)
    stream: bool = True
    sent_s: float | None = None
    status: int | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks (SSE events)
    chunk_texts: list[str] = field(default_factory=list)
    end_s: float | None = None
    finished: bool = False  # got the whole answer ([DONE] or the JSON body)
    cut: bool = False  # still open at the cap: its connection was closed
    error: str | None = None
    completion_tokens: int | None = None

    @property
    def first_visible_s(self) -> float | None:
        """Send → the first text the user could see (a streamed chunk, or the whole body)."""
        if self.sent_s is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        if self.sent_s is None or self.end_s is None or not self.finished:
            return None
        return self.end_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def text(self) -> str:
        return "".join(self.chunk_texts)

    @property
    def state(self) -> str:
        if self.error:
            return "오류"
        if self.cut:
            return "상한에서 끊음"
        return "완료" if self.finished else "미완료"


def request_body(prompt, max_tokens: int, stream: bool) -> dict:
    """A /v1/completions body: greedy, exactly max_tokens tokens (ignore_eos)."""
    return {
        "prompt": prompt,
        "max_tokens": int(max_tokens),
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": bool(stream),
    }


def chunk_text(payload: dict) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(client, url: str, body: dict, t0: float, result: ClientResult) -> None:
    """POST /v1/completions; fill `result` (chunk times on the client's clock)."""
    result.sent_s = time.perf_counter() - t0
    try:
        if body.get("stream"):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                result.status = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    result.error = f"HTTP {response.status_code}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    now = time.perf_counter() - t0
                    if data == "[DONE]":
                        result.finished = True
                        result.end_s = now
                        break
                    payload = json.loads(data)
                    if "error" in payload:
                        result.error = str(payload["error"].get("message", "error"))[:200]
                        return
                    text = chunk_text(payload)
                    if text:
                        result.chunk_times.append(now)
                        result.chunk_texts.append(text)
        else:
            response = await client.post(f"{url}/v1/completions", json=body)
            now = time.perf_counter() - t0
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return
            payload = response.json()
            result.chunk_times.append(now)
            result.chunk_texts.append(chunk_text(payload))
            result.completion_tokens = (payload.get("usage") or {}).get("completion_tokens")
            result.finished = True
            result.end_s = now
    except asyncio.CancelledError:
        result.cut = True
        result.end_s = time.perf_counter() - t0
        raise
    except Exception as exc:  # noqa: BLE001 - a transport error is this client's result
        result.error = type(exc).__name__


def run_with_ticks(
    coro_fn: Callable, on_tick: Callable[[], None] | None = None, interval: float = 0.1
):
    """Run a coroutine in its own thread (its own event loop) and call `on_tick` from the
    caller's thread every `interval` s until it ends: progress bars update in the caller's
    thread, where Streamlit allows it."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="ch14-measure", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(interval)
        if on_tick is not None:
            on_tick()
    if "error" in box:
        raise box["error"]
    return box["value"]
