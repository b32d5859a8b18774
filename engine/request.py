"""A request as the engine sees it: its tokens, how far it has been computed, and its journey."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed; it will be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class JourneyEvent:
    """One timestamped moment of a request's life (what chapter 01's swimlane draws)."""

    time: float  # time.perf_counter() seconds
    kind: str  # arrival, tokenized, queued, scheduled, first_token, token, preempted, resumed, streamed, finished
    step: int | None = None
    detail: dict = field(default_factory=dict)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    prompt: str | None = None
    priority: int = 0  # lower value = more important (used by the priority policy)
    arrival_time: float = field(default_factory=time.perf_counter)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    journey: list[JourneyEvent] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

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
        event = JourneyEvent(time.perf_counter(), kind, step, detail)
        self.journey.append(event)
        return event
