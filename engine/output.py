"""Output processing: token ids → streamed text, stop strings, and the per-request result.

Stop strings are matched on text, not tokens, so a stop string may be cut across tokens. While a
request runs, the last (longest stop string − 1) characters are held back from the stream, so a
stop string is never half-shown before it is recognised; streamed text therefore always equals
the final text.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request, RequestMetrics
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


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
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    # vLLM's name: once finished on a kv_producer, what a consumer needs to load its K/V
    kv_transfer_params: dict | None = None


def metrics_of(request: Request) -> RequestMetrics:
    return RequestMetrics.from_request(request, "wall")


class RequestTextState:
    """Per-request detokenizer and stop-string bookkeeping."""

    def __init__(self, tokenizer: Tokenizer, request: Request):
        params = request.sampling_params
        self.detok = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens
        )
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

    def make_error_output(self, request: Request) -> RequestOutput:
        """The last output of a request the engine failed: what was streamed stays, the error is
        added."""
        state = self.states.pop(request.request_id, None)
        text = state.text[: state.num_streamed_chars] if state else ""
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=text,
            token_ids=list(request.output_token_ids),
            delta_text="",
            delta_token_ids=[],
            finished=True,
            finish_reason=request.finish_reason,
            stop_reason=None,
            metrics=metrics_of(request),
            error=request.error,
        )

    def make_output(
        self, request: Request, new_token_ids: list[int], finished: bool
    ) -> RequestOutput:
        state = self.states[request.request_id]
        if finished and not isinstance(
            request.stop_reason, str
        ):  # a stop string already cut the text
            state.text += state.detok.flush()
        streamable = (
            len(state.text)
            if finished
            else max(len(state.text) - state.hold_back, state.num_streamed_chars)
        )
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
            logprobs=list(request.output_logprobs)
            if request.sampling_params.logprobs is not None
            else None,
            error=request.error,
            kv_transfer_params=request.kv_transfer_params if finished else None,
        )
