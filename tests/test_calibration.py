"""The calibration's fit: efficiencies and the measured overhead come back from known steps."""

import numpy as np
import pytest

from engine.calibration import fit_efficiency
from engine.cost_model import CostModel, Efficiency
from engine.presets import load_hardware_preset, load_model_preset


def _steps(truth: Efficiency):
    preset, hw = load_model_preset("smollm2-135m-instruct"), load_hardware_preset("l4")
    cost = CostModel(preset.config, hw, 1, truth)
    batches = [([(1, 50 + 10 * i)] * b, b) for b in (1, 4, 16, 32) for i in range(5)]
    batches += [([(n, 0)], 1) for n in (256, 512, 2048, 4096, 8192)] + [([(512, 512), (1, 30)], 2)]
    terms = [cost.terms(batch, sampled) for batch, sampled in batches]
    steps = [cost.step_cost(batch, sampled) for batch, sampled in batches]
    return terms, steps


def test_fit_with_measured_overhead_recovers_known_efficiencies():
    truth = Efficiency(
        linear_memory=0.6,
        linear_compute=0.4,
        attention=0.3,
        step_overhead_s=0.004,
        per_request_s=0.0002,
    )
    terms, steps = _steps(truth)
    fitted, stats = fit_efficiency(
        terms,
        [s.total_s for s in steps],
        forward_durations=[s.model_s for s in steps],
    )
    for name in (
        "linear_memory",
        "linear_compute",
        "attention",
        "step_overhead_s",
        "per_request_s",
    ):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    assert stats["median_abs_relative_error"] < 1e-6


def test_measured_overhead_is_not_confused_with_reading_the_weights():
    """Noisy forwards: the fixed cost comes from (step − forward), so it stays the measured few
    milliseconds instead of soaking up the weight-reading time every memory-bound step shares."""
    truth = Efficiency(
        linear_memory=0.5,
        linear_compute=0.5,
        attention=0.5,
        step_overhead_s=0.002,
        per_request_s=0.0,
    )
    terms, steps = _steps(truth)
    noise = np.random.default_rng(0).uniform(0.85, 1.15, len(steps))
    forward = [s.model_s * k for s, k in zip(steps, noise)]
    total = [f + s.overhead_s for f, s in zip(forward, steps)]
    fitted, _ = fit_efficiency(terms, total, forward_durations=forward)
    assert fitted.step_overhead_s == pytest.approx(0.002, rel=1e-6)
    assert fitted.linear_memory == pytest.approx(0.5, rel=0.2)
