"""EngineCore.fork: a second engine that continues from exactly this state.

The strongest check: an engine that was never forked (the reference), the original after the
fork, and the fork itself all make the same decisions and produce the same tokens step for step,
under preemption (recompute and swap), prefix caching, chunked prefill, speculative decoding and
seeded sampling. Then: a fork with changes behaves differently, the original does not notice, and
settings a fork cannot take are refused with the reason.
"""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.tools.simulator import make_simulated_engine

SYSTEM = list(range(1000, 1040))  # a 40-token shared prefix (2 full blocks of 16)


def ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def arrivals() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Requests added before a given step: shared prefixes, a seeded sampler, long prompts."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    return {
        0: [
            ("a", SYSTEM + ids(9, 300), SamplingParams(max_tokens=24, **greedy)),
            ("b", ids(70, 500), seeded),
            ("c", SYSTEM + ids(5, 700), SamplingParams(max_tokens=18, **greedy)),
        ],
        3: [("d", ids(90, 900), SamplingParams(max_tokens=16, **greedy))],
        9: [("e", SYSTEM + ids(12, 1200), SamplingParams(max_tokens=12, **greedy))],
    }


def decisions(record) -> tuple:
    """What a step decided and produced (no timings)."""
    return (
        [(s.request_id, s.phase, s.num_tokens, s.num_computed_tokens, s.num_prefix_hit_tokens,
          tuple(s.draft_token_ids), s.num_accepted_tokens) for s in record.scheduled],
        sorted(record.unscheduled.items()),
        list(record.preempted),
        sorted((k, tuple(v)) for k, v in record.new_tokens.items()),
        sorted(record.finished.items()),
        sorted((k, tuple(v)) for k, v in record.kv.block_tables.items()),
        record.kv.cached_free_ids and sorted(record.kv.cached_free_ids),
        (record.num_swapped_out_blocks, record.num_swapped_in_blocks),
    )  # fmt: skip


def step_with_arrivals(engine, step: int, plan) -> object:
    for request_id, prompt, params in plan.get(step, []):
        engine.add_request(None, params, request_id=request_id, prompt_token_ids=prompt)
    return engine.step() if engine.has_unfinished_requests() else None


def run(engine, plan, start: int = 0, limit: int = 400) -> list[tuple]:
    out = []
    for step in range(start, limit):
        if step > max(plan) and not engine.has_unfinished_requests():
            break
        record = step_with_arrivals(engine, step, plan)
        out.append(decisions(record) if record else None)
    return out


SCENARIOS = {
    "recompute preemption, prefix caching, chunked prefill": dict(
        num_kv_blocks=20, max_num_batched_tokens=48, long_prefill_token_threshold=32
    ),
    "swap preemption": dict(num_kv_blocks=20, max_num_batched_tokens=64, preemption_mode="swap"),
    "speculative decoding": dict(
        num_kv_blocks=40,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    ),
}


@pytest.mark.parametrize("fork_at", [4, 11])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_fork_with_no_changes_continues_exactly_like_the_original(make_engine, scenario, fork_at):
    settings = SCENARIOS[scenario]
    plan = arrivals()
    reference = run(make_engine(**settings), plan)
    engine = make_engine(**settings)
    before = run(engine, plan, limit=fork_at)
    assert before == reference[:fork_at]
    fork = engine.fork()
    assert fork.clock.now() == engine.clock.now()
    after_fork = run(fork, plan, start=fork_at)
    after_original = run(engine, plan, start=fork_at)
    assert after_original == reference[fork_at:]
    assert after_fork == reference[fork_at:]
    for request in engine.all_requests():
        twin = fork.get_request(request.request_id)
        assert twin is not request and twin.output_token_ids == request.output_token_ids
    if "preemption" in scenario:
        assert any(step and step[2] for step in reference[fork_at:]), "no preemption after fork"
    if settings.get("preemption_mode") == "swap":
        assert any(step and step[7][1] for step in reference[fork_at:]), "nothing swapped back in"
    if "speculative_config" in settings:
        assert any(step and any(s[5] for s in step[0]) for step in reference[fork_at:])


def test_a_fork_with_changes_decides_differently_and_leaves_the_original_alone(make_engine):
    settings = SCENARIOS["recompute preemption, prefix caching, chunked prefill"]
    plan = arrivals()
    reference = run(make_engine(**settings), plan)
    engine = make_engine(**settings)
    run(engine, plan, limit=4)
    wide = engine.fork(max_num_batched_tokens=128, long_prefill_token_threshold=0)
    narrow = engine.fork(num_kv_blocks=17, enable_prefix_caching=False)
    assert run(engine, plan, start=4) == reference[4:]
    wide_run, narrow_run = run(wide, plan, start=4), run(narrow, plan, start=4)
    assert wide_run != reference[4:]
    assert max(sum(s[2] for s in step[0]) for step in wide_run if step) > 48  # the wider budget
    assert narrow.num_blocks == 17 and narrow.kv_cache_manager.snapshot().num_blocks == 17
    hits = [s for step in narrow_run if step for s in step[0] if s[4] > 0]
    assert not hits, "prefix caching is off in the fork: no request may hit"
    # greedy requests' tokens do not depend on the schedule
    for rid in ("a", "c", "d", "e"):
        tokens = engine.get_request(rid).output_token_ids
        assert wide.get_request(rid).output_token_ids == tokens
        assert narrow.get_request(rid).output_token_ids == tokens


def test_a_fork_refuses_what_it_cannot_do(make_engine):
    engine = make_engine(num_kv_blocks=20, max_num_batched_tokens=64, max_model_len=128)
    for request_id, prompt, params in arrivals()[0]:
        engine.add_request(None, params, request_id=request_id, prompt_token_ids=prompt)
    for _ in range(3):
        engine.step()
    used = engine.kv_cache_manager.snapshot().num_used
    assert used > 9
    with pytest.raises(ValueError, match=f"cannot hold the {used} blocks"):
        engine.fork(num_kv_blocks=used - 1)
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=128"):
        engine.fork(num_kv_blocks=7)
    with pytest.raises(ValueError, match="a fork cannot change block_size, model"):
        engine.fork(model="other", block_size=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.fork(enable_chunked_prefill=False)  # budget 64 < max_model_len 128
    shrunk = engine.fork(num_kv_blocks=used)
    assert shrunk.kv_cache_manager.num_free_blocks == 0
    assert engine.kv_cache_manager.snapshot().num_used == used  # untouched


def test_a_fork_can_switch_preemption_to_swap_and_prefix_caching_on(make_engine):
    plan = arrivals()
    engine = make_engine(num_kv_blocks=20, max_num_batched_tokens=64, enable_prefix_caching=False)
    run(engine, plan, limit=2)
    fork = engine.fork(preemption_mode="swap", enable_prefix_caching=True)
    forked = run(fork, plan, start=2)
    assert any(step and step[7][0] for step in forked), "the fork swapped nobody out"
    hits = [s for step in forked if step for s in step[0] if s[4] > 0]
    assert hits, "request e shares the system prompt with a and c: it must hit in the fork"
    original = run(engine, plan, start=2)
    for rid in ("a", "c", "d", "e"):
        assert fork.get_request(rid).output_token_ids == engine.get_request(rid).output_token_ids
    assert not any(s[4] for step in original if step for s in step[0])


def test_a_simulated_engine_forks_on_its_virtual_clock():
    def make():
        return make_simulated_engine(
            "llama-3.1-8b",
            "h100-sxm",
            num_kv_blocks=300,
            max_num_batched_tokens=512,
            max_model_len=2048,
        )

    plan = {
        0: [(f"r{i}", ids(200 + 50 * i, 10 * i), SamplingParams(max_tokens=30)) for i in range(4)],
        5: [("late", ids(900, 5000), SamplingParams(max_tokens=10))],
    }
    reference = make()
    expected = run(reference, plan)
    engine = make()
    run(engine, plan, limit=6)
    fork = engine.fork()
    assert run(fork, plan, start=6) == expected[6:]
    assert fork.clock.now() == pytest.approx(reference.clock.now())
    assert fork.executor.clock is fork.clock and engine.executor.clock is engine.clock
    faster = engine.fork(max_num_batched_tokens=2048, long_prefill_token_threshold=0)
    run(faster, plan, start=6)
    late = faster.get_request("late").metrics(clock="engine")
    assert late.ttft < reference.get_request("late").metrics(clock="engine").ttft


def test_a_fork_refuses_settings_of_the_wrong_type():
    engine = make_simulated_engine(
        "llama-3.1-8b", "h100-sxm", num_kv_blocks=300, max_model_len=2048
    )
    bad = {
        "max_num_seqs": "8",
        "num_kv_blocks": 300.5,
        "max_num_batched_tokens": True,
        "enable_prefix_caching": "no",
        "speculative_config": "ngram",
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"{name} must be"):
            engine.fork(**{name: value})
    assert engine.fork(num_swap_blocks=None, enable_prefix_caching=False).num_blocks == 300
