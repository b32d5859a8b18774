"""Output processing: token ids → streamed text, stop strings, and the per-request result.

Stop strings are matched on text, not tokens, so a stop string may be cut across tokens. While a
request runs, the last (longest stop string − 1) characters are held back from the stream, so a
stop string is never half-shown before it is recognised; streamed text therefore always equals
the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival → first generated token (seconds)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival → last token (seconds)."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E − TTFT) / (output tokens − 1)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.token_times[-1] - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def as_dict(self) -> dict:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens, "num_cached_tokens": self.num_cached_tokens,
                "num_preemptions": self.num_preemptions}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # everything generated so far (final once finished)
    token_ids: list[int]
    delta_text: str  # what this step added to the stream
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics
    logprobs: list[dict] | None = None


def metrics_of(request: Request) -> RequestMetrics:
    # The first "scheduled" event is near the start of the journey: stop there (this runs for every
    # request at every step, and the journey grows by a few events per token).
    first_scheduled = next((e.time for e in request.journey if e.kind == "scheduled"), None)
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_scheduled_time=first_scheduled,
        first_token_time=request.first_token_time,
        finish_time=request.finish_time,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        token_times=list(request.token_times),
    )


class RequestTextState:
    """Per-request detokenizer and stop-string bookkeeping."""

    def __init__(self, tokenizer: Tokenizer, request: Request):
        params = request.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.num_streamed_chars = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestTextState] = {}

    def add_request(self, request: Request) -> None:
        self.states[request.request_id] = RequestTextState(self.tokenizer, request)

    def process_tokens(self, request: Request, new_token_ids: list[int]) -> str | None:
        """Detokenize new tokens; return the stop string if one appeared (the caller stops it)."""
        state = self.states[request.request_id]
        for token_id in new_token_ids:
            before = len(state.text)
            state.text += state.detok.add_token(token_id)
            hit = self._find_stop(state, before)
            if hit is not None:
                return hit
        return None

    def _find_stop(self, state: RequestTextState, new_from: int) -> str | None:
        for stop in state.stops:
            index = state.text.find(stop, max(0, new_from - len(stop) + 1))
            if index != -1:
                state.text = state.text[: index + (len(stop) if state.include_stop else 0)]
                return stop
        return None

    def make_output(self, request: Request, new_token_ids: list[int], finished: bool) -> RequestOutput:
        state = self.states[request.request_id]
        if finished and not isinstance(request.stop_reason, str):  # a stop string already cut the text
            state.text += state.detok.flush()
        streamable = len(state.text) if finished else max(len(state.text) - state.hold_back, state.num_streamed_chars)
        delta = state.text[state.num_streamed_chars : streamable]
        state.num_streamed_chars = streamable
        if finished:
            del self.states[request.request_id]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text,
            token_ids=list(request.output_token_ids),
            delta_text=delta,
            delta_token_ids=new_token_ids,
            finished=finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            metrics=metrics_of(request),
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
        )
