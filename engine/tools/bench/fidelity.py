"""Section 10: simulator fidelity. Calibrate the cost model on one workload, then run the
benchmark's offline workload on the real and on the simulated engine and compare."""

from __future__ import annotations

from pathlib import Path

from engine.tools.bench.config import BenchConfig, side_engine_kv_cache_memory
from engine.tools.workload import SimRequest, make_workload

FIDELITY_TARGET = 0.10  # the goal: each figure within 10 % of the real engine's


def compare_figures(real: dict, sim: dict) -> dict:
    """Each figure on the real and the simulated engine, with the relative error."""
    figures = {
        "total_time_s": (real["duration_s"], sim["duration_s"]),
        "ttft_p50_s": (real["ttft_s"]["p50"], sim["ttft_s"]["p50"]),
        "ttft_p90_s": (real["ttft_s"]["p90"], sim["ttft_s"]["p90"]),
        "tpot_p50_s": (real["tpot_s"]["p50"], sim["tpot_s"]["p50"]),
        "output_tokens_per_s": (real["output_tokens_per_s"], sim["output_tokens_per_s"]),
    }
    rows = {}
    for name, (measured, simulated) in figures.items():
        error = (
            float((simulated - measured) / measured) if measured and simulated is not None else None
        )
        rows[name] = {
            "real": measured,
            "simulated": simulated,
            "relative_error": error,
            "met": bool(error is not None and abs(error) <= FIDELITY_TARGET),
        }
    return rows


def simulator_fidelity(
    config: BenchConfig, calibration_path: str | Path | None = None, log=print
) -> dict:
    """Calibrate on one workload, then run the benchmark's offline workload (all requests at
    t = 0) on the real engine and on the simulated one, and compare on the engine clock."""
    from engine.core import EngineCore
    from engine.tools.calibration import CalibrationWorkload, calibrate, run_real_steps
    from engine.tools.presets import model_preset_from_dir
    from engine.tools.simulator import simulate, summarize

    cw = CalibrationWorkload.quick() if config.quick else CalibrationWorkload()
    cw.max_num_seqs, cw.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
    calibration = calibrate(
        config.model, config.device, config.dtype, cw, calibration_path, config.quick, log
    )

    engine = EngineCore(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_memory=side_engine_kv_cache_memory(config.device),
    )
    specials = sorted(engine.tokenizer.special_token_ids)
    items = make_workload(
        config.num_requests,
        config.prompt_len,
        config.output_len,
        config.seed,
        engine.model_config.vocab_size,
        specials,
    )
    workload = [
        SimRequest(w.prompt_token_ids, w.output_len, 0.0, w.output_len, ignore_eos=True)
        for w in items
    ]
    log(f"      fidelity: {len(workload)} requests on the real engine, then on the simulated one")
    records, requests = run_real_steps(engine, workload)
    real = summarize([r.metrics(clock="engine") for r in requests], records)
    sim = simulate(
        model_preset_from_dir(engine.model_dir),
        calibration.hardware,
        rate=None,
        workload=workload,
        efficiency=calibration.efficiency,
        num_kv_blocks=engine.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        block_size=engine.config.block_size,
    ).summary
    rows = compare_figures(real, sim)
    return {
        "figures": rows,
        "target": FIDELITY_TARGET,
        "steps": {"real": real["steps"], "simulated": sim["steps"]},
        "preemptions": {"real": real["preemptions"], "simulated": sim["preemptions"]},
        "calibration": {
            "path": str(calibration_path) if calibration_path else None,
            "fit": calibration.fit,
            "efficiency": calibration.efficiency.as_dict(),
            "workload": calibration.conditions["workload"],
        },
        "simulated_wall_s": sim["wall_s"],
        "evidence": (
            "real: measured on the engine clock (sum of measured step times); "
            "simulated: computed by "
            "the cost model with efficiencies fitted on a different workload; on a shared machine "
            "step times are noisy, so the errors move from run to run"
        ),
    }
