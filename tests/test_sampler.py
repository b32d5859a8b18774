"""The sampler on hand-made logits: greedy, temperature, top-k, top-p, min-p, seeds, logprobs, and
SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.sampler import Sampler, is_distribution
from engine.sampling_params import MIN_TEMPERATURE, InvalidRequestError, SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]  # a hand-made distribution, as logits below
LOGITS = torch.tensor([math.log(p) for p in PROBS])


def sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 1.0, 1.0, 1.0], [-3.0, -2.0, -1.0, -1.5]])
    results = Sampler()(logits, ["a", "b", "c"], [sp(temperature=0.0)] * 3)
    assert [r.token_id for r in results] == [1, 0, 2]
    assert all(r.logprob is None and r.top_logprobs is None for r in results)


def test_greedy_rows_are_unaffected_by_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [
        sp(temperature=0.0),
        sp(temperature=1.0),
        sp(temperature=0.0),
        sp(temperature=1.5, top_k=5),
        sp(temperature=0.0),
        sp(temperature=0.7, seed=3),
    ]
    results = Sampler()(logits, list("abcdef"), params)
    argmax = logits.argmax(-1).tolist()
    for i in (0, 2, 4):
        assert results[i].token_id == argmax[i]


def test_temperature_scales_the_distribution():
    for t in (0.5, 1.0, 2.0):
        probs = Sampler.probabilities(LOGITS, sp(temperature=t))
        assert torch.allclose(probs, torch.softmax(LOGITS / t, -1), atol=1e-6)
    assert torch.allclose(
        Sampler.probabilities(LOGITS, sp(temperature=1.0)), torch.tensor(PROBS), atol=1e-6
    )


def test_top_k_keeps_the_k_most_likely():
    probs = Sampler.probabilities(LOGITS, sp(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(Sampler.probabilities(LOGITS, sp(top_k=1)), torch.tensor([1.0, 0, 0, 0]))
    for disabled in (0, -1, 4, 100):
        assert torch.allclose(
            Sampler.probabilities(LOGITS, sp(top_k=disabled)), torch.tensor(PROBS), atol=1e-6
        )


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, [0]),
        (0.5, [0]),
        (0.6, [0, 1]),
        (0.75, [0, 1]),
        (0.9, [0, 1, 2]),
        (0.99, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = Sampler.probabilities(LOGITS, sp(top_p=top_p))
    expected = torch.tensor([p if i in kept else 0.0 for i, p in enumerate(PROBS)])
    assert torch.allclose(probs, expected / expected.sum(), atol=1e-6)


def test_top_p_works_on_unsorted_logits():
    order = [2, 0, 3, 1]
    probs = Sampler.probabilities(
        LOGITS[order], sp(top_p=0.75)
    )  # tokens 1 and 3 are the likely ones now
    assert torch.allclose(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]), atol=1e-6)


@pytest.mark.parametrize(
    "min_p, kept", [(0.05, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (0.9, [0])]
)
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p, kept):
    probs = Sampler.probabilities(LOGITS, sp(min_p=min_p))
    expected = torch.tensor([p if i in kept else 0.0 for i, p in enumerate(PROBS)])
    assert torch.allclose(probs, expected / expected.sum(), atol=1e-6)


def test_filters_combine():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]))
    probs = Sampler.probabilities(logits, sp(top_k=4, top_p=0.8, min_p=0.6))
    # top-k 4 → [.4 .25 .2 .1]/.95; top-p 0.8 keeps the first three; min-p 0.6 × max drops 0.2
    assert torch.allclose(probs, torch.tensor([0.4 / 0.65, 0.25 / 0.65, 0, 0, 0]), atol=1e-5)


def test_samples_stay_inside_the_filtered_set_and_follow_the_distribution():
    sampler = Sampler()
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = sp(temperature=1.0, top_k=3, seed=11)
    counts = [0, 0, 0, 0]
    for _ in range(3000):
        (result,) = sampler(logits[None], ["x"], [params])
        counts[result.token_id] += 1
    assert counts[3] == 0
    for i, p in enumerate([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]):
        assert abs(counts[i] / 3000 - p) < 0.04, counts


def test_same_seed_same_tokens_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    rows = torch.randn(30, 6, 200)  # 30 steps, up to 6 requests, vocab 200
    seeded = sp(temperature=0.9, top_p=0.95, seed=1234)

    alone = Sampler()
    solo = [alone(rows[t, :1], ["s"], [seeded])[0].token_id for t in range(30)]

    batched = Sampler()
    mixed = []
    for t in range(30):
        others = t % 5  # the batch around it changes from step to step
        ids = [f"o{k}" for k in range(others)] + ["s"]
        params = [sp(temperature=1.0, seed=k if k % 2 else None) for k in range(others)] + [seeded]
        logits = torch.cat([rows[t, 1 : 1 + others], rows[t, :1]])
        mixed.append(batched(logits, ids, params)[-1].token_id)
    assert mixed == solo
    other_seed = Sampler()
    seed99 = sp(temperature=0.9, top_p=0.95, seed=99)
    different = [other_seed(rows[t, :1], ["s"], [seed99])[0].token_id for t in range(30)]
    assert different != solo


def test_forget_restarts_a_seeded_stream():
    torch.manual_seed(1)
    logits = torch.randn(1, 100)
    sampler = Sampler()
    params = sp(temperature=1.0, seed=5)
    first = [sampler(logits, ["r"], [params])[0].token_id for _ in range(10)]
    sampler.forget("r")
    again = [sampler(logits, ["r"], [params])[0].token_id for _ in range(10)]
    assert first == again
    assert len(set(first)) > 1  # it is really sampling


def test_logprobs_are_of_the_unmodified_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    reference = torch.log_softmax(logits[0], -1)
    (greedy,) = Sampler()(logits, ["g"], [sp(temperature=0.0, logprobs=2)])
    assert greedy.token_id == 0 and greedy.logprob == pytest.approx(reference[0].item(), abs=1e-6)
    assert list(greedy.top_logprobs) == [0, 1]
    assert greedy.top_logprobs[1] == pytest.approx(reference[1].item(), abs=1e-6)
    (sampled,) = Sampler()(logits, ["s"], [sp(temperature=0.3, top_k=2, seed=0, logprobs=0)])
    assert sampled.top_logprobs == {}
    assert sampled.logprob == pytest.approx(reference[sampled.token_id].item(), abs=1e-6)
    (none,) = Sampler()(logits, ["n"], [sp(temperature=0.0)])
    assert none.logprob is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("stop", [""]),
        ("stop", [3]),
        ("seed", "abc"),
        ("seed", 1.5),
        # the killers: each once took a whole engine step down (or a server with it)
        ("temperature", 1e-40),
        ("temperature", 0.009),
        ("seed", 2**64),
        ("seed", -1),
        ("seed", -(2**70)),
        ("seed", 10**30),
        ("seed", True),
        # NaN and ±inf never pass, whatever the field
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("top_k", 2**31),
        ("top_k", 1.5),
        ("max_tokens", 2**31),
        ("max_tokens", True),
        ("min_tokens", 1.5),
        ("logprobs", True),
        ("n", 1.0),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**40]),
        ("stop", ["x"] * 17),
    ],
)
def test_invalid_params_raise_naming_the_param(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


def test_verify_catches_values_changed_after_construction():
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(InvalidRequestError) as err:
        params.verify()
    assert err.value.param == "top_p"


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(min_tokens=5, max_tokens=2)
    assert err.value.param == "min_tokens"


def test_valid_edge_values_are_accepted():
    SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=None, logprobs=20, seed=0
    )
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=0, min_p=0.0, max_tokens=1, logprobs=0)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy


def test_seed_accepts_vllms_whole_range_and_sampler_uses_it():
    logits = torch.randn(1, 64)
    for seed in (0, 2**63, 2**64 - 1):
        params = sp(temperature=1.0, seed=seed)
        first = Sampler()(logits, ["r"], [params])[0].token_id
        assert Sampler()(logits, ["r"], [params])[0].token_id == first  # reproducible


def test_minimum_temperature_samples_finite_probabilities():
    logits = torch.tensor([[30.0, 29.0, -50.0, 10.0]])
    probs = Sampler.probabilities(logits[0], sp(temperature=MIN_TEMPERATURE))
    assert torch.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
    assert Sampler()(logits, ["t"], [sp(temperature=MIN_TEMPERATURE, seed=1)])[0].token_id == 0


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324, 1e-8])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    """1e-46 is 0 in float32: the cutoff must still keep the first token, not mask every one."""
    probs = Sampler.probabilities(LOGITS, sp(top_p=top_p))
    assert torch.allclose(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    (result,) = Sampler()(LOGITS[None], ["p"], [sp(top_p=top_p, seed=0)])
    assert result.token_id == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_broken_logits_fall_back_to_greedy_instead_of_raising(bad):
    """Defence in depth: a model that emits NaN/inf must not make the sampler raise."""
    logits = torch.tensor([[0.5, 2.0, bad, 1.0], [bad] * 4])
    params = [sp(temperature=1.0, seed=0, logprobs=2), sp(temperature=0.7, top_p=0.5, logprobs=1)]
    results = Sampler()(logits, ["a", "b"], params)
    assert all(0 <= r.token_id < 4 for r in results)
    for r in results:  # logprobs stay JSON-safe numbers
        assert math.isfinite(r.logprob) and all(math.isfinite(v) for v in r.top_logprobs.values())
    if math.isnan(bad):  # greedy over the numbers that are there
        assert results[0].token_id == 1
    elif bad == math.inf:  # an infinitely likely token is the greedy choice
        assert results[0].token_id == 2


def test_every_distribution_check_rejects_what_cannot_be_sampled():
    assert is_distribution(torch.tensor([0.2, 0.8]))
    for probs in ([0.0, 0.0], [math.nan, 1.0], [math.inf, 0.0], [-0.1, 1.1]):
        assert not is_distribution(torch.tensor(probs))


@pytest.mark.parametrize("n", [1, 5, 16, 17, 31, 49_152, 49_153])
def test_argmax_kernel_equals_torch_argmax(ext, n):
    """The greedy choice on our kernel (engine/kernels/csrc/sampling.cpp): the first index of the
    largest value, a NaN winning over every number, on rows shorter than a vector, a tail after
    whole vectors, ties, infinities."""
    from engine.layers.ops import ArgMax

    argmax = ArgMax(ext, torch.float32, "cpu")
    assert argmax.forward == argmax.forward_cpu
    torch.manual_seed(n)
    for trial in range(40):
        x = torch.randn(3, n)
        if trial % 4 == 1:  # many ties
            x = torch.randint(-3, 3, (3, n)).float()
        elif trial % 4 == 2:  # NaNs, the first of them wins
            x[0, torch.randint(0, n, (2,))] = float("nan")
        elif trial % 4 == 3:
            x[:] = float("-inf")
            x[1, n // 2] = float("inf")
        assert torch.equal(argmax(x), x.argmax(dim=-1)), (n, trial)
    assert torch.equal(argmax(x.t().contiguous().t()), x.argmax(dim=-1))  # a strided view
