"""Calibration: fit the cost model's efficiencies to the real engine's step times on this machine.

    1. measure this machine's ceilings (memory bandwidth, matmul FLOP/s): the benchmark's functions
    2. run the real engine with the default model on a short, seeded workload; keep each step's
       measured duration (its StepRecord's engine_duration) and its batch
    3. the bookkeeping outside the forward pass (scheduling, inputs, sampling, outputs) is
       measured in every StepRecord: fit it as a fixed cost per step plus a cost per request
    4. compute each step's cost-model terms at 100 % of those ceilings, and find the efficiencies
       that make the cost model's forward times closest to the measured ones (least squares)

The roofline takes a max (a linear is bound by bytes *or* by FLOPs), so the fit alternates: with
the current efficiencies, each step's linears are classified memory- or compute-bound; with that
classification the step time is linear in 1/efficiency, which least squares solves; repeat until
the classification stops changing. Residuals are relative (a 20 ms decode step counts as much as
a 2 s prefill step), since TPOT is made of small steps and TTFT of large ones.

The result is cached in bench-results/calibration.json with the conditions it was measured
under. "This machine" as a hardware preset is built from it.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine.tools.bench.config import BenchConfig, side_engine_kv_cache_memory
from engine.tools.cost_model import (
    CostModel,
    Efficiency,
    layers_memory_bound,
    memory_bound,
    step_parts,
)
from engine.tools.presets import THIS_MACHINE, HardwarePreset, PresetError, model_preset_from_dir

CALIBRATION_FILE = "calibration.json"


def default_path() -> Path:
    from engine.tools.bench.results import RESULTS_DIR

    return RESULTS_DIR / CALIBRATION_FILE


@dataclass
class CalibrationWorkload:
    """Deliberately not the benchmark's workload (other seed, other lengths): the fidelity check
    then tests the fit on steps it has never seen."""

    # More requests than max_num_seqs, so decode batches run full (32, where this CPU's linears
    # turn compute-bound) as well as down to 1 while the last requests finish.
    num_requests: int = 40
    prompt_len: tuple[int, int] = (8, 320)
    output_len: tuple[int, int] = (8, 96)
    seed: int = 1000
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512

    @classmethod
    def quick(cls) -> "CalibrationWorkload":
        return cls(num_requests=12, prompt_len=(8, 160), output_len=(4, 40))


@dataclass
class Calibration:
    efficiency: Efficiency
    hardware: HardwarePreset
    conditions: dict
    fit: dict

    def to_dict(self) -> dict:
        return {
            "schema": 1,
            "kind": "fitted",
            "efficiency": self.efficiency.as_dict(),
            "hardware": asdict(self.hardware),
            "conditions": self.conditions,
            "fit": self.fit,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        return cls(
            Efficiency(**data["efficiency"]),
            HardwarePreset(**data["hardware"]),
            data["conditions"],
            data["fit"],
        )


# ---------------------------------------------------------------------------------------------
# This machine, measured


def _memory_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_this_machine(device, dtype, quick: bool = False) -> HardwarePreset:
    """A hardware preset from the benchmark's ceilings (measured now, best of N)."""
    import torch

    from engine.tools.bench.ceilings import measure_ceilings
    from engine.tools.bench.results import device_name

    c = BenchConfig.quick_config() if quick else BenchConfig()  # the bench's own sizes
    size, matmul, repeats = c.bandwidth_bytes, c.matmul_size, c.ceiling_repeats
    dtypes = tuple(dict.fromkeys((dtype, torch.float32)))  # the engine's, float32 to fall back on
    ceilings = measure_ceilings(device, size, matmul, repeats, dtypes, c.ceiling_budget_s)
    dtype_name = str(dtype).removeprefix("torch.")
    flops = ceilings["matmul_gflop_s"].get(dtype_name) or ceilings["matmul_gflop_s"]["float32"]
    return HardwarePreset(
        key=THIS_MACHINE,
        name=f"this machine ({device_name(device)})",
        kind="gpu" if device.type == "cuda" else "cpu",
        memory_bytes=_memory_bytes(device),
        memory_bandwidth=ceilings["memory_read_gb_s"] * 1e9,
        peak_flops=flops * 1e9,
        interconnect_bandwidth=0.0,
        interconnect="none",
        dtype=dtype_name,
        evidence="measured",
        source=f"engine/tools/bench/ceilings.py measure_ceilings, "
        f"{datetime.date.today().isoformat()}: read bandwidth of a {size >> 20} MiB tensor, "
        f"{matmul}² matmul, best of {repeats} each",
    )


# ---------------------------------------------------------------------------------------------
# The fit


def step_batch(record) -> tuple[list[tuple[int, int]], int]:
    """(new tokens, cached tokens) per scheduled request, and the number of sampling rows."""
    return [(s.num_tokens, s.num_computed_tokens) for s in record.scheduled], len(record.new_tokens)


def fit_efficiency(
    terms: list[dict],
    durations: list[float],
    iterations: int = 20,
    forward_durations: list[float] | None = None,
) -> tuple[Efficiency, dict]:
    """Least squares of measured step durations on the cost model's terms (see the module doc).

    With `forward_durations` (each step's measured forward, StepRecord.timings["forward"]) the
    bookkeeping outside the forward is not guessed but measured: a fixed cost per step plus a cost
    per request, fitted on (step − forward) alone; the efficiencies are then fitted on the forward
    alone. Without it, one fit of the whole step must split a constant between "overhead" and
    "reading the weights", which every memory-bound step pays alike; on real, noisy steps that
    split comes out arbitrary (58 ms of "overhead" for a 56 ms decode step, once)."""
    if forward_durations is not None:
        return _fit_with_measured_overhead(terms, durations, forward_durations, iterations)
    return _fit_steps(terms, np.array(durations), iterations, constant=True)


def _fit_with_measured_overhead(
    terms: list[dict], durations: list[float], forward: list[float], iterations: int
) -> tuple[Efficiency, dict]:
    step, fwd = np.array(durations), np.array(forward)
    outside = np.clip(step - fwd, 0.0, None)
    requests = np.array([t["requests"] for t in terms], dtype=float)
    fixed, per_request = _nonnegative_lstsq(
        np.stack([np.ones_like(requests), requests], 1), outside
    )
    # The forward has no bookkeeping of its own: only the three roofline terms. (A cost per
    # request there would compete with attention, which also grows with the requests.)
    e, _ = _fit_steps(terms, np.clip(fwd, 1e-6, None), iterations, constant=False, requests=False)
    e.step_overhead_s, e.per_request_s = float(fixed), float(per_request)
    cost = np.array([_predict(t, e) for t in terms])
    rel = (cost - step) / step
    return e, {
        **_stats(step, cost, rel, terms, e),
        "overhead": "measured: step − forward, fitted as a fixed cost + a cost per request",
    }


def _predict(t: dict, e: Efficiency) -> float:
    return sum(step_parts(t, e).values())


def _stats(y: np.ndarray, predicted: np.ndarray, rel: np.ndarray, terms, e: Efficiency) -> dict:
    return {
        "steps": len(y),
        "memory_bound_steps": sum(1 for t in terms if layers_memory_bound(t, e)),
        "median_abs_relative_error": float(np.median(np.abs(rel))),
        "p90_abs_relative_error": float(np.quantile(np.abs(rel), 0.9)),
        "total_measured_s": float(y.sum()),
        "total_predicted_s": float(predicted.sum()),
    }


def _linear_columns(t: dict, e: Efficiency) -> tuple[float, float, float, tuple[bool, bool]]:
    """A step's linears as (memory seconds, compute seconds, compute seconds per row) at 100 %,
    each counted only for the groups (layers, LM head) that the current `e` says are bound by it;
    and that classification. compute ÷ e_flop + per-row × ramp ÷ e_flop is their compute time."""
    memory = compute = per_row = 0.0
    bound = []
    for mem_s, comp_s, rows in (
        (t["layer_memory_s"], t["layer_compute_s"], t["tokens"]),
        (t["head_memory_s"], t["head_compute_s"], t["sampled"]),
    ):
        is_memory = memory_bound(mem_s, comp_s, rows, e)
        bound.append(is_memory)
        if is_memory:
            memory += mem_s
        else:
            compute += comp_s
            per_row += comp_s / max(rows, 1)
    return memory, compute, per_row, (bound[0], bound[1])


def _fit_steps(
    terms: list[dict], y: np.ndarray, iterations: int, constant: bool, requests: bool = True
) -> tuple[Efficiency, dict]:
    """The alternating fit of the module doc on durations y. With `constant`, a fixed cost per
    step is fitted (whole steps); without it, y is a forward pass and the small-matmul ramp is
    fitted instead (with a constant the two cannot be told apart on compute-bound steps).
    Without `requests`, no cost per request."""
    e = Efficiency(
        linear_memory=1.0, linear_compute=1.0, attention=1.0, step_overhead_s=0.0, per_request_s=0.0
    )
    classes = None
    for _ in range(iterations):
        rows, now = [], []
        for t in terms:
            memory, compute, per_row, bound = _linear_columns(t, e)
            rows.append(
                [
                    1.0 if constant else 0.0,
                    t["requests"] if requests else 0.0,
                    memory,
                    compute,
                    0.0 if constant else per_row,
                    t["attention_s"],
                ]
            )
            now.append(bound)
        x = _nonnegative_lstsq(np.array(rows) / y[:, None], np.ones_like(y))  # relative residuals
        e = Efficiency(
            linear_memory=float(1 / x[2]) if x[2] > 0 else 1.0,
            linear_compute=float(1 / x[3]) if x[3] > 0 else 1.0,
            linear_compute_ramp_tokens=float(x[4] / x[3]) if x[3] > 0 else 0.0,
            attention=float(1 / x[5]) if x[5] > 0 else 1.0,
            step_overhead_s=float(x[0]),
            per_request_s=float(x[1]),
            interconnect=Efficiency.interconnect,
            allreduce_latency_s=Efficiency.allreduce_latency_s,
            evidence="fitted",
        )
        if now == classes:
            break
        classes = now
    predicted = np.array(rows) @ x
    rel = (predicted - y) / y
    stats = {
        **_stats(y, predicted, rel, terms, e),
        "identified": {
            "linear_memory": bool(x[2] > 0),
            "linear_compute": bool(x[3] > 0),
            "attention": bool(x[5] > 0),
        },
    }
    return e, stats


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0: a column whose coefficient comes out negative is
    dropped (its coefficient set to 0) and the rest solved again. Small and good enough for 5."""
    active = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        negative = [i for i in active if x[i] < 0]
        if not negative:
            return x
        active.remove(min(negative, key=lambda i: x[i]))


# ---------------------------------------------------------------------------------------------
# The calibration run


def run_real_steps(engine, workload) -> tuple[list, list]:
    """Run a workload on a real engine: (StepRecords, Requests), after an unrecorded warm-up."""
    from engine.sampling_params import SamplingParams
    from engine.tools.workload import run_workload

    engine.add_request(
        prompt_token_ids=workload[0].prompt_token_ids[:8],
        sampling_params=SamplingParams(max_tokens=2),
    )
    while engine.has_unfinished_requests():
        engine.step()
    return run_workload(engine, workload)


def calibration_requests(engine, w: CalibrationWorkload) -> list:
    """The workload's requests, all at t = 0, each run to its drawn length: the real model's EOS
    would end requests early, and the lengths are the workload's."""
    from engine.tools.workload import poisson_workload

    specials = set(engine.tokenizer.special_token_ids)
    vocab = engine.model_config.vocab_size
    requests = poisson_workload(
        w.num_requests, None, w.prompt_len, w.output_len, vocab, w.seed, specials
    )
    for r in requests:
        r.ignore_eos = True
        r.max_tokens = r.output_len
    return requests


def calibration_conditions(
    engine,
    w: CalibrationWorkload,
    hardware: HardwarePreset,
    model_name: str,
    run_seconds: float,
    quick: bool,
) -> dict:
    """What the fit was measured under: device, threads, model, workload, engine settings."""
    import torch

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": engine.device.type,
        "dtype": hardware.dtype,
        "threads": torch.get_num_threads(),
        "model": str(engine.model_dir),
        "model_name": model_name,
        "torch": torch.__version__,
        "run_seconds": run_seconds,
        "quick": quick,
        "workload": {
            "num_requests": w.num_requests,
            "prompt_len": list(w.prompt_len),
            "output_len": list(w.output_len),
            "seed": w.seed,
            "arrivals": "all at t=0",
            "sampling": "greedy, ignore_eos",
        },
        "engine": {
            "max_num_seqs": w.max_num_seqs,
            "max_num_batched_tokens": w.max_num_batched_tokens,
            "num_kv_blocks": engine.num_blocks,
            "block_size": engine.config.block_size,
        },
    }


def fit_steps(records, hardware: HardwarePreset, preset) -> tuple[Efficiency, dict]:
    """The efficiencies that make the cost model's step times closest to the measured ones."""
    cost = CostModel(preset.config, hardware, 1, dtype=hardware.dtype)
    terms = [cost.terms(*step_batch(r)) for r in records if r.scheduled]
    durations = [r.engine_duration for r in records if r.scheduled]
    forward = [r.timings.get("forward", 0.0) for r in records if r.scheduled]
    efficiency, stats = fit_efficiency(terms, durations, forward_durations=forward)
    efficiency.evidence = (
        f"fitted: least squares on {len(durations)} measured steps of the real engine "
        f"({preset.name}, {hardware.dtype}, {hardware.name}), {datetime.date.today().isoformat()}"
    )
    return efficiency, stats


def calibrate(
    model: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    workload: CalibrationWorkload | None = None,
    path: str | Path | None = None,
    quick: bool = False,
    log=print,
) -> Calibration:
    """Measure, run, fit, save. About a minute on a 2-core CPU (half that with quick=True)."""
    import torch

    from engine.core import EngineCore

    w = workload or (CalibrationWorkload.quick() if quick else CalibrationWorkload())
    engine = EngineCore(
        model=model,
        device=device,
        dtype=dtype,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        kv_cache_memory=side_engine_kv_cache_memory(device),
    )
    log(
        f"calibration: measuring this machine's ceilings ({engine.device.type}, "
        f"{torch.get_num_threads()} threads)"
    )
    hardware = measure_this_machine(engine.device, engine.dtype, quick)
    requests = calibration_requests(engine, w)
    log(
        f"calibration: running the real engine on {len(requests)} requests (prompt {w.prompt_len}, "
        f"output {w.output_len}, seed {w.seed})"
    )
    started = time.perf_counter()
    records, _ = run_real_steps(engine, requests)
    run_seconds = time.perf_counter() - started
    preset = model_preset_from_dir(engine.model_dir)
    efficiency, stats = fit_steps(records, hardware, preset)
    conditions = calibration_conditions(engine, w, hardware, preset.name, run_seconds, quick)
    calibration = Calibration(efficiency, hardware, conditions, stats)
    save_calibration(calibration, path)
    log(
        f"calibration: {stats['steps']} steps, median |error| "
        f"{100 * stats['median_abs_relative_error']:.1f} %; linear memory "
        f"{efficiency.linear_memory:.2f}, compute {efficiency.linear_compute:.2f} (small-matmul "
        f"ramp {efficiency.linear_compute_ramp_tokens:.0f} rows), attention "
        f"{efficiency.attention:.2f}, overhead {1000 * efficiency.step_overhead_s:.2f} ms + "
        f"{1000 * efficiency.per_request_s:.3f} ms/request"
    )
    return calibration


def save_calibration(calibration: Calibration, path: str | Path | None = None) -> Path:
    path = Path(path) if path else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.to_dict(), indent=2, ensure_ascii=False))
    return path


def load_calibration(path: str | Path | None = None) -> Calibration | None:
    """The cached calibration, or None if there is none (or it is unreadable)."""
    try:
        return Calibration.from_dict(json.loads(Path(path or default_path()).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def this_machine(path: str | Path | None = None) -> HardwarePreset:
    """The "this-machine" hardware preset, from the cached calibration (calibrating if none)."""
    calibration = load_calibration(path)
    if calibration is None:
        try:
            calibration = calibrate(path=path)
        except Exception as error:  # noqa: BLE001 — say what to do instead of a traceback
            raise PresetError(
                f"'this-machine' needs a calibration run, which failed ({error}); "
                "build the default artifact (python -m engine artifact build) first"
            ) from error
    return calibration.hardware
