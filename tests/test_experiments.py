"""ui/experiments/ (one module per chapter) and ui/hardware_data.py: the comparisons of chapters
04–08 on real engine runs (the tiny model, so each run takes a second or two) and the memory
calculator's formulas."""

from __future__ import annotations

import math

import pytest

from ui import experiments as ex
from ui.hardware_data import GPUS, MODELS, memory_budget


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return ex.make_config(
        dict(
            model=str(tiny_model_dir),
            device="cpu",
            num_kv_blocks=64,
            max_model_len=1024,
            max_num_batched_tokens=128,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
    )


# -- chapter 05: data and formulas (no engine) ---------------------------------------------------


def test_param_counts_match_model_cards():
    for spec in MODELS.values():
        assert math.isclose(spec.param_count, spec.reported_params, rel_tol=0.01), spec.name
    assert MODELS["Llama-3.1-8B"].kv_bytes_per_token("bfloat16") == 131_072
    assert MODELS["Qwen2.5-7B"].kv_bytes_per_token("bfloat16") == 57_344
    ours = next(m for m in MODELS.values() if "우리 모델" in m.name)
    assert ours.kv_bytes_per_token("float32") == 46_080


def test_required_models_and_gpus_present():
    names = " ".join(MODELS)
    for m in ("Llama-3.1-8B", "Llama-3.1-70B", "Qwen2.5-7B", "Mistral-7B-v0.3", "SmolLM2-135M"):
        assert m in names
    for g in ("H100", "H200", "A100 40GB", "A100 80GB", "L4", "RTX 4090"):
        assert any(g in name for name in GPUS)


def test_memory_budget_matches_lesson_examples():
    b = memory_budget("Llama-3.1-8B", "H100 SXM 80GB", "bfloat16", 0.9, 2.0, 4096)
    assert round(b.kv_budget_bytes / 1e9, 1) == 53.9 and b.max_requests == 100
    assert (
        memory_budget("Qwen2.5-7B", "H100 SXM 80GB", "bfloat16", 0.9, 2.0, 4096).max_requests == 233
    )
    assert memory_budget("Llama-3.1-8B", "A100 40GB", "bfloat16", 0.9, 2.0, 4096).max_requests == 33
    big = memory_budget("Llama-3.1-70B", "H200 141GB", "bfloat16", 0.9, 2.0, 4096)
    assert not big.fits and big.max_requests == 0
    # doubling L halves the requests (floor)
    assert memory_budget("Llama-3.1-8B", "H100 SXM 80GB", seq_len=8192).max_requests == 50


# -- chapter 04 ----------------------------------------------------------------------------------


def test_run_workload_latency_metrics(cfg):
    res = ex.run_workload(cfg, ex.Workload.uniform(4, 12, 6), "fcfs")
    t = res.request_table()
    assert len(t) == 4 and (t["output_tokens"] == 6).all()
    assert (t["ttft_ms"] > 0).all() and (t["e2e_ms"] >= t["ttft_ms"]).all()
    # TPOT = (E2E − TTFT) / (N − 1) with the last token at finish (finish is recorded just after it)
    for _, row in t.iterrows():
        assert math.isclose(
            row["tpot_ms"], (row["e2e_ms"] - row["ttft_ms"]) / 5, rel_tol=1e-3, abs_tol=0.5
        )
    assert len(res.itl_samples_ms()) == 4 * 5
    p = ex.percentile_table(res).set_index("지표")
    assert p.loc["ITL", "n"] == 20 and p.loc["TTFT", "n"] == 4
    assert p.loc["ITL", "p50 (ms)"] <= p.loc["ITL", "p99 (ms)"] <= p.loc["ITL", "최대 (ms)"]
    assert res.throughput == pytest.approx(24 / res.elapsed_s)
    assert {"장치", "dtype", "모델", "스레드", "날짜"} <= set(res.conditions)
    # one metrics definition: the table equals RequestMetrics on the engine clock
    m = res.requests[0].metrics(clock="engine")
    assert t["ttft_ms"].iloc[0] == pytest.approx(1000 * m.ttft)


def test_one_token_requests_have_no_tpot(cfg):
    res = ex.run_workload(cfg, ex.Workload.uniform(2, 8, 1))
    t = res.request_table()
    assert t["tpot_ms"].isna().all()
    shown = ex.korean_table(t, ["request_id", "ttft_ms", "tpot_ms"])
    assert (
        list(shown.columns) == ["요청", "TTFT (ms)", "TPOT (ms)"]
        and (shown["TPOT (ms)"] == "—").all()
    )


def test_arrivals_are_honoured(cfg):
    # arrivals are placed on the engine clock: the run never sleeps, the idle engine jumps ahead
    wl = ex.Workload([ex.RequestSpec(8, 4, 0.0), ex.RequestSpec(8, 4, 150.0)])
    res = ex.run_workload(cfg, wl)
    t = res.request_table()
    assert t["arrival_ms"].iloc[1] == pytest.approx(150.0, abs=1e-6)
    assert t["finish_ms"].iloc[1] >= 150.0
    assert t["queue_ms"].iloc[1] < 150.0  # the engine was idle when it came
    assert res.wall_s < 0.15 or res.elapsed_s >= 0.15


# -- chapter 05 ----------------------------------------------------------------------------------


def test_measure_dtype_bytes_and_agreement(cfg):
    fp32 = ex.measure_dtype(cfg, "float32", num_tokens=4)
    bf16 = ex.measure_dtype(cfg, "bfloat16", num_tokens=4, reference=fp32)
    assert fp32.tensor_bytes == fp32.param_count * 4
    assert abs(bf16.tensor_bytes - bf16.param_count * 2) <= 64
    assert bf16.tensor_bytes < 0.6 * fp32.tensor_bytes
    assert fp32.num_tokens == bf16.num_tokens == 4 and fp32.tpot_ms > 0
    assert bf16.agree_with == "float32"
    assert bf16.first_divergence is None or 0 <= bf16.first_divergence < 4


def test_measure_dtype_on_a_cpu_has_no_device_counters(cfg):
    r = ex.measure_dtype(cfg, "float32", num_tokens=2)
    assert r.device_allocated_bytes is None and r.activation_peak_bytes is None


def test_measure_dtype_reads_the_gpu_allocator_when_there_is_one(cfg, monkeypatch):
    """The GPU path's arithmetic, with a stand-in for torch.cuda's counters (the real one runs
    only on a GPU): allocated before/after building the engine, the peak during the decode."""
    from ui.experiments import ch05

    class FakeCuda:
        source = "fake"

        def __init__(self, device):
            self.now, self.top = 1_000, 1_000

        def allocated(self) -> int:
            self.now += 7_000  # the engine build (weights + KV) happened since the last read
            self.top = max(self.top, self.now)
            return self.now

        def reset_peak(self) -> None:
            self.top = self.now

        def peak(self) -> int:
            return self.top + 300  # the decode's activations

    monkeypatch.setattr(ch05, "memory_probe", lambda device: FakeCuda(device))
    r = ex.measure_dtype(cfg, "float32", num_tokens=2)
    assert r.device_allocated_bytes == 7_000 and r.activation_peak_bytes == 300
    assert r.kv_cache_bytes > 0  # the engine's own KV tensors, counted


# -- chapter 06 ----------------------------------------------------------------------------------


def test_fragmentation_contiguous_vs_paged(cfg):
    wl = ex.Workload([ex.RequestSpec(p, o, 0.0) for p, o in [(10, 6), (30, 12), (20, 4), (40, 8)]])
    res = ex.run_workload(ex.make_config(cfg, max_model_len=128, num_kv_blocks=24), wl)
    fr = ex.fragmentation(res, "max_model_len")
    df = fr.per_step
    assert len(df) == len(res.records)
    bs = res.block_size
    # paged: measured block usage covers the tokens and wastes less than one block per request
    assert (df["paged_reserved"] >= df["used_slots"]).all()
    assert (df["paged_internal_frag"] < bs * df["live_requests"].clip(lower=1)).all()
    # contiguous: 24 blocks × 16 = 384 slots hold 3 reservations of 128, so one request must wait
    assert fr.pool_slots == 384 and fr.contiguous_capacity == 3
    assert len(fr.contiguous_rejected) == 1 and fr.paged_max_concurrent == 4
    s = fr.summary.set_index("방식")
    assert s.iloc[1]["사용률 = 사용량/예약량 (%)"] > s.iloc[0]["사용률 = 사용량/예약량 (%)"]
    fr2 = ex.fragmentation(res, "prompt+max_tokens")
    assert fr2.per_step["contiguous_reserved"].max() <= fr.per_step["contiguous_reserved"].max()
    tables = ex.block_tables_frame(res.records[0])
    assert set(tables.columns) == {"request_id", "logical", "physical"} and len(tables) > 0


# -- chapter 07 ----------------------------------------------------------------------------------


def test_compare_batching_three_modes(cfg):
    # All arrive at once: with late arrivals the tiny model may finish a batch before the next
    # request comes, and whether anyone waits on the static batch would depend on machine speed.
    wl = ex.batching_workload(4, late_ms=0.0)
    results = ex.compare_batching(cfg, wl, batch_size=2)
    assert list(results) == list(ex.BATCHING_MODES)
    seq, static, cont = results.values()
    assert all(len(r.scheduled) <= 1 for r in seq.records)
    assert max(len(r.scheduled) for r in cont.records) == 2
    assert any("static_batch_in_progress" in r.unscheduled.values() for r in static.records)
    for res in results.values():
        assert res.output_tokens == sum(s.max_tokens for s in wl.requests)
    w = ex.batch_waste(static)
    assert w["padding_slot_steps"] > 0 and w["num_batches"] >= 2
    assert ex.batch_waste(cont)["padding_slot_steps"] <= w["padding_slot_steps"]
    summary = ex.batching_summary(results)
    assert (
        list(summary["방식"]) == list(ex.BATCHING_MODES) and summary["처리량 (토큰/s)"].gt(0).all()
    )


# -- chapter 08 ----------------------------------------------------------------------------------


def test_chunked_prefill_comparison(cfg):
    wl = ex.long_prompt_workload(
        long_prompt_len=400,
        num_short=2,
        short_max_tokens=10,
        long_arrival_ms=50.0,
        long_max_tokens=3,
    )
    cmp = ex.compare_chunked_prefill(cfg, wl, budget=64, max_num_seqs=4)
    on, off = cmp.runs.values()
    assert on.config.enable_chunked_prefill and not off.config.enable_chunked_prefill
    assert max(r.total_tokens for r in on.records) <= 64
    # chunking off: vLLM's rule, the budget covers max_model_len, so both accept the long prompt
    assert off.config.max_num_batched_tokens == 1024 == off.max_model_len
    assert not on.rejected and not off.rejected
    s = cmp.summary.set_index("실행")
    assert s.loc["chunked prefill 켬", "긴 요청 prefill 스텝 수"] >= 400 // 64
    assert s.loc["chunked prefill 끔", "긴 요청 prefill 스텝 수"] == 1
    assert s.loc["chunked prefill 끔", "최대 스텝 토큰"] >= 400  # the whole prompt in one step
    # max_model_len 208 (so the unchunked budget is 208 too), the long prompt arriving with the
    # others: the first step's remaining budget cannot hold it whole, so it waits for the budget
    wl = ex.long_prompt_workload(
        long_prompt_len=200, num_short=2, short_max_tokens=6, long_arrival_ms=0.0, long_max_tokens=3
    )
    short_ctx = ex.make_config(cfg, max_model_len=208)
    cmp = ex.compare_chunked_prefill(short_ctx, wl, budget=64, max_num_seqs=4)
    off = cmp.runs["chunked prefill 끔"]
    assert not off.rejected and any(s.num_tokens == 200 for r in off.records for s in r.scheduled)
    assert cmp.summary.set_index("실행").loc["chunked prefill 끔", "긴 요청 prefill 스텝 수"] == 1
    assert any("token_budget" in r.unscheduled.values() for r in off.records)


def test_latest_bench_never_raises():
    result = ex.latest_bench()
    assert result is None or isinstance(result, dict)


# -- the package's rule ---------------------------------------------------------------------------


def test_experiments_load_no_streamlit():
    """ui/experiments/ computes, ui/labs/ draws: every experiment module imports in a fresh
    interpreter without loading Streamlit, so tests and scripts can run what a lab runs."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    modules = sorted(p.stem for p in (root / "ui" / "experiments").glob("*.py"))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module('ui.experiments.' + m)\n"
        "print('streamlit' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
