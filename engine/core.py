"""EngineCore: the loop of an inference server, one step at a time.

    step():  schedule  →  execute (executor → worker → model runner → model, sampler)  →  update
             (→ propose draft tokens for the next step, when speculative decoding is on)

Each step returns a StepRecord saying what was decided, why, what it cost and what the KV cache
looks like afterwards, so that a learner can replay the engine's life one decision at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict

from engine.artifact import resolve_model_path
from engine.clock import EngineClock
from engine.config import EngineConfig, default_cpu_kv_cache_bytes
from engine.executor.abstract import Executor, ExecutorDiedError, ForkNotSupportedError
from engine.executor.uniproc import UniProcExecutor
from engine.kv_cache import KVCacheManager
from engine.kv_connector import KVConnectorBase_V1, make_kv_connector
from engine.models.config import LlamaConfig
from engine.output import OutputProcessor, RequestOutput
from engine.request import Request, RequestStatus
from engine.sample.sampler import SampleResult
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler_output import Phase, ScheduledRequest, SchedulerOutput
from engine.spec_decode import NgramProposer, SpeculativeConfig
from engine.structured_output import StructuredOutputManager
from engine.tokenizer import Tokenizer
from engine.trace import ScheduledRecord, StepRecord
from engine.utils import cdiv
from engine.worker.model_runner import ModelRunnerOutput
from engine.worker.quantization import check_quantization
from engine.worker.worker import (
    CacheTooSmallError,
    Worker,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)

logger = logging.getLogger(__name__)

INITIAL_STATS = {
    "prompt_tokens": 0,
    "generation_tokens": 0,
    "preemptions": 0,
    "steps": 0,
    "recomputed_tokens": 0,
    "swapped_out_blocks": 0,
    "swapped_in_blocks": 0,
    "swap_seconds": 0.0,
    # speculative decoding (vLLM's counters): steps in which a request verified drafts, draft
    # tokens verified, and how many of those were accepted
    "spec_decode_num_drafts": 0,
    "spec_decode_num_draft_tokens": 0,
    "spec_decode_num_accepted_tokens": 0,
    # KV connector (engine/kv_connector.py): blocks copied in by loads, out by saves, to the
    # host tier by stores; their bytes and measured seconds; loads that failed (recomputed)
    "kv_load_blocks": 0,
    "kv_save_blocks": 0,
    "kv_store_blocks": 0,
    "kv_transfer_bytes": 0,
    "kv_transfer_seconds": 0.0,
    "kv_failed_loads": 0,
}

# What EngineCore.fork may change (the scheduler's and the cache's settings, never the model),
# and the types each takes.
FORKABLE: dict[str, tuple[type, ...]] = {
    "max_num_batched_tokens": (int,),
    "max_num_seqs": (int,),
    "scheduling_policy": (str,),
    "enable_chunked_prefill": (bool,),
    "long_prefill_token_threshold": (int,),
    "preemption_mode": (str,),
    "num_swap_blocks": (int, type(None)),
    "enable_prefix_caching": (bool,),
    "speculative_config": (dict, type(None)),
    "num_kv_blocks": (int,),
}


class EngineCore:
    def __init__(
        self,
        config: EngineConfig | None = None,
        executor: Executor | None = None,
        model_config: LlamaConfig | None = None,
        tokenizer: Tokenizer | None = None,
        **overrides,
    ):
        """Build the parts, size the KV cache, start. `overrides` change a copy of `config` (the
        caller's is never changed; an unknown name raises TypeError)."""
        self.config = config = dataclasses.replace(config or EngineConfig(), **overrides)
        self._load_model(config, model_config, tokenizer)
        self.speculative_config = SpeculativeConfig.from_value(config.speculative_config)
        self.proposer = self._make_proposer(self.speculative_config)
        self.kv_connector = self._make_kv_connector(config)
        self.executor = self._make_executor(config) if executor is None else executor
        self.num_blocks = self._initialize_kv_cache(config)
        self.cuda_graphs = self._configure_cuda_graphs()
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            num_swap_blocks=self.executor.num_swap_blocks,
        )
        self.scheduler = Scheduler(
            self._scheduler_config(config), self.kv_cache_manager, self.kv_connector
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output_manager = StructuredOutputManager(
            self.model_dir / "tokenizer.json" if self.model_dir else None,
            self.model_config.vocab_size,
            self.tokenizer.eos_token_id,
        )
        self.finished_requests: OrderedDict[str, Request] = OrderedDict()
        self.live_requests: dict[str, Request] = {}
        # False: no RequestOutput and no streamed text per step (a simulator, which reads only
        # records, journeys and metrics, turns them off; stop strings are still checked).
        self.emit_outputs = True
        self.stats = dict(INITIAL_STATS)
        self._ids = itertools.count()
        self.clock = EngineClock()
        self._output_failures: dict[str, str] = {}  # this step's requests whose text failed
        self._prefix_cache_counts = (0, 0)  # (queries, hits) at the last step's end
        self._executing: tuple[int, float] | None = None  # (step, monotonic start) while running

    def _load_model(
        self, config: EngineConfig, model_config: LlamaConfig | None, tokenizer: Tokenizer | None
    ) -> None:
        """The model's shapes, tokenizer, device, dtype and context length. A simulated engine
        (engine/tools/simulator.py) passes a preset's shapes and a stand-in tokenizer: there is
        no model directory then. Otherwise both come from the artifact."""
        self.model_dir = resolve_model_path(config.model) if model_config is None else None
        self.model_config = model_config or LlamaConfig.from_model_dir(self.model_dir)
        self.tokenizer = tokenizer or Tokenizer(self.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = config.resolve_max_model_len(
            self.model_config.max_position_embeddings, self.model_config.sliding_window
        )
        check_quantization(
            config.quantization,
            config.quantization_group_size,
            self.device,
            self.model_config,
            self.model_dir,
        )

    @staticmethod
    def _make_proposer(speculative_config: SpeculativeConfig | None) -> NgramProposer | None:
        if speculative_config is None:
            return None
        sc = speculative_config
        return NgramProposer(sc.num_speculative_tokens, sc.prompt_lookup_max, sc.prompt_lookup_min)

    def _make_kv_connector(self, config: EngineConfig) -> KVConnectorBase_V1 | None:
        """The KV connector's scheduler side (the worker builds its worker side), or None."""
        if config.kv_transfer_config is None:
            return None
        block_bytes = self.model_config.kv_bytes_per_block(self.kv_cache_dtype, config.block_size)
        return make_kv_connector(config.kv_transfer_config, config.block_size, block_bytes)

    def _initialize_kv_cache(self, config: EngineConfig) -> int:
        """Size the KV cache (and the swap space) on the executor's workers; the block count.
        A real CPU engine given no size takes the default (a simulated one sizes its own)."""
        kv_cache_memory = config.kv_cache_memory
        on_cpu = self.model_dir is not None and self.device.type == "cpu"
        if on_cpu and kv_cache_memory is None and config.num_kv_blocks is None:
            kv_cache_memory = default_cpu_kv_cache_bytes(
                self.model_config.kv_bytes_per_block(self.kv_cache_dtype, config.block_size),
                config.block_size,
                self.max_model_len,
                config.max_num_seqs,
            )
        return self.executor.initialize(
            self.max_model_len,
            num_kv_blocks=config.num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_swap_blocks=config.num_swap_blocks if config.preemption_mode == "swap" else 0,
        )

    def _scheduler_config(self, config: EngineConfig) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )

    def _make_executor(self, config: EngineConfig) -> Executor:
        """One worker in this process, or (tensor / pipeline parallel) one process per rank."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if (tp, pp) != (1, 1):
            from engine.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor(
                self.model_dir, self.model_config, self.device, self.dtype, config.block_size,
                config.kernels, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                step_timeout_s=config.engine_iteration_timeout_s,
                linear_precision=config.linear_precision, kv_cache_dtype=self.kv_cache_dtype,
            )  # fmt: skip
        return UniProcExecutor(
            Worker(
                self.model_dir,
                self.device,
                self.dtype,
                config.block_size,
                config.kernels,
                quantization=config.quantization,
                quantization_group_size=config.quantization_group_size,
                kv_transfer_config=config.kv_transfer_config,
                linear_precision=config.linear_precision,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        )

    # -- what if? ------------------------------------------------------------------------------

    def fork(self, **changes) -> "EngineCore":
        """A second engine that continues from exactly this state (queues, every request's tokens
        and progress, block tables, the block pool with its hashes and free-list order, the K/V,
        the engine clock, seeded samplers) with some settings changed (FORKABLE). The original
        is untouched. With no changes the fork makes the original's decisions and tokens, given
        the same arrivals (greedy and seeded sampling). Fewer `num_kv_blocks` keep the blocks in
        use and drop free ones; too few to hold what runs are refused with the numbers."""
        if self.kv_connector is not None:  # its channel or tier is not part of the copied state
            raise ForkNotSupportedError("an engine with a KV connector cannot be forked")
        config = self._fork_config(changes)
        twin = copy.copy(self)
        twin.config = config
        memo = {id(x): x for x in (self.tokenizer, self.model_config, self.executor)}
        state = (self.scheduler, self.output_processor, self.live_requests)
        state += (self.finished_requests, self.clock, self.stats)
        state = copy.deepcopy(state, memo)
        (twin.scheduler, twin.output_processor, twin.live_requests) = state[:3]
        (twin.finished_requests, twin.clock, twin.stats) = state[3:]
        twin.kv_cache_manager = twin.scheduler.kv_cache_manager
        next_id = next(self._ids)
        self._ids, twin._ids = itertools.count(next_id), itertools.count(next_id)
        twin._configure_fork(self, config)
        return twin

    def _fork_config(self, changes: dict) -> EngineConfig:
        unknown = sorted(set(changes) - set(FORKABLE))
        if unknown:
            raise ValueError(
                f"a fork cannot change {', '.join(unknown)}; it may change {', '.join(FORKABLE)}"
            )
        for name, value in changes.items():
            types = FORKABLE[name]
            # a bool is an int to Python, never a count here
            if not isinstance(value, types) or isinstance(value, bool) != (bool in types):
                raise ValueError(f"{name} must be {' or '.join(t.__name__ for t in types)}")
        changes.setdefault("num_kv_blocks", self.num_blocks)
        config = dataclasses.replace(self.config, **changes)  # checked in __post_init__
        config.resolve_max_model_len(self.max_model_len, None)  # chunked prefill off: budget
        if config.num_kv_blocks < cdiv(self.max_model_len, config.block_size):  # as at start-up
            raise CacheTooSmallError(config.num_kv_blocks, config.block_size, self.max_model_len)
        return config

    def _configure_fork(self, original: "EngineCore", config: EngineConfig) -> None:
        """The fork's own cache, swap space, scheduler settings and drafting (called on the fork
        right after the state was copied)."""
        kv = self.kv_cache_manager
        block_map = kv.resize(config.num_kv_blocks)
        kv.set_prefix_caching(config.enable_prefix_caching)
        self.scheduler.reconfigure(self._scheduler_config(config))
        num_swap = self._fork_swap_space(original.config, config)
        self.executor = original.executor.fork(
            block_map, config.num_kv_blocks, num_swap, self.clock
        )
        self.num_blocks = config.num_kv_blocks
        self.speculative_config = SpeculativeConfig.from_value(config.speculative_config)
        self.proposer = self._make_proposer(self.speculative_config)
        k = self.speculative_config.num_speculative_tokens if self.speculative_config else 0
        for request in self.scheduler.running:
            request.spec_token_ids = request.spec_token_ids[:k]
        self.cuda_graphs = self._configure_cuda_graphs()
        self._output_failures, self._executing = {}, None

    def _fork_swap_space(self, before: EngineConfig, after: EngineConfig) -> int:
        """The fork's swap blocks: the original's (copied) unless the preemption mode or the swap
        size changed; then a fresh swap space (refused while requests are swapped out)."""
        kv = self.kv_cache_manager
        mode = (after.preemption_mode, after.num_swap_blocks)
        if mode == (before.preemption_mode, before.num_swap_blocks):
            return kv.swap_space.num_blocks
        num_swap = 0
        if after.preemption_mode == "swap":
            num_swap = after.num_swap_blocks
            num_swap = after.num_kv_blocks if num_swap is None else num_swap
        kv.resize_swap_space(num_swap)
        return num_swap

    def shutdown(self) -> None:
        """Stop the executor's worker processes (if any). Also happens when the engine is
        garbage-collected and at interpreter exit."""
        self.executor.shutdown()

    def _configure_cuda_graphs(self) -> str:
        """Decode steps replay CUDA graphs on a GPU unless `enforce_eager`
        (engine/worker/cuda_graphs.py)."""
        if self.device.type != "cuda" or not isinstance(self.executor, UniProcExecutor):
            return f"off (device is {self.device.type})"
        from engine.worker.cuda_graphs import configure_engine

        return configure_engine(self)

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        engine_arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize, validate and queue a request. Raises InvalidRequestError for bad input.
        `arrival_time` is wall time (perf_counter); `engine_arrival_time` is on the engine clock
        (default: now), for a workload whose arrivals are scheduled in engine time. Requests share
        prefix-cache blocks only when their `cache_salt` is equal (None is a salt too)."""
        request = self.make_request(
            prompt,
            sampling_params,
            request_id,
            prompt_token_ids,
            priority,
            arrival_time,
            engine_arrival_time,
            cache_salt,
        )
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
        engine_arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate without touching the engine's state (safe from any thread)."""
        params = sampling_params or SamplingParams()
        params.verify()
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("a prompt or prompt_token_ids is required", "prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.model_config.vocab_size})", "prompt"
            )
        self.check_length(len(prompt_token_ids), params.max_tokens)
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.tokenizer.eos_token_id,
            prompt,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival,
            engine_clock=self.clock.now,
        )
        if params.structured_outputs is not None:  # compiled once, cached (the server did it)
            grammar = self.structured_output_manager.make_request(params.structured_outputs)
            request.structured_output_request = grammar
        event = request.record("arrival")
        event.time = arrival
        if engine_arrival_time is not None:
            event.engine_time = engine_arrival_time
        request.record("tokenized", num_prompt_tokens=len(prompt_token_ids))
        return request

    def queue_request(self, request: Request) -> None:
        if request.request_id in self.live_requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use", "request_id"
            )
        self.live_requests[request.request_id] = request
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """Prompt plus requested output must fit the model's context (error names both numbers)."""
        total = num_prompt_tokens + (max_tokens or 0)
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                "but the request has "
                f"{num_prompt_tokens} prompt tokens and asks for {max_tokens or 0} output tokens "
                f"({total} in total)",
                "max_tokens" if num_prompt_tokens < self.max_model_len else "prompt",
                max_model_len=self.max_model_len,
                num_prompt_tokens=num_prompt_tokens,
                max_tokens=max_tokens or 0,
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

    def weight_bytes(self) -> int:
        """Bytes of model weights the executor's workers hold."""
        return self.executor.weight_bytes()

    def kv_cache_bytes(self) -> int:
        """Bytes of KV-cache memory allocated (all blocks, K and V, all layers)."""
        return self.executor.kv_cache_bytes()

    def spec_decode_metrics(self) -> dict:
        """The run's speculation so far: acceptance rate = accepted / proposed draft tokens; mean
        accepted length = tokens emitted per verifying step (accepted drafts + the model's own)."""
        drafts = self.stats["spec_decode_num_drafts"]
        proposed = self.stats["spec_decode_num_draft_tokens"]
        accepted = self.stats["spec_decode_num_accepted_tokens"]
        return {
            "num_drafts": drafts,
            "num_draft_tokens": proposed,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        }

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_request(self, request_id: str) -> Request | None:
        return self.live_requests.get(request_id) or self.finished_requests.get(request_id)

    def all_requests(self) -> list[Request]:
        return list(self.finished_requests.values()) + list(self.live_requests.values())

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """One engine iteration: schedule → execute → update → record."""
        engine_start = self.clock.now()
        self.clock.start_step()
        timer = StepTimer()
        scheduler_output = self.scheduler.schedule()
        timer.lap("schedule")
        runner_output = self._execute(scheduler_output)
        timer.lap("execute")
        outputs = self._process_outputs(scheduler_output, runner_output)
        timer.lap("output_processing")
        if self.proposer is not None:
            self._propose_drafts()
            timer.lap("propose")
        duration = self.clock.end_step(runner_output.simulated_duration)
        return self._make_record(
            scheduler_output, runner_output, outputs, timer, engine_start, duration
        )

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model. If the forward itself fails, only the step's requests fail."""
        self._executing = (scheduler_output.step, time.monotonic())
        try:
            return self.executor.execute_model(scheduler_output)
        except ExecutorDiedError:  # no worker left to run the next step: the engine stops
            raise
        except Exception as error:  # noqa: BLE001 — one bad step must not stop the engine loop
            logger.exception("step %d: the forward pass failed", scheduler_output.step)
            message = f"the model failed in step {scheduler_output.step} ({type(error).__name__})"
            return ModelRunnerOutput(
                {}, failed={s.request_id: message for s in scheduler_output.scheduled}
            )
        finally:
            self._executing = None

    def stalled(self) -> str | None:
        """Why the engine is not making progress, or None: a step that has run past the engine
        iteration timeout (a hung worker, a deadlocked kernel). Read from any thread (the
        server's /health); the multi-process executor gives such a step up by itself."""
        executing = self._executing
        if executing is None:
            return None
        step, started = executing
        elapsed, limit = time.monotonic() - started, self.config.engine_iteration_timeout_s
        if elapsed <= limit:
            return None
        return (
            f"step {step} has run for {elapsed:.0f} s, past the engine iteration timeout "
            f"({limit:g} s): the engine is not making progress"
        )

    def _process_outputs(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list:
        """New tokens → the scheduler (one stop check per token, after the token's text is known),
        streamed text, journeys. A request may bring several tokens (speculative decoding): none
        after the first that stops it (EOS, stop token, max_tokens, max_model_len, or a stop
        string in the text) is kept."""
        if runner_output.failed_kv_loads:  # left out of the forward: recomputed from scratch
            self.scheduler.reset_failed_kv_loads(
                runner_output.failed_kv_loads, scheduler_output.step
            )
        self._fail_requests(runner_output.failed, scheduler_output.step)
        new_tokens = {
            request_id: [r.token_id for r in results]
            for request_id, results in runner_output.sampled.items()
            if request_id in self.live_requests
        }
        num_before = {rid: self.live_requests[rid].num_output_tokens for rid in new_tokens}
        self._output_failures = {}
        finished = self.scheduler.update_from_output(
            scheduler_output, new_tokens, on_token=self._detokenize
        )
        for request_id in self._output_failures:  # its text failed: this step's tokens are not kept
            del self.live_requests[request_id].output_token_ids[num_before[request_id] :]
        failed = {**runner_output.failed, **self._output_failures}
        self._fail_requests(self._output_failures, scheduler_output.step)
        finished_ids = {r.request_id for r in finished}
        now = time.perf_counter()
        outputs = [
            self.output_processor.make_error_output(self.get_request(rid))
            for rid in failed
            if self.get_request(rid) is not None
        ]
        for request_id, before in num_before.items():
            request = self.live_requests.get(request_id)
            if request is not None:
                tokens = request.output_token_ids[before:]
                self._keep_logprobs(request, runner_output.sampled[request_id][: len(tokens)])
                output = self._emit_tokens(
                    request, tokens, request_id in finished_ids, scheduler_output.step, now
                )
                if output is not None:
                    outputs.append(output)
        return outputs

    def _detokenize(self, request: Request, token: int) -> str | None:
        """A token the scheduler just appended, as text (when text is wanted or stop strings are
        set): the stop string the text now contains, if any. A failure fails this request only."""
        request_id = request.request_id
        if request_id in self._output_failures:
            return None
        if not (self.emit_outputs or request.sampling_params.stop):
            return None
        try:
            return self.output_processor.process_tokens(request, [token])
        except Exception as error:  # noqa: BLE001 — fail this request only
            logger.exception("request %s: output processing failed", request_id)
            self._output_failures[request_id] = f"output processing failed ({type(error).__name__})"
            return None

    def _emit_tokens(
        self, request: Request, tokens: list[int], is_finished: bool, step: int, now: float
    ) -> RequestOutput | None:
        """Journey events (one per token) and the RequestOutput for this step's new tokens
        (retires a finished request). Tokens verified together arrive at the same time."""
        for token in tokens:
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
                request.record("first_token", step, token_id=token).time = now
            else:
                request.record("token", step, token_id=token).time = now
        if is_finished:
            request.finish_time = now
            request.record("finished", step, reason=request.finish_reason)
        output = None
        if self.emit_outputs:
            output = self.output_processor.make_output(request, list(tokens), is_finished)
            if output.delta_text:
                request.record("streamed", step, chars=len(output.delta_text))
        if is_finished:
            self._retire(request)
        return output

    @staticmethod
    def _keep_logprobs(request: Request, results: list[SampleResult]) -> None:
        if request.sampling_params.logprobs is not None:
            for result in results:
                request.output_logprobs.append(
                    {
                        "token_id": result.token_id,
                        "logprob": result.logprob,
                        "top_logprobs": result.top_logprobs,
                    }
                )

    def _propose_drafts(self) -> None:
        """Speculative decoding: draft the next tokens of every running request about to decode
        (the scheduler decides next step how many of them fit). Not for a request with structured
        outputs: each draft position would need its own mask, computed from the grammar state
        after the drafts before it, and this engine verifies drafts without masks."""
        for request in self.scheduler.running:
            decoding = request.num_tokens - request.num_computed_tokens == 1
            decoding = decoding and request.structured_output_request is None
            drafts = self.proposer.propose(request.all_token_ids) if decoding else []
            request.spec_token_ids = drafts

    def _fail_requests(self, errors: dict[str, str], step: int) -> None:
        """End requests the engine could not serve; their clients get the error, the loop goes
        on."""
        for request_id, message in errors.items():
            request = self.live_requests.get(request_id)
            if request is None:
                continue
            request.error = message
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
            request.status = RequestStatus.FINISHED_ERROR  # also when this step had finished it
            request.finish_reason = request.status.value
            request.finish_time = time.perf_counter()
            request.record("finished", step, reason=request.finish_reason, error=message)
            self._retire(request)

    def _make_record(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        outputs: list,
        timer: "StepTimer",
        engine_start: float,
        engine_duration: float,
    ) -> StepRecord:
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(scheduler_output.preempted)
        self.stats["prompt_tokens"] += sum(
            s.num_tokens for s in scheduler_output.scheduled if s.phase != Phase.DECODE
        )
        self.stats["generation_tokens"] += sum(len(o.delta_token_ids) for o in outputs)
        self.stats["recomputed_tokens"] += sum(
            s.num_recomputed_tokens for s in scheduler_output.scheduled
        )
        self.stats["swapped_out_blocks"] += len(scheduler_output.blocks_to_swap_out)
        self.stats["swapped_in_blocks"] += len(scheduler_output.blocks_to_swap_in)
        self.stats["swap_seconds"] += runner_output.timings.get("swap", 0.0)
        scheduled = [self._scheduled_record(s, runner_output) for s in scheduler_output.scheduled]
        for record in scheduled:
            record.num_allowed_tokens = scheduler_output.grammar_num_allowed.get(record.request_id)
        self._count_speculation(scheduled)
        kv_seconds = self._count_kv_transfers(runner_output)
        finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
        kv = self.kv_cache_manager.snapshot()
        queries, hits = self._prefix_cache_counts
        self._prefix_cache_counts = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        return StepRecord(
            step=scheduler_output.step,
            start_time=timer.start,
            timings={
                "schedule": timer.laps["schedule"],
                "prepare_inputs": runner_output.timings.get("prepare_inputs", 0.0),
                "forward": runner_output.timings.get("forward", 0.0),
                "sample": runner_output.timings.get("sample", 0.0),
                "output_processing": timer.laps["output_processing"],
                **({"propose": timer.laps["propose"]} if "propose" in timer.laps else {}),
                **({"kv_transfer": kv_seconds} if runner_output.kv_transfers else {}),
            },
            scheduled=scheduled,
            unscheduled=scheduler_output.unscheduled,
            preempted=scheduler_output.preempted,
            token_budget=scheduler_output.token_budget,
            max_num_seqs=self.config.max_num_seqs,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            new_tokens={o.request_id: o.delta_token_ids for o in outputs if o.delta_token_ids},
            finished=finished,
            kv=kv,
            outputs=outputs,
            engine_start_time=engine_start,
            engine_duration=engine_duration,
            num_swapped_out_blocks=len(scheduler_output.blocks_to_swap_out),
            num_swapped_in_blocks=len(scheduler_output.blocks_to_swap_in),
            swap_seconds=runner_output.timings.get("swap", 0.0),
            prefix_cache_queries=kv.prefix_cache_queries - queries,
            prefix_cache_hits=kv.prefix_cache_hits - hits,
            workers=runner_output.workers,
            kv_transfers=runner_output.kv_transfers,
            grammar_mask_seconds=scheduler_output.grammar_mask_seconds,
            num_masked_requests=len(scheduler_output.grammar_bitmask),
        )

    def _scheduled_record(
        self, s: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> ScheduledRecord:
        """What one request did in the step; with drafts, also how many the model accepted and
        the token it added itself (the correction at the first rejection, or the bonus)."""
        record = ScheduledRecord(
            s.request_id,
            s.phase.value,
            s.num_tokens,
            s.num_computed_tokens,
            self._num_prompt_tokens(s.request_id),
            s.num_prefix_hit_tokens,
            s.num_recomputed_tokens,
            num_external_tokens=s.num_external_tokens,
        )
        record.mask_report = runner_output.mask_reports.get(s.request_id)
        results = runner_output.sampled.get(s.request_id, [])
        if s.draft_token_ids and results:
            record.draft_token_ids = list(s.draft_token_ids)
            record.num_accepted_tokens = len(results) - 1
            record.bonus_token_id = results[-1].token_id
        return record

    def _count_speculation(self, scheduled: list[ScheduledRecord]) -> None:
        for record in scheduled:
            if record.draft_token_ids:
                self.stats["spec_decode_num_drafts"] += 1
                self.stats["spec_decode_num_draft_tokens"] += len(record.draft_token_ids)
                self.stats["spec_decode_num_accepted_tokens"] += record.num_accepted_tokens

    def _count_kv_transfers(self, runner_output: ModelRunnerOutput) -> float:
        """Add the step's KV copies to the stats; their measured seconds (a phase of the step)."""
        seconds = sum(record.seconds for record in runner_output.kv_transfers)
        for record in runner_output.kv_transfers:
            if record.ok:
                self.stats[f"kv_{record.direction}_blocks"] += record.num_blocks
                self.stats["kv_transfer_bytes"] += record.num_bytes
        self.stats["kv_transfer_seconds"] += seconds
        self.stats["kv_failed_loads"] += len(runner_output.failed_kv_loads)
        return seconds

    def _retire(self, request: Request) -> None:
        self.live_requests.pop(request.request_id, None)
        self.output_processor.states.pop(request.request_id, None)  # (gone already if emitted)
        self.finished_requests[request.request_id] = request
        while len(self.finished_requests) > self.config.keep_finished:
            self.finished_requests.popitem(last=False)

    def _num_prompt_tokens(self, request_id: str) -> int:
        request = self.get_request(request_id)
        return request.num_prompt_tokens if request else 0


class StepTimer:
    """Wall time of a step's phases: `lap(name)` closes the phase that ran since the last lap."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now
