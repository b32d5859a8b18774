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
  worker holds the bytes the planned layout (engine/multiproc_executor.py's shard_weights on meta
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
    from engine.quality import TIE_MARGIN
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
