"""Chapter 12 (executor and workers) under Streamlit's AppTest: the page opens from app.py, its lab
runs the same requests on tp 1 and tp 2 (the tiny model's 4 query / 2 KV heads divide by 2; one
worker process per rank), draws the shard figure, the per-step compute vs all-reduce figure and the
step times, and every worker process is gone once the engines are shut down.

One real lab run only: each tp engine spawns worker processes (each imports torch), seconds
apiece. The 시뮬레이션 switch draws the same views for Llama-3.1-70B on 8 H100s against 4 (and as
tp 4 × pp 2), from engine/tools/simulator.py's computed layout and worker timings: no process
starts."""

from __future__ import annotations

import base64
import multiprocessing
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("streamlit")
from _apptest import chart  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

from ui.experiments.ch12 import (  # noqa: E402
    full_shapes,
    matrix_cuts,
    simulated_fit_error,
    simulated_sizes,
    speed_verdict,
    tp_scaling,
)
from ui.session import SETTINGS_KEY, EngineSettings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGE = "pages/ch12_distributed.py"
TIMEOUT = 300


def values(field) -> list:
    """A plotly trace's x or y as a list (plotly sends numeric arrays as base64 `bdata`)."""
    if isinstance(field, dict) and "bdata" in field:
        return np.frombuffer(base64.b64decode(field["bdata"]), dtype=field["dtype"]).tolist()
    return list(field or [])


def shutdown_all(at: AppTest) -> None:
    for entry in at.session_state["_engines"].values():
        entry["engine"].shutdown()


def test_matrix_cuts_follow_the_layout():
    from engine.models.config import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False,
    )  # fmt: skip
    full = full_shapes(cfg)
    assert full == {"qkv": (128, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    layout = [
        {"tp_rank": r, "pp_rank": 0, "shapes": {"qkv": [64, 64], "o": [64, 32],
         "gate_up": [128, 64], "down": [64, 64]}}
        for r in (1, 0)
    ]  # fmt: skip
    cuts = matrix_cuts(cfg, layout).set_index(["행렬", "tp rank"])
    assert cuts.loc[("qkv", 1), "시작"] == 64 and cuts.loc[("qkv", 1), "자른 축"] == "출력"
    assert cuts.loc[("down", 1), "시작"] == 64 and cuts.loc[("down", 1), "자른 축"] == "입력"
    assert cuts.loc[("o", 0), "크기"] == 32
    whole = matrix_cuts(cfg, [])  # tp 1: one piece per matrix, the whole matrix
    assert len(whole) == 4 and list(whole["크기"]) == [128, 64, 256, 128]
    assert speed_verdict(1.9, 2) == "워커 수만큼 빨라진다"
    assert speed_verdict(1.3, 2) == "조금 빨라진다"
    assert speed_verdict(1.66, 2.0) == "조금 빨라진다"  # 83 % of twice is not "twice"
    assert speed_verdict(0.7, 3) == "비슷하거나 느려진다"


@pytest.mark.slow  # starts worker processes for the real lab: ~60 s under load
def test_lab_runs_tp1_and_tp2_and_leaves_no_workers(tiny_model_dir):
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(tiny_model_dir), device="cpu")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    # worker processes of engines other tests' AppTest sessions left alive (test_app.py and
    # test_lessons.py open this page too) are not this test's business
    before = set(multiprocessing.active_children())
    try:
        at.switch_page(PAGE)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert any("실험실" in h.value for h in at.header)
        assert at.selectbox(key="ch12_tp").options == ["2", "4"]
        at.selectbox(key="ch12_tp").set_value(2).run()
        assert not at.exception, [e.value for e in at.exception]
        at.slider(key="ch12_out").set_value(8).run()
        # opening the page starts nothing: the planned shard figure (two ranks, four matrices)
        # and its per-worker table come from the model's shapes, no worker process yet
        assert set(multiprocessing.active_children()) == before
        assert not [k for k in at.session_state["_engines"] if k.startswith("ch12")]
        shards = chart(at, "ch12_shards")["data"]
        assert len(shards) == 8 and all(t["x"] for t in shards)
        text = " ".join(m.value for m in at.markdown)
        assert "워커가 가질 것" in text and "계산값" in text and "all-reduce 4번" in text
        # 워크로드 넣기 starts the engines once; 실행 then runs those same engines
        at.button(key="ch12_start_load").click().run()
        assert not at.exception, [e.value for e in at.exception]
        tp_engine = at.session_state["_engines"]["ch12_tpn"]["engine"]
        assert len(set(multiprocessing.active_children()) - before) == 2
        at.button(key="ch12_run").click().run()
        assert not at.exception, [e.value for e in at.exception]
        assert at.session_state["_engines"]["ch12_tpn"]["engine"] is tp_engine  # no restart

        result = at.session_state["ch12_result"]
        summary = result.summary.set_index("실행")
        assert list(summary.index) == ["tp 1 × pp 1", "tp 2 × pp 1"]
        assert summary["tp 1과 같은 출력"].all()  # greedy tokens agree
        assert list(summary["스텝당 all-reduce (측정)"]) == [0, 4]  # 2 layers × 2
        comm = chart(at, "ch12_comm")
        counts = values(
            next(t for t in comm["data"] if t["name"].startswith("all-reduce 횟수"))["y"]
        )
        assert counts and set(counts) == {4}
        layout = comm["layout"]
        assert layout["yaxis"]["rangemode"] == "tozero" and layout["yaxis2"]["range"][0] == 0
        assert layout["yaxis2"]["range"][1] > 4  # the count line sits below the top tick
        assert layout["legend"]["y"] < 0  # below the plot: clear of the top ticks
        steps = chart(at, "ch12_step_times")
        assert all(values(t["y"]) for t in steps["data"])
        assert steps["layout"]["yaxis"]["rangemode"] == "tozero"
        text = " ".join(m.value for m in at.markdown)
        assert "측정값" in text and "계산값" in text and "제조사 문서" in text
        assert "all-reduce 4번" in text  # derived: 2 × 2 layers

        # another layout goes back to the planned view; 실행 there starts the pp 2 engine, and
        # runs the workload in one click (the engines that ran before are built anew, the new
        # pp 2 engine is not started twice)
        at.slider(key="ch12_requests").set_value(1).run()
        at.checkbox(key="ch12_pp").check().run()
        assert not at.exception, [e.value for e in at.exception]
        assert at.button(key="ch12_start_run")
        at.button(key="ch12_start_run").click().run()
        assert not at.exception, [e.value for e in at.exception]
        entries = at.session_state["_engines"]
        assert entries["ch12_tpn"]["engine"] is not tp_engine
        # the pp engine the start built is the one that ran: created before the rebuilt tp one
        assert entries["ch12_pp2"]["created"] < entries["ch12_tpn"]["created"]
        rerun = at.session_state["ch12_result"]
        assert list(rerun.runs) == ["tp 1 × pp 1", "tp 2 × pp 1", "tp 1 × pp 2"]
        assert all(len(run.result.requests) == 1 for run in rerun.runs.values())
        assert rerun.summary["tp 1과 같은 출력"].all()
    finally:
        shutdown_all(at)
    assert set(multiprocessing.active_children()) - before == set()


def test_simulated_sizes_and_fit():
    assert simulated_sizes(8) == [(4, 1), (8, 1), (4, 2)] and simulated_sizes(1) == []
    fit = dict(max_model_len=1024, block_size=16, max_num_batched_tokens=128, max_num_seqs=8)
    assert simulated_fit_error("llama-3.1-70b", "h100-sxm", 4, 1, **fit) is None
    assert simulated_fit_error("llama-3.1-70b", "h100-sxm", 4, 2, **fit) is None
    # 70B in bf16 is about 141 GB: one 80 GB GPU cannot hold it (says by how much)
    assert "GB short" in simulated_fit_error("llama-3.1-70b", "h100-sxm", 1, 1, **fit)
    assert "가능한 tp" in simulated_fit_error("smollm2-135m-instruct", "h100-sxm", 2, 1, **fit)


def test_tp_scaling_shows_the_mistake_at_scale():
    """계산값: more GPUs shorten the step, less than in proportion; the all-reduce share grows."""
    table = tp_scaling("llama-3.1-8b", "h100-sxm")
    for phase in ("decode", "prefill"):
        rows = table[table["단계"] == phase].set_index("GPU 수 (tp)")
        assert list(rows.index) == [1, 2, 4, 8] and rows["메모리에 들어감"].all()
        assert rows["스텝 (ms)"].is_monotonic_decreasing
        assert rows["통신 비율 (%)"].is_monotonic_increasing and rows.loc[1, "통신 비율 (%)"] == 0
        assert (rows["속도 (가장 작은 tp 대비)"] < rows["이상적 속도"])[[2, 4, 8]].all()
    big = tp_scaling("llama-3.1-70b", "h100-sxm")
    decode = big[big["단계"] == "decode"].set_index("GPU 수 (tp)")
    # 70B in bf16 (about 141 GB) needs two 80 GB GPUs at least: the speed-ups are against tp 2
    assert list(decode["메모리에 들어감"]) == [False, True, True, True]
    assert pd.isna(decode.loc[1, "속도 (가장 작은 tp 대비)"])
    assert decode.loc[2, "속도 (가장 작은 tp 대비)"] == 1.0 and decode.loc[8, "이상적 속도"] == 4.0
    # ... and on two it fits only barely: 70.6 GB of weights per GPU leave under 1 GB, a few
    # hundred tokens of KV cache for the whole engine; four GPUs leave tens of GB
    assert decode.loc[2, "GPU당 가중치 (GB)"] == pytest.approx(70.6, abs=0.1)
    room, tokens = decode["GPU당 KV 캐시 자리 (GB)"], decode["KV 캐시에 들어가는 토큰"]
    assert room[2] < 1 < 30 < room[4] and tokens[2] < 32 * 1024 < tokens[4]
    assert (
        1
        < decode.loc[8, "속도 (가장 작은 tp 대비)"] / decode.loc[4, "속도 (가장 작은 tp 대비)"]
        < 2
    )


def test_lab_simulates_70b_on_8_gpus_against_4(tiny_model_dir):
    """The switch at 시뮬레이션 (set before the page first runs, so no real worker starts): the
    shard figure has 8 ranks × 4 matrices, the run's workers are simulated, the all-reduce count
    is the derived 2 × 80 (tp) and 2 × 40 (tp 4 × pp 2), and the scale view has data."""
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(tiny_model_dir), device="cpu")
    at.session_state["ch12_target"] = "시뮬레이션"
    at.session_state["ch12_pp"] = True
    at.run()
    before = set(multiprocessing.active_children())
    try:
        at.switch_page(PAGE)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert at.selectbox(key="ch12_sim_model").value == "llama-3.1-70b"
        assert at.selectbox(key="ch12_sim_tp").value == 8
        assert at.selectbox(key="ch12_tp").disabled
        shards = chart(at, "ch12_shards")["data"]
        assert len(shards) == 32 and all(t["x"] for t in shards)
        scale = chart(at, "ch12_scale")["data"]
        assert scale and all(values(t["y"]) for t in scale)
        at.button(key="ch12_run").click().run()
        assert not at.exception, [e.value for e in at.exception]

        result = at.session_state["ch12_result"]
        assert all(run.simulated for run in result.runs.values())
        summary = result.summary.set_index("실행")
        assert list(summary.index) == ["tp 4 × pp 1", "tp 8 × pp 1", "tp 4 × pp 2"]
        assert list(summary["스텝당 all-reduce (계산)"]) == [160, 160, 80]
        assert list(summary["가중치 합 (MB)"].notna()) == [True, True, True]
        assert summary.loc["tp 8 × pp 1", "기준 대비 속도 (decode)"] > 1
        comm = chart(at, "ch12_comm")["data"]
        counts = values(next(t for t in comm if t["name"].startswith("all-reduce 횟수"))["y"])
        assert counts and set(counts) == {160}
        assert all(values(t["y"]) for t in comm)
        assert all(values(t["y"]) for t in chart(at, "ch12_step_times")["data"])
        text = " ".join(m.value for m in at.markdown)
        assert "계산값" in text and "제조사 문서" in text and "NVLink" in text
        assert "all-reduce 160번" in text  # derived: 2 × 80 layers
    finally:
        shutdown_all(at)
    assert set(multiprocessing.active_children()) - before == set()


def test_fidelity_section_runs_the_smallest_trace_and_calibrates(tiny_model_dir):
    """The fidelity section under the lab (시뮬레이션 side set, so no worker process starts):
    실행 on the Mooncake sample (4 requests) runs the real tiny engine and the cost model, draws
    the per-step time and error figures with the load average and labelled numbers; 이 실행으로
    보정 adds the calibrated series and the before → after median."""
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=TIMEOUT)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(tiny_model_dir), device="cpu")
    at.session_state["ch12_target"] = "시뮬레이션"
    at.session_state["fidelity_requests"] = 4
    at.run()
    at.switch_page(PAGE)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.button(key="fidelity_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    steps = chart(at, "fidelity_steps")["data"]
    assert [t["name"] for t in steps] == ["측정 (실제 엔진)", "계산 (보정 전)"]
    assert all(values(t["y"]) for t in steps)
    assert values(chart(at, "fidelity_error")["data"][0]["y"])
    text = " ".join(m.value for m in at.markdown)
    assert "4/32개 요청" in text and "오차 중앙값" in text and "부하 평균" in text
    assert "측정값" in text and "계산값" in text
    at.button(key="fidelity_calibrate").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(chart(at, "fidelity_error")["data"]) == 2
    assert "보정한 뒤 오차 중앙값" in " ".join(m.value for m in at.markdown)
