"""The claims of chapters 11-14 (`render_chapter(..., claim=...)`): each chapter's DEFAULT lab
workload, run on the real default model through the same ui/experiments helpers the pages use
(no Streamlit), shows the effect its page states, and the verdicts the pages print follow their
own rules.

- ch11: the int4 (group 32) engine's linears are float32's own (max abs error 0: the float32
  weights came from that grid), int8's are not; where a quantized engine's greedy tokens part
  from float32's, float32 itself nearly tied and the engine wrote its runner-up; the agreement
  the page shows is the one the runs' tokens give. (Which near tie flips first depends on the
  arithmetic order, e.g. the float32 library the process timed as faster, so the agreement
  percentages themselves are not asserted.)
- ch12: tensor parallel (tp 3) and pipeline parallel (pp 2) write tp 1's greedy tokens, and each
  worker holds the bytes the planned layout (engine/models/llama.py's shard_weights on meta
  tensors) says.
- ch13: n-gram drafts are accepted on the default prompt (tokens per verifying step > 1) and the
  greedy output equals the engine without speculation.
- ch14: the prefill threshold cuts the short requests' TTFT (engine clock, a 2x margin); the
  streaming E2E verdict follows its stated rule.
"""

from __future__ import annotations

import pytest

from ui.session import EngineSettings


def settings(model_dir) -> EngineSettings:
    """The sidebar's defaults on the real model (what a learner's page runs with)."""
    return EngineSettings(model=str(model_dir), device="cpu")


# -- ch11 ----------------------------------------------------------------------------------------


def _token_share(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    return 100 * sum(x == y for x, y in zip(a[:n], b[:n])) / n


@pytest.mark.slow
def test_ch11_default_agreement_and_its_explanation(default_model_dir):
    from engine.core import EngineCore
    from engine.tools.quality import TIE_MARGIN
    from ui.experiments.ch11 import (
        DEFAULT_SIDES,
        GRIDS,
        VARIANTS,
        agreement_explanation,
        decode_workload,
        greedy_agreement_table,
        grid_fit_table,
        tie_report,
    )
    from ui.experiments.common import run_workload

    engines: dict[str, EngineCore] = {}
    runs = {}
    for label in DEFAULT_SIDES:
        cfg = settings(default_model_dir).to_config(**VARIANTS[label], enable_prefix_caching=False)
        runs[label] = run_workload(
            cfg, decode_workload(), label, engine_factory=lambda c, k=label: engines.setdefault(
                k, EngineCore(c)
            )
        )  # fmt: skip
    assert not any(r.rejected for r in runs.values())

    # the weights each engine holds: int4 < int8 < a quarter of float32's (plus scales)
    held = {label: e.weight_bytes() for label, e in engines.items()}
    assert held["int4"] < held["int8"] < held["float32"] / 3

    # the agreement the page shows is the share the runs' own tokens give
    table = greedy_agreement_table(runs).set_index("엔진")["float32와 같은 토큰 비율"]
    ref = list(runs["float32"].requests[0].output_token_ids)
    for label, run in runs.items():
        ours = list(run.requests[0].output_token_ids)
        assert table[label] == round(_token_share(ref, ours), 1)
    assert table["float32"] == 100.0

    # why: the float32 linears ARE int4's grid; int8's grid moves nearly all of them
    fit = grid_fit_table(default_model_dir).set_index("형식")
    int8, int4 = GRIDS[0][0], GRIDS[1][0]
    assert fit.loc[int4, "최대 절대 오차"] == 0.0 and fit.loc[int4, "그대로인 가중치 (%)"] == 100
    assert fit.loc[int8, "최대 절대 오차"] > 0.01 and fit.loc[int8, "그대로인 가중치 (%)"] < 5

    # every engine that parted from float32 did so where float32 itself nearly tied (top-1 vs
    # top-2 logit under TIE_MARGIN) and wrote float32's runner-up there
    ties = tie_report(default_model_dir, runs)
    parted = ties.table.set_index("엔진")
    assert "int8" in parted.index  # int8's grid moved the weights: it parts within 24 tokens
    assert (parted["그 위치의 float32 1·2순위 로짓 차"] < TIE_MARGIN).all()
    assert (parted["float32의 2순위를 골랐나"] == "예").all()
    for label in parted.index:
        ours = runs[label].requests[0].output_token_ids
        first = next(i for i, (a, b) in enumerate(zip(ref, ours)) if a != b)
        assert parted.loc[label, "처음 달라진 위치"] == first
    assert ties.near_ties >= 3  # a 135M model hesitates often
    text = " ".join(agreement_explanation(grid_fit_table(default_model_dir), ties))
    assert "최대 절대 오차 0" in text and "동점에 가까운 곳" in text


# -- ch12 ----------------------------------------------------------------------------------------


def base_bytes(model_dir) -> int:
    """What one in-process float32 engine holds (engine.weight_bytes(), measured)."""
    import torch

    from engine.worker.worker import load_model

    return load_model(model_dir, torch.device("cpu"), torch.float32).weight_bytes()


@pytest.mark.slow  # starts 3 + 2 worker processes: ~60-90 s on a shared CPU
def test_ch12_default_layouts_agree_and_hold_the_planned_bytes(default_model_dir):
    from engine.models.config import LlamaConfig
    from ui.experiments.ch12 import DEFAULT_TP, compare_layouts, lab_workload, planned_layout

    cfg = settings(default_model_dir).to_config(device="cpu", enable_prefix_caching=False)
    result = compare_layouts(cfg, lab_workload(), sizes=((1, 1), (DEFAULT_TP, 1), (1, 2)))
    runs = list(result.runs.values())
    base = runs[0]
    assert not base.result.rejected and len(base.tokens) == 2
    assert all(len(t) == 12 for t in base.tokens.values())
    model = LlamaConfig.from_model_dir(default_model_dir)
    full = planned_layout(model, 1, 1)[0]["weight_bytes"]  # every weight once (tied: one matrix)
    assert full == base_bytes(default_model_dir)
    for run in runs[1:]:
        # the same greedy tokens as one worker, token for token
        assert run.tokens == base.tokens, run.result.label
        # each worker holds exactly the bytes the page's planned layout shows before it starts
        planned = planned_layout(model, run.tp, run.pp)
        assert [r["weight_bytes"] for r in run.layout] == [r["weight_bytes"] for r in planned]
        assert [r["replicated_bytes"] for r in run.layout] == [
            r["replicated_bytes"] for r in planned
        ]
        assert [r["shapes"] for r in run.layout] == [r["shapes"] for r in planned]
    tp = result.runs[f"tp {DEFAULT_TP} × pp 1"].layout
    # tp 3: the unshared part (the layers' matrices) is cut in three equal pieces
    shared = tp[0]["replicated_bytes"]
    assert len({r["weight_bytes"] for r in tp}) == 1
    assert sum(r["weight_bytes"] - shared for r in tp) + shared == full
    # pp 2: each stage holds half the layers, and together every weight (the tied matrix twice)
    pp = result.runs["tp 1 × pp 2"].layout
    assert [r["layers"] for r in pp] == [[0, 15], [15, 30]]
    embed = model.vocab_size * model.hidden_size * 4
    assert sum(r["weight_bytes"] for r in pp) == full + embed


# -- ch13 ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ch13_default_prompt_accepts_drafts_and_keeps_the_output(default_model_dir):
    from ui.experiments.ch13 import (
        DEFAULT_MAX_TOKENS,
        DEFAULT_PROMPT,
        PROMPTS,
        compare_outputs,
        run_prompts,
        spec_config,
        spec_stats,
    )

    s = settings(default_model_dir)  # the sidebar's k, prompt_lookup_max and _min
    spec = spec_config(s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min)
    prompt = [PROMPTS[DEFAULT_PROMPT]]
    # as the lab's 실행 adds it: chat template, greedy, EOS allowed
    on = run_prompts(
        s.to_config(speculative_config=spec), prompt, DEFAULT_MAX_TOKENS, ignore_eos=False
    )
    off = run_prompts(
        s.to_config(speculative_config=None), prompt, DEFAULT_MAX_TOKENS, ignore_eos=False
    )
    stats = spec_stats(on.records, spec["num_speculative_tokens"])
    assert stats.accepted > 0 and stats.tokens_per_verify_step > 1.5
    assert compare_outputs(on.outputs, off.outputs)["all_equal"]
    assert on.output_tokens >= 16  # the answer copies the list, it does not stop at once
    assert 2 * len(on.records) <= len(off.records)


# -- ch14 ----------------------------------------------------------------------------------------


def _stream_table(streamed: list[float], whole: list[float]):
    import pandas as pd

    rows = [{"방식": "스트리밍 (stream=true)", "전체 답 (E2E, ms)": v} for v in streamed]
    rows += [{"방식": "비스트리밍 (stream=false)", "전체 답 (E2E, ms)": v} for v in whole]
    return pd.DataFrame(rows)


def test_ch14_stream_verdict_follows_its_stated_rule():
    from ui.experiments.ch14_stream import STREAM_RULE, stream_e2e_verdict

    assert "겹치면" in STREAM_RULE and "겹치지 않으면" in STREAM_RULE
    # the learner's run: the ranges 1,695-1,857 and 1,313-1,564 ms do not overlap
    assert stream_e2e_verdict(_stream_table([1695, 1780, 1857], [1313, 1450, 1564])) == "늘어난다"
    assert stream_e2e_verdict(_stream_table([1313, 1450, 1564], [1695, 1780, 1857])) == "줄어든다"
    # overlapping ranges are 비슷하다, however far apart the medians are
    assert stream_e2e_verdict(_stream_table([1000, 1900, 1950], [1100, 1150, 1200])) == "비슷하다"
    assert stream_e2e_verdict(_stream_table([1200, 1300], [1300, 1400])) == "비슷하다"  # touching
    assert stream_e2e_verdict(_stream_table([], [1300])) is None


@pytest.mark.slow
def test_ch14_default_threshold_cuts_the_short_requests_ttft(default_model_dir):
    from ui.experiments.ch14 import (
        FAIR_BUDGET,
        FAIR_LONG,
        FAIR_SEQS,
        FAIR_SHORT,
        FAIR_THRESHOLD,
        compare_fairness,
        fairness_base,
        fairness_workload,
    )

    base = fairness_base(settings(default_model_dir).to_config())
    result = compare_fairness(
        base,
        fairness_workload(FAIR_LONG, num_short=FAIR_SHORT),
        FAIR_BUDGET,
        FAIR_SEQS,
        thresholds=(0, FAIR_THRESHOLD),
    )
    assert not any(r.rejected for r in result.runs.values())
    off, on = result.summary.set_index("실행")["짧은 요청 TTFT 평균 (ms)"]
    assert on < off / 2  # the engine clock: the short requests ride along from the first step
    first = result.summary.set_index("실행")["짧은 요청이 처음 들어간 스텝"]
    assert list(first) == [6, 1]  # off: after the 320-token prompt's 5 chunks of 64; on: at once


@pytest.mark.slow
def test_ch14_default_stream_comparison_verdict_follows_the_rule(default_model_dir):
    from engine.core import EngineCore
    from ui.experiments.ch14_load import LOAD_MAX_TOKENS, LOAD_PROMPT_LEN
    from ui.experiments.ch14_server import server_overrides, start_live_server
    from ui.experiments.ch14_stream import (
        STREAM_MIN_TOKENS,
        STREAM_REPEATS,
        stream_e2e_verdict,
        stream_vs_nonstream,
    )
    from ui.experiments.common import prompt_ids

    engine = EngineCore(settings(default_model_dir).to_config(**server_overrides()))
    live = start_live_server(engine)
    try:
        table = stream_vs_nonstream(
            live.url,
            prompt_ids(engine, LOAD_PROMPT_LEN, 0),
            max(LOAD_MAX_TOKENS, STREAM_MIN_TOKENS),
            STREAM_REPEATS,
        )
    finally:
        live.stop()
    assert table["_text"].nunique() == 1 and (table["상태"] == table["상태"].iloc[0]).all()
    col = "전체 답 (E2E, ms)"
    streamed = table.loc[table["방식"].str.startswith("스트리밍"), col].tolist()
    whole = table.loc[table["방식"].str.startswith("비스트리밍"), col].tolist()
    assert len(streamed) == len(whole) == STREAM_REPEATS
    overlap = min(streamed) <= max(whole) and min(whole) <= max(streamed)
    expected = "비슷하다" if overlap else "늘어난다" if min(streamed) > max(whole) else "줄어든다"
    assert stream_e2e_verdict(table) == expected
