"""The guided forks of the lessons (🔀 갈라 보기 in lessons/chNN.md), at the engine level.

Each lesson tells the learner to run its lab's default workload to some step, fork one engine
there with ONE setting changed (ui/fork.py: EngineCore.fork and WorkloadFeeder.fork, as the
lab's "여기서 갈라 보기" form does), run both to the end and look at one thing. Each test here
runs the same scenario without Streamlit, with the lab's settings (ui/experiments/chNN.py) on
the tiny model (the real one where the direction needs its text, the cost-model simulator where
the lab simulates or the lesson speaks of time), and asserts the direction the lesson says to
expect. Directions in time (TTFT, ITL, E2E in ms) are asserted on the simulator's computed clock
only: measured step times on a shared CPU are noisy, and a fresh engine's first step carries
one-time work, so the lessons put the other directions in steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.trace import StepRecord
from engine.utils import cdiv
from ui.experiments.common import Workload, WorkloadFeeder
from ui.session import EngineSettings
from ui.simulation import DEFAULT_HARDWARE, DEFAULT_MODEL_PRESET, build_simulated_engine


@dataclass
class Forked:
    """An original and its fork (made after `step` steps), both run to the end."""

    original: EngineCore
    branch: EngineCore
    original_records: list[StepRecord]
    branch_records: list[StepRecord]
    step: int

    def first_token_step(self, request_id: str, branch: bool = False) -> int:
        """The step that gave `request_id` its first output token."""
        records = self.branch_records if branch else self.original_records
        return next(r.step for r in records if r.new_tokens.get(request_id))

    def metrics(self, request_id: str, branch: bool = False):
        engine = self.branch if branch else self.original
        return engine.get_request(request_id).metrics(clock="engine")

    def after_fork(self, branch: bool) -> list[StepRecord]:
        records = self.branch_records if branch else self.original_records
        return [r for r in records if r.step > self.step]


def _steps_to_end(step) -> list[StepRecord]:
    records = []
    while (record := step()) is not None:
        records.append(record)
    return records


def fork_workload(engine: EngineCore, workload: Workload, step: int, **changes) -> Forked:
    """워크로드 넣기, `step` × 다음 스텝, 갈라 보기 with `changes`, 끝까지 (the lab's order)."""
    feeder = WorkloadFeeder(engine, workload)
    before = [feeder.step() for _ in range(step)]
    twin = engine.fork(**changes)
    twin_feeder = feeder.fork(twin)
    original = before + _steps_to_end(feeder.step)
    branch = before + _steps_to_end(twin_feeder.step)
    return Forked(engine, twin, original, branch, step)


def fork_requests(engine: EngineCore, step: int, **changes) -> Forked:
    """The same for requests already added (예시 요청 추가): no feeder."""

    def stepper(e):
        return lambda: e.step() if e.has_unfinished_requests() else None

    before = [engine.step() for _ in range(step)]
    twin = engine.fork(**changes)
    original = before + _steps_to_end(stepper(engine))
    branch = before + _steps_to_end(stepper(twin))
    return Forked(engine, twin, original, branch, step)


@pytest.fixture(scope="module")
def lab_config(tiny_model_dir):
    """The sidebar's settings (ui/session.py EngineSettings) on the tiny model, as the lesson tests
    run the pages, with a chapter's overrides."""

    def config(**overrides):
        return EngineSettings(model=str(tiny_model_dir), device="cpu").to_config(**overrides)

    return config


def simulated(config, model: str = DEFAULT_MODEL_PRESET, **spec):
    """The lab's 시뮬레이션 engine: the page's default model and GPU presets."""
    return build_simulated_engine(
        {"model_preset": model, "hardware": DEFAULT_HARDWARE, **spec}, config
    )


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# -- ch00, ch02, ch03, ch04: one engine ------------------------------------------------------------


def test_ch00_a_smaller_budget_splits_the_prefill(lab_config):
    """ch00: 워크로드 넣기, then fork at once with 토큰 예산 8: the prefill takes ⌈prompt / 8⌉
    steps, so the steps follow the chapter's rule and the first token comes later."""
    from ui.experiments.ch00 import FIRST_MAX_TOKENS, first_workload

    engine = EngineCore(lab_config())
    workload = first_workload(engine)
    prompt = workload.requests[0].prompt_len
    run = fork_workload(engine, workload, 0, max_num_batched_tokens=8)
    assert len(run.original_records) == 1 + FIRST_MAX_TOKENS - 1  # one prefill step
    assert len(run.branch_records) == cdiv(prompt, 8) + FIRST_MAX_TOKENS - 1
    assert run.first_token_step("r0", branch=True) == cdiv(prompt, 8) > 1


def test_ch02_one_running_request_makes_the_second_wait(lab_config):
    """ch02: two example requests, fork at once with 최대 동시 요청 1: the second request gets its
    first token only after the first one's last (it waits for the slot), so the branch takes
    more steps."""
    from ui.experiments.ch00 import chat_prompt_ids
    from ui.lab import PRESETS

    engine = EngineCore(lab_config())
    for name in ("프랑스의 수도 (영어)", "피보나치 (코드)"):
        ids = chat_prompt_ids(engine, PRESETS[name])  # as 예시 요청 추가 sends it
        engine.add_request(None, _greedy(24), request_id=name, prompt_token_ids=ids)
    run = fork_requests(engine, 0, max_num_seqs=1)
    first, second = "프랑스의 수도 (영어)", "피보나치 (코드)"
    assert run.first_token_step(second) == 1
    assert run.first_token_step(second, branch=True) > run.first_token_step(first, branch=True) + 23
    assert len(run.branch_records) > len(run.original_records)


def test_ch03_without_prefix_caching_the_blocks_come_back_empty(lab_config):
    """ch03: fork after 10 steps with prefix caching off: when the request ends, the original
    keeps its full blocks as prefix cache, the branch frees them with nothing kept."""
    from ui.experiments.ch03 import growth_workload

    engine = EngineCore(lab_config())
    run = fork_workload(engine, growth_workload(engine), 10, enable_prefix_caching=False)
    last, twin_last = run.original_records[-1].kv, run.branch_records[-1].kv
    assert last.num_used == twin_last.num_used == 0
    assert last.num_cached_free > 0 and twin_last.num_cached_free == 0
    assert [r.scheduled for r in run.original_records] == [r.scheduled for r in run.branch_records]
    used = [r.kv.num_used for r in run.original_records]
    assert [r.kv.num_used for r in run.branch_records] == used  # one line on the KV chart


def test_ch04_more_running_slots_let_the_waiting_requests_in(lab_config):
    """ch04: fork at once with 최대 동시 요청 8 (lab: 4): the two requests that waited for a slot
    (for the first four to finish) start at once, in the first steps; fewer steps in all."""
    from ui.experiments import ch04

    engine = EngineCore(lab_config(**ch04.engine_overrides()))
    run = fork_workload(engine, ch04.lab_workload(), 0, max_num_seqs=8)
    for rid in ("r4", "r5"):
        assert run.first_token_step(rid) > ch04.DEFAULT_OUTPUT_LEN
        assert run.first_token_step(rid, branch=True) <= 2
    assert len(run.branch_records) < len(run.original_records)


# -- ch06 – ch10: blocks, batching, chunked prefill, preemption, prefix caching --------------------


def test_ch06_without_prefix_caching_the_same_prompt_takes_its_own_blocks(lab_config):
    """ch06: fork after one step with prefix caching off: the second request (the first one's
    prompt) shares no block, so the branch holds more blocks at its peak."""
    from ui.experiments.ch06 import live_workload

    engine = EngineCore(lab_config())
    run = fork_workload(engine, live_workload(engine), 1, enable_prefix_caching=False)
    assert run.original.get_request("r1").num_cached_tokens > 0
    assert run.branch.get_request("r1").num_cached_tokens == 0
    peak = max(r.kv.num_used for r in run.original_records)
    assert max(r.kv.num_used for r in run.branch_records) > peak


def test_ch07_static_batching_from_the_continuous_engine_takes_more_steps(lab_config):
    """ch07: fork the continuous-batching engine at once with 스케줄링 정책 정적 배칭: a batch
    waits for its longest request, so the branch needs more steps and the first late request
    (r4, arriving DEFAULT_LATE_STEPS decode steps in) gets its first token later."""
    from ui.experiments.ch07 import (
        DEFAULT_BATCH,
        DEFAULT_LATE_STEPS,
        batching_config,
        batching_workload,
        decode_step_ms,
        late_arrival_ms,
    )

    base = lab_config(enable_prefix_caching=False)
    cfg = batching_config(base, "continuous batching", DEFAULT_BATCH)
    late = late_arrival_ms(DEFAULT_LATE_STEPS, decode_step_ms(cfg, DEFAULT_BATCH))  # ui/labs/ch07
    run = fork_workload(
        EngineCore(cfg), batching_workload(late_ms=late), 0, scheduling_policy="static"
    )
    assert len(run.branch_records) > len(run.original_records)
    assert run.first_token_step("r4", branch=True) > run.first_token_step("r4")


def _ch08_engine(config_of, simulate: bool) -> tuple[EngineCore, Workload]:
    from ui.experiments.ch08 import (
        REAL_DEFAULTS,
        SIM_DEFAULTS,
        chunked_config,
        long_prompt_workload,
    )

    defaults = SIM_DEFAULTS if simulate else REAL_DEFAULTS
    base = config_of(max_model_len=defaults.max_model_len, num_kv_blocks=None if simulate else 64)
    cfg = chunked_config(base, True, defaults.budget, defaults.max_num_seqs)
    engine = simulated(cfg) if simulate else EngineCore(cfg)
    return engine, long_prompt_workload(defaults.long_prompt_len, long_arrival_ms=250.0)


def _worst_itl(run: Forked, branch: bool) -> float:
    engine = run.branch if branch else run.original
    shorts = [r for r in engine.all_requests() if r.request_id.startswith("짧은")]
    return max(max(r.metrics(clock="engine").itl) for r in shorts)


@pytest.mark.parametrize("simulate", [False, True], ids=["tiny", "simulated"])
def test_ch08_without_chunked_prefill_the_long_prompt_fills_one_step(lab_config, simulate):
    """ch08: fork the 'chunked prefill 켬' engine after one step with chunked prefill off (and,
    as vLLM requires then, a token budget of max_model_len; a fork with only the toggle is
    refused, the form says why): the long prompt goes through one step whole (beside the
    decodes, when they still run); the short requests' worst ITL grows (on the simulator's
    clock, where a step's time follows its tokens)."""
    engine, workload = _ch08_engine(lab_config, simulate)
    long_len, budget = workload.requests[-1].prompt_len, engine.config.max_num_batched_tokens
    with pytest.raises(ValueError, match="max_model_len"):
        engine.fork(enable_chunked_prefill=False)
    whole = engine.max_model_len
    run = fork_workload(
        engine, workload, 1, enable_chunked_prefill=False, max_num_batched_tokens=whole
    )
    assert max(r.total_tokens for r in run.original_records) <= budget
    assert max(r.total_tokens for r in run.branch_records) >= long_len
    if simulate:  # the short requests still decode when it arrives (the tiny model may be done)
        assert max(r.total_tokens for r in run.branch_records) > long_len
        assert _worst_itl(run, branch=True) > _worst_itl(run, branch=False)


def test_ch09_swap_brings_blocks_back_instead_of_recomputing(lab_config):
    """ch09 ①: fork at step 5 (no one preempted yet) with 선점 방식 스왑: the branch preempts
    too (the KV cache is as small), but the victims' K/V come back from host memory (blocks
    swapped in) and nothing is recomputed; the original recomputes."""
    from ui.experiments.ch09 import DEFAULT_BLOCKS, burst_workload, preemption_config

    engine = EngineCore(preemption_config(lab_config(), DEFAULT_BLOCKS))
    run = fork_workload(engine, burst_workload(), 5, preemption_mode="swap")
    assert not any(r.preempted for r in run.original_records[:5])
    assert sum(r.num_recomputed_tokens for r in run.original_records) > 0
    assert any(r.preempted for r in run.branch_records)
    assert sum(r.num_swapped_in_blocks for r in run.branch_records) > 0
    assert sum(r.num_recomputed_tokens for r in run.branch_records) == 0


@pytest.mark.parametrize("simulate", [False, True], ids=["tiny", "simulated"])
def test_ch10_turning_prefix_caching_off_midway(lab_config, tiny_tokenizer, simulate):
    """ch10: fork the 'prefix caching 켬' engine after one step with prefix caching off: the later
    questions find nothing in the cache and prefill their whole prompt; their TTFT grows (on the
    simulator's clock)."""
    from ui.experiments.ch10 import DEFAULT_GAP_MS, LAB_MAX_TOKENS, lab_overrides, prefix_workload

    cfg = lab_config(**lab_overrides(True, 64))
    engine = simulated(cfg) if simulate else EngineCore(cfg)
    workload = prefix_workload(
        tiny_tokenizer, "shared", 4, DEFAULT_GAP_MS["shared"], LAB_MAX_TOKENS
    )
    run = fork_workload(engine, workload, 1, enable_prefix_caching=False)
    later = workload.names()[1:]
    assert sum(r.prefix_cache_hits for r in run.after_fork(branch=False)) > 0
    assert sum(r.prefix_cache_hits for r in run.after_fork(branch=True)) == 0
    for rid in later:
        assert run.original.get_request(rid).num_cached_tokens > 0
        assert run.branch.get_request(rid).num_cached_tokens == 0
        if simulate:
            assert run.metrics(rid, branch=True).ttft > run.metrics(rid).ttft


# -- ch11 – ch14 -----------------------------------------------------------------------------------


def test_ch11_speculation_on_an_int8_engine_keeps_its_tokens(lab_config):
    """ch11: fork the int8 engine after one step with 추측 디코딩 ngram: greedy verification keeps
    the int8 engine's own tokens, in no more steps."""
    from ui.experiments.ch11 import VARIANTS, decode_workload

    engine = EngineCore(lab_config(**VARIANTS["int8"], enable_prefix_caching=False))
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    run = fork_workload(engine, decode_workload(), 1, speculative_config=spec)
    rid = "요청-0"
    tokens = run.original.get_request(rid).output_token_ids
    assert run.branch.get_request(rid).output_token_ids == tokens
    assert len(run.branch_records) <= len(run.original_records)


def test_ch12_one_running_request_on_eight_gpus(lab_config):
    """ch12 (simulation): 워크로드 넣기, then fork the tp 8 engine at once with 최대 동시 요청 1:
    the two requests run one after the other, not together: twice the steps, and the second
    request's E2E grows (on the simulator's clock)."""
    from ui.experiments.ch12 import lab_workload

    engine = simulated(lab_config(), "llama-3.1-70b", tensor_parallel_size=8)
    workload = lab_workload()
    run = fork_workload(engine, workload, 0, max_num_seqs=1)
    last = workload.names()[-1]
    assert len(run.branch_records) == 2 * len(run.original_records)
    assert run.metrics(last, branch=True).e2e > run.metrics(last).e2e


@pytest.mark.slow
def test_ch13_speculation_turned_on_midway(default_model_dir):
    """ch13 (the real model: acceptance needs its text): fork the 'off' engine after its first
    step with 추측 디코딩 ngram, k 3, on the repeating list prompt: the same tokens in fewer
    steps."""
    from ui.experiments.ch13 import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, PROMPTS

    engine = EngineCore(EngineSettings(model=str(default_model_dir), device="cpu").to_config())
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[DEFAULT_PROMPT]}]
    )
    greedy = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0)  # the lab's default
    engine.add_request(text, greedy, request_id="list")
    spec = {"method": "ngram", "num_speculative_tokens": 3}  # what the form sends
    run = fork_requests(engine, 1, speculative_config=spec)
    tokens = run.original.get_request("list").output_token_ids
    assert run.branch.get_request("list").output_token_ids == tokens
    assert len(run.branch_records) < len(run.original_records)


def test_ch14_a_long_prefill_cap_lets_the_short_requests_in(lab_config):
    """ch14: fork the engine without a cap after its first step with 긴 prefill 상한 32: the short
    requests get their first token while the long prompt is still being prefilled (in the
    original they wait for its last chunk)."""
    from ui.experiments.ch14 import (
        FAIR_BUDGET,
        FAIR_SEQS,
        FAIR_THRESHOLD,
        fairness_base,
        fairness_config,
        fairness_workload,
    )

    cfg = fairness_config(fairness_base(lab_config()), 0, FAIR_BUDGET, FAIR_SEQS)
    workload = fairness_workload()
    run = fork_workload(EngineCore(cfg), workload, 1, long_prefill_token_threshold=FAIR_THRESHOLD)
    long_name, shorts = workload.names()[0], workload.names()[1:]
    for rid in shorts:
        assert run.first_token_step(rid) > run.first_token_step(long_name)
        assert run.first_token_step(rid, branch=True) < run.first_token_step(long_name, branch=True)


# -- every chapter's scenario: a fork with no changes is the original ------------------------------


def _decisions(records: list[StepRecord]) -> list[tuple]:
    return [
        (
            [(s.request_id, s.phase, s.num_tokens, s.num_computed_tokens) for s in r.scheduled],
            sorted(r.unscheduled.items()),
            r.preempted,
            sorted((k, tuple(v)) for k, v in r.new_tokens.items()),
            r.num_swapped_in_blocks,
            r.prefix_cache_hits,
        )
        for r in records
    ]


def _chapter_scenario(name: str, config_of, tokenizer) -> tuple[EngineCore, Workload]:
    """A chapter lab's default engine and workload, on the simulator's clock where arrivals come
    later (a measured clock would admit them at different steps in two runs of the same engine)."""
    from ui.experiments import ch07, ch09, ch10, ch12

    if name == "ch07 continuous batching, late arrivals":
        base = config_of(enable_prefix_caching=False)
        cfg = ch07.batching_config(base, "continuous batching", ch07.DEFAULT_BATCH)
        return simulated(cfg), ch07.batching_workload(late_ms=40.0)
    if name == "ch08 chunked prefill, a long prompt arriving":
        return _ch08_engine(config_of, simulate=True)
    if name == "ch09 recompute preemption":
        return EngineCore(ch09.preemption_config(config_of(), ch09.DEFAULT_BLOCKS)), (
            ch09.burst_workload()
        )
    if name == "ch09 swap preemption":
        cfg = ch09.preemption_config(config_of(), ch09.DEFAULT_BLOCKS, mode="swap")
        return EngineCore(cfg), ch09.burst_workload()
    if name == "ch10 prefix caching, shared system prompt":
        cfg = config_of(**ch10.lab_overrides(True, 64))
        workload = ch10.prefix_workload(tokenizer, "shared", 4, ch10.DEFAULT_GAP_MS["shared"])
        return simulated(cfg), workload
    return simulated(config_of(), "llama-3.1-70b", tensor_parallel_size=8), ch12.lab_workload()


SCENARIOS = [
    "ch07 continuous batching, late arrivals",
    "ch08 chunked prefill, a long prompt arriving",
    "ch09 recompute preemption",
    "ch09 swap preemption",
    "ch10 prefix caching, shared system prompt",
    "ch12 eight simulated GPUs",
]


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_fork_with_no_changes_replays_the_chapters_scenario(name, lab_config, tiny_tokenizer):
    """The lab's own workload, forked at step 3 with nothing changed: the branch makes the
    original's decisions (tokens, preemptions, swaps, prefix hits) to the end."""
    engine, workload = _chapter_scenario(name, lab_config, tiny_tokenizer)
    run = fork_workload(engine, workload, 3)
    original, branch = run.after_fork(branch=False), run.after_fork(branch=True)
    assert original and _decisions(branch) == _decisions(original)
    if "preemption" in name:
        assert any(r.preempted for r in original)
    if "swap" in name:
        assert sum(r.num_swapped_in_blocks for r in original) > 0
    if "prefix" in name:
        assert sum(r.prefix_cache_hits for r in original) > 0
