"""A request as the engine sees it: its tokens, how far it has been computed, and its journey;
and RequestMetrics, the one definition of TTFT, TPOT, ITL and E2E that every figure uses."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; it will be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed this request (and only it); the loop went on

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}

Clock = Literal["wall", "engine"]


@dataclass
class JourneyEvent:
    """One timestamped moment of a request's life (what chapter 01's swimlane draws)."""

    time: float  # wall clock: time.perf_counter() seconds
    # arrival, tokenized, queued, scheduled, first_token, token, preempted, resumed, streamed,
    # finished
    kind: str
    step: int | None = None
    detail: dict = field(default_factory=dict)
    engine_time: float | None = (
        None  # engine clock (engine/clock.py) seconds, None outside an engine
    )

    def at(self, clock: Clock) -> float | None:
        return self.time if clock == "wall" else self.engine_time


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    prompt: str | None = None
    priority: int = 0  # lower value = more important (used by the priority policy)
    cache_salt: str | None = (
        None  # prefix-cache namespace: only requests with the same salt share blocks
    )
    arrival_time: float = field(default_factory=time.perf_counter)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    num_preemptions: int = 0
    max_computed_tokens: int = 0  # the most tokens ever in the cache (a preemption may lose them)
    num_recomputed_tokens: int = 0  # tokens computed again after a recompute preemption
    is_swapped_out: bool = False  # preempted by swap: its K/V wait in the swap space
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens for its next decode step
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    journey: list[JourneyEvent] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    error: str | None = None  # why the engine failed it (status FINISHED_ERROR)
    # vLLM's name: what a KV connector needs to find this request's K/V elsewhere (a consumer's
    # {"remote_request_id", "num_tokens"}), or, once finished on a producer, what it saved
    kv_transfer_params: dict | None = None
    # Its grammar state when it has structured outputs (engine/structured_output/grammar.py):
    # the matcher that advanced with every output token.
    structured_output_request: object | None = None
    engine_clock: Callable[[], float] | None = field(default=None, repr=False, compare=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end of prompt + output (what all_token_ids[start:end] holds), without
        building the whole list: a decode step needs one token of a long context."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def record(self, kind: str, step: int | None = None, **detail) -> JourneyEvent:
        engine_time = self.engine_clock() if self.engine_clock else None
        event = JourneyEvent(time.perf_counter(), kind, step, detail, engine_time)
        self.journey.append(event)
        return event

    def metrics(self, clock: Clock = "wall") -> "RequestMetrics":
        return RequestMetrics.from_request(self, clock)


@dataclass
class RequestMetrics:
    """A request's latencies, defined once (seconds on one clock, `wall` or `engine`).

    TTFT = first token − arrival;  E2E = last token − arrival;
    TPOT = (E2E − TTFT) / (N − 1): the mean gap between output tokens, undefined (None) for N < 2;
    ITL  = each gap between consecutive output tokens (N − 1 values).
    """

    clock: Clock
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    token_times: list[float] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: Request, clock: Clock = "wall") -> "RequestMetrics":
        if clock == "wall":
            # Fast path (runs for every request at every step): the request keeps its wall times.
            # The first "scheduled" event is near the start of the journey, so the search is short.
            first_scheduled = next((e.time for e in request.journey if e.kind == "scheduled"), None)
            arrival, first_token, finish = (
                request.arrival_time,
                request.first_token_time,
                request.finish_time,
            )
            token_times = list(request.token_times)
        else:
            times: dict[str, float] = {}
            token_times = []
            for e in request.journey:
                if e.kind in ("first_token", "token"):
                    token_times.append(e.engine_time)
                times.setdefault(e.kind, e.engine_time)
            arrival, first_scheduled = times.get("arrival", 0.0), times.get("scheduled")
            first_token = token_times[0] if token_times else None
            finish = times.get("finished") if request.is_finished else None
        return cls(
            clock,
            arrival,
            first_scheduled,
            first_token,
            finish,
            request.num_prompt_tokens,
            request.num_output_tokens,
            request.num_cached_tokens,
            request.num_preemptions,
            token_times,
        )

    @property
    def queue_time(self) -> float | None:
        """Arrival → first scheduled (waiting in the queue)."""
        return (
            None
            if self.first_scheduled_time is None
            else self.first_scheduled_time - self.arrival_time
        )

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival → first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival → finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None when there is no second token."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def as_dict(self) -> dict:
        return {
            "clock": self.clock,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "queue_time": self.queue_time,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
        }
