"""Chapter 16's claims, in directions: the per-step mask report (SamplingParams.report_top_tokens)
says what the mask did (its after-mask top tokens are all allowed, the removed mass is 1 − the
allowed tokens' probability sum, the sampled greedy token is the after-mask top one), the allowed
count is far below the vocabulary, and on the real model the constrained outputs parse while the
removed mass is above 0 at some step of the chosen prompt."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.worker.model_runner import mask_report
from ui.experiments import ch16


def pack(allowed: list[int], vocab: int) -> bytes:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_mask_report_of_one_row():
    """A row whose most likely tokens are forbidden: the after-mask top tokens are allowed ones,
    renormalized, and the removed mass is 1 − their share under the model's distribution."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(100, generator=generator)
    allowed = [3, 17, 40, 41, 99]
    logits[50] = 9.0  # far the most likely, and forbidden
    report = mask_report(logits, pack(allowed, 100), 5)
    probs = torch.softmax(logits, dim=-1)
    assert report.num_allowed == len(allowed)
    assert report.top_before[0][0] == 50
    assert {t for t, _ in report.top_after} == set(allowed)
    assert sum(p for _, p in report.top_after) == pytest.approx(1.0, abs=1e-5)
    assert report.removed_mass == pytest.approx(1 - float(probs[allowed].sum()), abs=1e-6)
    assert report.removed_mass > 0.9
    free = mask_report(logits, None, 3)
    assert free.removed_mass == pytest.approx(0.0, abs=1e-6) and free.num_allowed == 100
    assert free.top_before == free.top_after and len(free.top_before) == 3
    with pytest.raises(InvalidRequestError, match="report_top_tokens"):
        SamplingParams(report_top_tokens=-1)


def test_json_path_follows_a_partial_output():
    assert ch16.json_path("") == []
    assert ch16.json_path('{"na') == []
    assert ch16.json_path('{"name": "Ad') == ["name"]
    assert ch16.json_path('{"name": "A}{,", "age": 4') == ["age"]
    assert ch16.json_path('{"tasks": [{"title": "x", "done": tr') == ["tasks", 0, "done"]
    assert ch16.json_path('{"tasks": [{"title": "x"}, {"title": "y') == ["tasks", 1, "title"]
    assert ch16.json_path('{"a": {"b": 1}, "') == []
    lines = ch16.schema_outline(ch16.TODO)
    assert [path for _, _, path in lines] == [("tasks",), ("tasks", "title"), ("tasks", "done")]
    assert ch16.describe(ch16.WEATHER["properties"]["sky"]).startswith("enum [sunny")


def test_tiny_engine_reports_each_constrained_step(make_engine):
    """Side by side in one batch: the constrained request's every sampled step carries a report
    whose allowed count is the scheduler's and far below the vocabulary, whose greedy token is
    the after-mask top one; the free request that asked reports 0 removed, one that did not
    ask reports nothing."""
    engine = make_engine()
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    ask = dict(max_tokens=8, temperature=0.0, report_top_tokens=5)
    engine.add_request("pick one:", SamplingParams(**ask, structured_outputs=choice), "c")
    engine.add_request("pick one:", SamplingParams(**ask), "f")
    engine.add_request("pick one:", SamplingParams(max_tokens=8, temperature=0.0), "plain")
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    vocab = engine.model_config.vocab_size
    rows = ch16.step_rows(records, engine.tokenizer, "c")
    assert rows and all(r.num_allowed is not None and r.num_allowed < vocab for r in rows)
    sampled = [s for rec in records for s in rec.scheduled if s.request_id == "c" and s.mask_report]
    assert len(sampled) == len(rows)
    for s in sampled:
        assert s.mask_report.num_allowed == s.num_allowed_tokens
        assert all(0 <= p <= 1 for _, p in s.mask_report.top_after)
    tokens = [t for rec in records for t in rec.new_tokens.get("c", [])]
    assert [s.mask_report.top_after[0][0] for s in sampled] == tokens
    assert engine.tokenizer.decode(tokens).strip() in choice.choice
    free = [s.mask_report for rec in records for s in rec.scheduled if s.request_id == "f"]
    assert all(r is not None and r.removed_mass == pytest.approx(0, abs=1e-6) for r in free)
    plain = [s.mask_report for rec in records for s in rec.scheduled if s.request_id == "plain"]
    assert plain and all(r is None for r in plain)


@pytest.mark.slow
def test_real_model_constrained_outputs_parse_and_the_mask_removes_mass(default_model_dir):
    """The lab's default preset on the 135M model: the constrained output validates against the
    schema, the mask removed probability at some step (the model's favourite was forbidden
    somewhere: it likes a code fence before JSON), the allowed count stays below 49,152."""
    from engine.config import EngineConfig

    run = ch16.parse_rate(EngineConfig(model=str(default_model_dir)), next(iter(ch16.PRESETS)))
    assert run.constrained_ok == run.num_prompts == 1
    from engine.core import EngineCore

    engine = EngineCore(EngineConfig(model=str(default_model_dir)))
    preset = next(iter(ch16.PRESETS.values()))
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": preset.prompt}])
    params = SamplingParams(
        max_tokens=48, temperature=0.0, structured_outputs=preset.params(), report_top_tokens=5
    )
    engine.add_request(text, params, "c")
    records = []
    while engine.has_unfinished_requests():
        records.append(engine.step())
    rows = ch16.step_rows(records, engine.tokenizer, "c")
    assert ch16.output_ok(preset, rows[-1].text)
    assert all(r.removed_mass >= 0 for r in rows)
    assert max(r.removed_mass for r in rows) > 0.01
    assert all(r.num_allowed < 49152 for r in rows)
