"""Prometheus metrics of a running server, under the names vLLM uses (so vLLM dashboards read them).

Two kinds of numbers:
- the engine's *state* right now (requests running and waiting, KV-cache usage, prefix-cache and
  preemption totals): read from the engine at scrape time by `EngineStateCollector`, so /metrics
  is current even when the engine is idle (an aborted request's blocks show as freed at once);
- what *happened* to requests (prompt and generation tokens, TTFT, inter-token latency, E2E):
  observed by `ServerMetrics.on_step`, a step listener that the engine thread calls after every
  step with its StepRecord.

Each server owns its CollectorRegistry (not prometheus_client's global one), so several servers
can live in one process (the Streamlit app, the tests). All times are measured on the server with
time.perf_counter(), from the moment the HTTP request arrived.
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.trace import StepRecord

logger = logging.getLogger(__name__)

# vLLM's buckets, with finer steps below 10 ms added: a small model on a CPU decodes in
# milliseconds.
# fmt: off
TTFT_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0
]
ITL_BUCKETS = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
]
E2E_BUCKETS = [
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0
]
# fmt: on
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]

LABELS = ["model_name"]
SPEC_DECODE_COUNTERS = {  # engine.stats key (and vLLM's name without "vllm:") → documentation
    "spec_decode_num_drafts": "Speculative decoding: draft verifications (a request in a step).",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
}


class EngineStateCollector:
    """Gauges and running totals read straight from the engine whenever /metrics is scraped.

    The engine thread owns these objects; reading a list's length or an int from another thread
    is safe in CPython and at worst one step stale.
    """

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        scheduler = self.engine.scheduler
        kv = self.engine.kv_cache_manager
        label = [self.model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(label, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(label, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in the running batch.",
            len(scheduler.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be scheduled (preempted included).",
            len(scheduler.waiting),
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks held by requests (1 = full).",
            kv.usage,
        )
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge(
            "vllm:prefix_cache_hit_rate",
            "prefix_cache_hits / prefix_cache_queries since start "
            "(a convenience; vLLM leaves this division to PromQL).",
            hits / queries if queries else 0.0,
        )
        yield counter(
            "vllm:num_preemptions",
            "Requests preempted (KV freed, to be recomputed).",
            self.engine.stats["preemptions"],
        )
        stats = self.engine.stats
        for name, documentation in SPEC_DECODE_COUNTERS.items():
            yield counter(f"vllm:{name}", documentation, stats.get(name, 0))
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV-cache configuration (value is always 1).",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [str(kv.block_size), str(kv.num_blocks), str(kv.enable_prefix_caching)], 1.0
        )
        yield info


class ServerMetrics:
    """One server's metrics: a private registry, a step listener, and the text /metrics serves."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStateCollector(engine, model_name))

        def counter(name, documentation, labels=LABELS):
            return Counter(name, documentation, labels, registry=self.registry)

        def histogram(name, documentation, buckets):
            return Histogram(
                name, documentation, LABELS, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.prompt_tokens = counter(
            "vllm:prompt_tokens",
            "Prompt tokens of requests that produced their first "
            "token (prefix-cache hits included).",
        ).labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.").labels(
            model_name
        )
        self.request_success = counter(
            "vllm:request_success",
            "Finished requests, by finish reason.",
            LABELS + ["finished_reason"],
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token: HTTP arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Gap between consecutive tokens of a request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "HTTP arrival to the last token.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "HTTP arrival to the first scheduling of the request.",
            E2E_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Output length of finished requests.", TOKEN_BUCKETS
        )

    def on_step(self, record: StepRecord) -> None:
        """Step listener (runs in the engine thread). It must never raise: that would stop the
        engine."""
        try:
            self._observe(record)
        except Exception:  # noqa: BLE001 - a metrics bug must not take the engine down
            logger.exception("metrics: could not observe step %s", record.step)

    def _observe(self, record: StepRecord) -> None:
        for output in record.outputs:
            metrics = output.metrics
            num_new = len(output.delta_token_ids)
            self.generation_tokens.inc(num_new)
            if len(output.token_ids) == num_new:  # this step produced the request's first token
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                if metrics.ttft is not None:
                    self.ttft.observe(metrics.ttft)
                if metrics.first_scheduled_time is not None:
                    self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
            elif len(metrics.token_times) >= 2:
                self.itl.observe(metrics.token_times[-1] - metrics.token_times[-2])
            if output.finished:
                self.request_success.labels(
                    self.model_name, output.finish_reason or "unknown"
                ).inc()
                if metrics.e2e is not None:
                    self.e2e.observe(metrics.e2e)
                self.request_prompt_tokens.observe(metrics.num_prompt_tokens)
                self.request_generation_tokens.observe(metrics.num_output_tokens)

    def count_abort(self) -> None:
        """Aborted requests never appear in a StepRecord; the server counts them here."""
        self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
