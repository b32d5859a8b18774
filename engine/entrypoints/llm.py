"""The two ways in: `LLM` for offline batches, `AsyncLLM` for streaming (what the server uses)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from typing import AsyncIterator, Callable

from tqdm.auto import tqdm

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from engine.core import EngineConfig, EngineCore
from engine.output import RequestOutput
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.trace import StepRecord

logger = logging.getLogger(__name__)


# vLLM's TextPrompt and TokensPrompt keys that this engine uses (it has no multi-modal inputs)
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def parse_prompt(prompt: str | dict | None) -> tuple[str | None, list[int] | None, str | None]:
    """(text, token ids, cache_salt) of a string or of vLLM's prompt dict; a dict with another
    key, or with neither text nor token ids, is refused (ValueError) before anything runs."""
    if prompt is None or isinstance(prompt, str):
        return prompt, None, None
    if not isinstance(prompt, dict):
        raise TypeError(f"a prompt is a string or a dict, got {type(prompt).__name__}")
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(
            f"unsupported prompt key(s) {', '.join(map(repr, unknown))}; a prompt dict takes "
            f"{', '.join(map(repr, PROMPT_KEYS))}"
        )
    if prompt.get("prompt") is None and prompt.get("prompt_token_ids") is None:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    return prompt.get("prompt"), prompt.get("prompt_token_ids"), prompt.get("cache_salt")


class LLM:
    """Offline inference: give it all prompts, get all answers (vLLM's `LLM`)."""

    def __init__(
        self,
        model: str | None = None,
        device: str = "auto",
        dtype: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        speculative_config: dict | None = None,
        quantization: str | None = None,
        **engine_kwargs,
    ):
        """`speculative_config`: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 3, "prompt_lookup_min": 1}; None: no speculative decoding.
        `quantization`: None, "int8", "int4" or "gguf" (weight-only, engine/worker/quantization.py;
        the int4 group size is `quantization_group_size`, 32 by default).
        `tensor_parallel_size=N, pipeline_parallel_size=M` (engine_kwargs, EngineConfig's
        names) run N × M worker processes, forked where safe (Linux, CUDA not initialised in
        this process), so a plain script needs no `if __name__ == "__main__":` guard; where they
        must be spawned, an unguarded script is refused at once, with the fix."""
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,
            speculative_config=speculative_config,
            quantization=quantization,
            **engine_kwargs,
        )
        self.engine = EngineCore(config)
        self.step_records: list[StepRecord] = []  # of the last generate() call

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the worker processes (tensor / pipeline parallel); also done at exit."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: str | dict | list[str | dict] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        prompt_token_ids: list[list[int]] | None = None,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs in input order. A
        prompt is a string or one of vLLM's prompt dicts: {"prompt": text} (TextPrompt) or
        {"prompt_token_ids": [...]} (TokensPrompt), either with "cache_salt" (requests share
        prefix-cache blocks only under an equal salt)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        count = len(prompts) if prompts is not None else len(prompt_token_ids or [])
        parsed = [parse_prompt(p) for p in prompts or [None] * count]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * count
        requests = [
            self.engine.add_request(
                prompt=prompt,
                sampling_params=params,
                prompt_token_ids=prompt_token_ids[i] if prompt_token_ids else token_ids,
                priority=priorities[i] if priorities else 0,
                cache_salt=cache_salt,
            )
            for i, ((prompt, token_ids, cache_salt), params) in enumerate(
                zip(parsed, sampling_params)
            )
        ]
        finished: dict[str, RequestOutput] = {}
        self.step_records = []
        with tqdm(total=count, desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(finished) < count:
                record = self.engine.step()
                self.step_records.append(record)
                for output in record.outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r.request_id] for r in requests]

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params=None,
        use_tqdm: bool = True,
    ):
        """Apply the chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        # encode_chat: message text can never turn into control tokens (see Tokenizer.encode_chat)
        encoded = [self.engine.tokenizer.encode_chat(c) for c in conversations]
        prompts, token_ids = [text for text, _ in encoded], [ids for _, ids in encoded]
        return self.generate(prompts, sampling_params, use_tqdm, prompt_token_ids=token_ids)


class AsyncLLM:
    """Streaming front end: the engine steps in its own thread, callers await text deltas.

    Only the engine thread touches the scheduler. Callers validate and tokenize their request in
    their own thread (so a bad request fails at once, with its message), then hand it over
    through an inbox; aborts travel the same way. Outputs come back to each caller's event loop.
    """

    def __init__(self, engine: EngineCore | None = None, **engine_kwargs):
        self.engine = engine or EngineCore(EngineConfig(**engine_kwargs))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.errored: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def generate(
        self,
        prompt: str | None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (a bad request raises InvalidRequestError here, before any streaming),
        then return a stream yielding a RequestOutput each time the request advances; the last
        one has finished=True. Leaving the stream early (or cancelling the task) aborts the
        request and frees its KV blocks."""
        if self.errored is not None:
            raise RuntimeError(f"engine loop died: {self.errored!r}")
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        if request_id in self._streams or request_id in self.engine.live_requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        request = self.engine.make_request(
            prompt,
            sampling_params,
            request_id,
            prompt_token_ids,
            priority,
            arrival_time,
            cache_salt=cache_salt,
        )
        request.kv_transfer_params = kv_transfer_params  # a kv_consumer loads the remote K/V
        return self._stream(request)

    async def _stream(self, request) -> AsyncIterator[RequestOutput]:
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", request))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    @property
    def is_running(self) -> bool:
        """False once the engine thread has died (or was shut down): nothing will be served."""
        return self.errored is None and self._thread.is_alive() and not self._stopped

    def health(self) -> str | None:
        """None while the engine loop runs and makes progress; else why not: it died, it was
        shut down, or its step has run past the engine iteration timeout (the server's /health
        answers 503 with this reason)."""
        if self.errored is not None:
            return f"the engine loop died: {self.errored}"
        if self._stopped or not self._thread.is_alive():
            return "the engine loop is stopped"
        stalled = getattr(self.engine, "stalled", None)
        return stalled() if stalled is not None else None

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(0.1)
                    self._wakeup.clear()
                    continue
                record = self.engine.step()
                for output in record.outputs:
                    self._deliver(output.request_id, output)
                for listener in self.step_listeners:
                    try:
                        listener(record)
                    except Exception:  # an observer must never stop the engine
                        logger.exception("step listener failed")
        except BaseException as exc:  # surface the failure to every waiting caller and /health
            self.errored = exc
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(f"engine loop died: {exc!r}"))
            logger.error("the engine loop died; every open request failed", exc_info=exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                action, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if action == "add":
                if payload.request_id in self._streams:
                    try:
                        self.engine.queue_request(payload)
                    except Exception as exc:
                        self._deliver(payload.request_id, exc)
            else:
                self.engine.abort_request(payload)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
