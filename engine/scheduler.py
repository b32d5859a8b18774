"""The scheduler: each step, which requests run and how many tokens each (control path only).

One decision per step, `{request_id: num_tokens}`, as in vLLM V1. Prompt tokens and generated
tokens are scheduled the same way: a request still reading its prompt gets a chunk of it (chunked
prefill), a generating request gets one token. The decision obeys two limits: a token budget per
step (`max_num_batched_tokens`) and a cap on running requests (`max_num_seqs`).

With speculative decoding a generating request also gets its draft tokens (`spec_token_ids`,
proposed after the last step): 1 + d tokens, counted in the budget and given KV slots like any
other, verified in the same forward. Drafts never cost anyone else their place: they are cut to
the budget, to the request's remaining max_tokens and max_model_len, and dropped when their
KV slots would need a preemption. After the step the request keeps only the accepted ones.

Order: running requests first (so ongoing generations keep flowing), then waiting ones, FCFS or by
priority. If a running request needs a KV block and none is free, the most recently admitted
running request (the lowest-priority one, under the priority policy) is preempted: its blocks are
freed and it goes back to the head of the queue. Its K/V are then either recomputed when it
resumes (`preemption_mode="recompute"`, vLLM V1's only mode) or copied to a bounded swap space in
host memory and copied back (`"swap"`, vLLM V0's other mode; when the swap space is full, the
request is recomputed instead).

The "static" policy is classic static batching, kept for chapter 07's comparison: a batch is
formed when nothing runs, and nothing new is admitted until every request of it has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.config import (
    DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
)
from engine.kv_cache import KVCacheManager
from engine.kv_connector import KVConnectorBase_V1
from engine.request import Request, RequestStatus
from engine.scheduler_output import Phase, ScheduledRequest, SchedulerOutput
from engine.structured_output import grammar_bitmask

# Why a request got no tokens this step (shown in the app's decision table).
REASON_TOKEN_BUDGET = "token_budget"
REASON_NO_KV_BLOCKS = "no_free_kv_blocks"
REASON_MAX_NUM_SEQS = "max_num_seqs"
REASON_PREEMPTED = "preempted"
REASON_STATIC_BATCH = "static_batch_in_progress"


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = 8192
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap"
    # max prompt tokens per request per step (0: no cap); 64 by default, not vLLM's 0 (config.py)
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD


PREEMPTION_MODES = ("recompute", "swap")


class TokenBudget:
    """The step's token budget: how many tokens are left, and how many a request may take."""

    def __init__(
        self,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
    ):
        self.remaining = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold

    def fit(self, num_uncomputed_tokens: int) -> int:
        """Tokens a request may run now: all it has left, cut to the budget. Without chunked
        prefill a request that does not fit whole gets none. With chunked prefill a long prompt
        is also cut to `long_prefill_token_threshold` (unless 0), which leaves the rest of the
        budget to the requests behind it: prefill fairness. The cut holds even when nothing else
        waits, as in vLLM V1's scheduler: a lone long prompt simply takes more, smaller steps."""
        if not self.enable_chunked_prefill:
            return num_uncomputed_tokens if num_uncomputed_tokens <= self.remaining else 0
        wanted = num_uncomputed_tokens
        if 0 < self.long_prefill_token_threshold < wanted:
            wanted = self.long_prefill_token_threshold
        return min(wanted, self.remaining)


@dataclass
class StepPlan:
    """The decision under construction: who runs how many tokens, who waits and why."""

    step: int
    budget: TokenBudget
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    unscheduled: dict[str, str] = field(default_factory=dict)  # request_id → reason
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def add(self, scheduled: ScheduledRequest) -> None:
        self.scheduled[scheduled.request_id] = scheduled
        self.budget.remaining -= scheduled.num_tokens

    def withdraw(self, request_id: str) -> None:
        """A request scheduled earlier in this step was preempted: its tokens return to the
        budget."""
        if request_id in self.scheduled:
            self.budget.remaining += self.scheduled.pop(request_id).num_tokens


class SchedulingPolicy:
    """FCFS: waiting requests in arrival order; the newest running request is preempted first."""

    name = "fcfs"

    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        return list(waiting)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def begin_admission(
        self, waiting: list[Request], running: list[Request], max_num_seqs: int
    ) -> None:
        """Called once per step before waiting requests are considered."""

    def may_admit(self, request: Request) -> bool:
        return True

    def on_finish(self, request: Request) -> None:
        pass


class PriorityPolicy(SchedulingPolicy):
    """Lower `priority` value first (then earlier arrival); the least important runs are
    preempted."""

    name = "priority"

    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))


class StaticBatchingPolicy(SchedulingPolicy):
    """Static batching (chapter 07's baseline): a batch forms only when nothing runs, and nothing
    joins it until all of it has finished."""

    name = "static"

    def __init__(self) -> None:
        self.batch: set[str] = set()

    def begin_admission(
        self, waiting: list[Request], running: list[Request], max_num_seqs: int
    ) -> None:
        if not running and not self.batch:
            self.batch = {r.request_id for r in waiting[:max_num_seqs]}

    def may_admit(self, request: Request) -> bool:
        return request.request_id in self.batch

    def on_finish(self, request: Request) -> None:
        self.batch.discard(request.request_id)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "static": StaticBatchingPolicy,
}


def check_stop(
    request: Request, max_model_len: int, stop_string: str | None = None
) -> RequestStatus | None:
    """Whether the token just appended to `request` ends it (vLLM's `check_stop`), called once per
    new token; sets the request's stop_reason. A stop string the text now contains wins, even over
    the length limit; EOS and stop tokens count only after `min_tokens`; then `max_tokens`, then
    the context (`max_model_len`)."""
    if stop_string is not None:
        request.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
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
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {tuple(POLICIES)}, got {name!r}")
    return POLICIES[name]()


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        kv_connector: KVConnectorBase_V1 | None = None,
    ):
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}"
            )
        self.config = config
        self.policy = make_policy(config.policy)
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.finished_since_last_step: list[str] = []
        self.step_index = 0
        self.num_preemptions = 0
        # A KV connector (engine/kv_connector.py): K/V loaded from outside at admission, saved
        # for a consumer, evicted prefix blocks stored to a host tier. Finished requests whose
        # blocks it keeps until a save has run: waiting for the next step, then freed after it.
        self.kv_connector = kv_connector
        self._delayed_free: list[Request] = []
        self._freeing: list[Request] = []
        if kv_connector is not None:
            kv_connector.hash_fn = kv_cache_manager.hash_fn
            kv_cache_manager.block_pool.on_evict = kv_connector.block_evicted

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)
        request.record("queued", waiting=len(self.waiting))

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """End requests from outside the step (abort, error): free their blocks at once."""
        for request_id in list(request_ids):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            if request in self.waiting:
                self.waiting.remove(request)
            if request.is_swapped_out:
                self.kv_cache_manager.drop_swapped(request)
                request.is_swapped_out = False
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """New settings from the next step on (EngineCore.fork). A new policy starts with no
        history; leaving swap preemption turns every swapped-out request into a recompute one,
        the way a preemption without swap space would have left it."""
        if config.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}"
            )
        if config.policy != self.config.policy:
            self.policy = make_policy(config.policy)
        if config.preemption_mode != "swap":
            for request in self.waiting:
                if request.is_swapped_out:
                    self.kv_cache_manager.drop_swapped(request)
                    request.is_swapped_out = False
                    request.num_computed_tokens = request.num_cached_tokens = 0
        self.config = config

    # -- the decision --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Running requests first (ongoing generations keep flowing), then waiting ones."""
        self.step_index += 1
        plan = StepPlan(
            self.step_index,
            TokenBudget(
                self.config.max_num_batched_tokens,
                self.config.enable_chunked_prefill,
                self.config.long_prefill_token_threshold,
            ),
        )
        self._schedule_running(plan)
        self._schedule_waiting(plan)
        return self._finalize(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Each running request gets its next tokens; if the KV cache is full, someone is
        preempted."""
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room for another
            num_new = plan.budget.fit(request.num_tokens - request.num_computed_tokens)
            if num_new == 0:
                plan.unscheduled[request.request_id] = REASON_TOKEN_BUDGET
                continue
            drafts = self._reserve_drafts(request, num_new, plan.budget)
            if self._make_room(request, num_new + len(drafts), plan):
                plan.add(self._make_scheduled(request, num_new, draft_token_ids=drafts))

    def _reserve_drafts(self, request: Request, num_new: int, budget: TokenBudget) -> list[int]:
        """The draft tokens a decoding request verifies this step, with KV slots allocated for
        them; [] if it has none, or if the slots would need a preemption (drafts are optional)."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        # Every draft may be accepted, plus one token: the request must stay within its limits.
        room = min(budget.remaining - 1, self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        drafts = drafts[: max(room, 0)]
        if drafts and self.kv_cache_manager.allocate_slots(request, 1 + len(drafts)) is None:
            return []
        return drafts

    def _make_room(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Allocate KV slots for `num_new` tokens, preempting running requests (the policy picks
        whom) until they fit. False if the request itself had to be preempted."""
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.policy.pick_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in the policy's order while they fit. Once one cannot be
        admitted, all behind it wait too (no overtaking), and none is admitted after a
        preemption."""
        self.policy.begin_admission(self.waiting, self.running, self.config.max_num_seqs)
        blocked = REASON_NO_KV_BLOCKS if plan.preempted else None
        for request in self.policy.order_waiting(self.waiting):
            if not self.policy.may_admit(request):
                plan.unscheduled[request.request_id] = REASON_STATIC_BATCH
                continue
            if blocked is None and len(self.running) >= self.config.max_num_seqs:
                blocked = REASON_MAX_NUM_SEQS
            if blocked is None:
                blocked = self._admit(request, plan)
            if blocked is not None:
                plan.unscheduled.setdefault(
                    request.request_id, blocked
                )  # a victim keeps "preempted"

    def _admit(self, request: Request, plan: StepPlan) -> str | None:
        """Move a waiting request to running if its first chunk fits; else return why not."""
        if request.is_swapped_out:
            return self._swap_in(request, plan)
        kv = self.kv_cache_manager
        computed_blocks, num_cached = kv.get_computed_blocks(request)
        num_external = 0
        if self.kv_connector is not None:  # K/V beyond the device hits, loaded, not computed
            num_external = self.kv_connector.get_num_new_matched_tokens(request, num_cached)
        num_new = plan.budget.fit(request.num_tokens - num_cached - num_external)
        if num_new == 0:
            return REASON_TOKEN_BUDGET
        if kv.allocate_slots(request, num_external + num_new, computed_blocks) is None:
            return REASON_NO_KV_BLOCKS
        kv.record_prefix_lookup(request.num_tokens, num_cached)
        request.num_computed_tokens = num_cached
        if self.kv_connector is not None:
            block_ids = kv.block_ids(request.request_id)
            self.kv_connector.update_state_after_alloc(request, block_ids, num_external)
        request.num_computed_tokens = request.num_cached_tokens = num_cached + num_external
        self._start_running(request, plan, mode="recompute")
        plan.add(
            self._make_scheduled(request, num_new, num_cached, num_external_tokens=num_external)
        )
        return None

    def _swap_in(self, request: Request, plan: StepPlan) -> str | None:
        """Resume a swapped-out request: fresh blocks, its K/V copied back before the forward."""
        num_new = plan.budget.fit(request.num_tokens - request.num_computed_tokens)
        if num_new == 0:
            return REASON_TOKEN_BUDGET
        pairs = self.kv_cache_manager.swap_in(request, num_new)
        if pairs is None:
            return REASON_NO_KV_BLOCKS
        plan.swap_in += pairs
        request.is_swapped_out = False
        self._start_running(request, plan, mode="swap", blocks=len(pairs))
        plan.add(self._make_scheduled(request, num_new))
        return None

    def _start_running(self, request: Request, plan: StepPlan, **detail) -> None:
        self.waiting.remove(request)
        self.running.append(request)
        if request.status == RequestStatus.PREEMPTED:
            request.record("resumed", plan.step, **detail)
        request.status = RequestStatus.RUNNING

    def _finalize(self, plan: StepPlan) -> SchedulerOutput:
        for s in (
            plan.scheduled.values()
        ):  # only now is the decision final (a victim may have lost its share)
            drafts = {"num_draft_tokens": len(s.draft_token_ids)} if s.draft_token_ids else {}
            self.requests[s.request_id].record(
                "scheduled",
                plan.step,
                phase=s.phase.value,
                num_tokens=s.num_tokens,
                start=s.num_computed_tokens,
                **drafts,
            )
        finished_ids, self.finished_since_last_step = self.finished_since_last_step, []
        masks = self._grammar_bitmask(plan)
        output = SchedulerOutput(
            step=plan.step,
            scheduled=list(plan.scheduled.values()),
            unscheduled=plan.unscheduled,
            preempted=plan.preempted,
            token_budget=self.config.max_num_batched_tokens,
            finished_ids=finished_ids,
            blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in,
            grammar_bitmask=masks.masks,
            grammar_num_allowed=masks.num_allowed,
            grammar_mask_seconds=masks.seconds,
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output)
            self._freeing, self._delayed_free = self._delayed_free, []  # their saves run now
        return output

    def _grammar_bitmask(self, plan: StepPlan):
        """Structured outputs: the token mask of each request that samples under a grammar now
        (its matcher holds exactly its output tokens, also after a recompute preemption)."""
        grammars = {}
        for s in plan.scheduled.values():
            grammar = self.requests[s.request_id].structured_output_request
            if s.produces_token and grammar is not None:
                grammars[s.request_id] = grammar
        return grammar_bitmask(grammars)

    def _make_scheduled(
        self,
        request: Request,
        num_new: int,
        num_prefix_hit_tokens: int = 0,
        draft_token_ids: list[int] | None = None,
        num_external_tokens: int = 0,
    ) -> ScheduledRequest:
        """`num_new` of the request's own tokens from its first uncomputed one, then its drafts."""
        drafts = list(draft_token_ids or [])
        start = request.num_computed_tokens
        end = start + num_new
        if start >= request.num_prompt_tokens and num_new == 1:
            phase = Phase.DECODE
        elif start == request.num_cached_tokens and end == request.num_tokens:
            phase = Phase.PREFILL
        else:
            phase = Phase.CHUNKED_PREFILL
        return ScheduledRequest(
            request_id=request.request_id,
            phase=phase,
            num_tokens=num_new + len(drafts),
            num_computed_tokens=start,
            token_ids=request.token_ids(start, end) + drafts,
            block_ids=self.kv_cache_manager.block_ids(request.request_id),
            sampling_params=request.sampling_params,
            produces_token=end == request.num_tokens,
            num_prefix_hit_tokens=num_prefix_hit_tokens,
            num_recomputed_tokens=max(0, min(end, request.max_computed_tokens) - start),
            draft_token_ids=drafts,
            num_external_tokens=num_external_tokens,
        )

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Take the victim's KV blocks and put it back at the head of the queue. Its K/V go to
        the swap space if swapping is on and there is room, else they are recomputed later."""
        plan.withdraw(request.request_id)
        plan.preempted.append(request.request_id)
        plan.unscheduled[request.request_id] = REASON_PREEMPTED
        self.running.remove(request)
        swapped = None
        if self.config.preemption_mode == "swap":
            swapped = self.kv_cache_manager.swap_out(request)
        if swapped is not None:
            plan.swap_out += swapped
            request.is_swapped_out = True
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_cached_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, request)
        request.record(
            "preempted",
            plan.step,
            mode="swap" if swapped is not None else "recompute",
            tokens_kept=request.num_computed_tokens,
        )

    # -- after the model ran -------------------------------------------------------------------

    def update_from_output(
        self,
        output: SchedulerOutput,
        new_token_ids: dict[str, list[int]],
        on_token: Callable[[Request, int], str | None] | None = None,
    ) -> list[Request]:
        """Advance each scheduled request, append its new tokens, stop it if it is done.
        `new_token_ids`: per request the tokens this step produced, in order (one, or with
        speculative decoding the accepted drafts and the target's own token). Tokens after one
        that stops the request are dropped.
        `on_token(request, token)`: called for each appended token before its stop check (the
        engine detokenizes there); returns the stop string the text now contains, or None.
        Returns the requests that finished in this step."""
        for request in self._freeing:  # the saves that needed their blocks have run
            self.kv_cache_manager.free(request)
        self._freeing = []
        finished = []
        for s in output.scheduled:
            request = self.requests.get(s.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or failed while the step ran, or its K/V load failed
            request.num_computed_tokens += s.num_tokens
            request.num_recomputed_tokens += s.num_recomputed_tokens
            tokens = new_token_ids.get(s.request_id, [])
            status = self._append_tokens(request, tokens, on_token)
            if s.draft_token_ids:
                self._keep_accepted(request)
            request.max_computed_tokens = max(
                request.max_computed_tokens, request.num_computed_tokens
            )
            self.kv_cache_manager.cache_full_blocks(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return finished

    def _append_tokens(
        self,
        request: Request,
        token_ids: list[int],
        on_token: Callable[[Request, int], str | None] | None,
    ) -> RequestStatus | None:
        """Append tokens one at a time, with one stop check after each."""
        for token in token_ids:
            request.output_token_ids.append(token)
            stop_string = on_token(request, token) if on_token is not None else None
            status = self._advance_grammar(request, token) or check_stop(
                request, self.config.max_model_len, stop_string
            )
            if status is not None:
                return status
        return None

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> RequestStatus | None:
        """Structured outputs: the grammar accepts the token; a grammar that has ended (it
        accepted EOS after a complete output) finishes the request with "stop". A token the
        grammar refuses (none should pass the mask) fails the request, never the step."""
        grammar = request.structured_output_request
        if grammar is None:
            return None
        if not grammar.accept_token(token):
            why = grammar.error or f"the grammar refused token {token}"
            request.error = f"structured outputs: {why}"
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if grammar.is_terminated else None

    def _keep_accepted(self, request: Request) -> None:
        """Roll a speculating request back to what was accepted. The forward wrote K/V for its
        last token and every draft; those of the accepted drafts are valid (they were computed
        from exactly the tokens now in the request), the rejected ones are not. The new last
        token has no K/V yet, so: computed = all tokens but the last. Blocks that now hold only
        rejected K/V go back to the pool."""
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self.kv_cache_manager.free_rejected_blocks(request)

    def reset_failed_kv_loads(self, request_ids, step: int) -> None:
        """The worker could not load these requests' external K/V (and ran none of their
        tokens): back to the head of the queue with nothing computed, to be recomputed; the
        connector forgets what it offered them."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request not in self.running:
                continue
            self.running.remove(request)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = request.num_cached_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.insert(0, request)
            self.kv_connector.request_load_failed(request)
            request.record("kv_load_failed", step)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finish_reason = status.value
        if not self._connector_keeps_blocks(request):
            self.kv_cache_manager.free(request)
        self.policy.on_finish(request)
        self.finished_since_last_step.append(request.request_id)
        del self.requests[request.request_id]

    def _connector_keeps_blocks(self, request: Request) -> bool:
        """Tell the connector the request finished: it may hand back kv_transfer_params (a
        producer: where a consumer finds the K/V) and keep the blocks until a save has run."""
        if self.kv_connector is None:
            return False
        block_ids = self.kv_cache_manager.block_ids(request.request_id)
        delay, params = self.kv_connector.request_finished(request, block_ids)
        if params is not None:
            request.kv_transfer_params = params
        if delay:
            self._delayed_free.append(request)
        return delay
