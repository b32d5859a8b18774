"""engine/tools/workload.py: the one workload (seeded items, Poisson arrivals, percentiles) that
the benchmark, the simulator and the labs share."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.tools.workload import (
    make_workload,
    percentile,
    percentiles,
    poisson_arrivals,
    poisson_workload,
)


def test_workload_is_seeded_and_within_its_ranges():
    a = make_workload(20, (16, 512), (16, 256), 7, 49152, range(17))
    b = make_workload(20, (16, 512), (16, 256), 7, 49152, range(17))
    assert [(w.prompt_token_ids, w.output_len) for w in a] == [
        (w.prompt_token_ids, w.output_len) for w in b
    ]
    assert all(16 <= len(w.prompt_token_ids) <= 512 and 16 <= w.output_len <= 256 for w in a)
    assert all(17 <= t < 49152 for w in a for t in w.prompt_token_ids)  # no special tokens


def test_percentiles_interpolate_like_numpy():
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p == {"p50": 3.0, "p90": pytest.approx(4.6), "p99": pytest.approx(4.96)}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentile([], 50) is None
    values = [random.Random(3).random() for _ in range(37)]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_poisson_arrivals_are_seeded_exponential_gaps():
    """The same seed gives the same times, the first at 0, gaps averaging 1/rate."""
    a = poisson_arrivals(2000, 4.0, seed=1)
    assert a == poisson_arrivals(2000, 4.0, seed=1) != poisson_arrivals(2000, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    rng = random.Random(1)
    assert a[1] == pytest.approx(rng.expovariate(4.0))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)
    assert poisson_arrivals(5, None, seed=0) == [0.0] * 5


def test_poisson_arrivals_with_a_deadline_start_after_one_gap():
    a = poisson_arrivals(10, 5.0, seed=1, first_at_zero=False, until_s=3.0)
    assert 0 < a[0] and all(t < 3.0 for t in a) and len(a) <= 10
    assert len(poisson_arrivals(7, 1000.0, seed=0, first_at_zero=False, until_s=3.0)) == 7


def test_poisson_workload_joins_items_and_arrivals():
    w = poisson_workload(6, 2.0, (5, 40), (5, 20), 1000, seed=3, special_ids={0, 1})
    items = make_workload(6, (5, 40), (5, 20), 3, 1000, {0, 1})
    assert [r.prompt_token_ids for r in w] == [i.prompt_token_ids for i in items]
    assert [r.arrival for r in w] == poisson_arrivals(6, 2.0, seed=4)
    assert all(r.max_tokens == 20 for r in w)
    with pytest.raises(ValueError):
        poisson_workload(0, 2.0, (5, 40), (5, 20), 1000)
    with pytest.raises(ValueError):
        poisson_workload(3, 0.0, (5, 40), (5, 20), 1000)
