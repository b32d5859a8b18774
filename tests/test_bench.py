"""`python -m engine bench`: runs end to end on the tiny model and writes complete, self-describing
results. No timing is asserted here: timings belong to the benchmark's report, not to tests."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
from _tiny import TINY_VOCAB_SIZE

from engine.__main__ import main
from engine.tools.bench.report import format_results
from engine.tools.bench.results import load_latest_results, save_results
from engine.tools.bench.timing import best_time, best_times
from engine.tools.workload import make_workload

# --quick plus an even smaller workload: a few seconds on the tiny model, every section still runs.
SMALL = [
    "--quick",
    "--num-requests",
    "5",
    "--prompt-len",
    "8",
    "40",
    "--output-len",
    "3",
    "9",
    "--max-num-seqs",
    "4",
    "--latency-requests",
    "3",
]


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    """(results path, exit code, printed text) of one small bench run."""
    path = tmp_path_factory.mktemp("bench") / "results.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "--model", str(tiny_model_dir), "--json", str(path), *SMALL])
    return path, rc, out.getvalue()


def test_quick_bench_runs_and_prints_the_table(bench_run):
    path, rc, printed = bench_run
    assert rc == 0 and path.is_file()
    assert "1. Ceilings" in printed and "5. Latency under load" in printed and str(path) in printed
    assert "load average (1 min):" in printed  # quiet or BUSY, with the rule


def test_progress_labels_count_the_sections_in_order(bench_run):
    """Each section starts with [k/n]: k runs 1..n in order, n is the sections this run has (the
    app's progress bar reads them)."""
    labels = [
        tuple(map(int, m.groups()))
        for m in map(re.compile(r"^\[(\d+)/(\d+)\]").match, bench_run[2].splitlines())
        if m
    ]
    n = labels[0][1]
    assert labels == [(k, n) for k in range(1, n + 1)]
    assert n == 6  # sections 1-5 and the simulator's fidelity (section 10) in a quick run


def test_results_carry_their_conditions(bench_run, tiny_model_dir):
    results = json.loads(bench_run[0].read_text())
    c = results["conditions"]
    for key in (
        "date",
        "device",
        "device_name",
        "threads",
        "dtype",
        "model",
        "seed",
        "workload",
        "engine",
        "num_parameters",
        "weight_bytes_per_step",
        "flop_per_token",
        "torch",
        "transformers",
        "machine",
        "load_before",
        "load_after",
        "busy",
    ):
        assert key in c, key
    assert isinstance(c["busy"], bool) and "load" in c["busy_rule"]
    assert "pages (transparent huge pages: " in c["pages"]  # a CPU run says which pages it read
    assert f"memory: {c['pages']}" in bench_run[2]
    assert c["model"] == str(tiny_model_dir) and c["dtype"] == "float32" and c["quick"] is True
    assert c["workload"]["num_requests"] == 5 and c["workload"]["prompt_len"] == [8, 40]
    assert c["engine"]["max_num_seqs"] == 4
    # the tiny model is tied: its lm_head is the embedding, so every parameter is a matmul weight
    assert c["weight_bytes_per_step"] == 4 * c["num_parameters"]
    assert c["flop_per_token"] == 2 * c["num_parameters"]


def test_ceilings_and_rooflines_are_consistent(bench_run):
    results = json.loads(bench_run[0].read_text())
    ce, ro, c = results["ceilings"], results["rooflines"], results["conditions"]
    assert ce["kind"] == "measured" and ro["kind"] == "derived"
    assert ce["memory_read_gb_s"] > 0 and ce["matvec_gb_s"] > 0
    # sampled at the start, then just before and just after the batch-1 decode
    assert len(ce["memory_read_gb_s_samples"]) == 3 and ce["memory_read_gb_s"] == max(
        ce["memory_read_gb_s_samples"]
    )
    assert set(ce["matmul_gflop_s"]) == {"float32", "bfloat16"}
    for dtype, by_kernel in ce["matmul_gflop_s_by_kernel"].items():
        assert ce["matmul_gflop_s"][dtype] == max(by_kernel.values())
    # the rooflines are the formulas they claim to be
    assert math.isclose(
        ro["decode_tokens_per_s"], ce["memory_read_gb_s"] * 1e9 / c["weight_bytes_per_step"]
    )
    assert math.isclose(
        ro["compute_tokens_per_s"], ce["matmul_gflop_s"]["float32"] * 1e9 / c["flop_per_token"]
    )
    assert math.isclose(
        ro["decode_matvec_tokens_per_s"], ce["matvec_gb_s"] * 1e9 / c["weight_bytes_per_step"]
    )


def test_offline_counts_only_useful_tokens(bench_run):
    results = json.loads(bench_run[0].read_text())
    off = results["offline"]
    workload = make_workload(5, (8, 40), (3, 9), 0, TINY_VOCAB_SIZE, range(3))
    useful = sum(w.output_len for w in workload)
    assert off["engine"]["output_tokens"] == useful == off["transformers"]["output_tokens"]
    hf = off["transformers"]
    assert hf["batches"] == 2 and hf["batch_size"] == 4
    assert hf["output_slots_computed"] >= hf["output_slots_useful"] == useful
    assert hf["prompt_tokens_computed"] >= hf["prompt_tokens_useful"]
    assert math.isclose(
        off["ratio"], off["engine"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )
    agreement = off["greedy_agreement"]
    # The tiny model's logits are spread wide (initializer 0.2), so no near-tie can flip a token:
    # both sides must agree on every request, token for token.
    assert agreement["requests"] == 5 and agreement["identical_requests"] == 5
    assert agreement["mean_matching_prefix"] == 1.0


def test_decode_overhead_and_latency_sections(bench_run):
    results = json.loads(bench_run[0].read_text())
    b1 = results["decode_batch1"]
    assert b1["tokens_per_s"] > 0 and 0 < b1["fraction_of_roofline"]
    # the roofline of the bandwidth sampled next to the decode; beside it, the run's best
    samples = results["ceilings"]["memory_read_gb_s_samples"]
    assert b1["bandwidth_gb_s"] == max(samples[-2:])
    weight_bytes = results["conditions"]["weight_bytes_per_step"]
    assert math.isclose(b1["roofline_tokens_per_s"], b1["bandwidth_gb_s"] * 1e9 / weight_bytes)
    assert math.isclose(
        b1["fraction_of_best_roofline"],
        b1["tokens_per_s"] / results["rooflines"]["decode_tokens_per_s"],
    )
    for key, batch in (("batch_1", 1), ("full_batch", 4)):
        o = results["overhead"][key]
        assert o["batch"] == batch and o["steps"] > 0
        assert 0 <= o["overhead_share"] < 1
        assert set(o["phase_ms"]) == {
            "schedule",
            "prepare_inputs",
            "forward",
            "sample",
            "output_processing",
            "untimed",
        }
    runs = results["latency"]["runs"]
    assert len(runs) == 2  # --quick: half and all of the offline request rate
    for run in runs:
        assert run["requests"] == 3 and run["rate_req_s"] > 0 and run["output_tokens_per_s"] > 0
        for metric in ("ttft_s", "tpot_s", "e2e_s"):
            p = run[metric]
            assert p["p50"] <= p["p90"] <= p["p99"]
    targets = {t["name"].split(" ")[0]: t for t in results["targets"]}
    assert set(targets) == {"offline", "batch-1", "overhead"}
    for name, t in targets.items():  # "met" must say what the value and the target say
        lower_is_better = name == "overhead"
        assert t["value"] is not None
        assert t["met"] == (
            t["value"] < t["target"] if lower_is_better else t["value"] >= t["target"]
        )


def test_table_names_every_section(bench_run):
    text = format_results(json.loads(bench_run[0].read_text()))
    for needle in (
        "1. Ceilings",
        "decode roofline",
        "2. Offline throughput",
        "ratio",
        "3. Decode at batch 1",
        "4. Engine overhead",
        "5. Latency under load",
        "Targets",
    ):
        assert needle in text, needle


def test_load_latest_results_reads_back_what_was_saved(bench_run, tmp_path):
    results = json.loads(bench_run[0].read_text())
    assert load_latest_results(bench_run[0]) == results
    assert load_latest_results(tmp_path / "missing.json") is None
    copy = save_results(results, tmp_path / "sub" / "latest.json")
    assert load_latest_results(copy) == results


def test_llama_cpp_peer_is_optional_and_isolated(monkeypatch, tmp_path):
    """The llama.cpp peer runs in a child process: without llama-cpp-python, or when the child
    fails (here: no such GGUF file), the peer row says why, and this process goes on."""
    from engine.tools.peers import llama_cpp as peer

    monkeypatch.setattr(peer, "llama_cpp_version", lambda: None)
    assert "not installed" in peer.measure_llama_cpp_isolated("x.gguf", [[1, 2]], 4, 1)["skipped"]
    monkeypatch.setattr(peer, "llama_cpp_version", lambda: "test")  # the child asks for itself
    row = peer.measure_llama_cpp_isolated(tmp_path / "missing.gguf", [[1, 2]], 4, 1, timeout_s=120)
    assert set(row) == {"skipped"} and row["skipped"]


def test_llama_cpp_peer_says_what_its_import_misses(monkeypatch):
    """Installed without its dependencies (pip install --no-deps), llama_cpp fails to import on
    one of them: the row names it instead of saying llama-cpp-python is not installed."""
    import importlib.abc
    import sys

    from engine.tools.peers import llama_cpp as peer

    class MissingDependency(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp":
                raise ModuleNotFoundError("No module named 'diskcache'", name="diskcache")

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(sys, "meta_path", [MissingDependency(), *sys.meta_path])
    assert peer.llama_cpp_version() is None
    assert "cannot be imported" in peer.unavailable()["skipped"]
    assert "diskcache" in peer.unavailable()["skipped"]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import halts: not installed
    assert peer.unavailable()["skipped"] == peer.NOT_INSTALLED


def test_llama_cpp_peer_killed_by_a_signal_is_measured_at_its_best_configuration(monkeypatch):
    """llama.cpp's AMX kernels crashed its child on an AMX Xeon VM with prompts of more than one
    token: a child killed by a signal is run again with the extra buffers on one-token prompts
    and without them on the same prompts; the row is the faster and says what the other did. An
    ordinary failure is not run again."""
    import json
    import subprocess

    from engine.tools.peers import llama_cpp as peer

    monkeypatch.setattr(peer, "llama_cpp_version", lambda: "test")
    jobs, results = [], []

    def fake_run(args, input, **kwargs):
        jobs.append(json.loads(input))
        code, rate = results.pop(0)
        out = json.dumps({"decode_tokens_per_s": rate})
        return subprocess.CompletedProcess(args, code, stdout=out if code == 0 else "", stderr="")

    monkeypatch.setattr(peer.subprocess, "run", fake_run)
    prompts = [[1, 2, 3], [4, 5]]
    for repacked, plain in ((230.0, 87.0), (80.0, 87.0)):
        jobs.clear()
        results[:] = [(-11, 0), (0, repacked), (0, plain)]
        row = peer.measure_llama_cpp_isolated("x.gguf", prompts, 4, 1)
        assert [j.get("extra_buffers", True) for j in jobs] == [True, True, False]
        assert [j["prompts"] for j in jobs] == [prompts, [[1], [4]], prompts]
        assert row["decode_tokens_per_s"] == max(repacked, plain)
        assert "exit code -11" in row["note"]
        assert f"{min(repacked, plain):.1f} tokens/s" in row["note"]
        assert ("one-token prompts (this row" in row["note"]) == (repacked > plain)
    jobs.clear()
    results[:] = [(-11, 0), (-11, 0), (0, 87.0)]  # the one-token run crashes too: the other row
    row = peer.measure_llama_cpp_isolated("x.gguf", [[1, 2]], 4, 1)
    assert row["decode_tokens_per_s"] == 87.0 and row["note"].count("exit code -11") == 2
    assert "(this row) and" in row["note"]  # not "the faster": the other did not run
    jobs.clear()
    results[:] = [(1, 0)]
    row = peer.measure_llama_cpp_isolated("x.gguf", [[1, 2]], 4, 1)
    assert len(jobs) == 1 and set(row) == {"skipped"}


def test_the_bfloat16_linears_target_is_a_row_where_it_is_set_for():
    """Issue 37's 2× for bfloat16 linears offline is a goal on AMX machines: a target row there,
    met or not by the measured ratio; no row where auto kept float32 or the CPU has no AMX."""
    from engine.tools.bench.targets import TARGETS, evaluate_targets

    def rows(bf16: dict) -> dict:
        results = {
            "offline": {"ratio": 3.0, "bfloat16_linears": bf16},
            "decode_batch1": {"fraction_of_roofline": 0.7},
            "overhead": {"full_batch": {"overhead_share": 0.02}},
            "conditions": {},
        }
        return {r["name"]: r for r in evaluate_targets(results)}

    name = "offline throughput, bfloat16 linears (auto), float32 KV cache ÷ float32's, on AMX"
    kv_name = name.replace("float32 KV", "bfloat16 KV")
    assert TARGETS["bf16_linears_offline_on_amx"] == 2.0
    assert rows({"ran": True, "amx": "AMX", "ratio": 1.81})[name]["met"] is False
    assert kv_name not in rows({"ran": True, "amx": "AMX", "ratio": 1.81})  # not measured
    both = rows(
        {"ran": True, "amx": "AMX", "ratio": 2.05, "with_bfloat16_kv_cache": {"ratio": 1.9}}
    )
    assert both[name]["met"] is True and both[kv_name]["met"] is False
    assert both[kv_name]["value"] == 1.9
    assert name not in rows({"ran": True, "amx": "not an AMX machine", "ratio": 1.4})
    assert name not in rows({"ran": False, "why": "auto chooses float32", "amx": "AMX"})


def test_the_4_bit_targets_take_the_best_4_bit_run_against_the_peer_and_the_roofline():
    """Issue 37's two 4-bit goals: the best of section 8's int4 and gguf rows (and the run's own
    engine when it is 4-bit) against llama.cpp Q4_1's decode, and against its weight-streaming
    limit at the bandwidth sampled next to it (0.7); no rows where no 4-bit engine ran."""
    from engine.tools.bench.targets import TARGETS, evaluate_targets

    def rows(variants: list[dict], **extra) -> dict:
        results = {
            "offline": {},
            "decode_batch1": {"fraction_of_roofline": 0.9, "tokens_per_s": 90.0},
            "overhead": {"full_batch": {"overhead_share": 0.02}},
            "conditions": extra.pop("conditions", {}),
            "variants": {"rows": variants},
            **extra,
        }
        found = [r for r in evaluate_targets(results) if r["name"].startswith("4-bit")]
        return {r["name"].split(" ÷ ")[1]: r for r in found}

    def variant(name: str, method: str, rate: float, fraction: float) -> dict:
        return {
            "name": name,
            "quantization": method,
            "decode_tokens_per_s": rate,
            "fraction_of_roofline": fraction,
        }

    f32 = variant("float32", "none", 90.0, 0.9)
    int4 = variant("float32 + int4", "int4", 180.0, 0.3)
    gguf = variant("float32 + gguf", "gguf", 360.0, 0.52)
    both = rows([f32, int4, gguf], llama_cpp={"decode_tokens_per_s": 120.0})
    assert TARGETS["int4_roofline_fraction"] == 0.7
    assert both["llama.cpp Q4_1's"]["value"] == 3.0 and both["llama.cpp Q4_1's"]["met"] is True
    roof = both["its weight-streaming roofline"]
    assert roof["value"] == 0.52 and roof["target"] == 0.7 and roof["met"] is False
    slow_memory = rows([int4, {**gguf, "fraction_of_roofline": 0.77}])
    assert slow_memory["its weight-streaming roofline"]["met"] is True
    assert "llama.cpp Q4_1's" not in slow_memory  # no peer in this run
    own = rows([], conditions={"quantization_method": "gguf"})
    assert own["its weight-streaming roofline"]["value"] == 0.9  # the run's own 4-bit engine
    assert rows([f32]) == {}


def test_a_target_not_measured_is_neither_met_nor_missed():
    """`--skip-transformers` measures no offline ratio: its target row says "not run", not
    "NOT met", so a learner reading the table is not told the engine failed a goal it never ran."""
    from engine.tools.bench.report import format_targets
    from engine.tools.bench.targets import evaluate_targets

    results = {
        "offline": {},  # transformers skipped: no "ratio"
        "decode_batch1": {"fraction_of_roofline": 0.5},
        "overhead": {"full_batch": {"overhead_share": 0.02}},
        "conditions": {},
    }
    targets = {t["name"].split(" ")[0]: t for t in evaluate_targets(results)}
    assert [targets[n]["met"] for n in ("offline", "batch-1", "overhead")] == [None, False, True]
    lines = format_targets(list(targets.values()))
    assert "  not run  offline throughput ÷ transformers static batching: not measured" in lines[2]
    assert lines[3].startswith("  NOT met  batch-1") and lines[4].startswith("  met      overhead")


def test_best_time_keeps_the_fastest_call_and_stops_at_its_budget():
    """Best of N, but a very slow call (bfloat16 matmul on a CPU without bfloat16 instructions)
    stops after two timed calls once the budget is spent, instead of running all N."""
    import time

    import torch

    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02 if len(calls) != 3 else 0.005)

    assert best_time(slow, torch.device("cpu"), repeats=5) < 0.01  # the fast third call
    assert len(calls) == 6  # warm-up + 5
    calls.clear()
    best_time(slow, torch.device("cpu"), repeats=50, budget_s=0.01)
    assert len(calls) == 3  # warm-up + the two calls it always times
    calls.clear()  # back to back (a GPU's short kernels): the mean of `inner` calls per timing
    t = best_time(slow, torch.device("cpu"), repeats=2, inner=4)
    assert len(calls) == 1 + 2 * 4 and 0.01 < t < 0.05


def test_best_times_takes_turns_and_keeps_each_paths_fastest_call():
    """Paths compared in one table take turns, so a slow stretch of the machine falls on all of
    them: after one warm-up each, round after round of a, b; each path's best is its own."""
    import time

    import torch

    order = []

    def path(name, seconds):
        def call():
            order.append(name)
            time.sleep(seconds(len(order)))

        return call

    a_fast_once = path("a", lambda n: 0.001 if n == 5 else 0.01)  # a's second timed call
    best = best_times({"a": a_fast_once, "b": path("b", lambda n: 0.004)}, torch.device("cpu"), 3)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert best["a"] < 0.004 < best["b"] < 0.01
    order.clear()
    best_times({"a": path("a", lambda n: 0.01)}, torch.device("cpu"), 50, budget_s=0.01)
    assert len(order) == 3  # warm-up + the two rounds it always times


def test_kernel_section_measures_attention_and_linears_on_the_tiny_model(tiny_model_dir):
    """The full bench's kernels section (not in --quick): attention alone on both paths and the
    linear libraries, on a real model's shapes, and its report lines (the section once read a
    scale the model no longer has, and its report shadowed `fmt`)."""
    from engine.models.llama import LlamaModel
    from engine.tools.bench.kernels import measure_attention_kernel, measure_linear_kernels
    from engine.tools.bench.report import format_kernels

    model = LlamaModel.from_pretrained(tiny_model_dir)
    attention = measure_attention_kernel(model, 2, (20, 40), 1, 0)
    assert attention["torch_ms"] > 0 and attention["kv_bytes_read"] > 0
    linear = measure_linear_kernels(model, 1)
    step = {"batch_1": {"step_ms": 2.0, "tokens_per_s": 500.0}, "full_batch": {}}
    decode = {"torch": {"path": "torch", **step}, "auto": {"path": "cpu", **step}}
    text = "\n".join(format_kernels({"linear": linear, "attention": attention, "decode": decode}))
    assert "6. Kernels" in text and "int4 ours, 1 row / 32 rows" in text
    table = text.splitlines()[2 : 3 + len(linear["kernels"])]  # header and one row per path
    assert len({len(line) for line in table}) == 1  # the columns line up, long names included
    from engine import kernels
    from engine.kernels.bfloat16_tiles import tiles_available
    from engine.kernels.float32_linear import float32_linear_backend

    tiled = tiles_available(kernels.load())  # AMX or AVX512-BF16: our bfloat16 tiles, timed too
    assert ("bfloat16 ours (tiles)" in linear["kernels"]) == tiled
    ours = [name for name in linear["kernels"] if name.startswith("float32 ours")]
    library = {"mkl": "MKL", "onednn": "oneDNN"}[float32_linear_backend()["backend"]]
    expected = [f"float32 ours (one row; 32 rows {library})"] if kernels.load() else []
    assert ours == expected  # the engine's own float32 linear, where our kernels build
