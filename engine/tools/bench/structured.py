"""Part of section 4 (engine overhead): what structured outputs cost per step. The same chat
prompt decoded greedily free and under a JSON schema, at batch 1 and at a small batch: the
median decode step, the grammar mask's share of it (computed in the scheduler before the
forward, engine/structured_output/), the sampler (which applies the mask) and the tokens the mask
allows; plus the grammar's compile time, cold and from the cache."""

from __future__ import annotations

import statistics
import time

from engine.sampling_params import SamplingParams, StructuredOutputsParams

# Long enough to decode for many steps: an object holding a list of 48 small integers.
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 48,
            "maxItems": 48,
        },
    },
    "required": ["name", "values"],
    "additionalProperties": False,
}
PROMPT = "Give a name and a list of 48 numbers between 0 and 999 as JSON."
BATCHES = (1, 4)


def _decode_steps(engine, prompt: list[int], params: SamplingParams, batch: int) -> list:
    for _ in range(batch):
        engine.add_request(prompt_token_ids=prompt, sampling_params=params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        record = engine.step()
        steps.append((time.perf_counter() - start, record))
    return [
        (wall, r)
        for wall, r in steps
        if len(r.scheduled) == batch and all(s.phase == "decode" for s in r.scheduled)
    ]


def _row(steps: list) -> dict:
    if not steps:
        return {"steps": 0}
    allowed = [s.num_allowed_tokens for _, r in steps for s in r.scheduled]
    allowed = [a for a in allowed if a is not None]
    return {
        "steps": len(steps),
        "step_ms": statistics.median(w for w, _ in steps) * 1e3,
        "mask_ms": statistics.median(r.grammar_mask_seconds for _, r in steps) * 1e3,
        "sample_ms": statistics.median(r.timings["sample"] for _, r in steps) * 1e3,
        "allowed_tokens_median": statistics.median(allowed) if allowed else None,
    }


def compile_times(engine) -> dict:
    """Compile the schema cold (a fresh manager: llguidance's tokenizer view is built too), then
    once more from the cache."""
    from engine.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(
        engine.model_dir / "tokenizer.json",
        engine.model_config.vocab_size,
        engine.tokenizer.eos_token_id,
    )
    params = StructuredOutputsParams(json=LIST_SCHEMA)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        manager.compile(params)
        times.append((time.perf_counter() - start) * 1e3)
    return {"cold_ms": times[0], "cached_ms": times[1]}


def run_structured_outputs(engine, output_len: int) -> dict:
    """Free against constrained decode, at each of BATCHES (greedy, up to `output_len` tokens)."""
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])[1]
    rows = {}
    for batch in BATCHES:
        for label, constraint in (
            ("free", None),
            ("json_schema", StructuredOutputsParams(json=LIST_SCHEMA)),
        ):
            params = SamplingParams(
                temperature=0,
                max_tokens=output_len,
                ignore_eos=constraint is None,
                structured_outputs=constraint,
            )
            rows[f"{label} × {batch}"] = _row(_decode_steps(engine, prompt, params, batch))
    return {
        "backend": "llguidance",
        "vocab_size": engine.model_config.vocab_size,
        "rows": rows,
        "compile": compile_times(engine),
    }


def format_structured_outputs(result: dict | None) -> list[str]:
    if not result:
        return []
    c = result["compile"]
    lines = [
        f"  structured outputs ({result['backend']}, {result['vocab_size']:,}-token vocabulary; "
        f"median decode step, ms; schema compiled in {c['cold_ms']:.0f} ms cold, "
        f"{c['cached_ms']:.2f} ms cached)",
        f"  {'requests':<18}{'step':>9}{'mask':>9}{'sample':>9}{'allowed':>10}{'steps':>7}",
    ]
    for name, row in result["rows"].items():
        if not row.get("steps"):
            lines.append(f"  {name:<18}  (no pure decode steps)")
            continue
        allowed = row["allowed_tokens_median"]
        lines.append(
            f"  {name:<18}{row['step_ms']:9.2f}{row['mask_ms']:9.3f}{row['sample_ms']:9.2f}"
            f"{'—' if allowed is None else f'{allowed:,.0f}':>10}{row['steps']:>7}"
        )
    return lines
