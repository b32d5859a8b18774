"""EngineCore on the tiny random model: step records, traces, journeys, stop strings, lengths,
aborts, prefix caching, seeds, and greedy agreement with transformers under preemption and
chunked prefill (the tiny model makes these fast; the real model's oracle is test_engine_oracle)."""

from __future__ import annotations

import pytest
import torch
from _tiny import TINY_VOCAB_SIZE, run_engine

from engine import InvalidRequestError, SamplingParams
from engine.core import EngineCore
from engine.trace import PHASES, record_to_dict

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def ids(n: int, start: int = 1000) -> list[int]:
    """`n` distinct token ids; different starts give different sequences (tiny vocabulary)."""
    return [3 + (start * 31 + 7 * i) % (TINY_VOCAB_SIZE - 3) for i in range(n)]


def run(engine: EngineCore, max_steps: int = 2000):
    """Step until idle. Returns (records, final outputs by id, streamed text by id)."""
    return run_engine(engine, max_steps)


def generate(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams | dict):
    for rid, prompt in prompts.items():
        sp = params[rid] if isinstance(params, dict) else params
        engine.add_request(prompt_token_ids=prompt, sampling_params=sp, request_id=rid)
    return run(engine)


# -- greedy against transformers (tiny model) -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_prompts():
    g = torch.Generator().manual_seed(7)
    lengths = {"a": 5, "b": 17, "c": 40, "d": 1, "e": 33, "f": 90}
    return {
        k: torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=g).tolist() for k, n in lengths.items()
    }


@pytest.fixture(scope="module")
def tiny_reference(tiny_hf_model, tiny_prompts):
    out = {}
    for rid, prompt in tiny_prompts.items():
        with torch.no_grad():
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            gen = tiny_hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=None,
                pad_token_id=0,
            )
        out[rid] = gen[0, len(prompt) :].tolist()
        assert len(out[rid]) == 12
    return out


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # chunked prefill beside decodes
        dict(
            num_kv_blocks=8,
            max_model_len=128,
            max_num_batched_tokens=24,
            enable_prefix_caching=False,
        ),
        dict(
            num_kv_blocks=8,
            max_model_len=128,
            max_num_batched_tokens=24,
            scheduling_policy="priority",
        ),
        dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24, preemption_mode="swap"),
        dict(max_num_seqs=2, scheduling_policy="static"),
        dict(max_model_len=128, max_num_batched_tokens=128, enable_chunked_prefill=False),
    ],
    ids=[
        "default",
        "chunked",
        "tiny_kv_no_caching",
        "tiny_kv_priority",
        "tiny_kv_swap",
        "static",
        "no_chunking",
    ],
)
def test_greedy_matches_transformers_under_any_schedule(
    make_engine, tiny_prompts, tiny_reference, config
):
    engine = make_engine(**config)
    records, final, _ = generate(engine, tiny_prompts, SamplingParams(max_tokens=12, **GREEDY))
    for rid, ref in tiny_reference.items():
        assert final[rid].token_ids == ref, rid
    phases = {s.phase for r in records for s in r.scheduled}
    if config.get("max_num_batched_tokens", 512) < 90:
        assert "chunked_prefill" in phases
    if config.get("num_kv_blocks") == 8:
        assert engine.scheduler.num_preemptions > 0 and any(r.preempted for r in records)
        swapped = sum(r.num_swapped_out_blocks for r in records)
        recomputed = sum(r.num_recomputed_tokens for r in records)
        assert recomputed == engine.stats["recomputed_tokens"]
        assert (swapped > 0) == (config.get("preemption_mode") == "swap")
        assert (recomputed > 0) == (config.get("preemption_mode") != "swap")
    if not config.get("enable_chunked_prefill", True):
        assert "chunked_prefill" not in phases
        assert any(
            why == "token_budget" for r in records for why in r.unscheduled.values()
        )  # f had to wait
    assert engine.kv_cache_manager.snapshot().num_used == 0


# -- the step record --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced(make_engine):
    """A small run that has everything: chunked prefill, a full batch, preemption, prefix hits."""
    engine = make_engine(
        num_kv_blocks=8, max_model_len=96, max_num_batched_tokens=40, max_num_seqs=3
    )
    shared = ids(40)
    prompts = {
        "r0": shared + ids(5, 9),
        "r1": shared + ids(9, 20000),
        "r2": ids(30, 3000),
        "r3": ids(12, 5000),
        "r4": shared + ids(3, 7000),
    }
    params = SamplingParams(max_tokens=20, **GREEDY)
    records, final, streamed = generate(engine, prompts, params)
    return engine, records, final, streamed


def test_step_record_shows_decision_reasons_kv_and_timings(traced):
    engine, records, final, _ = traced
    first = records[0]
    assert first.step == 1 and first.token_budget == 40 and first.max_num_seqs == 3
    assert [(s.request_id, s.phase, s.num_tokens) for s in first.scheduled] == [
        ("r0", "chunked_prefill", 40)
    ]
    assert (
        first.scheduled[0].num_prompt_tokens == 45 and first.scheduled[0].num_computed_tokens == 0
    )
    assert set(first.unscheduled) == {"r1", "r2", "r3", "r4"}
    assert set(first.unscheduled.values()) == {"token_budget"}
    assert (
        first.new_tokens == {} and first.outputs == []
    )  # a chunk short of the prompt's end samples nothing
    reasons = {why for r in records for why in r.unscheduled.values()}
    assert {"token_budget", "max_num_seqs", "preempted", "no_free_kv_blocks"} <= reasons
    assert sum(len(r.preempted) for r in records) == engine.scheduler.num_preemptions > 0
    phases = {s.phase for r in records for s in r.scheduled}
    assert phases == {"prefill", "chunked_prefill", "decode"}
    for r in records:
        assert set(r.timings) == set(PHASES) and all(t >= 0.0 for t in r.timings.values())
        if r.scheduled:
            assert r.timings["forward"] > 0.0
        assert r.total_tokens == sum(s.num_tokens for s in r.scheduled) <= 40
        assert len(r.scheduled) <= 3 and r.num_running <= 3
        assert set(r.new_tokens) == {o.request_id for o in r.outputs}
        assert all(len(t) == 1 for t in r.new_tokens.values())
        for rid, reason in r.finished.items():
            assert reason == "length" and final[rid].finish_reason == "length"
        # the KV snapshot: one entry per block, owners from the block tables, usage = used / all
        kv = r.kv
        assert kv.num_blocks == 8 and len(kv.blocks) == 8 and kv.block_size == 16
        owners = {}
        for rid, table in kv.block_tables.items():
            for b in table:
                owners.setdefault(b, []).append(rid)
        for b in kv.blocks:
            assert sorted(b.owners) == sorted(owners.get(b.block_id, []))
            assert (b.status == "used") == (b.ref_cnt > 0) == bool(b.owners)
            assert b.ref_cnt == len(b.owners)
        assert kv.usage == pytest.approx(kv.num_used / 8)
        assert kv.num_used + kv.num_free + kv.num_cached_free == 8
    assert any(r.kv.num_cached_free > 0 for r in records)
    assert any(len(b.owners) > 1 for r in records for b in r.kv.blocks)  # a shared prefix block
    assert records[-1].kv.num_used == 0 and records[-1].kv.block_tables == {}
    assert records[-1].kv.prefix_cache_hits > 0 and 0 < records[-1].kv.hit_rate < 1
    hits = [s for r in records for s in r.scheduled if s.num_prefix_hit_tokens > 0]
    assert hits and all(s.num_prefix_hit_tokens % 16 == 0 for s in hits)
    assert all(s.num_computed_tokens == s.num_prefix_hit_tokens for s in hits)
    import json

    json.dumps(record_to_dict(records[5]))  # plain data


def test_journeys_are_complete_and_in_time_order(traced):
    engine, records, final, _ = traced
    scheduled_at = {(s.request_id, r.step) for r in records for s in r.scheduled}
    for request in engine.all_requests():
        kinds = [e.kind for e in request.journey]
        times = [e.time for e in request.journey]
        assert times == sorted(times), (request.request_id, kinds)
        assert kinds[:3] == ["arrival", "tokenized", "queued"]
        order = [
            kinds.index(k)
            for k in ("arrival", "tokenized", "queued", "scheduled", "first_token", "finished")
        ]
        assert order == sorted(order), kinds
        assert kinds.count("finished") == 1 and kinds.count("first_token") == 1
        assert set(kinds[kinds.index("finished") + 1 :]) <= {"streamed"}
        assert kinds.count("first_token") + kinds.count("token") == request.num_output_tokens == 20
        assert kinds.count("preempted") == request.num_preemptions
        assert kinds.count("resumed") == request.num_preemptions
        for e in request.journey:
            if e.kind == "scheduled":
                assert (request.request_id, e.step) in scheduled_at
        metrics = final[request.request_id].metrics
        assert metrics.ttft > 0 and metrics.e2e >= metrics.ttft and metrics.tpot > 0
        assert len(metrics.itl) == 19 and metrics.num_output_tokens == 20
    preempted = [r for r in engine.all_requests() if r.num_preemptions]
    assert preempted
    for request in preempted:
        kinds = [e.kind for e in request.journey]
        assert kinds.index("preempted") < kinds.index("resumed") < kinds.index("finished")


def test_outputs_decode_to_the_streamed_text(traced, engine):
    _, _, final, streamed = traced
    for rid, out in final.items():
        assert streamed[rid] == out.text == engine.tokenizer.decode(out.token_ids)
        assert (
            len(out.token_ids) == 20 and out.finish_reason == "length" and out.stop_reason is None
        )


# -- stop strings, lengths, aborts ------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_text(engine):
    """A prompt, its greedy continuation and the text after each token (prefix decodes). The
    prompt is the first of a few whose continuation has a stop string across a token boundary
    (a random tiny model often repeats itself, which rules a candidate out)."""
    for start in range(4000, 4400, 40):
        prompt = ids(6, start)
        rid = f"probe-{start}"
        engine.add_request(
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=24, **GREEDY),
            request_id=rid,
        )
        _, final, _ = run(engine)
        tokens = final[rid].token_ids
        prefix_texts = [engine.tokenizer.decode(tokens[: k + 1]) for k in range(len(tokens))]
        if find_stop(final[rid].text, prefix_texts) is not None:
            return prompt, tokens, final[rid].text, prefix_texts
    raise AssertionError("no candidate prompt gives a continuation with a usable stop string")


def stop_across_a_token_boundary(text, prefix_texts):
    """A 2-character stop string made of the last character of token k's text and the first of
    token k+1's, found nowhere earlier. Returns (stop, its index, k + 1 = the completing token)."""
    found = find_stop(text, prefix_texts)
    assert found is not None  # greedy_text picked its prompt so that one exists
    return found


def find_stop(text, prefix_texts):
    for k in range(2, len(prefix_texts) - 3):
        b = len(prefix_texts[k])
        if not (text.startswith(prefix_texts[k + 1]) and len(prefix_texts[k + 1]) > b > 0):
            continue
        if "\ufffd" in prefix_texts[k + 1]:  # token k+1 ends inside a character: the streamed
            continue  # text (and so the stop string) only shows up with a later token
        stop = text[b - 1 : b + 1]
        if stop.strip() and "\ufffd" not in stop and text.find(stop) == b - 1:
            return stop, b - 1, k + 1
    return None


def test_stop_string_cuts_the_text_even_across_tokens(engine, greedy_text):
    prompt, tokens, text, prefix_texts = greedy_text
    stop, index, completing = stop_across_a_token_boundary(text, prefix_texts)
    for include in (False, True):
        params = SamplingParams(
            max_tokens=24, stop=[stop, "\x00never"], include_stop_str_in_output=include, **GREEDY
        )
        _, final, streamed = generate(engine, {"s": prompt}, params)
        out = final["s"]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: index + (len(stop) if include else 0)]
        assert streamed["s"] == out.text  # nothing past the cut was ever streamed
        assert out.token_ids == tokens[: completing + 1]
    assert engine.kv_cache_manager.snapshot().num_used == 0


def test_streaming_holds_back_a_possible_stop_string(engine, greedy_text):
    """With a stop string that never matches, text is streamed late by at most len(stop) - 1
    characters and the concatenation of deltas is the final text."""
    prompt, tokens, text, _ = greedy_text
    stop = "\x00\x01\x02\x03"
    engine.add_request(
        prompt_token_ids=prompt,
        request_id="h",
        sampling_params=SamplingParams(max_tokens=24, stop=[stop], **GREEDY),
    )
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            streamed += out.delta_text
            if not out.finished:
                assert len(out.text) - len(streamed) <= len(stop) - 1
                assert out.text.startswith(streamed)
    assert streamed == out.text == text and out.finish_reason == "length"


def test_stop_string_on_the_last_allowed_token_reports_stop(engine, greedy_text):
    """If the stop string appears in the very token that also reaches max_tokens, the text is cut
    and the request stopped because of the string (vLLM reports finish_reason "stop" then)."""
    prompt, tokens, text, prefix_texts = greedy_text
    stop, index, completing = stop_across_a_token_boundary(text, prefix_texts)
    _, final, streamed = generate(
        engine, {"edge": prompt}, SamplingParams(max_tokens=completing + 1, stop=[stop], **GREEDY)
    )
    out = final["edge"]
    assert out.text == text[:index] == streamed["edge"]
    assert out.stop_reason == stop
    assert out.finish_reason == "stop", (
        f"finish_reason {out.finish_reason!r} with stop_reason {out.stop_reason!r}"
    )


def test_stop_token_ids_and_eos(engine, greedy_text):
    prompt, tokens, _, _ = greedy_text
    target = tokens[5]
    first = tokens.index(target)
    _, final, _ = generate(
        engine, {"t": prompt}, SamplingParams(max_tokens=24, stop_token_ids=[target], **GREEDY)
    )
    assert final["t"].finish_reason == "stop" and final["t"].stop_reason == target
    assert final["t"].token_ids == tokens[: first + 1]


def test_max_tokens_finishes_with_length(engine, greedy_text):
    prompt, tokens, _, _ = greedy_text
    _, final, _ = generate(engine, {"m": prompt}, SamplingParams(max_tokens=3, **GREEDY))
    assert final["m"].finish_reason == "length" and final["m"].token_ids == tokens[:3]


def test_too_long_requests_are_refused_naming_both_numbers(make_engine):
    engine = make_engine(max_model_len=64, num_kv_blocks=8)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt_token_ids=ids(50), sampling_params=SamplingParams(max_tokens=20))
    message = str(err.value)
    assert "64" in message and "70" in message and "50" in message and "20" in message
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt_token_ids=ids(64), sampling_params=SamplingParams(max_tokens=1))
    assert "64" in str(err.value) and err.value.param == "prompt"
    # exactly fits
    engine.add_request(
        prompt_token_ids=ids(44), sampling_params=SamplingParams(max_tokens=20, **GREEDY)
    )
    _, final, _ = run(engine)
    (out,) = final.values()
    assert len(out.token_ids) == 20
    assert not engine.scheduler.requests and engine.kv_cache_manager.snapshot().num_used == 0


def test_the_config_refuses_bad_settings_before_anything_loads():
    """EngineConfig checks itself (nano-vllm's __post_init__): no model is read, no worker made."""
    from engine.config import EngineConfig

    for bad, message in [
        (dict(block_size=0), "must be positive"),
        (dict(max_num_seqs=0), "must be positive"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(num_swap_blocks=-1), "num_swap_blocks"),
        (dict(quantization="int8", tensor_parallel_size=2), "one worker only"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="/nonexistent", **bad)
    config = EngineConfig(max_model_len=None, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="at least max_model_len"):
        config.resolve_max_model_len(2048, sliding_window=None)
    assert EngineConfig(max_model_len=4096).resolve_max_model_len(8192, sliding_window=1024) == 1024


def test_bad_preemption_settings_and_request_fields_are_refused(make_engine, engine):
    with pytest.raises(ValueError, match="num_swap_blocks"):
        make_engine(preemption_mode="swap", num_swap_blocks=-1)
    with pytest.raises(ValueError, match="preemption_mode"):
        make_engine(preemption_mode="drop")
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_engine(long_prefill_token_threshold=-1)
    for bad in ("high", 1.5, True, None):
        with pytest.raises(InvalidRequestError, match="priority"):
            engine.add_request(prompt_token_ids=[5], priority=bad)
    for bad in (7, "", ["a"]):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            engine.add_request(prompt_token_ids=[5], cache_salt=bad)
    assert not engine.has_unfinished_requests()  # nothing half-added


def test_bad_requests_are_refused(make_engine, engine):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt_token_ids=[])
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt_token_ids=[TINY_VOCAB_SIZE])
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.add_request()
    engine.add_request(
        prompt_token_ids=[5], request_id="dup", sampling_params=SamplingParams(max_tokens=1)
    )
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt_token_ids=[5], request_id="dup")
    assert err.value.param == "request_id"
    run(engine)
    with pytest.raises(ValueError) as err:  # a step could never hold a whole long request
        make_engine(enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=256)
    assert "32" in str(err.value) and "256" in str(err.value)
    with pytest.raises(ValueError):
        make_engine(
            max_model_len=1024, num_kv_blocks=8
        )  # the cache cannot hold one full-length request


def test_abort_frees_the_blocks_at_once(make_engine):
    engine = make_engine(num_kv_blocks=32, max_num_seqs=3)
    for rid in ("keep", "drop", "waiting"):
        prompt = (
            ids(5) if rid == "waiting" else ids(40, start={"keep": 101, "drop": 202}[rid])
        )  # no shared prefix
        engine.add_request(
            prompt_token_ids=prompt,
            request_id=rid,
            sampling_params=SamplingParams(max_tokens=30, **GREEDY),
        )
    engine.add_request(
        prompt_token_ids=ids(5), request_id="queued", sampling_params=SamplingParams(max_tokens=5)
    )
    engine.step()
    engine.step()
    kv = engine.kv_cache_manager
    held = kv.block_ids("drop")
    assert len(held) == 3
    used_before = kv.snapshot().num_used
    assert engine.abort_request("drop") is True
    snap = kv.snapshot()
    assert "drop" not in snap.block_tables and snap.num_used == used_before - 3
    assert all(snap.blocks[b].status != "used" and not snap.blocks[b].owners for b in held)
    assert engine.abort_request("drop") is False and engine.abort_request("nope") is False
    request = engine.get_request("drop")
    assert request.finish_reason == "abort" and request.journey[-1].kind == "finished"
    assert request.journey[-1].detail["reason"] == "abort"
    assert (
        engine.abort_request("queued") is True
    )  # still waiting: nothing to free, gone from the queue
    assert "queued" not in [r.request_id for r in engine.scheduler.waiting]
    records, final, _ = run(engine)
    assert "drop" not in final and all(o.request_id != "drop" for r in records for o in r.outputs)
    assert set(final) == {"keep", "waiting"}
    assert records[0].kv.num_used > 0 and kv.snapshot().num_used == 0


def test_chunked_prefill_off_with_small_budget_cannot_livelock(make_engine):
    """Without chunking, a request preempted after generating tokens must be recomputed (prompt +
    output) in one step: with a budget below max_model_len that could never fit again, so such a
    config is refused up front; with the smallest budget allowed (= max_model_len) a preempted
    request is recomputed whole in one step and every request finishes."""
    small = dict(
        block_size=4,
        num_kv_blocks=5,
        max_model_len=20,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be at least"):
        make_engine(**small, max_num_batched_tokens=8)
    engine = make_engine(**small, max_num_batched_tokens=20)
    for rid in "ab":  # 3 + 12 tokens each: 4 blocks each, 5 in the cache, so one is preempted
        engine.add_request(
            prompt_token_ids=ids(3),
            request_id=rid,
            sampling_params=SamplingParams(max_tokens=12, **GREEDY),
        )
    records, final, _ = run(engine, max_steps=300)
    assert set(final) == {"a", "b"}
    assert all(len(out.token_ids) == 12 for out in final.values())
    assert sum(len(r.preempted) for r in records) > 0
    recomputed = [s for r in records for s in r.scheduled if s.num_recomputed_tokens > 0]
    assert any(s.num_tokens > 8 for s in recomputed)  # more than the refused budget, in one step


# -- prefix caching through the engine --------------------------------------------------------


def test_shared_prefix_is_computed_once(make_engine):
    system = ids(100, 2000)
    questions = {"q1": ids(9, 30000), "q2": ids(13, 40000)}
    params = SamplingParams(max_tokens=8, **GREEDY)
    cold = make_engine(enable_prefix_caching=False)
    warm = make_engine(enable_prefix_caching=True)
    outputs = {}
    for name, engine in (("cold", cold), ("warm", warm)):
        records = []
        for rid, q in questions.items():  # one after the other: q2 arrives after q1 finished
            r, final, _ = generate(engine, {rid: system + q}, params)
            records += r
            outputs[name, rid] = final[rid].token_ids
        computed = {
            rid: sum(
                s.num_tokens
                for r in records
                for s in r.scheduled
                if s.request_id == rid and s.phase != "decode"
            )
            for rid in questions
        }
        first = {
            rid: next(s for r in records for s in r.scheduled if s.request_id == rid)
            for rid in questions
        }
        if name == "cold":
            assert computed == {"q1": 109, "q2": 113}
            assert first["q2"].num_prefix_hit_tokens == 0
        else:
            assert first["q1"].num_prefix_hit_tokens == 0
            hit = first["q2"].num_prefix_hit_tokens
            assert hit == 96  # 6 full blocks of the 100-token system prompt
            assert hit + computed["q2"] == 113 and first["q2"].num_computed_tokens == 96
            assert warm.get_request("q2").num_cached_tokens == 96
    for rid in questions:
        assert outputs["cold", rid] == outputs["warm", rid]


# -- sampling through the engine --------------------------------------------------------------


def test_seeded_request_is_reproducible_alone_and_in_a_batch(make_engine):
    prompt = ids(12, 6000)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine()
    _, final, _ = generate(alone, {"s": prompt}, seeded)
    batched = make_engine(max_num_batched_tokens=32)
    others = {"o1": ids(20, 100), "o2": ids(50, 200), "o3": prompt}
    params = {
        "o1": SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True),
        "o2": SamplingParams(max_tokens=20, temperature=0.7, seed=99, ignore_eos=True),
        "o3": SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
        "s": seeded,
    }
    _, final2, _ = generate(batched, {**others, "s": prompt}, params)
    assert final2["s"].token_ids == final["s"].token_ids and final2["s"].text == final["s"].text
    greedy = make_engine()
    _, g, _ = generate(greedy, {"g": prompt}, SamplingParams(max_tokens=16, **GREEDY))
    assert g["g"].token_ids != final["s"].token_ids  # it really sampled


def test_logprobs_are_returned(engine):
    params = SamplingParams(max_tokens=5, logprobs=3, **GREEDY)
    _, final, _ = generate(engine, {"lp": ids(8)}, params)
    out = final["lp"]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry["token_id"] == token
        assert len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == pytest.approx(
            max(entry["top_logprobs"].values())
        )  # greedy = the top one
        assert all(v <= 0.0 for v in entry["top_logprobs"].values())
    _, final, _ = generate(engine, {"nolp": ids(8)}, SamplingParams(max_tokens=2, **GREEDY))
    assert final["nolp"].logprobs is None


# -- one request never takes the engine down ------------------------------------------------------


def test_a_request_whose_sampling_fails_fails_alone(make_engine, monkeypatch):
    """The sampler raises whenever request "bad" is in its batch: the batch is retried row by row,
    only "bad" ends with finish_reason "error", the others finish as if nothing happened."""
    from engine.sample.sampler import Sampler

    prompts = {"ok1": ids(9, 11), "bad": ids(12, 12), "ok2": ids(20, 13)}
    clean = generate(make_engine(), prompts, SamplingParams(max_tokens=6, **GREEDY))[1]

    real_call = Sampler.__call__

    def poisoned(self, logits, request_ids, params):
        if "bad" in request_ids:
            raise RuntimeError("injected sampling fault")
        return real_call(self, logits, request_ids, params)

    monkeypatch.setattr(Sampler, "__call__", poisoned)
    engine = make_engine()
    records, final, _ = generate(engine, prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert final["bad"].finish_reason == "error" and final["bad"].error
    assert "injected" not in final["bad"].error  # clients get a short reason, not internals
    for rid in ("ok1", "ok2"):
        assert final[rid].finish_reason == "length" and final[rid].token_ids == clean[rid].token_ids
    assert any(r.finished.get("bad") == "error" for r in records)
    assert engine.kv_cache_manager.snapshot().num_used == 0
    monkeypatch.setattr(Sampler, "__call__", real_call)
    _, after, _ = generate(engine, {"later": ids(5, 14)}, SamplingParams(max_tokens=3, **GREEDY))
    assert after["later"].finish_reason == "length"  # the loop goes on


def test_a_failed_forward_fails_only_that_steps_requests(make_engine, monkeypatch):
    engine = make_engine()
    engine.add_request(
        prompt_token_ids=ids(8, 21),
        request_id="victim",
        sampling_params=SamplingParams(max_tokens=4, **GREEDY),
    )
    real_execute = engine.executor.execute_model

    def broken(scheduler_output):
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(engine.executor, "execute_model", broken)
    record = engine.step()
    assert record.finished == {"victim": "error"}
    assert engine.get_request("victim").error and not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.snapshot().num_used == 0
    monkeypatch.setattr(engine.executor, "execute_model", real_execute)
    _, final, _ = generate(engine, {"next": ids(8, 22)}, SamplingParams(max_tokens=4, **GREEDY))
    assert final["next"].finish_reason == "length"


def test_a_request_whose_output_processing_fails_fails_alone(make_engine, monkeypatch):
    engine = make_engine()
    real = engine.output_processor.process_tokens

    def flaky(request, token_ids):
        if request.request_id == "bad":
            raise UnicodeError("injected detokenizer fault")
        return real(request, token_ids)

    monkeypatch.setattr(engine.output_processor, "process_tokens", flaky)
    _, final, _ = generate(
        engine, {"bad": ids(6, 31), "good": ids(7, 32)}, SamplingParams(max_tokens=4, **GREEDY)
    )
    assert final["bad"].finish_reason == "error" and final["bad"].token_ids == []
    assert final["good"].finish_reason == "length" and len(final["good"].token_ids) == 4


# -- the engine clock and the one definition of TTFT / TPOT ----------------------------------------


def test_engine_clock_ignores_pauses_between_steps(make_engine):
    """Step mode: a learner pauses before pressing "next step". Wall-clock TTFT includes the
    pause; engine-clock TTFT counts only the engine's own work."""
    import time

    engine = make_engine()
    request = engine.add_request(
        prompt_token_ids=ids(10, 41),
        request_id="r",
        sampling_params=SamplingParams(max_tokens=3, **GREEDY),
    )
    time.sleep(0.3)
    records = run(engine)[0]
    wall, clocked = request.metrics("wall"), request.metrics("engine")
    assert wall.ttft - clocked.ttft >= 0.29  # the pause counts on the wall clock only
    assert clocked.ttft == pytest.approx(
        records[0].engine_start_time + records[0].engine_duration, abs=0.05
    )
    assert engine.clock.now() == pytest.approx(sum(r.engine_duration for r in records))
    starts = [r.engine_start_time for r in records]
    assert starts == sorted(starts)
    for metrics in (wall, clocked):
        assert metrics.tpot == pytest.approx((metrics.token_times[-1] - metrics.token_times[0]) / 2)
        assert len(metrics.itl) == 2 and metrics.e2e >= metrics.ttft


def test_arrivals_scheduled_in_engine_time(make_engine):
    engine = make_engine()
    engine.clock.advance_to(2.0)
    request = engine.add_request(
        prompt_token_ids=ids(4, 42),
        engine_arrival_time=1.5,
        sampling_params=SamplingParams(max_tokens=1, **GREEDY),
    )
    run(engine)
    metrics = request.metrics("engine")
    assert metrics.arrival_time == 1.5 and metrics.queue_time >= 0.5
    assert metrics.tpot is None and metrics.itl == []  # one token: no time *between* tokens
    assert request.metrics("wall").tpot is None


def test_a_cpu_engine_given_no_size_takes_no_more_kv_than_its_requests_can_use(tiny_model_dir):
    from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, default_cpu_kv_cache_bytes

    engine = EngineCore(model=str(tiny_model_dir), device="cpu", max_num_seqs=4, block_size=16)
    # 4 requests of the tiny model's whole context (1,024 tokens): 4 x 64 blocks, not the 1 GiB
    # (131,072 blocks of 8 KiB) a bigger model gets
    assert engine.max_model_len == 1024 and engine.num_blocks == 4 * 64
    bytes_per_block = engine.model_config.kv_bytes_per_block(engine.kv_cache_dtype, 16)
    assert engine.executor.worker.kv_cache_bytes() == 256 * bytes_per_block
    given = EngineCore(model=str(tiny_model_dir), device="cpu", kv_cache_memory=3 << 20)
    assert given.num_blocks == (3 << 20) // bytes_per_block  # a size given is taken as given
    # the default model (30 layers, 3 KV heads of 64, float32): 32 requests of 8,192 tokens would
    # need 11.3 GiB, so it gets the whole GiB
    assert default_cpu_kv_cache_bytes(30 * 2 * 3 * 64 * 4 * 16, 16, 8192, 32) == (
        DEFAULT_CPU_KV_CACHE_BYTES
    )
