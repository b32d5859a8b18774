"""Chapter 14 · streaming: the same request streamed and whole, one at a time on an idle server;
and a live stream the learner disconnects mid-answer, with /metrics watched until the server has
freed it (no Streamlit here)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd

from ui.experiments.ch14 import CHOICES
from ui.experiments.ch14_client import (
    ClientResult,
    chunk_text,
    request_body,
    run_with_ticks,
    send_request,
)
from ui.experiments.ch14_server import MetricsSample, fetch_metrics, samples_table
from ui.experiments.common import _r

# The streaming comparison sends at least STREAM_MIN_TOKENS tokens, STREAM_REPEATS tries per mode.
STREAM_MIN_TOKENS, STREAM_REPEATS = 16, 3

# -- streaming vs non-streaming ----------------------------------------------------------------


def stream_vs_nonstream(
    url: str,
    prompt,
    max_tokens: int,
    repeats: int = 3,
    on_tick: Callable[[dict], None] | None = None,
) -> pd.DataFrame:
    """The same request (greedy, exactly max_tokens tokens) sent with stream=True and
    stream=False, alternately, one at a time on an idle server. Rows: one per try, with the time
    to the first visible text and the time to the whole answer (client side, ms)."""
    progress = {"done": 0, "total": 2 * repeats}

    async def run() -> list[ClientResult]:
        import httpx

        out = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5.0)) as client:
            for i in range(repeats):
                for stream in (True, False) if i % 2 == 0 else (False, True):
                    r = ClientResult(len(out), 0.0, stream)
                    t0 = time.perf_counter()
                    await send_request(client, url, request_body(prompt, max_tokens, stream), t0, r)
                    out.append(r)
                    progress["done"] += 1
        return out

    results = run_with_ticks(run, (lambda: on_tick(progress)) if on_tick else None)
    rows = []
    for r in results:
        rows.append(
            {
                "방식": "스트리밍 (stream=true)" if r.stream else "비스트리밍 (stream=false)",
                "시도": r.index + 1,
                "첫 글자가 보이기까지 (ms)": _r(
                    None if r.first_visible_s is None else 1000 * r.first_visible_s
                ),
                "전체 답 (E2E, ms)": _r(None if r.e2e_s is None else 1000 * r.e2e_s),
                "조각 수": len(r.chunk_times),
                "글자 수": len(r.text),
                "상태": r.state,
                "_text": r.text,
            }
        )
    return pd.DataFrame(rows)


def stream_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Medians per mode, and whether both modes returned the same text (the same request)."""
    cols = ["첫 글자가 보이기까지 (ms)", "전체 답 (E2E, ms)"]
    med = table.groupby("방식", sort=False)[cols].median().round(1).reset_index()
    return med


STREAM_RULE = (
    "두 범위가 겹치면 차이는 이 기계의 측정 잡음 안에 있다고 보고 '비슷하다', 겹치지 않으면 "
    "스트리밍의 범위가 통째로 위에 있을 때 '늘어난다', 아래에 있을 때 '줄어든다'로 판정합니다."
)


def ranges_verdict(streamed: Sequence[float], whole: Sequence[float]) -> str | None:
    """STREAM_RULE on two sets of E2E tries: '비슷하다' when their [min, max] ranges overlap,
    else '늘어난다' / '줄어든다' as streaming's whole range lies above / below non-streaming's."""
    if not len(streamed) or not len(whole):
        return None
    if min(streamed) > max(whole):
        return CHOICES[2]
    if max(streamed) < min(whole):
        return CHOICES[0]
    return CHOICES[1]


def stream_e2e_verdict(table: pd.DataFrame) -> str | None:
    """Streaming's E2E against non-streaming's over the tries of stream_vs_nonstream, by
    STREAM_RULE (the rule the page states beside the ranges)."""
    col = "전체 답 (E2E, ms)"
    streamed = table.loc[table["방식"].str.startswith("스트리밍"), col].dropna()
    whole = table.loc[table["방식"].str.startswith("비스트리밍"), col].dropna()
    return ranges_verdict(streamed.tolist(), whole.tolist())


# -- a live stream the learner disconnects ---------------------------------------------------


class BackgroundStream:
    """One streamed completion read in a background thread (its own event loop), so that it
    outlives a Streamlit rerun. disconnect() cancels the read at once, which closes the
    connection mid-stream (as a closing browser tab would); the server then aborts the request
    and frees its KV blocks. The thread ends by itself when the answer is complete, and at the
    latest after `max_s` seconds."""

    def __init__(self, url: str, body: dict, max_s: float = 60.0):
        self.url, self.body, self.max_s = url, dict(body, stream=True), max_s
        self.chunks: list[tuple[float, str]] = []  # (s since send, text)
        self.status: int | None = None
        self.finished = False
        self.disconnected = False
        self.error: str | None = None
        self.disconnect_s: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._ready = threading.Event()
        self._t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="ch14-stream", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import httpx

        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self._ready.set()
        try:
            async with asyncio.timeout(self.max_s):
                async with httpx.AsyncClient(timeout=httpx.Timeout(self.max_s, connect=5)) as c:
                    async with c.stream("POST", f"{self.url}/v1/completions", json=self.body) as r:
                        self.status = r.status_code
                        if r.status_code != 200:
                            self.error = f"HTTP {r.status_code}"
                            return
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line[len("data: ") :]
                            if data == "[DONE]":
                                self.finished = True
                                return
                            text = chunk_text(json.loads(data))
                            if text:
                                self.chunks.append((time.perf_counter() - self._t0, text))
        except (asyncio.CancelledError, TimeoutError):  # disconnect() or max_s: connection closed
            self.disconnected = True
            self.disconnect_s = time.perf_counter() - self._t0
        except Exception as exc:  # noqa: BLE001 - shown to the learner as this stream's state
            self.error = type(exc).__name__

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)

    def disconnect(self, timeout: float = 10.0) -> bool:
        """Close the connection now. True if the stream was still live (it was cut)."""
        live = self.alive
        if live and self._ready.wait(5.0) and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._task.cancel)
            except RuntimeError:  # the loop closed meanwhile: the stream had ended
                pass
        self.thread.join(timeout)
        return live and self.disconnected


@dataclass
class DisconnectResult:
    cut: bool  # the stream was live and got cut
    chunks_before: int
    before: MetricsSample  # just before the disconnect
    after: list[MetricsSample]  # polled after it, until the server held no request
    freed_after_ms: float | None  # disconnect → first scrape with nothing running

    def table(self) -> pd.DataFrame:
        return samples_table([self.before, *self.after])


def disconnect_and_watch(
    url: str, stream: BackgroundStream, timeout_s: float = 5.0, poll_s: float = 0.05
) -> DisconnectResult:
    """Scrape /metrics, disconnect the stream, then scrape until no request runs or waits."""
    before = MetricsSample.of(0.0, fetch_metrics(url))
    t0 = time.perf_counter()
    chunks = len(stream.chunks)
    cut = stream.disconnect()
    after, freed = [], None
    while time.perf_counter() - t0 < timeout_s:
        sample = MetricsSample.of(time.perf_counter() - t0, fetch_metrics(url))
        after.append(sample)
        if sample.running == 0 and sample.waiting == 0:
            freed = 1000 * sample.t_s
            break
        time.sleep(poll_s)
    return DisconnectResult(cut, chunks, before, after, freed)
