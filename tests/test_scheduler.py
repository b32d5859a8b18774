"""The scheduler with the KV-cache manager, driven without a model.

A fake loop plays the engine: schedule(), check invariants, then update_from_output() with random
tokens (random EOS too), with requests arriving over time and random aborts. Unit tests then pin
down the individual decisions: chunked prefill, reasons, preemption, priority and static
policies."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from engine.kv_cache import KVCacheManager, chained_block_hash
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import (
    REASON_MAX_NUM_SEQS,
    REASON_NO_KV_BLOCKS,
    REASON_PREEMPTED,
    REASON_STATIC_BATCH,
    REASON_TOKEN_BUDGET,
    Scheduler,
    SchedulerConfig,
    check_stop,
)

EOS = 0
VOCAB = 8  # tiny vocabulary: random prompts share prefixes by chance, EOS comes often


def constant_hash(parent_hash, token_ids) -> int:
    return 1


def make_req(
    rid, tokens, max_tokens=8, priority=0, arrival=0.0, ignore_eos=True, **params
) -> Request:
    if isinstance(tokens, int):
        tokens = [1 + (i % (VOCAB - 1)) for i in range(tokens)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, **params)
    return Request(rid, list(tokens), sp, eos_token_id=EOS, priority=priority, arrival_time=arrival)


def make_sched(
    num_blocks=64,
    block_size=4,
    budget=512,
    max_seqs=32,
    max_model_len=256,
    policy="fcfs",
    caching=True,
    chunked=True,
    hash_fn=chained_block_hash,
    preemption_mode="recompute",
    num_swap_blocks=0,
    long_prefill=0,
) -> Scheduler:
    kv = KVCacheManager(
        num_blocks, block_size, caching, hash_fn=hash_fn, num_swap_blocks=num_swap_blocks
    )
    return Scheduler(
        SchedulerConfig(
            budget, max_seqs, max_model_len, policy, chunked, preemption_mode, long_prefill
        ),
        kv,
    )


def step(sched: Scheduler, token: int = 5):
    """One fake engine step: every request that produces a token gets `token`."""
    out = sched.schedule()
    finished = sched.update_from_output(
        out, {s.request_id: [token] for s in out.scheduled if s.produces_token}
    )
    return out, finished


# -- invariants -----------------------------------------------------------------------------------


def check_kv(sched: Scheduler) -> None:
    """Block ownership and reference counts against the block tables of live requests."""
    kv = sched.kv_cache_manager
    bs = kv.block_size
    running_ids = {r.request_id for r in sched.running}
    assert set(kv.req_to_blocks) == running_ids, "only running requests hold blocks"
    holders: dict[int, list[str]] = {}
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice"
        for b in ids:
            holders.setdefault(b, []).append(rid)
    for block in kv.block_pool.blocks:
        owners = holders.get(block.block_id, [])
        assert block.ref_cnt == len(owners), (block, owners)
        assert (block.ref_cnt == 0) == (block.block_id in kv.block_pool.free_queue)
        if len(owners) > 1:
            assert kv.enable_prefix_caching and block.block_hash is not None, (
                f"block {block.block_id} owned by {owners} but is not a prefix-cache block"
            )
    for request in sched.running:
        blocks = kv.req_to_blocks[request.request_id]
        assert len(blocks) * bs >= request.num_computed_tokens
        for i, block in enumerate(blocks):
            if block.block_hash is not None:  # its K/V were computed from exactly this prefix
                assert (i + 1) * bs <= request.num_computed_tokens
                assert block.token_ids == tuple(request.all_token_ids[i * bs : (i + 1) * bs])
                parent = (blocks[i - 1].block_id, blocks[i - 1].generation) if i else None
                assert block.parent_key == parent
    snap = kv.snapshot()
    assert snap.num_used == sum(1 for owners in holders.values() if owners)
    assert snap.num_used + snap.num_cached_free + snap.num_free == kv.num_blocks
    # swap space: exactly the swapped-out waiting requests hold swap blocks, each block once
    swap = kv.swap_space
    swapped = {r.request_id for r in sched.waiting if r.is_swapped_out}
    assert set(swap.req_to_swap_ids) == swapped
    held = [i for ids in swap.req_to_swap_ids.values() for i in ids]
    assert len(held) == len(set(held)) == swap.num_used and not set(held) & set(swap.free_ids)
    for request in sched.waiting:
        if request.is_swapped_out:
            assert len(swap.req_to_swap_ids[request.request_id]) == -(
                -request.num_computed_tokens // bs
            )
        else:
            assert request.num_computed_tokens == 0


@dataclass
class Driver:
    """Runs a scheduler the way EngineCore does, checking every decision."""

    sched: Scheduler
    rng: random.Random
    check_every_request_has_a_decision: bool = True
    arrivals: dict = field(default_factory=dict)  # request_id → set of requests running at arrival
    first_scheduled: dict = field(default_factory=dict)  # request_id → step
    finish_step: dict = field(default_factory=dict)
    finished: dict = field(default_factory=dict)  # request_id → Request
    num_steps: int = 0
    saw: set = field(default_factory=set)  # reasons and phases seen

    def add(self, request: Request) -> None:
        self.arrivals[request.request_id] = {r.request_id for r in self.sched.running}
        self.sched.add_request(request)

    def abort(self, request_id: str) -> None:
        request = self.sched.requests.get(request_id)
        self.sched.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        if request is not None:
            assert (
                request.finish_reason == "abort"
                and request_id not in self.sched.kv_cache_manager.req_to_blocks
            )
            self.finished[request_id] = request
            self.finish_step.setdefault(request_id, self.num_steps)

    def step(self, abort_during: str | None = None):
        sched, cfg = self.sched, self.sched.config
        waiting_before = [r.request_id for r in sched.waiting]
        running_before = list(sched.running)
        live_before = set(sched.requests)
        computed_before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        out = sched.schedule()
        self.num_steps += 1
        scheduled = out.num_scheduled_tokens

        # limits
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        assert len(scheduled) == len(out.scheduled), "a request scheduled twice"
        assert all(n >= 1 for n in scheduled.values())
        # every live request got tokens or a reason, never both
        assert not set(scheduled) & set(out.unscheduled)
        assert set(scheduled) | set(out.unscheduled) <= live_before
        if self.check_every_request_has_a_decision:
            assert set(scheduled) | set(out.unscheduled) == live_before, (
                f"step {out.step}: no decision for "
                f"{live_before - set(scheduled) - set(out.unscheduled)}"
            )
        self.saw.update(out.unscheduled.values())
        if out.blocks_to_swap_out:
            self.saw.add("swap_out")
        if out.blocks_to_swap_in:
            self.saw.add("swap_in")
        swapped_ids = {s for _, s in out.blocks_to_swap_out} | {s for s, _ in out.blocks_to_swap_in}
        assert len(swapped_ids) == len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        # queues
        running_ids = [r.request_id for r in sched.running]
        waiting_ids = [r.request_id for r in sched.waiting]
        assert set(running_ids).isdisjoint(waiting_ids)
        assert set(running_ids) | set(waiting_ids) == live_before
        assert set(scheduled) <= set(running_ids)
        # preemption: newest running first (lowest priority first under "priority"), back to the
        # head
        preempted = out.preempted
        assert all(out.unscheduled[rid] == REASON_PREEMPTED for rid in preempted)
        assert sorted(
            rid for rid, why in out.unscheduled.items() if why == REASON_PREEMPTED
        ) == sorted(preempted)
        assert len(set(preempted)) == len(preempted)
        if preempted:
            if cfg.policy == "priority":
                order = sorted(running_before, key=lambda r: (r.priority, r.arrival_time))
            else:
                order = running_before
            assert preempted == [r.request_id for r in reversed(order)][: len(preempted)]
            assert waiting_ids[: len(preempted)] == preempted[::-1]
            for rid in preempted:  # recomputed from scratch, or kept whole in the swap space
                request = sched.requests[rid]
                assert request.is_swapped_out or request.num_computed_tokens == 0
                assert request.status == RequestStatus.PREEMPTED
        # admission is in queue order: the admitted form a prefix of the (eligible) waiting queue
        admitted = [rid for rid in waiting_before if rid in scheduled]
        if cfg.policy == "priority":
            eligible = [
                r.request_id
                for r in sorted(
                    (sched.requests[rid] for rid in waiting_before),
                    key=lambda r: (r.priority, r.arrival_time),
                )
            ]
        elif cfg.policy == "static":
            eligible = [
                rid for rid in waiting_before if out.unscheduled.get(rid) != REASON_STATIC_BATCH
            ]
        else:
            eligible = waiting_before
        assert set(admitted) == set(eligible[: len(admitted)]), (admitted, eligible)
        if preempted:
            assert not admitted, "no admission in a step that had to preempt"
        # static batching: a request that arrived while others ran waits until they have finished
        if cfg.policy == "static":
            for rid in admitted:
                if rid not in self.first_scheduled:
                    assert all(other in self.finished for other in self.arrivals[rid]), rid
        # each scheduled chunk is the right slice, with room for it in the cache
        for s in out.scheduled:
            request = sched.requests[s.request_id]
            self.first_scheduled.setdefault(s.request_id, out.step)
            self.saw.add(s.phase)
            assert s.num_computed_tokens == request.num_computed_tokens
            if s.request_id not in admitted:
                assert s.num_computed_tokens == computed_before[s.request_id]
            assert (
                s.token_ids
                == request.all_token_ids[
                    s.num_computed_tokens : s.num_computed_tokens + s.num_tokens
                ]
            )
            assert s.produces_token == (s.num_computed_tokens + s.num_tokens == request.num_tokens)
            assert (
                len(s.block_ids) * sched.kv_cache_manager.block_size
                >= s.num_computed_tokens + s.num_tokens
            )
            assert s.block_ids == sched.kv_cache_manager.block_ids(s.request_id)
            if s.phase == "decode":
                assert s.num_tokens == 1 and s.num_computed_tokens >= request.num_prompt_tokens
            if s.phase == "prefill":
                assert s.produces_token
            if not cfg.enable_chunked_prefill:
                assert s.phase != "chunked_prefill" or s.produces_token
            swapped_in = any(
                e.kind == "resumed" and e.step == out.step and e.detail.get("mode") == "swap"
                for e in request.journey
            )
            if s.request_id in admitted and swapped_in:  # its K/V come back from the swap space
                assert (
                    s.num_prefix_hit_tokens == 0
                    and s.num_computed_tokens == computed_before[s.request_id]
                )
            elif s.request_id in admitted:
                assert s.num_prefix_hit_tokens == request.num_cached_tokens == s.num_computed_tokens
                assert s.num_prefix_hit_tokens % sched.kv_cache_manager.block_size == 0
                if not sched.kv_cache_manager.enable_prefix_caching:
                    assert s.num_prefix_hit_tokens == 0
        check_kv(sched)

        if abort_during is not None and abort_during in sched.requests:
            self.abort(abort_during)  # the step is "running" while this abort arrives

        sampled = {}
        for s in out.scheduled:
            if s.produces_token:
                sampled[s.request_id] = [self.rng.randrange(VOCAB)]
        before_out = {
            rid: list(sched.requests[rid].output_token_ids)
            for rid in sampled
            if rid in sched.requests
        }
        finished = sched.update_from_output(out, sampled)
        for rid, tokens in before_out.items():
            request = sched.requests.get(rid) or next(r for r in finished if r.request_id == rid)
            assert request.output_token_ids == tokens + sampled[rid]
        for request in finished:
            self.check_finish(request)
            self.finished[request.request_id] = request
            self.finish_step[request.request_id] = self.num_steps
        check_kv(sched)
        return out

    def check_finish(self, request: Request) -> None:
        params, cfg = request.sampling_params, self.sched.config
        assert (
            request.request_id not in self.sched.requests
            and request.request_id not in self.sched.kv_cache_manager.req_to_blocks
        )
        last = request.output_token_ids[-1]
        if request.finish_reason == "stop":
            assert not params.ignore_eos and last == EOS or last in params.stop_token_ids
        else:
            assert request.finish_reason == "length"
            assert (
                request.num_output_tokens == params.max_tokens
                or request.num_tokens >= cfg.max_model_len
            )
        assert request.num_output_tokens <= params.max_tokens
        # no stop token before the end (unless ignored, or before min_tokens)
        early = request.output_token_ids[max(params.min_tokens, 1) - 1 : -1]
        if not params.ignore_eos:
            assert EOS not in early
        assert not set(params.stop_token_ids) & set(early)


# -- property tests ---------------------------------------------------------------------------


@st.composite
def scenarios(draw, policies=("fcfs", "priority", "static")):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    min_blocks = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + 8))  # tiny caches: preemption is common
    chunked = draw(st.booleans())
    # without chunked prefill a budget below max_model_len can never schedule a long recompute
    # (see test_engine_core.py::test_chunked_prefill_off_with_small_budget_cannot_livelock)
    budget = draw(st.integers(1, 64) if chunked else st.integers(max_model_len, 96))
    cfg = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_model_len=max_model_len,
        max_seqs=draw(st.integers(1, 6)),
        policy=draw(st.sampled_from(policies)),
        caching=draw(st.booleans()),
        chunked=chunked,
        hash_fn=draw(st.sampled_from([chained_block_hash, constant_hash])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        num_swap_blocks=draw(st.integers(0, 12)),
    )
    prefixes = [
        draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=40)) for _ in range(2)
    ]
    # later arrivals more important: the least important request then sits early in `running`
    newer_first = draw(st.booleans())
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from([[], *prefixes]))
        tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=12))
        prompt = (prefix[: draw(st.integers(0, len(prefix)))] + tail)[: max_model_len - 1] or [1]
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        arrival_step = draw(st.integers(0, 12))
        requests.append(
            dict(
                tokens=prompt,
                max_tokens=max_tokens,
                priority=12 - arrival_step if newer_first else draw(st.integers(0, 3)),
                arrival_step=arrival_step,
                ignore_eos=draw(st.booleans()),
                min_tokens=draw(st.sampled_from([0, 0, 2])),
                stop_token_ids=draw(st.sampled_from([[], [7]])),
            )
        )
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 40), st.integers(0, len(requests) - 1), st.booleans()),
            max_size=3,
        )
    )
    seed_ = draw(st.integers(0, 2**31))
    # drawn last, so that the scenarios drawn before this setting existed stay the same
    cfg["long_prefill"] = draw(st.sampled_from([0, 0, 0, 1, 8])) if chunked else 0
    return cfg, requests, aborts, seed_


def run_scenario(scenario, check_decisions=True):
    cfg, specs, aborts, seed = scenario
    sched = make_sched(**cfg)
    driver = Driver(sched, random.Random(seed), check_every_request_has_a_decision=check_decisions)
    pending = sorted(range(len(specs)), key=lambda i: specs[i]["arrival_step"])
    abort_at: dict[int, list] = {}
    for at, index, during in aborts:
        abort_at.setdefault(at, []).append((f"r{index}", during))
    max_steps = (
        20 + sum((len(s["tokens"]) + s["max_tokens"]) * 6 for s in specs) + 20 * len(specs) ** 2
    )
    t = 0
    while pending or sched.has_unfinished_requests():
        stuck = [(r.request_id, r.status) for r in sched.requests.values()]
        assert t < max_steps, f"no progress after {t} steps: {stuck}"
        while pending and specs[pending[0]]["arrival_step"] <= t:
            i = pending.pop(0)
            s = specs[i]
            driver.add(
                make_req(
                    f"r{i}",
                    s["tokens"],
                    s["max_tokens"],
                    s["priority"],
                    arrival=float(i),
                    ignore_eos=s["ignore_eos"],
                    min_tokens=min(s["min_tokens"], s["max_tokens"]),
                    stop_token_ids=s["stop_token_ids"],
                )
            )
        during = None
        for rid, in_step in abort_at.get(t, []):
            if in_step:
                during = rid
            else:
                driver.abort(rid)
        driver.step(abort_during=during)
        t += 1
    # everything finished or aborted: all blocks free or cached-free
    assert not sched.running and not sched.waiting and not sched.requests
    assert all(b.ref_cnt == 0 for b in sched.kv_cache_manager.block_pool.blocks)
    assert (
        sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
        and sched.kv_cache_manager.usage == 0.0
    )
    assert sched.kv_cache_manager.req_to_blocks == {}
    snap = sched.kv_cache_manager.snapshot()
    assert snap.num_used == 0 and snap.num_free + snap.num_cached_free == snap.num_blocks
    if not cfg["caching"]:
        assert snap.num_cached_free == 0
    assert len(driver.finished) == len(specs)
    for request in driver.finished.values():
        resumes = [e for e in request.journey if e.kind == "resumed"]
        preempts = [e for e in request.journey if e.kind == "preempted"]
        assert len(preempts) == request.num_preemptions
        assert len(resumes) in (len(preempts), len(preempts) - 1)  # the last may end in an abort
    return driver


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_mixes_keep_every_invariant_and_finish(scenario):
    run_scenario(scenario, check_decisions=True)


@st.composite
def priority_scenarios(draw):
    """Priority mixes that make the least important request sit early in `running`: it arrives
    first, the rest arrive over the next steps, the cache is tight and nobody stops early."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 24))
    min_blocks = -(-max_model_len // block_size)
    cfg = dict(
        num_blocks=draw(st.integers(min_blocks, min_blocks + 4)),
        block_size=block_size,
        budget=draw(st.integers(4, 64)),
        max_model_len=max_model_len,
        max_seqs=draw(st.integers(3, 6)),
        policy="priority",
        caching=draw(st.booleans()),
        chunked=True,
        hash_fn=chained_block_hash,
    )
    requests = []
    for i in range(draw(st.integers(3, 8))):
        n = draw(st.integers(1, max_model_len - 1))
        requests.append(
            dict(
                tokens=draw(st.lists(st.integers(1, VOCAB - 1), min_size=n, max_size=n)),
                max_tokens=max_model_len - n,
                priority=draw(st.integers(0, 9)) if i else 10,
                arrival_step=min(i, 1 + draw(st.integers(0, 1))),
                ignore_eos=True,
                min_tokens=0,
                stop_token_ids=[],
            )
        )
    return cfg, requests, [], draw(st.integers(0, 2**31))


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(priority_scenarios())
def test_priority_mixes_every_live_request_gets_tokens_or_a_reason(scenario):
    run_scenario(scenario, check_decisions=True)


def test_property_driver_sees_preemption_chunking_and_every_reason():
    """The random scenarios really reach the interesting states (else the property tests would
    pass vacuously)."""
    seen: set = set()
    preemptions = hits = 0

    # A fixed seed, not derandomize: derandomize seeds from the function's source text, so merely
    # reformatting this test used to change which scenarios ran. (Adding a drawn setting changes
    # them too: re-check that every reason is still reached, and move the seed if not.)
    @seed(2)
    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(scenarios())
    def collect(scenario):
        nonlocal preemptions, hits
        driver = run_scenario(scenario, check_decisions=scenario[0]["policy"] != "priority")
        seen.update(driver.saw)
        preemptions += driver.sched.num_preemptions
        hits += driver.sched.kv_cache_manager.prefix_cache_hits

    collect()
    assert {"prefill", "chunked_prefill", "decode"} <= seen
    reasons = {
        REASON_TOKEN_BUDGET,
        REASON_NO_KV_BLOCKS,
        REASON_MAX_NUM_SEQS,
        REASON_PREEMPTED,
        REASON_STATIC_BATCH,
    }
    assert reasons <= seen, reasons - seen
    assert {"swap_out", "swap_in"} <= seen
    assert preemptions > 0 and hits > 0


# -- unit tests: chunked prefill --------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_and_shares_steps_with_decodes():
    sched = make_sched(
        budget=16, block_size=4, caching=False
    )  # (with caching b would hit a's block)
    sched.add_request(make_req("a", 4, max_tokens=10))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled[0].phase == "prefill"
    sched.add_request(make_req("b", 40, max_tokens=3))
    chunks = []
    while (
        "b" not in [r.request_id for r in sched.running]
        or sched.requests["b"].num_output_tokens == 0
    ):
        out, _ = step(sched)
        by_id = {s.request_id: s for s in out.scheduled}
        assert out.total_num_scheduled_tokens <= 16
        assert (
            by_id["a"].phase == "decode" and by_id["a"].num_tokens == 1
        )  # the decode keeps flowing
        chunks.append((by_id["b"].phase, by_id["b"].num_tokens, by_id["b"].produces_token))
    assert chunks == [
        ("chunked_prefill", 15, False),
        ("chunked_prefill", 15, False),
        ("chunked_prefill", 10, True),
    ]
    out, _ = step(sched)
    assert {s.request_id: s.phase for s in out.scheduled} == {"a": "decode", "b": "decode"}


def test_budget_left_after_decodes_goes_to_the_waiting_prompt():
    sched = make_sched(budget=8)
    for rid in "abc":
        sched.add_request(make_req(rid, 2, max_tokens=20))
    step(sched)
    sched.add_request(make_req("d", 30))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 5}
    assert out.scheduled[-1].phase == "chunked_prefill"


def test_long_prefill_threshold_leaves_budget_to_short_requests_behind_a_long_prompt():
    """Without the cap the first long prompt takes the whole budget every step and the short
    request behind it waits until the long prefill ends; with the cap they share each step."""

    def steps_until_short_runs(threshold: int) -> tuple[int, list[int]]:
        sched = make_sched(budget=32, caching=False, long_prefill=threshold)
        sched.add_request(make_req("long", 200, max_tokens=2))
        sched.add_request(make_req("short", 4, max_tokens=2))
        long_chunks = []
        for n in range(1, 50):
            out, _ = step(sched)
            tokens = out.num_scheduled_tokens
            long_chunks.append(tokens.get("long", 0))
            if "short" in tokens:
                return n, long_chunks
        raise AssertionError("the short request never ran")

    uncapped_steps, uncapped_chunks = steps_until_short_runs(0)
    capped_steps, capped_chunks = steps_until_short_runs(8)
    # uncapped: six full-budget chunks of the 200-token prompt, the short one only in the 7th
    assert uncapped_chunks[0] == 32 and uncapped_steps == 7
    assert capped_steps == 1 and capped_chunks == [8]  # capped: the short one starts at once


def test_chunked_prefill_off_waits_for_room_for_the_whole_prompt():
    sched = make_sched(budget=16, chunked=False, caching=False)
    sched.add_request(make_req("a", 4, max_tokens=3))
    sched.add_request(make_req("b", 16, max_tokens=2))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.unscheduled == {"b": REASON_TOKEN_BUDGET}  # 16 tokens do not fit beside a's 4
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 1} and out.unscheduled == {"b": REASON_TOKEN_BUDGET}
    step(sched)  # a finishes (3 tokens)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 16} and out.scheduled[0].phase == "prefill"


def test_max_num_batched_tokens_of_one_still_makes_progress():
    sched = make_sched(budget=1)
    sched.add_request(make_req("a", 5, max_tokens=2))
    phases = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        phases.append(out.scheduled[0].phase)
    assert phases == ["chunked_prefill"] * 5 + ["decode"]


# -- unit tests: reasons ----------------------------------------------------------------------


def test_reason_max_num_seqs():
    sched = make_sched(max_seqs=2)
    for rid in "abc":
        sched.add_request(make_req(rid, 3))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"} and out.unscheduled == {
        "c": REASON_MAX_NUM_SEQS
    }


def test_reason_token_budget_for_waiting_and_running():
    sched = make_sched(budget=6)
    sched.add_request(make_req("a", 10))
    sched.add_request(make_req("b", 3))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 6} and out.unscheduled == {"b": REASON_TOKEN_BUDGET}
    sched2 = make_sched(budget=4)
    for rid in "abcde":
        sched2.add_request(make_req(rid, 1, max_tokens=5))
    out, _ = step(sched2)
    assert out.unscheduled == {"e": REASON_TOKEN_BUDGET}
    sched2.add_request(make_req("f", 1))
    out, _ = step(sched2)  # four running decodes use the budget; e and f wait for it
    assert set(out.num_scheduled_tokens) == set("abcd")
    assert out.unscheduled == {"e": REASON_TOKEN_BUDGET, "f": REASON_TOKEN_BUDGET}


def test_reason_no_free_kv_blocks_blocks_everyone_behind():
    sched = make_sched(num_blocks=4, block_size=4, caching=False)
    sched.add_request(make_req("a", 12, max_tokens=2))
    sched.add_request(make_req("b", 8))
    sched.add_request(make_req("c", 1))  # would fit, but FCFS: it waits behind b
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"a": 12}
    assert out.unscheduled == {"b": REASON_NO_KV_BLOCKS, "c": REASON_NO_KV_BLOCKS}


def test_reason_static_batch_in_progress():
    sched = make_sched(policy="static", max_seqs=2)
    sched.add_request(make_req("a", 3, max_tokens=2))
    sched.add_request(make_req("b", 3, max_tokens=4))
    sched.add_request(make_req("c", 3))  # beyond the batch size: waits for the next batch
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert out.unscheduled == {"c": REASON_STATIC_BATCH}
    sched.add_request(make_req("d", 3))
    decisions = []
    while "a" in sched.requests or "b" in sched.requests:
        out, _ = step(sched)
        decisions.append((set(out.num_scheduled_tokens), dict(out.unscheduled)))
    # a finished after 2 tokens, leaving a free seat, yet nothing new joined b's batch
    for scheduled, unscheduled in decisions:
        assert scheduled <= {"a", "b"}
        assert unscheduled == {"c": REASON_STATIC_BATCH, "d": REASON_STATIC_BATCH}
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"c", "d"} and not out.unscheduled


def test_continuous_batching_fills_a_freed_seat_at_once():
    sched = make_sched(policy="fcfs", max_seqs=2)
    sched.add_request(make_req("a", 3, max_tokens=1))
    sched.add_request(make_req("b", 3, max_tokens=4))
    sched.add_request(make_req("c", 3))
    out, finished = step(sched)
    assert [r.request_id for r in finished] == ["a"]
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"b", "c"}


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        make_sched(policy="lifo")


# -- unit tests: preemption -------------------------------------------------------------------


def test_swap_preemption_keeps_the_victims_tokens_and_copies_them_back():
    sched = make_sched(
        num_blocks=6,
        block_size=4,
        caching=False,
        max_model_len=24,
        preemption_mode="swap",
        num_swap_blocks=4,
    )
    sched.add_request(make_req("a", 8, max_tokens=3))
    for rid in "bc":
        sched.add_request(make_req(rid, 8, max_tokens=10))
    step(sched)
    c_blocks = sched.kv_cache_manager.block_ids("c")
    out, _ = step(sched)  # every request needs a third block: c is swapped out, not dropped
    assert out.preempted == ["c"] and out.blocks_to_swap_out == list(zip(c_blocks, [3, 2]))
    c = sched.requests["c"]
    assert c.is_swapped_out and c.num_computed_tokens == 8 and c.num_preemptions == 1
    assert c.journey[-1].detail == {"mode": "swap", "tokens_kept": 8}
    step(sched)  # a finishes and frees its blocks
    out, _ = step(sched)
    assert out.num_scheduled_tokens["c"] == 1  # resumes where it stopped: no recompute
    assert [swap for swap, _ in out.blocks_to_swap_in] == [3, 2]
    assert [dev for _, dev in out.blocks_to_swap_in] == sched.kv_cache_manager.block_ids("c")[:2]
    assert not c.is_swapped_out and c.num_recomputed_tokens == 0
    assert sched.kv_cache_manager.swap_space.num_used == 0


def test_a_full_swap_space_falls_back_to_recompute():
    sched = make_sched(
        num_blocks=6,
        block_size=4,
        caching=False,
        max_model_len=24,
        preemption_mode="swap",
        num_swap_blocks=1,
    )  # c needs 3 swap blocks
    sched.add_request(make_req("a", 8, max_tokens=3))
    for rid in "bc":
        sched.add_request(make_req(rid, 8, max_tokens=10))
    step(sched)
    out, _ = step(sched)
    c = sched.requests["c"]
    assert out.preempted == ["c"] and out.blocks_to_swap_out == []
    assert not c.is_swapped_out and c.num_computed_tokens == 0
    assert c.journey[-1].detail["mode"] == "recompute"
    while c.num_output_tokens < 3:
        step(sched)
    assert c.num_recomputed_tokens == 8  # its 8 prompt tokens, once more


def test_unknown_preemption_mode_is_refused():
    with pytest.raises(ValueError, match="preemption_mode"):
        make_sched(preemption_mode="discard")


def test_newest_running_request_is_preempted_and_returns_to_the_head_of_the_queue():
    sched = make_sched(num_blocks=6, block_size=4, caching=False, max_model_len=24)
    sched.add_request(make_req("a", 8, max_tokens=3))
    for rid in "bc":
        sched.add_request(make_req(rid, 8, max_tokens=10))  # 2 full blocks each: the cache is full
    sched.add_request(make_req("d", 2))
    out, _ = step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"} and out.unscheduled == {
        "d": REASON_NO_KV_BLOCKS
    }
    out, _ = step(sched)  # every request needs a third block: the newest, c, makes room
    assert out.preempted == ["c"]
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.unscheduled == {"c": REASON_PREEMPTED, "d": REASON_NO_KV_BLOCKS}
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    c = sched.requests["c"]
    assert (
        c.status == RequestStatus.PREEMPTED
        and c.num_computed_tokens == 0
        and c.num_preemptions == 1
    )
    assert c.num_output_tokens == 1 and sched.kv_cache_manager.block_ids("c") == []
    assert [e.kind for e in c.journey][-1] == "preempted"
    assert sched.num_preemptions == 1
    out, finished = step(sched)  # c waits for blocks; a finishes
    assert out.unscheduled == {"c": REASON_NO_KV_BLOCKS, "d": REASON_NO_KV_BLOCKS}
    assert [r.request_id for r in finished] == ["a"]
    # c (head of the queue) is resumed first and recomputes its prompt and its output token
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"b": 1, "c": 9}
    assert out.scheduled[1].phase == "prefill" and out.scheduled[1].produces_token
    assert out.scheduled[1].token_ids == c.prompt_token_ids + [5]
    assert out.unscheduled == {"d": REASON_NO_KV_BLOCKS}
    assert [e.kind for e in c.journey][-2:] == ["resumed", "scheduled"]


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sched = make_sched(num_blocks=4, block_size=4, caching=False, max_model_len=16)
    sched.add_request(make_req("a", 4, max_tokens=10))
    sched.add_request(make_req("b", 8, max_tokens=4))
    step(sched)  # a: 1 block, b: 2 blocks, one block left
    out, _ = step(sched)  # both need a new block: a (older) takes it, b has nobody newer to evict
    assert out.preempted == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert out.unscheduled == {"b": REASON_PREEMPTED}
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv_cache_manager.usage == 0.0


def test_preempted_request_hits_its_own_cached_prefix_when_resumed():
    sched = make_sched(num_blocks=6, block_size=4, caching=True, max_model_len=24)
    sched.add_request(make_req("a", 8, max_tokens=12))
    sched.add_request(make_req("b", [3] * 9, max_tokens=12))
    step(sched)
    preempted_at = None
    for _ in range(20):
        out, _ = step(sched)
        if "b" in out.preempted:
            preempted_at = out.step
            break
    assert preempted_at is not None
    b = sched.requests["b"]
    num_tokens_when_preempted = b.num_tokens
    resumed = None
    while resumed is None:
        out, _ = step(sched)
        resumed = next((s for s in out.scheduled if s.request_id == "b"), None)
    # its full blocks were freed as cached-free (tail first); its first block outlived the others
    assert resumed.num_prefix_hit_tokens >= 4 and resumed.num_prefix_hit_tokens % 4 == 0
    assert resumed.num_prefix_hit_tokens + resumed.num_tokens == num_tokens_when_preempted


# -- unit tests: priority ---------------------------------------------------------------------


def test_priority_admits_the_most_important_first():
    sched = make_sched(policy="priority", max_seqs=2)
    sched.add_request(make_req("low", 3, priority=5, arrival=0.0))
    sched.add_request(make_req("high", 3, priority=0, arrival=1.0))
    sched.add_request(make_req("mid", 3, priority=2, arrival=2.0))
    sched.add_request(make_req("high2", 3, priority=0, arrival=3.0))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["high", "high2"]
    assert out.unscheduled == {"mid": REASON_MAX_NUM_SEQS, "low": REASON_MAX_NUM_SEQS}
    fcfs = make_sched(policy="fcfs", max_seqs=2)
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        fcfs.add_request(make_req(rid, 3, priority=prio))
    out, _ = step(fcfs)
    assert [s.request_id for s in out.scheduled] == ["low", "high"]  # fcfs ignores priority


def test_priority_preempts_the_least_important_running_request():
    sched = make_sched(
        policy="priority", num_blocks=6, block_size=4, caching=False, max_model_len=24
    )
    sched.add_request(make_req("low", 7, priority=9, arrival=0.0, max_tokens=10))
    step(sched)
    sched.add_request(make_req("high", 7, priority=0, arrival=1.0, max_tokens=10))
    sched.add_request(make_req("mid", 7, priority=3, arrival=2.0, max_tokens=10))
    out, _ = step(sched)
    assert [s.request_id for s in sched.running] == ["low", "high", "mid"]
    preempted = []
    while not preempted:
        out, _ = step(sched)
        preempted = out.preempted
    assert preempted[0] == "low"  # the oldest, but the least important
    assert sched.waiting[0].request_id == "low"


def test_priority_preemption_of_an_earlier_request_skips_none():
    """Preempting a victim that sits *before* the current request in `running` must not make the
    loop skip the request after the current one: every live request gets tokens or a reason."""
    sched = make_sched(
        policy="priority", num_blocks=3, block_size=4, caching=False, max_model_len=12
    )
    sched.add_request(make_req("A", 1, priority=5, arrival=0.0, max_tokens=6))
    step(sched)
    sched.add_request(make_req("B", 4, priority=0, arrival=1.0, max_tokens=6))
    sched.add_request(make_req("C", 1, priority=0, arrival=2.0, max_tokens=6))
    out, _ = step(sched)
    assert [r.request_id for r in sched.running] == [
        "A",
        "B",
        "C",
    ] and sched.kv_cache_manager.num_free_blocks == 0
    out, _ = step(sched)  # B needs a second block; A (least important, but first in `running`) goes
    assert out.preempted == ["A"]
    assert out.num_scheduled_tokens == {"B": 1, "C": 1}, (out.num_scheduled_tokens, out.unscheduled)


def test_a_victim_unscheduled_in_the_same_step_has_no_scheduled_event():
    sched = make_sched(
        policy="priority", num_blocks=3, block_size=4, caching=False, max_model_len=12
    )
    sched.add_request(make_req("A", 1, priority=5, arrival=0.0, max_tokens=6))
    step(sched)
    sched.add_request(make_req("B", 8, priority=0, arrival=1.0, max_tokens=4))
    step(sched)
    out, _ = step(sched)  # A is scheduled first, then preempted so that B gets a third block
    assert out.preempted == ["A"] and out.num_scheduled_tokens == {"B": 1}
    a = sched.requests["A"]
    assert [e.kind for e in a.journey if e.step == out.step] == ["preempted"]


# -- unit tests: stopping and finishing -------------------------------------------------------


def test_eos_stop_tokens_min_tokens_and_max_model_len():
    sched = make_sched(max_model_len=10)
    sched.add_request(make_req("eos", 3, ignore_eos=False))
    sched.add_request(make_req("ignored", 3, max_tokens=2, ignore_eos=True))
    sched.add_request(make_req("stop_id", 3, stop_token_ids=[5]))
    sched.add_request(make_req("min", 3, ignore_eos=False, min_tokens=2))
    sched.add_request(make_req("ctx", 8, max_tokens=None))
    out = sched.schedule()
    finished = {
        r.request_id: r
        for r in sched.update_from_output(out, {rid: [EOS] for rid in out.num_scheduled_tokens})
    }
    assert set(finished) == {"eos"} and finished["eos"].finish_reason == "stop"
    assert finished["eos"].stop_reason is None
    out = sched.schedule()
    tokens = {"ignored": [EOS], "stop_id": [5], "min": [EOS], "ctx": [3]}
    finished = {r.request_id: r for r in sched.update_from_output(out, tokens)}
    assert finished["ignored"].finish_reason == "length"
    assert finished["stop_id"].finish_reason == "stop" and finished["stop_id"].stop_reason == 5
    assert finished["min"].finish_reason == "stop"  # EOS counted from the second token on
    assert finished["ctx"].finish_reason == "length" and finished["ctx"].num_tokens == 10
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.usage == 0.0


def test_finish_requests_frees_blocks_at_once_and_is_reported_next_step():
    sched = make_sched(num_blocks=8)
    sched.add_request(make_req("a", 9))
    sched.add_request(make_req("w", 3))
    step(sched)
    assert sched.kv_cache_manager.snapshot().num_used == 4
    sched.finish_requests(["a", "w", "missing"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.snapshot().num_used == 0 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_ids == ["a", "w"] and out.is_empty
    assert sched.schedule().finished_ids == []


def test_abort_while_the_step_runs_is_ignored_by_the_update():
    sched = make_sched()
    sched.add_request(make_req("a", 3))
    sched.add_request(make_req("b", 3))
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    finished = sched.update_from_output(out, {"a": [4], "b": [4]})
    assert finished == [] and list(sched.requests) == ["b"]
    assert sched.requests["b"].output_token_ids == [4]
    check_kv(sched)


def test_check_stop_rules_in_order():
    """One check per appended token: a stop string wins even over the length limit; EOS and stop
    tokens count only from min_tokens on (stop_reason: None for EOS, the token id for a stop
    token); then max_tokens; then the context."""

    def after(request: Request, *tokens: int, **kwargs) -> RequestStatus | None:
        request.output_token_ids.extend(tokens)
        return check_stop(request, kwargs.pop("max_model_len", 100), **kwargs)

    request = make_req("s", 4, max_tokens=1)
    assert after(request, 5, stop_string="ab") == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == "ab"
    request = make_req("e", 4, ignore_eos=False, min_tokens=2)
    assert after(request, EOS) is None  # below min_tokens
    assert after(request, EOS) == RequestStatus.FINISHED_STOPPED and request.stop_reason is None
    request = make_req("t", 4, stop_token_ids=[3])
    assert after(request, 3) == RequestStatus.FINISHED_STOPPED and request.stop_reason == 3
    request = make_req("m", 4, max_tokens=2, ignore_eos=False)
    assert after(request, 5) is None
    assert after(request, 5) == RequestStatus.FINISHED_LENGTH and request.stop_reason is None
    request = make_req("c", 4, max_tokens=None)
    assert after(request, 5, max_model_len=6) is None
    assert after(request, 5, max_model_len=6) == RequestStatus.FINISHED_LENGTH
