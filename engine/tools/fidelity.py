"""The same trace on both executors, step by step: how far is the simulator from the real engine?

1. A trace (engine/tools/trace_readers.py) is scaled to fit the real engine on this machine:
   the first few requests, prompts and outputs capped, arrivals compressed so the whole replay
   spans a few seconds. The scaling is stated in the conditions.
2. The real engine runs it (after an unrecorded warm-up): every step's time is measured
   (StepRecord.engine_duration, on the engine clock).
3. Each measured step's batch — (new tokens, cached tokens) per request, rows sampled — goes
   through the cost model (engine/tools/cost_model.py) with this machine's hardware preset: the
   simulated time of *that same step*. Steps pair by index, exactly.

   Why the real batches and not the simulator's own schedule: arrivals on the real engine wait
   for the engine clock, which moves by measured step times; on the simulated engine it moves by
   computed ones. Wherever the two differ, a request arrives one step earlier on one side, and
   from there on the batches (and every later step) differ: the comparison would measure the
   schedule's drift, not the cost model. So the simulator's own run of the same arrivals is done
   too, and whether its schedule matched the real one (and from which step it did not) is
   reported next to the per-step errors, which always pair the real batches.
4. Per step: error = (simulated − measured) / measured; the median and p90 of |error|.
5. "Calibrate on this run": the cost model's efficiencies are fitted on these measured steps
   (calibration.fit_steps) and the errors recomputed. That fit is in-sample: it shows how well
   the model's *form* can describe this machine, not a prediction of an unseen run.
6. The load average (os.getloadavg, one minute) before and after the measured run. The run
   counts as busy when the load before it was above 1.5, or the load after it above 1.5 plus
   the engine's own threads (the measured run itself adds about that many): step times are then
   mostly other programs' noise, which the report says instead of calling it the simulator's
   error.

    python -m engine.tools.fidelity --trace-file tests/data/mooncake_sample.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.tools.trace_readers import Scaling, TraceWorkload, build_workload, read_rows

BUSY_LOAD = 1.5
FIDELITY_TARGET = 0.10  # median |step error| after calibration, on a quiet machine
TARGET_SPAN_S = 2.0  # the scaled replay's arrivals span at most this many seconds
SAMPLES = {
    "mooncake": Path(__file__).resolve().parents[2] / "tests/data/mooncake_sample.jsonl",
    "azure": Path(__file__).resolve().parents[2] / "tests/data/azure_sample.csv",
}


def cpu_scaling() -> Scaling:
    """What fits the 135M model on a 2-core CPU in well under a minute. time_scale 0 means:
    choose it so that the replayed arrivals span TARGET_SPAN_S."""
    return Scaling(time_scale=0, max_requests=10, max_input_len=160, max_output_len=16)


def scale_trace(path, engine, fmt: str = "auto", scaling: Scaling | None = None) -> TraceWorkload:
    """The trace as a workload for `engine` (its vocabulary, specials and context limit)."""
    scaling = scaling or cpu_scaling()
    rows, fmt = read_rows(path, fmt)
    if scaling.time_scale == 0:
        used = rows[: scaling.max_requests] if scaling.max_requests else rows
        scaling.time_scale = max(1.0, used[-1].arrival / TARGET_SPAN_S)
    if scaling.max_total_len is None:
        scaling.max_total_len = engine.max_model_len
    specials = engine.tokenizer.special_token_ids
    return build_workload(path, rows, fmt, engine.model_config.vocab_size, scaling, specials)


# ---------------------------------------------------------------------------------------------
# The real run


@dataclass
class Replay:
    """A scaled trace run on the real engine: records, requests, metrics and what it rested on."""

    records: list
    requests: list
    metrics: list
    summary: dict
    conditions: dict


def engine_settings(engine) -> dict:
    """The settings the scheduler's decisions depend on (the simulator gets the same)."""
    c = engine.config
    return {
        "num_kv_blocks": engine.num_blocks,
        "block_size": c.block_size,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "long_prefill_token_threshold": c.long_prefill_token_threshold,
        "enable_prefix_caching": c.enable_prefix_caching,
        "enable_chunked_prefill": c.enable_chunked_prefill,
        "scheduling_policy": c.scheduling_policy,
        "preemption_mode": c.preemption_mode,
    }


def replay_on_engine(engine, trace: TraceWorkload) -> Replay:
    """Run the (scaled) trace on a real EngineCore, after an unrecorded warm-up request; the load
    average is read right before and right after the measured run."""
    import torch

    from engine.tools.calibration import run_real_steps
    from engine.tools.simulator import summarize

    load_before = os.getloadavg()[0]
    records, requests = run_real_steps(engine, trace.requests)
    load_after = os.getloadavg()[0]
    threads = torch.get_num_threads()
    metrics = [r.metrics(clock="engine") for r in requests]
    conditions = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "model": str(engine.model_dir),
        "device": engine.device.type,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": threads,
        "engine": engine_settings(engine),
        "trace": trace.conditions,
        **load_conditions(load_before, load_after, threads),
    }
    return Replay(records, requests, metrics, summarize(metrics, records), conditions)


def load_conditions(load_before: float, load_after: float, threads: int) -> dict:
    """The machine's 1-minute load average around a measured run, and whether it was busy: other
    programs before it, or more than its own `threads` after it (the run itself loads the
    machine by about its thread count). The one rule for every measurement that reports it."""
    return {
        "load_before": load_before,
        "load_after": load_after,
        "busy": load_before > BUSY_LOAD or load_after > BUSY_LOAD + threads,
        "busy_rule": f"1-minute load > {BUSY_LOAD} before, or > {BUSY_LOAD} + threads after",
    }


# ---------------------------------------------------------------------------------------------
# The comparison


def step_errors(records, preset, hardware, efficiency) -> dict:
    """Each measured step's batch through the cost model: measured and simulated seconds per
    step, the relative error, and its median and p90 in absolute value."""
    from engine.tools.calibration import step_batch
    from engine.tools.cost_model import CostModel
    from engine.tools.workload import percentile

    model = CostModel(preset.config, hardware, 1, efficiency, dtype=hardware.dtype)
    steps = [r for r in records if r.scheduled]
    measured = [r.engine_duration for r in steps]
    simulated = [model.step_cost(*step_batch(r)).total_s for r in steps]
    errors = [(s - m) / m for s, m in zip(simulated, measured)]
    return {
        "step": [r.step for r in steps],
        "tokens": [sum(s.num_tokens for s in r.scheduled) for r in steps],
        "measured_s": measured,
        "simulated_s": simulated,
        "error": errors,
        "median_abs_error": percentile([abs(e) for e in errors], 50),
        "p90_abs_error": percentile([abs(e) for e in errors], 90),
        "efficiency": efficiency.as_dict(),
    }


def _batches(records) -> list[list[tuple[str, int, int]]]:
    return [
        sorted((s.request_id, s.num_tokens, s.num_computed_tokens) for s in r.scheduled)
        for r in records
        if r.scheduled
    ]


def schedule_check(replay: Replay, trace: TraceWorkload, preset, hardware, efficiency) -> dict:
    """The simulator's own run of the same arrivals and settings (with the efficiencies fitted on
    this run, its best chance): did it schedule the same batches as the real engine, and if not,
    from which step on?"""
    from engine.tools.simulator import simulate

    settings = replay.conditions["engine"]
    sim = simulate(
        preset, hardware, None, workload=trace.requests, efficiency=efficiency, **settings
    )
    real, simulated = _batches(replay.records), _batches(sim.records)
    first = next((i for i, (a, b) in enumerate(zip(real, simulated)) if a != b), None)
    if first is None and len(real) != len(simulated):
        first = min(len(real), len(simulated))
    return {
        "same_schedule": first is None,
        "first_different_step": first,
        "steps": {"real": len(real), "simulated": len(simulated)},
        "total_s": {"real": replay.summary["duration_s"], "simulated": sim.summary["duration_s"]},
    }


def this_machine_hardware(engine, calibration_path: str | Path | None = None):
    """The hardware preset and efficiencies of this machine: the cached calibration's (measured
    ceilings, efficiencies fitted on the calibration's own workload, not this trace) if there is
    one, else ceilings measured now (quick) with the assumed efficiencies, labelled as such."""
    from engine.tools.calibration import load_calibration, measure_this_machine
    from engine.tools.cost_model import Efficiency

    calibration = load_calibration(calibration_path)
    if calibration is not None and calibration.hardware.dtype == str(engine.dtype).removeprefix(
        "torch."
    ):
        return calibration.hardware, calibration.efficiency
    return measure_this_machine(engine.device, engine.dtype, quick=True), Efficiency()


@dataclass
class Fidelity:
    """The per-step comparison before and after calibrating on this run, and its conditions."""

    before: dict
    after: dict
    schedule: dict
    conditions: dict
    summary: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def compare(
    replay: Replay, trace: TraceWorkload, engine, hardware=None, efficiency=None, calibration=None
) -> Fidelity:
    """Before (this machine's preset as it is; `hardware` and `efficiency` override it) and after
    (efficiencies fitted on this run). `calibration`: a calibration file to start from."""
    from engine.tools.calibration import fit_steps
    from engine.tools.cost_model import Efficiency
    from engine.tools.presets import model_preset_from_dir

    preset = model_preset_from_dir(engine.model_dir)
    if hardware is None:
        hardware, efficiency = this_machine_hardware(engine, calibration)
    efficiency = efficiency or Efficiency()
    before = step_errors(replay.records, preset, hardware, efficiency)
    fitted, _ = fit_steps(replay.records, hardware, preset)
    after = step_errors(replay.records, preset, hardware, fitted)
    schedule = schedule_check(replay, trace, preset, hardware, fitted)
    conditions = {
        **replay.conditions,
        "hardware": {
            "name": hardware.name,
            "evidence": hardware.evidence,
            "source": hardware.source,
        },
        "efficiency_before": efficiency.evidence,
        "efficiency_after": fitted.evidence + " (in-sample: fitted on the steps it is compared on)",
        "pairing": "the real run's batches through the cost model, step by step (module doc)",
    }
    return Fidelity(before, after, schedule, conditions, replay.summary)


def run_fidelity(
    trace_path: str | Path = SAMPLES["mooncake"],
    fmt: str = "auto",
    model: str | None = None,
    scaling: Scaling | None = None,
    engine=None,
    log=print,
    calibration: str | Path | None = None,
) -> Fidelity:
    """Scale the trace, run it on the real engine (default model, CPU unless `engine` is given),
    and compare every step with the cost model's time, before and after calibrating on it."""
    from engine.core import EngineCore

    if engine is None:
        engine = EngineCore(model=model, device="cpu", max_num_seqs=8, max_num_batched_tokens=256)
    trace = scale_trace(trace_path, engine, fmt, scaling)
    log(f"fidelity: {trace.conditions['requests']} requests of {trace_path} on the real engine")
    replay = replay_on_engine(engine, trace)
    log("fidelity: the same steps through the cost model, before and after calibrating")
    return compare(replay, trace, engine, calibration=calibration)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.1f} %"


def format_fidelity(f: Fidelity) -> str:
    """The report: what ran, the step errors before and after, the schedule check, the load."""
    from engine.tools.trace_readers import describe

    c, s = f.conditions, f.schedule
    busy = "BUSY — step times are mostly other programs' noise" if c["busy"] else "quiet"
    lines = [
        f"Simulator fidelity on this machine ({c['device']}, {c['dtype']}, {c['threads']} threads)"
        f", {c['date']}",
        describe(TraceWorkload([], c["trace"])),
        f"  steps compared: {len(f.before['error'])} (measured: engine clock; simulated: "
        f"the cost model on {c['hardware']['name']}, the same batches)",
        f"  median |step error| before calibration: {_pct(f.before['median_abs_error'])} "
        f"(p90 {_pct(f.before['p90_abs_error'])}) — efficiencies: {c['efficiency_before']}",
        f"  median |step error| after calibrating on this run: "
        f"{_pct(f.after['median_abs_error'])} (p90 {_pct(f.after['p90_abs_error'])}, in-sample)",
        "  the simulator's own schedule of these arrivals: "
        + (
            "the same batches as the real run"
            if s["same_schedule"]
            else f"differs from step {s['first_different_step']} on "
            f"({s['steps']['real']} real vs {s['steps']['simulated']} simulated steps)"
        ),
        f"  load average (1 min): {c['load_before']:.2f} before, {c['load_after']:.2f} after "
        f"→ {busy}",
        f"  target: median ≤ {_pct(FIDELITY_TARGET)} after calibration on a quiet machine",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tools.fidelity", description=__doc__)
    p.add_argument("--trace-file", default=str(SAMPLES["mooncake"]))
    p.add_argument("--trace-format", choices=["auto", "mooncake", "azure"], default="auto")
    p.add_argument("--model", default=None, help="an artifact directory (default: the 135M one)")
    p.add_argument("--json", default=None, help="also write every step's figures here")
    p.add_argument(
        "--calibration",
        default=None,
        help="the calibration to start from (default: bench-results/calibration.json if any)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="first fit a calibration on its own workload into --calibration (about a minute)",
    )
    args = p.parse_args(argv)
    try:
        if args.calibrate:
            from engine.tools.calibration import calibrate

            calibrate(args.model, device="cpu", path=args.calibration)
        result = run_fidelity(
            args.trace_file, args.trace_format, args.model, calibration=args.calibration
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(format_fidelity(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
