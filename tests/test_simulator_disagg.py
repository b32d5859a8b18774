"""Disaggregated prefill/decode in the simulator (engine/tools/disagg_sim.py): N prefill and M
decode instances of a GPU preset on one virtual clock, the K/V crossing a link preset, against
colocated instances on the same GPUs; goodput under SLOs; the P:D sweep and its CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from engine.tools.disagg_sim import (
    SLO,
    compare_colocated,
    parse_split,
    simulate_cluster,
    summarize_rows,
    sweep_pd_ratio,
)
from engine.tools.presets import (
    PresetError,
    link_preset_names,
    load_link_preset,
    load_model_preset,
)
from engine.tools.workload import SimRequest, poisson_workload

MODEL, GPU = "llama-3.1-8b", "h100-sxm"
ENGINE = dict(max_num_batched_tokens=8192, max_model_len=8192)
LONG = 6000


def test_link_presets_carry_their_source_and_the_one_way_bandwidth():
    assert link_preset_names() == ["eth100", "eth25", "ib", "nvlink", "pcie"]
    for key in link_preset_names():
        link = load_link_preset(key)
        assert link.evidence == "vendor-reported" and link.source and link.reported
        assert link.latency_evidence.startswith("assumed")
    assert load_link_preset("nvlink").one_way_bandwidth == 900e9 / 2  # 900 GB/s both ways
    assert load_link_preset("ib").one_way_bandwidth == 400e9 / 8  # 400 Gb/s
    assert load_link_preset("pcie").one_way_bandwidth == pytest.approx(
        32e9 * 16 * 128 / 130 / 8, rel=0.01
    )
    assert load_link_preset("eth25").transfer_seconds(3_125_000_000) == pytest.approx(1 + 50e-6)


def long_prompt(arrival: float) -> SimRequest:
    return SimRequest([7 + i % 5000 for i in range(LONG)], 4, arrival, max_tokens=4)


def long_prompt_during_decodes() -> list[SimRequest]:
    """Four short requests decoding 120 tokens each from t=0; at t=0.3 s a long prompt."""
    short = [SimRequest(list(range(10 + i, 42 + i)), 120, 0.0, max_tokens=120) for i in range(4)]
    return short + [long_prompt(0.3)]


def test_long_prefill_stretches_colocated_itl_but_not_split_itl():
    split, colocated = compare_colocated(
        MODEL, GPU, 1, 1, "ib", workload=long_prompt_during_decodes(), **ENGINE
    )
    assert (split.mode, colocated.mode) == ("disaggregated", "colocated")
    assert (colocated.num_prefill, colocated.num_decode) == (2, 0)  # the same two GPUs
    # On the virtual clock: the decodes' worst gap grows colocated (the long prefill shares a
    # step with them) and stays about one decode step when split.
    worst_split = max(max(r["itl_s"]) for r in split.rows[:4])
    worst_colocated = max(max(r["itl_s"]) for r in colocated.rows[:4])
    typical = min(min(r["itl_s"]) for r in split.rows[:4])
    assert worst_colocated > 5 * worst_split
    assert worst_split < 2 * typical
    # every request decoded on the decode instance, each output complete
    assert [r["output_tokens"] for r in split.rows] == [120] * 4 + [4]
    assert all(r["decode_instance"] == 0 for r in split.rows)


def test_the_transfer_is_bytes_over_bandwidth_on_the_virtual_clock_and_the_scheduler_admits():
    fast = simulate_cluster(MODEL, GPU, 1, 1, "nvlink", workload=[long_prompt(0.0)], **ENGINE)
    slow = simulate_cluster(MODEL, GPU, 1, 1, "eth25", workload=[long_prompt(0.0)], **ENGINE)
    f, s = fast.rows[0], slow.rows[0]
    # layers × 2 × KV heads × head_dim × 2 bytes (bf16) × tokens, over the link one way
    assert f["kv_bytes"] == 32 * 2 * 8 * 128 * 2 * LONG == load_model_preset(MODEL).kv_bytes(LONG)
    assert f["transfer_s"] == pytest.approx(f["kv_bytes"] / 450e9 + 5e-6)
    assert s["transfer_s"] == pytest.approx(f["kv_bytes"] / 3.125e9 + 50e-6)
    assert s["transfer_s"] == load_link_preset("eth25").transfer_seconds(f["kv_bytes"])
    # With the decode instance idle, the slower link delays the first token by exactly the
    # difference, and the first token comes after prefill end + transfer.
    assert s["ttft_s"] - f["ttft_s"] == pytest.approx(s["transfer_s"] - f["transfer_s"])
    assert f["arrival_s"] + f["ttft_s"] > f["prefill_done_s"] + f["transfer_s"]
    # The decode instance's real scheduler admitted it with the transferred prompt computed:
    # its first step computed the last prompt token only (the K/V came over the link).
    decode = fast.cluster.final["sim-0"]
    first = next(e for e in decode.journey if e.kind == "scheduled")
    assert (first.detail["start"], first.detail["num_tokens"]) == (LONG - 1, 1)
    assert decode.num_preemptions == 0


def test_goodput_counts_requests_meeting_both_slos():
    workload = poisson_workload(24, 30.0, (64, 2048), (8, 64), 128256, seed=3)
    first = simulate_cluster(MODEL, GPU, 1, 1, "ib", workload=workload, **ENGINE)
    slo = SLO(first.summary["ttft_s"]["p50"], first.summary["tpot_s"]["p50"])
    again = simulate_cluster(MODEL, GPU, 1, 1, "ib", slo=slo, workload=workload, **ENGINE)
    rows = again.rows
    both = [
        r["ttft_s"] <= slo.ttft_s and (r["tpot_s"] is None or r["tpot_s"] <= slo.tpot_s)
        for r in rows
    ]
    assert [r["meets_slo"] for r in rows] == both
    meets_ttft, meets_tpot = (sum(r[k] for r in rows) for k in ("meets_ttft", "meets_tpot"))
    assert 0 < sum(both) <= min(meets_ttft, meets_tpot) and sum(both) < len(rows)
    goodput = again.summary["goodput"]
    assert goodput["share"] == sum(both) / len(rows)
    assert goodput["requests_per_s"] == pytest.approx(sum(both) / again.summary["duration_s"])
    assert goodput["requests_per_s_per_gpu"] == pytest.approx(goodput["requests_per_s"] / 2)
    # by hand: one meets both, one only TTFT, one only TPOT
    hand = [
        {
            "arrival_s": 0.0,
            "e2e_s": 2.0,
            "ttft_s": 0.1,
            "tpot_s": 0.01,
            "itl_s": [0.01],
            "output_tokens": 2,
            "kv_bytes": 0,
            "transfer_s": 0.0,
            "preemptions": 0,
            "meets_ttft": t,
            "meets_tpot": p,
            "meets_slo": t and p,
        }
        for t, p in ((True, True), (True, False), (False, True))
    ]
    summary = summarize_rows(hand, num_gpus=1)
    assert summary["goodput"] == {
        "share": 1 / 3,
        "requests_per_s": 0.5,
        "requests_per_s_per_gpu": 0.5,
    }


def test_the_sweep_returns_every_split_and_the_best():
    workload = poisson_workload(12, 20.0, (256, 2048), (8, 48), 128256, seed=1)
    sweep = sweep_pd_ratio(MODEL, GPU, 3, "pcie", SLO(0.2, 0.02), workload=workload, **ENGINE)
    assert [r["deployment"] for r in sweep.rows] == ["1:2", "2:1", "colocated"]
    assert [r["gpus"] for r in sweep.rows] == [3, 3, 3]
    splits = sweep.rows[:2]
    best = max(splits, key=lambda r: (r["goodput_req_s"], r["goodput_share"]))
    assert sweep.best == best["deployment"]
    data = json.loads(json.dumps(sweep.to_dict()))
    assert data["best"] == sweep.best and data["link"] == "pcie" and len(data["rows"]) == 3
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        sweep_pd_ratio(MODEL, GPU, 1, workload=workload)
    with pytest.raises(ValueError, match="P:D"):
        parse_split("3")
    with pytest.raises(PresetError, match="unknown link preset"):
        simulate_cluster(MODEL, GPU, 1, 1, "carrier-pigeon", workload=workload)


def run_cli(*argv):
    from engine.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["simulate", *argv])
    return rc, out.getvalue()


def test_cli_disaggregate_and_pd_sweep(tmp_path):
    small = ["--num-requests", "6", "--rate", "20", "--prompt-len", "64", "512"]
    small += ["--output-len", "8", "32", "--max-num-batched-tokens", "2048"]
    rc, out = run_cli(
        "--disaggregate", "1:1", "--link", "ib", *small, "--json", str(tmp_path / "a.json")
    )
    assert rc == 0
    assert "1:1" in out and "colocated" in out and "InfiniBand NDR" in out
    data = json.loads((tmp_path / "a.json").read_text())
    assert [r["deployment"] for r in data["rows"]] == ["1:1", "colocated"]
    assert len(data["requests"]["split"]) == 6
    rc, out = run_cli("--pd-sweep", "2", "--slo-ttft-ms", "500", "--slo-tpot-ms", "30", *small)
    assert rc == 0 and "best split for this workload and SLO: 1:1" in out
    trace = ["--trace-file", "tests/data/mooncake_sample.jsonl", "--max-requests", "4"]
    rc, out = run_cli("--disaggregate", "1:2", *trace, "--json", str(tmp_path / "t.json"))
    assert rc == 0 and "trace: tests/data/mooncake_sample.jsonl" in out
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["conditions"]["workload"]["trace_format"] == "mooncake"
    assert len(data["requests"]["colocated"]) == 4
    rc, out = run_cli("--list")
    assert "link presets:" in out and "nvlink" in out
