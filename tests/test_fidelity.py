"""Simulator fidelity on a trace (engine/tools/fidelity.py), on the tiny model: the scaled trace
runs on the real engine, every measured step pairs with the cost model's time for the same batch,
calibrating on the run shrinks the error, and the load average decides "busy"."""

from __future__ import annotations

import json

import pytest

from engine.tools.cost_model import Efficiency
from engine.tools.fidelity import (
    SAMPLES,
    TARGET_SPAN_S,
    compare,
    format_fidelity,
    replay_on_engine,
    scale_trace,
)
from engine.tools.presets import HardwarePreset
from engine.tools.trace_readers import Scaling

# Deliberately far from a 2-core CPU (ten times too fast), so the fit has something to fix.
WRONG_HARDWARE = HardwarePreset(
    key="wrong",
    name="a made-up machine",
    kind="cpu",
    memory_bytes=64 << 30,
    memory_bandwidth=500e9,
    peak_flops=2e12,
    interconnect_bandwidth=0.0,
    interconnect="none",
    dtype="float32",
    evidence="assumed",
    source="test",
)


@pytest.mark.parametrize("load, busy", [((0.3, 0.3, 0.3), False), ((3.0, 2.0, 1.0), True)])
def test_trace_on_both_executors_step_by_step(make_engine, monkeypatch, load, busy):
    monkeypatch.setattr("os.getloadavg", lambda: load)
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_token_threshold=0)
    trace = scale_trace(SAMPLES["mooncake"], engine)
    c = trace.conditions
    assert c["requests"] == 10 and c["span_replayed_s"] <= TARGET_SPAN_S + 1e-9
    assert c["time_scale"] > 1 and c["capped_input"] == 10  # stated, not silent
    replay = replay_on_engine(engine, trace)
    assert len(replay.metrics) == 10 and all(m.finish_time for m in replay.metrics)
    assert sum(r.prefix_cache_hits for r in replay.records) > 0  # shared hash ids were shared
    result = compare(replay, trace, engine, WRONG_HARDWARE, Efficiency())
    before, after = result.before, result.after
    measured = [r.engine_duration for r in replay.records if r.scheduled]
    assert before["measured_s"] == measured == after["measured_s"]  # paired by step, all of them
    for sim, real, error in zip(before["simulated_s"], measured, before["error"]):
        assert error == pytest.approx((sim - real) / real)

    # the fit minimizes squared relative residuals: that, not the median, must shrink (the median
    # of a noisy run, e.g. under a loaded suite, may not)
    def mean_square(errors: list[float]) -> float:
        return sum(e * e for e in errors) / len(errors)

    assert mean_square(after["error"]) < mean_square(before["error"]), (before, after)
    assert result.conditions["busy"] is busy
    assert result.schedule["steps"]["real"] == len(measured)
    text = format_fidelity(result)
    assert ("BUSY" in text) is busy and "10 of 32 requests" in text and "÷" in text
    json.dumps(result.to_dict())  # what --json writes and the page reads


def test_scaling_is_the_callers_when_given(make_engine):
    engine = make_engine()
    trace = scale_trace(SAMPLES["azure"], engine, scaling=Scaling(time_scale=5, max_requests=3))
    assert trace.conditions["time_scale"] == 5 and len(trace.requests) == 3
    assert trace.conditions["max_total_len"] == engine.max_model_len
