"""Speculative decoding (n-gram drafts): exact, and measured.

- greedy outputs with speculation equal those without, token for token, under batching, chunked
  prefill, prefix caching and preemption, with drafts both accepted and rejected;
- stops (stop string, stop token, EOS, max_tokens, max_model_len) that fall inside a run of
  accepted tokens emit nothing past the stop;
- the KV manager's block accounting stays exact over random accept/reject cycles (Hypothesis);
- with sampling, the output distribution is the target model's (a chi-square test);
- bad `speculative_config` values are refused at start-up.
"""

from __future__ import annotations

import random

import pytest
import torch
from _tiny import TINY_VOCAB_SIZE, run_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import EOS, VOCAB, check_kv, make_req, make_sched

from engine import SamplingParams
from engine.core import EngineCore
from engine.sample.rejection_sampler import RejectionSampler, verify_greedy
from engine.sample.sampler import Sampler
from engine.spec_decode import NgramProposer, SpeculativeConfig
from ui.trace_frames import spec_decode_dataframe

GREEDY = dict(temperature=0.0, ignore_eos=True)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


# -- the proposer and the verifier alone -------------------------------------------------------


def test_ngram_proposer_prefers_the_longest_then_the_earliest_match():
    """vLLM's prompt lookup (v1/spec_decode/ngram_proposer.py) takes the longest n-gram and,
    among its occurrences, the earliest."""
    proposer = NgramProposer(num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1)
    # "7 8 9" occurred at index 0 (followed by 1 2); "8 9" also at 5 (followed by 5 5)
    assert proposer.propose([7, 8, 9, 1, 2, 8, 9, 5, 5, 7, 8, 9]) == [1, 2]
    # only the 1-gram "9" matches; its earliest occurrence is followed by 3 9 (the later by 4 5)
    assert proposer.propose([9, 3, 9, 4, 5, 6, 9]) == [3, 9]
    # "1 2" occurs at 0 (then 5 1) and at 3 (then 6 1): the earliest wins
    assert proposer.propose([1, 2, 5, 1, 2, 6, 1, 2]) == [5, 1]
    assert proposer.propose([1, 2, 3]) == []  # nothing repeats: no draft
    assert proposer.propose([5]) == []
    # near the end of the text fewer than k tokens may follow
    assert NgramProposer(4, 3, 1).propose([1, 2, 1]) == [2, 1]
    assert NgramProposer(3, 2, 2).propose([4, 1, 4, 2, 4]) == []  # no 2-gram repeats, min_n = 2


def test_greedy_verification_accepts_the_matching_prefix_plus_one():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + the bonus
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # rejected at 9: the target's 6 instead
    assert verify_greedy([5, 6], [4]) == [5]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_token": 2}, "unknown keys"),
    ],
)
def test_bad_speculative_config_is_refused_at_start_up(make_engine, bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_value(bad)
    with pytest.raises(ValueError, match=message):
        make_engine(speculative_config=bad)


# -- the engine on the tiny model --------------------------------------------------------------


def run(engine: EngineCore, max_steps: int = 3000):
    """Step until idle. Returns (records, final outputs by id, streamed text by id)."""
    return run_engine(engine, max_steps)


def generate(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams):
    for rid, prompt in prompts.items():
        engine.add_request(prompt_token_ids=prompt, sampling_params=params, request_id=rid)
    return run(engine)


@pytest.fixture(scope="module")
def prompts():
    """Prompts that repeat themselves (a pattern several times over, built from token ids) and
    prompts that do not (random ids)."""
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=g).tolist()  # noqa: E731
    out = {f"random{i}": rand(n) for i, n in enumerate([5, 23, 41])}
    for i, (period, times) in enumerate([(4, 6), (7, 4), (13, 3)]):
        out[f"repeat{i}"] = rand(period) * times
    return out


@pytest.fixture(scope="module")
def reference(make_engine, prompts):
    """Greedy outputs without speculation (an unconstrained engine)."""
    _, final, _ = generate(make_engine(), prompts, SamplingParams(max_tokens=40, **GREEDY))
    return {rid: out.token_ids for rid, out in final.items()}


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # chunked prefill beside speculating decodes
        dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24),  # preemption
        dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24, preemption_mode="swap"),
        dict(num_kv_blocks=10, max_model_len=128, enable_prefix_caching=False, max_num_seqs=3),
    ],
    ids=["default", "chunked", "tiny_kv", "tiny_kv_swap", "no_caching"],
)
def test_greedy_with_speculation_equals_greedy_without(make_engine, prompts, reference, config):
    engine = make_engine(speculative_config=NGRAM, **config)
    records, final, _ = generate(engine, prompts, SamplingParams(max_tokens=40, **GREEDY))
    for rid, ref in reference.items():
        assert final[rid].token_ids == ref, rid
    spec = spec_decode_dataframe(records)
    assert (spec.num_accepted_tokens > 0).any(), "no draft was ever accepted"
    assert (spec.num_accepted_tokens < spec.num_draft_tokens).any(), "no draft was ever rejected"
    metrics = engine.spec_decode_metrics()
    assert metrics["num_draft_tokens"] == spec.num_draft_tokens.sum()
    assert metrics["num_accepted_tokens"] == spec.num_accepted_tokens.sum()
    assert 0 < metrics["acceptance_rate"] < 1 and metrics["mean_accepted_length"] > 1
    # a verifying step runs 1 + d tokens and stays within the token budget
    for r in records:
        assert r.total_tokens <= r.token_budget
        for s in r.scheduled:
            if s.draft_token_ids:
                assert s.phase == "decode" and s.num_tokens == 1 + s.num_draft_tokens
                assert len(r.new_tokens.get(s.request_id, [])) <= s.num_accepted_tokens + 1
    # one journey "token" event per emitted token
    for request in engine.all_requests():
        kinds = [e.kind for e in request.journey]
        assert kinds.count("first_token") + kinds.count("token") == request.num_output_tokens
    if config.get("num_kv_blocks") == 8:
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.snapshot().num_used == 0


def test_speculation_mixes_with_prefills_in_one_step(make_engine, prompts):
    """A forward that verifies drafts also runs another request's prefill."""
    engine = make_engine(speculative_config=NGRAM)
    engine.add_request(
        prompt_token_ids=prompts["repeat0"],
        request_id="early",
        sampling_params=SamplingParams(max_tokens=40, **GREEDY),
    )
    mixed = False
    for i in range(40):
        if i == 3:
            engine.add_request(
                prompt_token_ids=prompts["random2"],
                request_id="late",
                sampling_params=SamplingParams(max_tokens=4, **GREEDY),
            )
        record = engine.step()
        phases = {s.phase for s in record.scheduled}
        if any(s.draft_token_ids for s in record.scheduled) and phases & {
            "prefill",
            "chunked_prefill",
        }:
            mixed = True
        if not engine.has_unfinished_requests():
            break
    assert mixed


def test_vllm_counters_are_on_the_metrics_page(make_engine, prompts):
    from engine.metrics import ServerMetrics

    engine = make_engine(speculative_config=NGRAM)
    generate(engine, {"r": prompts["repeat0"]}, SamplingParams(max_tokens=30, **GREEDY))
    text = ServerMetrics(engine, "tiny").render().decode()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        value = engine.stats[f"spec_decode_{name}"]
        assert f'vllm:spec_decode_{name}_total{{model_name="tiny"}} {float(value)}' in text
    assert engine.stats["spec_decode_num_draft_tokens"] > 0


@pytest.mark.slow
def test_real_model_copying_a_list_accepts_drafts_and_keeps_its_output(default_model_dir):
    """SmolLM2 asked to repeat a list: the answer repeats the prompt, drafts are accepted, and
    the greedy output is the one without speculation."""
    from engine import LLM

    words = [
        "apple orange",
        "river window",
        "stone garden",
        "cloud silver",
        "lamp bridge",
        "tiger candle",
    ]
    text = "Repeat this list exactly, one item per line:\n" + "\n".join(
        f"{i}. {w} {10 + 3 * i}" for i, w in enumerate(words, 1)
    )
    outputs, metrics = [], None
    for spec in (None, NGRAM):
        llm = LLM(
            model=str(default_model_dir),
            device="cpu",
            num_kv_blocks=64,
            max_model_len=1024,
            speculative_config=spec,
        )
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])
        outputs.append(
            llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)[
                0
            ]
        )
        metrics = llm.engine.spec_decode_metrics()
    assert outputs[1].token_ids == outputs[0].token_ids and outputs[1].text == outputs[0].text
    assert metrics["acceptance_rate"] > 0 and metrics["mean_accepted_length"] > 1


# -- stops inside a run of accepted tokens -----------------------------------------------------


@pytest.fixture(scope="module")
def spec_run(make_engine, prompts):
    """A greedy speculative run: the prompt whose output had the most steps that emitted more
    than one token, its output tokens, and the output indices that arrived as the 2nd or later
    token of a step (inside an accepted run)."""
    engine = make_engine(speculative_config=NGRAM)
    records, final, _ = generate(engine, prompts, SamplingParams(max_tokens=40, **GREEDY))
    inside: dict[str, list[int]] = {rid: [] for rid in prompts}
    emitted = dict.fromkeys(prompts, 0)
    for record in records:
        for rid, new in record.new_tokens.items():
            inside[rid] += range(emitted[rid] + 1, emitted[rid] + len(new))
            emitted[rid] += len(new)
    rid = max(inside, key=lambda r: len(inside[r]))
    assert inside[rid], "no step emitted more than one token"
    return prompts[rid], final[rid].token_ids, inside[rid]


def test_max_tokens_inside_an_accepted_run(make_engine, spec_run):
    prompt, tokens, inside = spec_run
    engine = make_engine(speculative_config=NGRAM)
    for n in [i + 1 for i in inside][:6]:
        records, final, _ = generate(engine, {"m": prompt}, SamplingParams(max_tokens=n, **GREEDY))
        assert final["m"].token_ids == tokens[:n] and final["m"].finish_reason == "length"
        assert sum(len(r.new_tokens.get("m", [])) for r in records) == n


def test_stop_token_inside_an_accepted_run(make_engine, spec_run):
    prompt, tokens, inside = spec_run
    engine = make_engine(speculative_config=NGRAM)
    index = next(i for i in inside if tokens.index(tokens[i]) == i)  # the token's first occurrence
    _, final, _ = generate(
        engine,
        {"t": prompt},
        SamplingParams(max_tokens=40, stop_token_ids=[tokens[index]], **GREEDY),
    )
    assert final["t"].token_ids == tokens[: index + 1]
    assert final["t"].finish_reason == "stop" and final["t"].stop_reason == tokens[index]


def test_stop_string_inside_an_accepted_run(make_engine, spec_run):
    """The text is cut at the stop string, nothing after it is streamed, and the engine agrees
    with the same request run without speculation."""
    prompt, tokens, inside = spec_run
    plain, spec = make_engine(), make_engine(speculative_config=NGRAM)
    tokenizer = spec.tokenizer
    for index in inside:
        piece = tokenizer.decode(tokens[: index + 1])[len(tokenizer.decode(tokens[:index])) :]
        before = tokenizer.decode(tokens[:index])
        if piece.strip() and "\ufffd" not in piece and piece not in before:
            break
    else:
        pytest.skip("no usable stop string inside an accepted run")
    params = SamplingParams(max_tokens=40, stop=[piece], **GREEDY)
    _, want, _ = generate(plain, {"s": prompt}, params)
    _, got, streamed = generate(spec, {"s": prompt}, params)
    assert got["s"].finish_reason == want["s"].finish_reason == "stop"
    assert got["s"].text == want["s"].text == streamed["s"]
    assert got["s"].token_ids == want["s"].token_ids == tokens[: index + 1]


def test_max_model_len_is_never_crossed(make_engine, spec_run):
    prompt, tokens, _ = spec_run
    max_model_len = len(prompt) + 20
    plain = make_engine(max_model_len=max_model_len)
    spec = make_engine(max_model_len=max_model_len, speculative_config=NGRAM)
    _, want, _ = generate(plain, {"l": prompt}, SamplingParams(max_tokens=None, **GREEDY))
    _, got, _ = generate(spec, {"l": prompt}, SamplingParams(max_tokens=None, **GREEDY))
    assert (
        got["l"].token_ids == want["l"].token_ids
        and len(prompt) + len(got["l"].token_ids) == max_model_len
    )
    assert got["l"].finish_reason == "length" and spec.stats["spec_decode_num_accepted_tokens"] > 0


def test_eos_inside_an_accepted_run_drops_the_rest():
    """Scheduler level: EOS in the middle of a step's tokens ends the request there."""
    sched = make_sched(block_size=4)
    request = make_req("e", 6, max_tokens=20, ignore_eos=False)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"e": [5]})  # prefill
    request.spec_token_ids = [3, EOS, 4]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [3, EOS, 4] and out.scheduled[0].num_tokens == 4
    finished = sched.update_from_output(out, {"e": [3, EOS, 4, 6]})
    assert finished == [request] and request.output_token_ids == [5, 3, EOS]
    assert request.finish_reason == "stop"
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def test_drafts_are_cut_to_max_tokens_budget_and_max_model_len():
    sched = make_sched(block_size=4, budget=64, max_model_len=12)
    request = make_req("c", 6, max_tokens=4)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"c": [5]})
    request.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [1, 2]  # 1 output so far + 2 drafts + 1 = max_tokens
    sched = make_sched(block_size=4, budget=3, max_model_len=64)
    request = make_req("b", 2, max_tokens=40)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"b": [5]})
    request.spec_token_ids = [1, 2, 3, 4, 5]
    assert sched.schedule().scheduled[0].draft_token_ids == [1, 2]  # the token budget is 3
    sched = make_sched(block_size=4, budget=64, max_model_len=10)
    request = make_req("l", 6, max_tokens=40)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {"l": [5]})  # 7 tokens: at most 3 more
    request.spec_token_ids = [1, 2, 3, 4, 5]
    assert sched.schedule().scheduled[0].draft_token_ids == [1, 2]


def test_drafts_never_cause_a_preemption():
    """Drafts are optional: without free blocks for them a request decodes one token as usual."""
    sched = make_sched(num_blocks=4, block_size=4, caching=False)
    a, b = make_req("a", 7, max_tokens=8), make_req("b", 7, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    sched.update_from_output(sched.schedule(), {"a": [5], "b": [5]})  # 2 blocks each, all in use
    b.spec_token_ids = [1, 2, 3]  # would need a third block for b
    out = sched.schedule()
    assert not out.preempted
    assert {s.request_id: s.draft_token_ids for s in out.scheduled}["b"] == []


# -- block accounting over random accept/reject cycles (no model) ------------------------------


@st.composite
def spec_scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(8, 40))
    min_blocks = -(-max_model_len // block_size)
    cfg = dict(
        num_blocks=draw(st.integers(min_blocks, min_blocks + 10)),
        block_size=block_size,
        budget=draw(st.integers(4, 48)),
        max_model_len=max_model_len,
        max_seqs=draw(st.integers(1, 5)),
        caching=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        num_swap_blocks=draw(st.integers(0, 8)),
    )
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=max_model_len - 1))
        requests.append((prompt, draw(st.integers(1, max_model_len - len(prompt)))))
    return cfg, requests, draw(st.integers(1, 4)), draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_scenarios())
def test_block_accounting_stays_exact_across_accept_reject_cycles(scenario):
    cfg, request_specs, k, seed = scenario
    rng = random.Random(seed)
    sched = make_sched(**cfg)
    kv = sched.kv_cache_manager
    for i, (prompt, max_tokens) in enumerate(request_specs):
        sched.add_request(make_req(f"r{i}", prompt, max_tokens=max_tokens))
    finished = []
    for _ in range(400):
        if not sched.has_unfinished_requests():
            break
        for request in sched.running:  # the proposer: random drafts, often from the own text
            tokens = request.all_token_ids
            request.spec_token_ids = [rng.choice(tokens) for _ in range(rng.randint(0, k))]
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg["budget"]
        check_kv(sched)
        new_tokens = {}
        for s in out.scheduled:
            assert s.num_tokens == 1 + len(s.draft_token_ids) or not s.draft_token_ids
            if not s.produces_token:
                continue
            accepted = rng.randint(0, len(s.draft_token_ids))  # a random verification outcome
            correction = rng.randrange(1, VOCAB)
            if accepted < len(s.draft_token_ids) and correction == s.draft_token_ids[accepted]:
                correction = correction % (VOCAB - 1) + 1  # a rejected draft is never the output
            new_tokens[s.request_id] = s.draft_token_ids[:accepted] + [correction]
        finished += sched.update_from_output(out, new_tokens)
        check_kv(sched)
        for s in out.scheduled:  # blocks holding only rejected drafts went back to the pool
            request = sched.requests.get(s.request_id)
            if request is not None and s.draft_token_ids:
                assert request.num_computed_tokens == request.num_tokens - 1
                assert len(kv.req_to_blocks[s.request_id]) == -(
                    -request.num_computed_tokens // kv.block_size
                )
    assert not sched.has_unfinished_requests()
    for request in finished:
        assert request.num_output_tokens <= request.sampling_params.max_tokens
        assert request.num_tokens <= cfg["max_model_len"]
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


# -- sampling: the output distribution is the target model's -----------------------------------

# Upper 0.001 critical values of the chi-square distribution, by degrees of freedom (scipy-free).
CHI2_CRITICAL_0_001 = {
    1: 10.828,
    2: 13.816,
    3: 16.266,
    4: 18.467,
    5: 20.515,
    6: 22.458,
    7: 24.322,
    8: 26.124,
    9: 27.877,
    10: 29.588,
    11: 31.264,
    12: 32.909,
    13: 34.528,
    14: 36.123,
}


def chi_square(counts: dict, expected: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 pooled into one."""
    cells, pooled_count, pooled_expected = [], 0, 0.0
    for key, e in expected.items():
        if e < min_expected:
            pooled_count, pooled_expected = pooled_count + counts.get(key, 0), pooled_expected + e
        else:
            cells.append((counts.get(key, 0), e))
    unexpected = sum(c for key, c in counts.items() if key not in expected)
    if pooled_expected > 0 or unexpected:
        cells.append((pooled_count + unexpected, max(pooled_expected, 1e-9)))
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


class FixedProposer:
    """Always drafts the same tokens: rejection sampling must be exact for any fixed draft."""

    def __init__(self, draft: list[int]):
        self.draft = draft

    def propose(self, token_ids: list[int]) -> list[int]:
        return list(self.draft)


def test_sampling_with_speculation_keeps_the_target_distribution(make_engine, tiny_model_dir):
    """Many seeded requests, each: t1 sampled after the prompt (prefill), then t2 in a verifying
    step with a fixed one-token draft. The joint counts of (t1, t2) must follow
    p(t1) · p(t2 | t1) of the target model, with acceptance and rejection both frequent."""
    params = dict(temperature=1.0, top_k=3, ignore_eos=True, max_tokens=3)
    prompt = [5 + (7 * i) % 50 for i in range(12)]
    engine = make_engine(
        speculative_config=NGRAM, max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=600
    )
    runner = engine.executor.worker.runner
    exact = SamplingParams(**params)

    def next_token_probs(tokens: list[int]) -> torch.Tensor:
        from engine.layers.attention import build_attention_metadata

        meta = build_attention_metadata([len(tokens)], [0], [[599]], 16, runner.device)
        logits = runner.model.forward(
            torch.tensor(tokens),
            torch.arange(len(tokens)),
            runner.kv_caches,
            meta,
            torch.tensor([len(tokens) - 1]),
        )
        return Sampler.probabilities(logits[0], exact)

    p1 = next_token_probs(prompt)
    expected_joint = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = next_token_probs(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            expected_joint[(t1, t2)] = (p1[t1] * p2[t2]).item()
    likely_t1 = int(p1.argmax())
    draft = int(next_token_probs(prompt + [likely_t1]).argmax())
    engine.proposer = FixedProposer([draft])

    n = 500
    for seed in range(n):
        engine.add_request(
            prompt_token_ids=prompt,
            request_id=f"s{seed}",
            sampling_params=SamplingParams(seed=seed, **params),
        )
    records, final, _ = run(engine)
    counts: dict = {}
    for out in final.values():
        key = tuple(out.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    spec = spec_decode_dataframe(records)
    assert len(spec) >= n * 0.99  # (nearly) every second token came out of a verification
    accepted = spec.num_accepted_tokens.sum()
    assert 0.05 * len(spec) < accepted < 0.95 * len(spec), "acceptance and rejection both happen"
    statistic, dof = chi_square(counts, {key: n * p for key, p in expected_joint.items()})
    print(f"chi-square {statistic:.2f}, {dof} degrees of freedom, {accepted}/{len(spec)} accepted")
    assert statistic < CHI2_CRITICAL_0_001[dof], (statistic, dof, counts)


def test_rejection_sampler_alone_keeps_the_distribution():
    """The verifier on fixed logits: the first emitted token is distributed as p, whichever
    draft is proposed (a likely one, an unlikely one)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, 0.5]] * 2)
    params = SamplingParams(temperature=0.9, seed=0)
    p = Sampler.probabilities(logits[0], params)
    n = 2000
    for draft in (0, 4):
        verifier = RejectionSampler()
        counts: dict = {}
        for _ in range(n):
            token = verifier(logits, [draft], params, "r")[0]
            counts[token] = counts.get(token, 0) + 1
        statistic, dof = chi_square(counts, {t: n * p[t].item() for t in range(len(p))})
        assert statistic < CHI2_CRITICAL_0_001[dof], (draft, statistic, counts)


# -- the bench section -------------------------------------------------------------------------


def test_bench_section_measures_both_workloads_with_and_without(tiny_model_dir):
    from engine.entrypoints.llm import LLM
    from engine.tools.bench.config import BenchConfig
    from engine.tools.bench.report import format_spec_decode
    from engine.tools.bench.spec_decode import run_spec_decode

    config = BenchConfig(
        model=str(tiny_model_dir),
        device="cpu",
        speculative="ngram",
        spec_num_requests=2,
        spec_output_len=12,
        probe_prompt_len=16,
        max_num_seqs=4,
    )
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_num_seqs=4)
    result = run_spec_decode(llm, config, specials=[0, 1, 2])
    assert set(result["workloads"]) == {"repetitive", "random"}
    for row in result["workloads"].values():
        assert row["identical_outputs"]
        assert (
            row["plain"]["decode_batch1_tokens_per_s"] > 0
            and row["ngram"]["offline_output_tokens_per_s"] > 0
        )
        assert row["ngram"]["spec"]["num_draft_tokens"] >= 0
    assert "7. Speculative decoding" in "\n".join(format_spec_decode(result))
