"""`python -m engine selfcheck` on the CPU: every check runs and reports on the tiny model, a
broken engine makes it fail, and the near-tie rule excuses only genuine near ties."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch

from engine.__main__ import main
from engine.models.llama import LlamaModel
from engine.tools import selfcheck

CHECKS = [
    "device",
    "load",
    "oracle float32",
    "prefix caching",
    "oracle bfloat16",
    "chunked prefill",
    "preemption recompute",
    "preemption swap",
    "kv cache sizing",
    "cuda graphs",
    "bench",
]
CPU_SKIPS = {"oracle bfloat16", "cuda graphs"}  # CUDA only


def run_selfcheck(args: list[str], tmp_path) -> tuple[int, dict, str]:
    path = tmp_path / "selfcheck.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["selfcheck", *args, "--json", str(path)])
    return rc, json.loads(path.read_text()), out.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    return run_selfcheck(
        ["--device", "cpu", "--model", str(tiny_model_dir), "--quick"],
        tmp_path_factory.mktemp("selfcheck"),
    )


def test_selfcheck_passes_on_the_cpu_and_reports_every_check(tiny_run):
    rc, results, printed = tiny_run
    checks = {c["name"]: c for c in results["checks"]}
    assert rc == 0 and results["passed"] is True
    assert list(checks) == CHECKS
    for name, check in checks.items():
        assert check["status"] == ("SKIP" if name in CPU_SKIPS else "PASS"), (name, check["detail"])
        assert check["detail"] and name in printed
    assert (
        "CUDA" in checks["cuda graphs"]["detail"] and "CUDA" in checks["oracle bfloat16"]["detail"]
    )
    assert "ALL PASSED" in printed


def test_each_feature_check_saw_its_feature_happen(tiny_run):
    checks = {c["name"]: c for c in tiny_run[1]["checks"]}
    assert checks["prefix caching"]["data"]["prefix_hit_tokens"] >= 16
    assert checks["chunked prefill"]["data"]["chunked_prefill_steps"] > 0
    assert checks["preemption recompute"]["data"]["preemptions"] > 0
    assert checks["preemption recompute"]["data"]["recomputed_tokens"] > 0
    assert checks["preemption swap"]["data"]["swapped_out_blocks"] > 0
    for name in ("oracle float32", "chunked prefill", "preemption recompute", "preemption swap"):
        comparisons = checks[name]["data"]["comparisons"]
        assert len(comparisons) == 7 and all(c["equal"] or c["near_tie"] for c in comparisons)
    kv = checks["kv cache sizing"]["data"]
    assert (
        kv["tokens"] == kv["num_blocks"] * 16
        and kv["bytes"] == kv["num_blocks"] * kv["bytes_per_block"]
    )
    assert checks["bench"]["data"]["bench"]["offline"]["engine"]["output_tokens_per_s"] > 0


def test_a_wrong_token_fails_the_selfcheck(tiny_model_dir, tmp_path, monkeypatch):
    """An engine that always prefers token 5 must fail the oracle and every check that compares."""
    forward = LlamaModel.forward

    def broken(self, *args, **kwargs):
        logits = forward(self, *args, **kwargs)
        logits[:, 5] += 1000.0
        return logits

    monkeypatch.setattr(LlamaModel, "forward", broken)
    monkeypatch.setattr(
        selfcheck.SelfCheck, "check_bench", lambda self: ("SKIP", "not in this test", {})
    )
    rc, results, printed = run_selfcheck(
        ["--device", "cpu", "--model", str(tiny_model_dir), "--quick"], tmp_path
    )
    checks = {c["name"]: c for c in results["checks"]}
    assert rc == 1 and results["passed"] is False
    assert (
        checks["oracle float32"]["status"] == "FAIL"
        and "MISMATCH" in checks["oracle float32"]["detail"]
    )
    assert "prefix caching" not in checks  # it compares against the oracle's references: not run
    assert checks["preemption swap"]["status"] == "FAIL"
    assert "FAILED: oracle float32" in printed


def test_a_crashing_check_is_a_failure_and_the_others_still_run(tiny_model_dir):
    check = selfcheck.SelfCheck(
        selfcheck.SelfCheckConfig(model=str(tiny_model_dir), device="cpu"), log=lambda m: None
    )

    def boom():
        raise RuntimeError("no luck")

    assert check.run_check("x", boom).status == "FAIL" and "no luck" in check.results[0].detail
    assert check.run_check("y", lambda: ("PASS", "fine", {})).status == "PASS"
    assert "FAILED: x" in selfcheck.format_table(check.results)


class FakeHF:
    """A 'transformers model' whose next-token logits are fixed."""

    def __init__(self, logits: list[float]):
        self.logits = torch.tensor(logits)

    def parameters(self):
        return iter([self.logits])

    def __call__(self, ids):
        return SimpleNamespace(logits=self.logits.view(1, 1, -1).expand(1, ids.shape[1], -1))


@pytest.mark.parametrize(
    "logits, ours, ok",
    [
        ([0.0, 5.0, 5.0005, 1.0], 1, True),  # top-2 0.0005 apart and ours is the runner-up: excused
        ([0.0, 4.0, 5.0, 1.0], 1, False),  # a clear winner: a real mismatch
        ([0.0, 5.0, 5.0005, 1.0], 3, False),  # a near tie, but ours is not one of the two
    ],
)
def test_near_tie_rule(logits, ours, ok):
    c = selfcheck.compare_greedy(FakeHF(logits), "p", [1, 2], [7, ours], [7, 2], tie_margin=1e-3)
    assert (
        c.ok is ok
        and c.diverge_at == 1
        and c.reference == 2
        and c.margin == pytest.approx(logits[2] - logits[1], rel=1e-3)
    )


def test_equal_and_length_mismatch():
    hf = FakeHF([0.0, 1.0])
    assert selfcheck.compare_greedy(hf, "p", [1], [3, 4], [3, 4], 1e-3).equal
    short = selfcheck.compare_greedy(hf, "p", [1], [3], [3, 4], 1e-3)
    assert not short.ok and short.diverge_at == 1
    ok, line, _ = selfcheck.summarize([short])
    assert not ok and "MISMATCH" in line


def test_each_finished_check_is_reported_as_it_ends(tiny_model_dir):
    """`after_each` sees the results after every check: `--json` rewrites its file then, so a
    run stopped by a time limit keeps what it finished."""
    seen = []
    check = selfcheck.SelfCheck(
        selfcheck.SelfCheckConfig(model=str(tiny_model_dir), device="cpu"),
        log=lambda m: None,
        after_each=lambda results: seen.append([r.name for r in results]),
    )
    check.run_check("x", lambda: ("PASS", "fine", {}))
    check.run_check("y", lambda: ("SKIP", "not here", {}))
    assert seen == [["x"], ["x", "y"]]
