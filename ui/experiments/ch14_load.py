"""Chapter 14 · load: simulated users arriving as a Poisson process, each sending one completion
to the live server while its /metrics is polled; one load test per arrival rate for the latency
curve and its knee (no Streamlit here)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from engine.tools import workload
from ui.experiments.ch14_client import ClientResult, request_body, run_with_ticks, send_request
from ui.experiments.ch14_server import (
    E2E_HIST,
    ITL_HIST,
    TTFT_HIST,
    MetricsSample,
    histogram_count,
    histogram_mean,
    parse_metrics,
)
from ui.experiments.common import _r

# The load lab's requests: prompt length and tokens per answer.
LOAD_PROMPT_LEN, LOAD_MAX_TOKENS = 32, 8


def user_arrivals(rate: float, max_users: int, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of the simulated users: a Poisson process of `rate` per second
    (engine/tools/workload.py's, seeded, so the same slider values give the same times), the first
    one gap after the start, at most `max_users`, all before `duration_s`; none at rate 0."""
    if not rate > 0:
        return []
    return workload.poisson_arrivals(max_users, rate, seed, first_at_zero=False, until_s=duration_s)


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
            for q, value in workload.percentiles(values).items():
                out[f"{name} {q} (ms)"] = _r(value)
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
    arrivals = user_arrivals(rate, max_users, duration_s, seed)
    drain_s = duration_s if drain_s is None else drain_s
    cap_s = duration_s + drain_s
    progress: dict = {"done": 0, "total": len(arrivals), "cap_s": cap_s}
    start = time.perf_counter()

    def tick() -> None:
        if on_tick is not None:
            progress["elapsed_s"] = time.perf_counter() - start
            on_tick(progress)

    results, samples, wall, before, after = run_with_ticks(
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
