"""Chapter 14 · the API server under load (no Streamlit here).

Two parts:

1. Prefill fairness on the engine clock: a long prompt first in line with short requests behind
   it, `long_prefill_token_threshold` 0 (off) vs a cap, under the same token budget.
2. The live server: the learner's own OpenAIServer (engine/server.py) in a background thread on
   127.0.0.1, driven over real HTTP by simulated users (httpx async clients, Poisson arrivals),
   with the server's own /metrics (Prometheus text) polled while they run. Every time here is
   wall-clock (time.perf_counter) on the client side, from the moment a request was sent; every
   measurement is bounded by a duration cap and a drain cap, and requests still open at the cap
   are cut (their connections closed, so the server aborts them and frees their blocks).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from ui.experiments.common import (
    ConfigLike,
    RequestSpec,
    RunResult,
    Workload,
    _r,
    make_config,
    run_workload,
)

# -- part 1: prefill fairness ----------------------------------------------------------------

LONG_NAME = "긴-프롬프트"
# The fairness lab's defaults: a 320-token prompt first in line, 3 short requests behind it, a
# token budget of 64, at most 4 running, the threshold 32 on one side and 0 (off) on the other.
FAIR_LONG, FAIR_SHORT, FAIR_BUDGET, FAIR_THRESHOLD, FAIR_SEQS = 320, 3, 64, 32, 4


def fairness_workload(
    long_prompt_len: int = 320,
    num_short: int = 3,
    short_prompt_len: int = 8,
    short_max_tokens: int = 8,
    short_arrival_ms: float = 0.0,
    long_max_tokens: int = 4,
) -> Workload:
    """A long prompt first in line, short requests right behind it (same or later arrival)."""
    specs = [RequestSpec(long_prompt_len, long_max_tokens, 0.0, LONG_NAME)]
    specs += [
        RequestSpec(short_prompt_len, short_max_tokens, short_arrival_ms, f"짧은-{i}")
        for i in range(num_short)
    ]
    return Workload(specs)


def fairness_label(threshold: int) -> str:
    return "임계값 끔 (0)" if threshold <= 0 else f"임계값 {threshold}"


def fairness_base(config: ConfigLike | None):
    """The sidebar's config with room for the longest prompt the lab offers (1,024 tokens)."""
    cfg = make_config(config)
    blocks = max(cfg.num_kv_blocks or 0, 1024 // cfg.block_size)
    return make_config(cfg, max_model_len=1024, num_kv_blocks=blocks)


def fairness_config(config: ConfigLike | None, threshold: int, budget: int, max_num_seqs: int):
    """One side's engine config: chunked prefill on, the same budget, the threshold varied."""
    return make_config(
        config,
        enable_chunked_prefill=True,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        long_prefill_token_threshold=max(int(threshold), 0),
    )


@dataclass
class FairnessComparison:
    runs: dict[str, RunResult]
    summary: pd.DataFrame


def first_short_step(res: RunResult, long_name: str = LONG_NAME) -> int | None:
    """The first step (1-based within the run) that scheduled any short request."""
    for n, rec in enumerate(res.records, start=1):
        if any(s.request_id != long_name for s in rec.scheduled):
            return n
    return None


def fairness_summary(runs: dict[str, RunResult], long_name: str = LONG_NAME) -> pd.DataFrame:
    """Per run (engine clock): the short requests' TTFT, the long one's TTFT and prefill steps,
    the first step a short request ran in, the largest prefill chunk of the long prompt."""
    rows = []
    for label, res in runs.items():
        t = res.request_table()
        is_long = t["request_id"] == long_name
        chunks = [
            s.num_tokens
            for rec in res.records
            for s in rec.scheduled
            if s.request_id == long_name and s.phase != "decode"
        ]
        rows.append(
            {
                "실행": label,
                "임계값 (long_prefill_token_threshold)": res.config.long_prefill_token_threshold,
                "토큰 예산": res.config.max_num_batched_tokens,
                "짧은 요청 TTFT 평균 (ms)": _r(t.loc[~is_long, "ttft_ms"].mean()),
                "짧은 요청 TTFT 최대 (ms)": _r(t.loc[~is_long, "ttft_ms"].max()),
                "짧은 요청이 처음 들어간 스텝": first_short_step(res, long_name),
                "긴 요청 TTFT (ms)": _r(t.loc[is_long, "ttft_ms"].max()) if is_long.any() else None,
                "긴 요청 prefill 스텝 수": len(chunks),
                "긴 요청 최대 조각 (토큰)": max(chunks) if chunks else 0,
                "전체 시간 (s)": round(res.elapsed_s, 3),
            }
        )
    return pd.DataFrame(rows)


def compare_fairness(
    config: ConfigLike | None,
    workload: Workload,
    budget: int,
    max_num_seqs: int,
    thresholds: Sequence[int] = (0, 32),
    engine_factory=None,
) -> FairnessComparison:
    """Run the workload once per threshold, all under the same token budget."""
    runs = {
        fairness_label(th): run_workload(
            fairness_config(config, th, budget, max_num_seqs),
            workload,
            fairness_label(th),
            engine_factory=engine_factory,
        )
        for th in thresholds
    }
    return FairnessComparison(runs, fairness_summary(runs))


CHOICES = ["줄어든다", "비슷하다", "늘어난다"]


def direction(new: float | None, old: float | None, tol: float = 0.2) -> str | None:
    """'줄어든다' / '비슷하다' / '늘어난다' for new relative to old (within ±tol: similar)."""
    if new is None or old is None:
        return None
    if old <= 0:
        return CHOICES[1] if new <= 0 else CHOICES[2]
    ratio = new / old
    if ratio < 1 - tol:
        return CHOICES[0]
    if ratio > 1 + tol:
        return CHOICES[2]
    return CHOICES[1]


# -- part 2: the live server -----------------------------------------------------------------

# The server lab's defaults: its engine (max_num_seqs, KV blocks) and the requests' sizes; the
# streaming comparison sends at least STREAM_MIN_TOKENS tokens, STREAM_REPEATS tries per mode.
SERVER_SEQS, SERVER_BLOCKS, LOAD_PROMPT_LEN, LOAD_MAX_TOKENS = 4, 48, 32, 8
STREAM_MIN_TOKENS, STREAM_REPEATS = 16, 3


def server_overrides(seqs: int = SERVER_SEQS, blocks: int = SERVER_BLOCKS) -> dict:
    """EngineConfig overrides of the live server's engine."""
    return dict(
        max_num_seqs=int(seqs),
        num_kv_blocks=int(blocks),
        max_model_len=512,
        max_num_batched_tokens=128,
        enable_prefix_caching=False,
    )


IDLE_STOP_S = 600.0  # a server nobody used for this long stops itself (an abandoned tab)


@dataclass
class LiveServer:
    """The learner's OpenAIServer in a uvicorn thread (engine/server.py's ServerHandle). The
    server owns its AsyncLLM, so stop() also ends the engine loop thread. A watchdog stops it
    after `idle_s` without an engine step, so a closed browser tab does not leave it running."""

    handle: object  # engine.server.ServerHandle
    engine: object  # engine.core.EngineCore
    signature: tuple = ()
    idle_s: float = IDLE_STOP_S
    last_active: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._stopped = threading.Event()
        self.async_llm.step_listeners.append(self._touch)
        self.watchdog = threading.Thread(target=self._watch, name="ch14-watchdog", daemon=True)
        self.watchdog.start()

    def _touch(self, _record=None) -> None:
        self.last_active = time.monotonic()

    def _watch(self) -> None:
        while not self._stopped.wait(min(5.0, self.idle_s / 4)):
            idle = time.monotonic() - self.last_active
            if idle > self.idle_s and not self.engine.has_unfinished_requests():
                self.stop()
                return

    @property
    def url(self) -> str:
        return self.handle.url

    @property
    def async_llm(self):
        return self.handle.app.state.server.async_llm

    @property
    def threads(self) -> list[threading.Thread]:
        return [self.handle.thread, self.async_llm._thread, self.watchdog]

    @property
    def alive(self) -> bool:
        return self.handle.thread.is_alive() and self.async_llm.is_running

    def stop(self, timeout: float = 10.0) -> None:
        """Stop uvicorn (its lifespan shuts the AsyncLLM down) and wait for the threads."""
        self._stopped.set()
        self.handle.stop(timeout)
        if self.async_llm._thread.is_alive():  # the lifespan did not run (e.g. startup failed)
            self.async_llm.shutdown()
        if self.watchdog is not threading.current_thread():
            self.watchdog.join(timeout)


def start_live_server(engine, signature: tuple = (), idle_s: float = IDLE_STOP_S) -> LiveServer:
    """Serve `engine` on 127.0.0.1, a free port (never another interface)."""
    from engine.server import start_server_in_thread

    handle = start_server_in_thread(engine, host="127.0.0.1", port=0)
    return LiveServer(handle, engine, signature, idle_s)


# -- /metrics ---------------------------------------------------------------------------------

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
TTFT_HIST = "vllm:time_to_first_token_seconds"
ITL_HIST = "vllm:inter_token_latency_seconds"
E2E_HIST = "vllm:e2e_request_latency_seconds"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value}, labels dropped except a histogram bucket's `le`
    (kept as name{le=...}); samples that differ only in other labels are summed."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if "le" in sample.labels:
                name = f"{name}{{le={sample.labels['le']}}}"
            out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def histogram_mean(before: dict, after: dict, name: str) -> float | None:
    """Mean of the observations a histogram got between two scrapes (sum Δ / count Δ)."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if count <= 0:
        return None
    return (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count


def histogram_count(before: dict, after: dict, name: str) -> int:
    return int(after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0))


@dataclass
class MetricsSample:
    t_s: float  # seconds from the start of the measurement
    running: float
    waiting: float
    kv_usage: float  # 0..1

    @classmethod
    def of(cls, t_s: float, parsed: dict) -> "MetricsSample":
        return cls(t_s, parsed.get(RUNNING, 0.0), parsed.get(WAITING, 0.0), parsed.get(KV_USAGE, 0))


def fetch_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    import httpx

    response = httpx.get(f"{url}/metrics", timeout=timeout)
    response.raise_for_status()
    return parse_metrics(response.text)


def samples_table(samples: list[MetricsSample]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "시각 (s)": round(s.t_s, 3),
                "실행 중": s.running,
                "대기": s.waiting,
                "KV 사용률 (%)": round(100 * s.kv_usage, 1),
            }
            for s in samples
        ],
        columns=["시각 (s)", "실행 중", "대기", "KV 사용률 (%)"],
    )


# -- one client -------------------------------------------------------------------------------


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


def _chunk_text(payload: dict) -> str:
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
                    text = _chunk_text(payload)
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
            result.chunk_texts.append(_chunk_text(payload))
            result.completion_tokens = (payload.get("usage") or {}).get("completion_tokens")
            result.finished = True
            result.end_s = now
    except asyncio.CancelledError:
        result.cut = True
        result.end_s = time.perf_counter() - t0
        raise
    except Exception as exc:  # noqa: BLE001 - a transport error is this client's result
        result.error = type(exc).__name__


# -- load ---------------------------------------------------------------------------------------


def poisson_arrivals(rate: float, max_users: int, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` per second: at most `max_users`, all
    before `duration_s`. Exponential gaps, seeded (the same slider values give the same times)."""
    if rate <= 0 or max_users <= 0:
        return []
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    while len(out) < max_users:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            break
        out.append(t)
    return out


@dataclass
class LoadResult:
    rate: float
    max_users: int
    duration_s: float
    max_tokens: int
    prompt_tokens: int
    clients: list[ClientResult]
    samples: list[MetricsSample]
    wall_s: float
    server_before: dict = field(default_factory=dict)
    server_after: dict = field(default_factory=dict)

    @property
    def completed(self) -> list[ClientResult]:
        return [c for c in self.clients if c.finished and not c.error]

    def request_table(self) -> pd.DataFrame:
        rows = []
        for c in self.clients:
            itl = c.itl_s
            rows.append(
                {
                    "사용자": c.index,
                    "도착 (s)": round(c.arrival_s, 3),
                    "TTFT (ms)": _r(
                        None if c.first_visible_s is None else 1000 * c.first_visible_s
                    ),
                    "ITL 평균 (ms)": _r(1000 * float(np.mean(itl))) if itl else None,
                    "E2E (ms)": _r(None if c.e2e_s is None else 1000 * c.e2e_s),
                    "받은 조각": len(c.chunk_times),
                    "상태": c.state,
                }
            )
        return pd.DataFrame(
            rows,
            columns=["사용자", "도착 (s)", "TTFT (ms)", "ITL 평균 (ms)", "E2E (ms)", "받은 조각"]
            + ["상태"],
        )

    def percentiles(self) -> dict:
        """TTFT and ITL percentiles (ms) over every request that got that far (cut ones too),
        E2E over the completed ones; all client side. "첫 조각 없음" counts the requests cut
        before their first chunk (their TTFT is only known to be longer than the cap)."""
        done = self.completed
        seen = [c for c in self.clients if not c.error]
        ttft = [1000 * c.first_visible_s for c in seen if c.first_visible_s is not None]
        itl = [1000 * x for c in seen for x in c.itl_s]
        e2e = [1000 * c.e2e_s for c in done if c.e2e_s is not None]
        out: dict = {
            "요청": len(self.clients),
            "완료": len(done),
            "끊음": sum(c.cut for c in self.clients),
            "오류": sum(bool(c.error) for c in self.clients),
            "첫 조각 없음": sum(c.first_visible_s is None and not c.error for c in self.clients),
        }
        for name, values in (("TTFT", ttft), ("ITL", itl), ("E2E", e2e)):
            for q in (50, 90, 99):
                out[f"{name} p{q} (ms)"] = _r(float(np.percentile(values, q))) if values else None
        tokens = sum(len(c.chunk_times) for c in seen)
        out["처리량 (조각/s)"] = _r(tokens / self.wall_s) if self.wall_s > 0 else None
        out["최대 대기"] = max((s.waiting for s in self.samples), default=None)
        out["최대 KV 사용률 (%)"] = _r(100 * max((s.kv_usage for s in self.samples), default=0))
        return out

    def percentile_table(self) -> pd.DataFrame:
        p = self.percentiles()
        rows = [
            {
                "지표": name,
                "p50 (ms)": p[f"{name} p50 (ms)"],
                "p90 (ms)": p[f"{name} p90 (ms)"],
                "p99 (ms)": p[f"{name} p99 (ms)"],
            }
            for name in ("TTFT", "ITL", "E2E")
        ]
        return pd.DataFrame(rows)

    def server_means_ms(self) -> dict:
        """The server's own view of this run (/metrics histograms, Δ over the run)."""
        out = {}
        for label, name in (("TTFT", TTFT_HIST), ("ITL", ITL_HIST), ("E2E", E2E_HIST)):
            mean = histogram_mean(self.server_before, self.server_after, name)
            out[label] = None if mean is None else round(1000 * mean, 1)
            out[f"{label} 관측 수"] = histogram_count(self.server_before, self.server_after, name)
        return out


class _Ticker:
    """Runs a coroutine in its own thread (its own event loop) and calls `on_tick` from the
    caller's thread every `interval` s until it ends: progress bars update in the caller's
    thread, where Streamlit allows it."""

    @staticmethod
    def run(coro_fn: Callable, on_tick: Callable[[], None] | None = None, interval: float = 0.1):
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


async def _load(
    url: str,
    prompts: Sequence,
    arrivals: list[float],
    max_tokens: int,
    cap_s: float,
    poll_s: float,
    progress: dict,
    stream: bool = True,
) -> tuple[list[ClientResult], list[MetricsSample], float, dict, dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(arrivals) + 4, max_keepalive_connections=8)
    timeout = httpx.Timeout(cap_s + 10, connect=5.0)
    results = [ClientResult(i, a, stream) for i, a in enumerate(arrivals)]
    samples: list[MetricsSample] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        before = parse_metrics((await client.get(f"{url}/metrics")).text)
        t0 = time.perf_counter()
        stop = asyncio.Event()

        async def user(r: ClientResult) -> None:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            body = request_body(prompts[r.index % len(prompts)], max_tokens, stream)
            await send_request(client, url, body, t0, r)
            progress["done"] = progress.get("done", 0) + 1

        async def poll() -> None:
            while not stop.is_set():
                try:
                    text = (await client.get(f"{url}/metrics")).text
                    samples.append(MetricsSample.of(time.perf_counter() - t0, parse_metrics(text)))
                except Exception:  # noqa: BLE001 - a missed scrape is a gap in the plot
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), poll_s)
                except asyncio.TimeoutError:
                    pass

        poller = asyncio.create_task(poll())
        tasks = [asyncio.create_task(user(r)) for r in results]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=cap_s)
            for task in pending:  # cut at the cap: closing the connection aborts the request
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(2 * poll_s)  # a sample or two after the last request left
        stop.set()
        await poller
        wall = time.perf_counter() - t0
        after = parse_metrics((await client.get(f"{url}/metrics")).text)
    return results, samples, wall, before, after


def run_load_test(
    url: str,
    prompts: Sequence,
    rate: float,
    max_users: int,
    duration_s: float,
    max_tokens: int,
    prompt_tokens: int = 0,
    drain_s: float | None = None,
    poll_s: float = 0.1,
    seed: int = 0,
    on_tick: Callable[[dict], None] | None = None,
    stream: bool = True,
) -> LoadResult:
    """N users arriving as a Poisson process of `rate`/s during `duration_s`, each sending one
    streamed completion; /metrics polled every `poll_s`. Everything ends by duration_s + drain_s
    (requests still open then are cut). on_tick(progress) gets {"done", "total", "elapsed_s",
    "cap_s"} from the caller's thread."""
    arrivals = poisson_arrivals(rate, max_users, duration_s, seed)
    drain_s = duration_s if drain_s is None else drain_s
    cap_s = duration_s + drain_s
    progress: dict = {"done": 0, "total": len(arrivals), "cap_s": cap_s}
    start = time.perf_counter()

    def tick() -> None:
        if on_tick is not None:
            progress["elapsed_s"] = time.perf_counter() - start
            on_tick(progress)

    results, samples, wall, before, after = _Ticker.run(
        lambda: _load(url, prompts, arrivals, max_tokens, cap_s, poll_s, progress, stream), tick
    )
    return LoadResult(
        rate,
        max_users,
        duration_s,
        max_tokens,
        prompt_tokens,
        results,
        samples,
        wall,
        before,
        after,
    )


def latency_vs_load(
    url: str,
    prompts: Sequence,
    rates: Sequence[float],
    max_users: int,
    duration_s: float,
    max_tokens: int,
    prompt_tokens: int = 0,
    drain_s: float | None = None,
    seed: int = 0,
    on_tick: Callable[[dict], None] | None = None,
) -> list[LoadResult]:
    """One load test per rate (same users, same caps, same seed), lowest rate first."""
    out = []
    for i, rate in enumerate(sorted(rates)):

        def tick(p: dict, i: int = i, rate: float = rate) -> None:
            if on_tick is not None:
                on_tick({**p, "point": i + 1, "points": len(rates), "rate": rate})

        out.append(
            run_load_test(
                url,
                prompts,
                rate,
                max_users,
                duration_s,
                max_tokens,
                prompt_tokens,
                drain_s,
                seed=seed,
                on_tick=tick,
            )
        )
    return out


def curve_table(results: list[LoadResult]) -> pd.DataFrame:
    rows = []
    for res in results:
        p = res.percentiles()
        waits = [s.waiting for s in res.samples]
        rows.append(
            {
                "도착률 (요청/s)": res.rate,
                "요청": p["요청"],
                "완료": p["완료"],
                "끊음": p["끊음"],
                "TTFT p50 (ms)": p["TTFT p50 (ms)"],
                "TTFT p90 (ms)": p["TTFT p90 (ms)"],
                "E2E p50 (ms)": p["E2E p50 (ms)"],
                "E2E p90 (ms)": p["E2E p90 (ms)"],
                "평균 대기 요청": _r(float(np.mean(waits)), 2) if waits else None,
                "처리량 (조각/s)": p["처리량 (조각/s)"],
            }
        )
    return pd.DataFrame(rows)


def capacity_estimate(max_num_seqs: int, e2e_ms_alone: float | None) -> float | None:
    """계산값: requests per second the server could finish if max_num_seqs requests ran at once,
    each taking the E2E measured at the lowest load. Past it, arrivals queue (the knee). An upper
    bound: a fuller batch makes each step a little longer."""
    if e2e_ms_alone is None or not e2e_ms_alone > 0:  # None, NaN, 0
        return None
    return max_num_seqs / (e2e_ms_alone / 1000)


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

    results = _Ticker.run(run, (lambda: on_tick(progress)) if on_tick else None)
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
                            text = _chunk_text(json.loads(data))
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
