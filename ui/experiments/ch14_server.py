"""Chapter 14 · the live server: the learner's own OpenAIServer
(engine/entrypoints/server/serving.py) in a background thread on 127.0.0.1, stopped by a watchdog
when idle, and its /metrics (Prometheus text) scraped and parsed (no Streamlit here)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pandas as pd

# The server lab's engine: max_num_seqs and KV blocks.
SERVER_SEQS, SERVER_BLOCKS = 4, 48


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
    """The learner's OpenAIServer in a uvicorn thread (engine/entrypoints/server/app.py's
    ServerHandle). The server owns its AsyncLLM, so stop() also ends the engine loop thread. A
    watchdog stops it after `idle_s` without an engine step, so a closed browser tab does not leave
    it running."""

    handle: object  # engine.entrypoints.server.app.ServerHandle
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
    from engine.entrypoints.server.app import start_server_in_thread

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
