"""EngineCore: the loop of an inference server, one step at a time.

    step():  schedule  →  execute (executor → worker → model runner → model, sampler)  →  update

Each step returns a StepRecord saying what was decided, why, what it cost and what the KV cache
looks like afterwards, so that a learner can replay the engine's life one decision at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from engine.artifact import resolve_model_path
from engine.executor import Executor, UniProcExecutor
from engine.kv_cache import KVCacheManager
from engine.models.llama import LlamaConfig
from engine.output import OutputProcessor
from engine.request import Request, RequestStatus
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tokenizer import Tokenizer
from engine.trace import ScheduledRecord, StepRecord
from engine.worker import Worker, resolve_device, resolve_dtype


@dataclass
class EngineConfig:
    model: str | Path | None = None  # None: the embedded default artifact
    device: str = "auto"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes (CPU default 1 GiB)
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    keep_finished: int = 1000  # finished requests kept for the app's plots


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None, **overrides):
        # A copy with the overrides: the caller's config is never changed; unknown names raise TypeError.
        config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.config = config
        self.model_dir = resolve_model_path(config.model)
        self.model_config = LlamaConfig.from_model_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.model_config.sliding_window:  # full attention equals sliding-window attention only up to the window
            self.max_model_len = min(self.max_model_len, self.model_config.sliding_window)
        if config.block_size < 1 or config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be positive")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            # Without chunking a request is prefilled (or, after preemption, recomputed) in one step,
            # so one step must be able to hold the longest request; vLLM refuses the same way.
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({config.max_num_batched_tokens}) must be at "
                f"least max_model_len ({self.max_model_len})"
            )

        self.executor = executor or UniProcExecutor(Worker(self.model_dir, self.device, self.dtype, config.block_size))
        self.num_blocks = self.executor.initialize(
            self.max_model_len,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=config.kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.kv_cache_manager = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv_cache_manager,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.finished_requests: OrderedDict[str, Request] = OrderedDict()
        self.live_requests: dict[str, Request] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0}
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Tokenize, validate and queue a request. Raises InvalidRequestError for bad input."""
        request = self.make_request(prompt, sampling_params, request_id, prompt_token_ids, priority, arrival_time)
        self.queue_request(request)
        return request

    def make_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """Tokenize and validate without touching the engine's state (safe from any thread)."""
        params = sampling_params or SamplingParams()
        params.verify()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("a prompt or prompt_token_ids is required", "prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.model_config.vocab_size})", "prompt")
        self.check_length(len(prompt_token_ids), params.max_tokens)
        request = Request(request_id, list(prompt_token_ids), params, self.tokenizer.eos_token_id, prompt,
                          priority=priority, arrival_time=arrival)
        request.record("arrival").time = arrival
        request.record("tokenized", num_prompt_tokens=len(prompt_token_ids))
        return request

    def queue_request(self, request: Request) -> None:
        if request.request_id in self.live_requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", "request_id")
        self.live_requests[request.request_id] = request
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Prompt plus requested output must fit the model's context (error names both numbers)."""
        total = num_prompt_tokens + (max_tokens or 0)
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request has "
                f"{num_prompt_tokens} prompt tokens and asks for {max_tokens or 0} output tokens ({total} in total)",
                "max_tokens" if num_prompt_tokens < self.max_model_len else "prompt",
            )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. True if it was still live."""
        request = self.live_requests.get(request_id)
        if request is None:
            return False
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        request.finish_time = time.perf_counter()
        request.record("finished", reason=request.finish_reason)
        self.output_processor.states.pop(request_id, None)
        self._retire(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_request(self, request_id: str) -> Request | None:
        return self.live_requests.get(request_id) or self.finished_requests.get(request_id)

    def all_requests(self) -> list[Request]:
        return list(self.finished_requests.values()) + list(self.live_requests.values())

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """One engine iteration. Its record carries an output for every request that advanced."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        t_scheduled = time.perf_counter()
        runner_out = self.executor.execute_model(sched)
        t_executed = time.perf_counter()

        sampled = {rid: r.token_id for rid, r in runner_out.sampled.items()}
        for rid, result in runner_out.sampled.items():
            request = self.live_requests.get(rid)
            if request is not None and request.sampling_params.logprobs is not None:
                request.output_logprobs.append(
                    {"token_id": result.token_id, "logprob": result.logprob, "top_logprobs": result.top_logprobs})
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, sampled)}

        t_token = time.perf_counter()
        outputs = []
        for rid, token in sampled.items():
            request = self.live_requests.get(rid)
            if request is None:
                continue
            self._record_token(request, token, sched.step, t_token)
            stop = self.output_processor.process_tokens(request, [token])
            if stop is not None:
                request.stop_reason = stop
                if rid in finished:  # the same token also hit the length limit: the stop string wins
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.finish_reason = RequestStatus.FINISHED_STOPPED.value
                else:
                    self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
                    finished.add(rid)
            is_finished = rid in finished
            if is_finished:
                request.finish_time = t_token
                request.record("finished", sched.step, reason=request.finish_reason)
            output = self.output_processor.make_output(request, [token], is_finished)
            if output.delta_text:
                request.record("streamed", sched.step, chars=len(output.delta_text))
            outputs.append(output)
            if is_finished:
                self._retire(request)
        t_done = time.perf_counter()

        self.stats["steps"] += 1
        self.stats["preemptions"] += len(sched.preempted)
        self.stats["prompt_tokens"] += sum(s.num_tokens for s in sched.scheduled if s.phase != "decode")
        self.stats["generation_tokens"] += len(sampled)
        record = StepRecord(
            step=sched.step,
            start_time=start,
            timings={
                "schedule": t_scheduled - start,
                "prepare_inputs": runner_out.timings.get("prepare_inputs", 0.0),
                "forward": runner_out.timings.get("forward", 0.0),
                "sample": runner_out.timings.get("sample", 0.0),
                "output_processing": (t_done - t_executed),
            },
            scheduled=[
                ScheduledRecord(s.request_id, s.phase, s.num_tokens, s.num_computed_tokens,
                                self._num_prompt_tokens(s.request_id), s.num_prefix_hit_tokens)
                for s in sched.scheduled
            ],
            unscheduled=sched.unscheduled,
            preempted=sched.preempted,
            token_budget=sched.token_budget,
            max_num_seqs=self.config.max_num_seqs,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            new_tokens={rid: [tok] for rid, tok in sampled.items()},
            finished={rid: self.get_request(rid).finish_reason for rid in finished if self.get_request(rid)},
            kv=self.kv_cache_manager.snapshot(),
            outputs=outputs,
        )
        return record

    def _record_token(self, request: Request, token: int, step: int, now: float) -> None:
        request.token_times.append(now)
        if request.first_token_time is None:
            request.first_token_time = now
            request.record("first_token", step, token_id=token).time = now
        else:
            request.record("token", step, token_id=token).time = now

    def _retire(self, request: Request) -> None:
        self.live_requests.pop(request.request_id, None)
        self.finished_requests[request.request_id] = request
        while len(self.finished_requests) > self.config.keep_finished:
            self.finished_requests.popitem(last=False)

    def _num_prompt_tokens(self, request_id: str) -> int:
        request = self.get_request(request_id)
        return request.num_prompt_tokens if request else 0
