"""The claims of chapters 00, 01, 02, 03, 05 and 06 (render_chapter(..., claim=...)), each checked
by running that lab's DEFAULT workload, with the app's default engine settings, on the real model
(and on the simulator where the lab runs one): the effect the claim states shows, in its predicted
direction, and the engine refuses none of the default requests.

Times are read on the engine clock (RequestMetrics, clock="engine"), never the wall clock; every
timing claim is checked with a margin of several times, so a busy CPU does not flip it. A few fast
tests on the tiny model pin the helpers the pages compare with (step counts, shared blocks)."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from ui.experiments.common import WorkloadFeeder


def app_config(model_dir, **overrides):
    """The engine config a lab gets from the sidebar's defaults (ui/session.py EngineSettings)."""
    from ui.session import EngineSettings

    return EngineSettings(model=str(model_dir), device="cpu").to_config(**overrides)


def feed(engine: EngineCore, workload) -> tuple[WorkloadFeeder, list]:
    """Run a workload to the end the way the lab's 끝까지 does (WorkloadFeeder on the engine
    clock); no request may be refused."""
    feeder = WorkloadFeeder(engine, workload)
    records = []
    while (record := feeder.step()) is not None:
        records.append(record)
    assert not feeder.rejected, feeder.rejected
    assert feeder.done
    return feeder, records


# -- ch00: the predicted number of steps is what the engine did ---------------------------------


@pytest.mark.slow
def test_ch00_first_request_takes_exactly_the_predicted_steps(default_model_dir):
    from ui.experiments.ch00 import FIRST_MAX_TOKENS, first_workload, predicted_steps, step_count

    engine = EngineCore(app_config(default_model_dir))
    feeder, records = feed(engine, first_workload(engine))
    (request,) = [r for r in feeder.requests if r is not None]
    count = step_count(records, request)
    budget = engine.config.max_num_batched_tokens
    assert count.steps == FIRST_MAX_TOKENS  # what a learner predicting "max_tokens steps" wrote
    assert count.steps == predicted_steps(request.num_prompt_tokens, FIRST_MAX_TOKENS, budget)
    assert (count.prefill_steps, count.decode_steps) == (1, FIRST_MAX_TOKENS - 1)
    assert request.finish_reason == "length" and not count.stopped_early


@pytest.mark.slow
def test_ch00_the_same_preset_without_ignore_eos_stops_early_and_says_why(default_model_dir):
    """The preset path (예시 요청 추가) keeps EOS: the model ends its answer before max_tokens, and
    the comparison then has both the steps the engine ran and the full-length count."""
    from ui.experiments.ch00 import FIRST_MAX_TOKENS, FIRST_PROMPT, chat_prompt_ids, step_count

    engine = EngineCore(app_config(default_model_dir))
    request = engine.add_request(
        prompt_token_ids=chat_prompt_ids(engine, FIRST_PROMPT),
        sampling_params=SamplingParams(max_tokens=FIRST_MAX_TOKENS, temperature=0.0),
    )
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    count = step_count(records, request)
    assert count.stopped_early and count.finish_reason == "stop"
    assert count.steps == count.output_tokens < FIRST_MAX_TOKENS  # one prefill, then decodes
    assert count.full_length_steps == FIRST_MAX_TOKENS


# -- ch01: parameters counted two ways agree; one HTTP request's journey in order --------------


@pytest.mark.slow
def test_ch01_parameter_count_and_http_journey(default_model_dir):
    from engine.artifact import inspect_artifact
    from engine.entrypoints.llm import AsyncLLM
    from engine.entrypoints.server.app import start_server_in_thread
    from ui.experiments.ch01 import (
        HTTP_MAX_TOKENS,
        HTTP_PROMPT,
        derived_param_count,
        journey_in_order,
        send_http_request,
    )

    info = inspect_artifact(default_model_dir)
    assert sum(derived_param_count(info.config).values()) == info.num_params

    engine = EngineCore(app_config(default_model_dir))
    async_llm = AsyncLLM(engine)
    handle = start_server_in_thread(async_llm, host="127.0.0.1", port=0)
    try:
        result = send_http_request(handle.url, HTTP_PROMPT, HTTP_MAX_TOKENS)
    finally:
        handle.stop()
        async_llm.shutdown()
    assert result.status == 200 and result.chunks[-1]["data"] == "[DONE]"
    request = engine.get_request(result.request_id)
    assert request is not None and 1 <= request.num_output_tokens <= HTTP_MAX_TOKENS
    kinds = [e.kind for e in request.journey]
    assert journey_in_order(kinds), kinds
    times = [e.time for e in request.journey]
    assert times == sorted(times)
    assert result.text == engine.tokenizer.decode(request.output_token_ids)


# -- ch02: a long prefill step costs far more than a decode step, far less per token ------------


@pytest.mark.slow
def test_ch02_prefill_of_the_long_prompt_costs_more_than_a_decode_step(default_model_dir):
    from ui.experiments.ch02 import DEFAULT_LENGTHS, DEFAULT_NUM_DECODE, timing_overrides
    from ui.measure import measure_prefill_decode
    from ui.session import EngineSettings

    settings = EngineSettings()
    engine = EngineCore(
        app_config(
            default_model_dir, **timing_overrides(settings.num_kv_blocks, settings.block_size)
        )
    )
    results = [measure_prefill_decode(engine, n, DEFAULT_NUM_DECODE) for n in DEFAULT_LENGTHS]
    longest = results[-1]
    assert longest.num_prompt_tokens == max(DEFAULT_LENGTHS) == 512
    assert longest.prefill_steps == 1 and len(longest.decode_ms) == DEFAULT_NUM_DECODE
    # engine clock: TTFT is the prefill step (one request, no queue), TPOT the decode steps
    assert longest.ttft_ms > 3 * longest.tpot_ms
    assert longest.ttft_ms / longest.num_prompt_tokens < longest.tpot_ms / 3
    assert results[0].ttft_ms < longest.ttft_ms  # a longer prompt, a longer prefill


# -- ch03: the cache grows by blocks during decode --------------------------------------------


@pytest.mark.slow
def test_ch03_default_request_grows_its_cache_by_blocks(default_model_dir):
    from ui.experiments.ch03 import GROWTH_MAX_TOKENS, block_growth, growth_workload

    engine = EngineCore(app_config(default_model_dir))
    feeder, records = feed(engine, growth_workload(engine))
    (request,) = [r for r in feeder.requests if r is not None]
    assert request.num_output_tokens == GROWTH_MAX_TOKENS
    growth = block_growth(records, request.request_id)
    assert growth.after_prefill == growth.rule(request.num_prompt_tokens)
    assert growth.grown >= 3  # the claim: three more blocks than the prefill took (16-token blocks)
    live = [(b, t) for b, t in zip(growth.blocks, growth.tokens) if b]
    assert all(b == growth.rule(t) for b, t in live)  # ⌈tokens ÷ 16⌉ at every step
    assert growth.blocks == sorted(growth.blocks[:-1]) + [0]  # it only grows, then returns all


# -- ch05: half the bytes in bf16; the simulated budget admits more, then preempts -------------


@pytest.mark.slow
def test_ch05_bf16_and_fp16_weights_are_half_of_fp32(default_model_dir):
    from ui.experiments.ch05 import DEFAULT_NUM_TOKENS, DTYPES, measure_dtype

    config = app_config(default_model_dir)
    fp32 = measure_dtype(config, "float32", num_tokens=DEFAULT_NUM_TOKENS)
    for dtype in DTYPES[1:]:
        half = measure_dtype(config, dtype, num_tokens=DEFAULT_NUM_TOKENS, reference=fp32)
        assert 2 * half.tensor_bytes == fp32.tensor_bytes, dtype
        assert half.computed_bytes == half.tensor_bytes
        assert half.num_tokens == DEFAULT_NUM_TOKENS


def test_ch05_simulated_budget_admits_more_than_fit_then_preempts():
    from ui.experiments.ch05 import (
        DEFAULT_GPU,
        DEFAULT_MODEL,
        DEFAULT_SEQ_LEN,
        DEFAULT_SIM_REQUESTS,
        DEFAULT_UTILIZATION,
        simulate_capacity,
    )

    run = simulate_capacity(
        DEFAULT_MODEL, DEFAULT_GPU, DEFAULT_UTILIZATION, DEFAULT_SEQ_LEN, DEFAULT_SIM_REQUESTS
    )
    assert DEFAULT_SIM_REQUESTS > run.planned_requests > 0
    assert run.peak_running > run.planned_requests and run.preemptions > 0


# -- ch06: paged blocks use most of what they hold; contiguous reservations do not -------------


@pytest.mark.slow
def test_ch06_paged_utilization_is_several_times_the_contiguous_one(default_model_dir):
    from engine.utils import cdiv
    from ui.experiments import fragmentation, run_workload
    from ui.experiments.ch06 import (
        DEFAULT_MAX_LEN,
        DEFAULT_MAX_OUT,
        DEFAULT_NUM_REQUESTS,
        MIN_BLOCKS,
        paged_workload,
    )

    config = app_config(
        default_model_dir,
        max_model_len=DEFAULT_MAX_LEN,
        num_kv_blocks=max(MIN_BLOCKS, cdiv(DEFAULT_MAX_LEN, 16)),
        enable_prefix_caching=False,
    )
    result = run_workload(config, paged_workload(DEFAULT_NUM_REQUESTS, DEFAULT_MAX_OUT), "paged")
    assert not result.rejected and len(result.requests) == DEFAULT_NUM_REQUESTS
    summary = fragmentation(result, "max_model_len").summary
    contiguous, paged = summary["사용률 = 사용량/예약량 (%)"]
    assert paged >= 2 * contiguous, (paged, contiguous)
    assert paged > 80


@pytest.mark.slow
def test_ch06_live_workload_shares_the_repeated_prompt_blocks(default_model_dir):
    """The step-by-step lab's default: the repeated prompt's full blocks are listed in both
    requests' tables (what the block-table view marks as 공유) and every request grows."""
    from ui.experiments.ch06 import live_workload, shared_blocks

    engine = EngineCore(app_config(default_model_dir))
    feeder, records = feed(engine, live_workload(engine))
    first, second, _ = feeder.requests
    pair = {first.request_id, second.request_id}
    admitted = next(r for r in records if second.request_id in r.kv.block_tables)
    full_prompt_blocks = admitted.kv.block_tables[first.request_id][: first.num_prompt_tokens // 16]
    both = {b for b, rids in shared_blocks(admitted).items() if pair <= set(rids)}
    assert len(full_prompt_blocks) == 2 and set(full_prompt_blocks) <= both  # stored once
    assert all(r.finish_reason == "length" for r in feeder.requests)


# -- fast: the helpers on the tiny model ------------------------------------------------------


def test_step_count_and_shared_blocks_on_the_tiny_model(make_engine):
    from ui.experiments.ch00 import first_workload, predicted_steps, step_count
    from ui.experiments.ch06 import shared_blocks

    engine = make_engine(max_num_batched_tokens=16)  # the prompt needs several prefill chunks
    feeder, records = feed(engine, first_workload(engine, max_tokens=5))
    (request,) = [r for r in feeder.requests if r is not None]
    count = step_count(records, request)
    assert count.prefill_steps == -(-request.num_prompt_tokens // 16) > 1
    assert count.steps == predicted_steps(request.num_prompt_tokens, 5, 16)
    assert not any(shared_blocks(r) for r in records)  # one request shares nothing


# -- the pages: what a learner sees after running the defaults (AppTest, real model) -----------


@pytest.fixture(scope="module")
def real_app(default_model_dir):
    pytest.importorskip("streamlit")
    from _apptest import open_app

    return open_app(default_model_dir)


def _open(at, page: str):
    from _apptest import no_exception

    at.switch_page(page)
    at.run()
    no_exception(at)
    return at


def _markdown(at) -> str:
    return " ".join(m.value for m in at.markdown)


@pytest.mark.slow
def test_ch00_page_scores_the_prediction_against_the_engine_and_names_an_early_stop(real_app):
    from ui.experiments.ch00 import FIRST_MAX_TOKENS

    at = _open(real_app, "pages/ch00_intro.py")
    assert any("정확히 24 스텝" in i.value for i in at.info)  # the claim above the lab
    at.button(key="main_reset").click().run()
    at.number_input(key="predict_ch00_steps").set_value(float(FIRST_MAX_TOKENS)).run()
    at.button(key="main_load").click().run()
    at.button(key="main_to_end").click().run()
    measured = next(m for m in at.metric if m.label == "측정값")
    assert measured.value == f"{FIRST_MAX_TOKENS} 스텝"
    assert "20% 안에 들었습니다" in _markdown(at)
    assert not any("일찍 끝났습니다" in i.value for i in at.info)
    # the preset keeps EOS: the comparison uses the engine's count and says why it is short
    at.button(key="main_reset").click().run()
    at.button(key="main_add_preset").click().run()
    at.button(key="main_to_end").click().run()
    measured = next(m for m in at.metric if m.label == "측정값")
    assert measured.value != f"{FIRST_MAX_TOKENS} 스텝"
    assert any("종료 토큰(EOS)" in i.value and "일찍 끝났습니다" in i.value for i in at.info)


@pytest.mark.slow
def test_ch03_and_ch06_pages_show_growth_and_shared_blocks(real_app):
    at = _open(real_app, "pages/ch03_kv_cache.py")
    at.button(key="ch03_load").click().run()
    at.button(key="ch03_to_end").click().run()
    grown = next(m for m in at.metric if m.label == "decode 중 새로 받은 블록")
    assert int(grown.value) >= 3
    at = _open(real_app, "pages/ch06_paged_kv.py")
    at.button(key="ch06_load").click().run()
    at.number_input(key="ch06_step_count").set_value(3).run()
    at.button(key="ch06_nsteps").click().run()
    tables = [df.value for df in at.dataframe if any("논리" in str(c) for c in df.value.columns)]
    assert tables and (tables[0].astype(str) == "0 (공유)").any().any()
    assert "함께 올라 있습니다" in " ".join(c.value for c in at.caption)
