"""The scheduler: each step, which requests run and how many tokens each (control path only).

One decision per step, `{request_id: num_tokens}`, as in vLLM V1. Prompt tokens and generated
tokens are scheduled the same way: a request still reading its prompt gets a chunk of it (chunked
prefill), a generating request gets one token. The decision obeys two limits: a token budget per
step (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`).

Order: running requests first (so ongoing generations keep flowing), then waiting ones, FCFS or by
priority. If a running request needs a KV block and none is free, the most recently admitted
running request (the lowest-priority one, under the priority policy) is preempted: its blocks are
freed and it goes back to the head of the queue, to be recomputed later.

The "static" policy is classic static batching, kept for chapter 07's comparison: a batch is
formed when nothing runs, and nothing new is admitted until every request of it has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

# Why a request got no tokens this step (shown in the app's decision table).
REASON_TOKEN_BUDGET = "token_budget"
REASON_NO_KV_BLOCKS = "no_free_kv_blocks"
REASON_MAX_NUM_SEQS = "max_num_seqs"
REASON_PREEMPTED = "preempted"
REASON_STATIC_BATCH = "static_batch_in_progress"

POLICIES = ("fcfs", "priority", "static")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 8192
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledRequest:
    """One request's share of a step: plain data, enough for a worker in another process."""

    request_id: str
    phase: str  # "prefill" (whole prompt at once), "chunked_prefill" or "decode"
    num_tokens: int
    num_computed_tokens: int  # tokens already in the cache before this step
    token_ids: list[int]  # the tokens to run now
    block_ids: list[int]  # the request's block table
    sampling_params: SamplingParams
    produces_token: bool  # False for a prefill chunk that does not reach the end of the prompt
    num_prefix_hit_tokens: int = 0  # tokens found in the prefix cache when admitted this step


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest]
    unscheduled: dict[str, str]  # request_id → reason
    preempted: list[str]
    token_budget: int
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        if config.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {config.policy!r}")
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.static_batch: set[str] = set()
        self.finished_since_last_step: list[str] = []
        self.step_index = 0
        self.num_preemptions = 0

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.record("queued", waiting=len(self.waiting))

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string): free their blocks at once."""
        for request_id in list(request_ids):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            if request in self.waiting:
                self.waiting.remove(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the decision --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        step = self.step_index
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        unscheduled: dict[str, str] = {}
        preempted: list[str] = []

        # 1. Running requests, oldest first.
        i = 0
        while i < len(self.running):
            request = self.running[i]
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                unscheduled[request.request_id] = REASON_TOKEN_BUDGET
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                if victim.request_id in scheduled:  # priority policy: the victim may already have its share
                    budget += scheduled.pop(victim.request_id).num_tokens
                if self.running.index(victim) < i:
                    i -= 1  # keep `i` on the current request once the list closes up
                self._preempt(victim, step)
                preempted.append(victim.request_id)
                unscheduled[victim.request_id] = REASON_PREEMPTED
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = self._make_scheduled(request, num_new)
                budget -= num_new
                i += 1
                continue
            # the request preempted itself; `running` shrank, so `i` already points at the next one

        # 2. Waiting requests, unless this step already had to preempt.
        if self.config.policy == "static" and not self.running and not self.static_batch:
            self.static_batch = {r.request_id for r in self.waiting[: self.config.max_num_seqs]}
        blocked = REASON_NO_KV_BLOCKS if preempted else None  # FCFS: once one waits, all behind it wait
        for request in self._waiting_in_order():
            request_id = request.request_id
            if self.config.policy == "static" and request_id not in self.static_batch:
                unscheduled[request_id] = REASON_STATIC_BATCH
                continue
            if blocked is None and len(self.running) >= self.config.max_num_seqs:
                blocked = REASON_MAX_NUM_SEQS
            if blocked is None:
                blocked = self._admit(request, budget, step, scheduled)
                if blocked is None:
                    budget -= scheduled[request_id].num_tokens
                    continue
            unscheduled.setdefault(request_id, blocked)  # a victim keeps "preempted"

        for s in scheduled.values():  # only now is the decision final (a victim may have lost its share)
            self.requests[s.request_id].record("scheduled", step, phase=s.phase, num_tokens=s.num_tokens,
                                               start=s.num_computed_tokens)
        finished_ids, self.finished_since_last_step = self.finished_since_last_step, []
        return SchedulerOutput(
            step=step,
            scheduled=list(scheduled.values()),
            unscheduled=unscheduled,
            preempted=preempted,
            token_budget=self.config.max_num_batched_tokens,
            finished_ids=finished_ids,
        )

    def _admit(self, request: Request, budget: int, step: int, scheduled: dict) -> str | None:
        """Move a waiting request to running if its first chunk fits; else return why not."""
        computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        request.num_computed_tokens = num_cached
        num_new = self._num_tokens_to_schedule(request, budget)
        if num_new == 0:
            request.num_computed_tokens = 0
            return REASON_TOKEN_BUDGET
        request.num_computed_tokens = 0
        if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
            return REASON_NO_KV_BLOCKS
        self.kv.record_prefix_lookup(request.num_tokens, num_cached)
        request.num_computed_tokens = request.num_cached_tokens = num_cached
        self.waiting.remove(request)
        self.running.append(request)
        if request.status == RequestStatus.PREEMPTED:
            request.record("resumed", step)
        request.status = RequestStatus.RUNNING
        scheduled[request.request_id] = self._make_scheduled(request, num_new)
        scheduled[request.request_id].num_prefix_hit_tokens = num_cached
        return None

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        """All tokens not yet computed, cut to the budget (or 0 if chunking is off and it won't fit)."""
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        if start >= request.num_prompt_tokens and num_new == 1:
            phase = "decode"
        elif start == request.num_cached_tokens and end == request.num_tokens:
            phase = "prefill"
        else:
            phase = "chunked_prefill"
        return ScheduledRequest(
            request_id=request.request_id,
            phase=phase,
            num_tokens=num_new,
            num_computed_tokens=start,
            token_ids=request.all_token_ids[start:end],
            block_ids=self.kv.block_ids(request.request_id),
            sampling_params=request.sampling_params,
            produces_token=end == request.num_tokens,
        )

    def _waiting_in_order(self) -> list[Request]:
        if self.config.policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return list(self.waiting)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, step: int) -> None:
        """Free the victim's KV and put it back at the head of the queue; it will be recomputed."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)
        request.record("preempted", step)

    # -- after the model ran -------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance each scheduled request, append its new token, stop it if it is done.
        Returns the requests that finished in this step."""
        finished = []
        for s in output.scheduled:
            request = self.requests.get(s.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += s.num_tokens
            self.kv.cache_full_blocks(request)
            if s.request_id not in sampled:
                continue
            request.output_token_ids.append(sampled[s.request_id])
            status = self._check_stop(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finish_reason = status.value
        self.kv.free(request)
        self.static_batch.discard(request.request_id)
        self.finished_since_last_step.append(request.request_id)
        del self.requests[request.request_id]
