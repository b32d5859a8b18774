"""Chapter 16 (structured outputs) without Streamlit: the constraint presets, where in a JSON
schema a partial output is, the per-step table of a constrained and a free request (allowed
tokens, top tokens before and after the mask, the probability mass the mask removed, the mask
time), and the parse rate of the same prompts with and without the constraint."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from engine.core import EngineCore
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.trace import StepRecord
from ui.experiments.common import ConfigLike, make_config

TOP = 5  # tokens shown before and after the mask
KINDS = {"JSON 스키마": "json", "정규식": "regex", "선택지": "choice"}
DEFAULT_MAX_TOKENS = 48

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        "temperature_c": {"type": "number", "minimum": -30, "maximum": 45},
    },
    "required": ["city", "sky", "temperature_c"],
    "additionalProperties": False,
}
TODO = {
    "type": "object",
    "properties": {
        "tasks": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 24},
                    "done": {"type": "boolean"},
                },
                "required": ["title", "done"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["tasks"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Preset:
    """A constraint and the prompt that asks for it in words (English: the 135M default model
    answers English prompts sensibly)."""

    kind: str  # json / regex / choice
    spec: object
    template: str  # the prompt, with {} for one of the subjects
    subjects: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return self.template.format(self.subjects[0])

    def prompts(self, n: int) -> list[str]:
        """n prompts of the same request, one per subject (the parse-rate measurement)."""
        return [self.template.format(s) for s in self.subjects[:n]]

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**{self.kind: self.spec})


PRESETS: dict[str, Preset] = {
    "사람 (객체: 문자열 + 정수 0–120)": Preset(
        "json",
        PERSON,
        "Reply with only a JSON object with the keys name (a string) and age (an integer) "
        "describing a famous {}.",
        ("scientist", "painter", "athlete", "writer", "composer", "explorer"),
    ),
    "날씨 (enum + 숫자 범위 −30–45)": Preset(
        "json",
        WEATHER,
        "Reply with only a JSON object with the keys city, sky (one of sunny, cloudy, rain, "
        "snow) and temperature_c (a number) for the weather in {} today.",
        ("Paris", "Tokyo", "Cairo", "Oslo", "Lima", "Seoul"),
    ),
    "할 일 (객체의 배열)": Preset(
        "json",
        TODO,
        "Reply with only a JSON object with the key tasks: a list of objects with title and "
        "done (true or false) for {}.",
        ("cleaning a kitchen", "moving house", "a birthday party", "a trip", "a garden", "exams"),
    ),
    "날짜 (정규식 YYYY-MM-DD)": Preset(
        "regex",
        r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
        "On what date did {}? Reply with only the date.",
        (
            "the first person walk on the Moon",
            "the Berlin Wall fall",
            "World War II end in Europe",
            "the Titanic sink",
            "the first iPhone go on sale",
            "Korea host the Olympic Games",
        ),
    ),
    "감정 (선택지 3개)": Preset(
        "choice",
        ["positive", "negative", "neutral"],
        "Is this review positive, negative or neutral? '{}' Reply with one word.",
        (
            "The soup was cold and the waiter ignored us.",
            "Lovely staff, great coffee!",
            "It was fine, nothing special.",
            "Never again.",
            "Best pizza in town.",
            "The room was clean.",
        ),
    ),
}


def presets_of(kind: str) -> dict[str, Preset]:
    return {label: p for label, p in PRESETS.items() if p.kind == kind}


# -- where in the schema the output is ---------------------------------------------------------


def json_path(text: str) -> list[str | int]:
    """The key path at the end of a partial JSON text: ["tasks", 0, "title"] while the title's
    value is being written. A key still being typed is not on the path yet (its object is).
    Strings are skipped with their escapes, so braces inside them do not count."""
    stack: list[list] = []  # per open container: [kind, key or index, expecting_key]
    in_string, escaped, string_is_key, key_chars = False, False, False, []
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if string_is_key:
                    stack[-1][1] = "".join(key_chars)
            elif string_is_key:
                key_chars.append(ch)
            continue
        if ch == '"':
            in_string, key_chars = True, []
            string_is_key = bool(stack) and stack[-1][0] == "obj" and stack[-1][2]
        elif ch == "{":
            stack.append(["obj", None, True])
        elif ch == "[":
            stack.append(["arr", 0, False])
        elif ch in "}]" and stack:
            stack.pop()
        elif ch == ":" and stack and stack[-1][0] == "obj":
            stack[-1][2] = False
        elif ch == "," and stack:
            if stack[-1][0] == "obj":
                stack[-1][1], stack[-1][2] = None, True
            else:
                stack[-1][1] += 1
    path = []
    for kind, key, expecting_key in stack:
        if kind == "obj" and (key is None or expecting_key):
            break
        path.append(key)
    return path


def schema_path(path: list[str | int]) -> list[str]:
    """The schema's property names along a key path (array indices become their items)."""
    return [p for p in path if isinstance(p, str)]


def schema_outline(schema: dict, depth: int = 0, path: tuple = ()) -> list[tuple[int, str, tuple]]:
    """The schema as lines (depth, text, property path) to draw with the current one marked."""
    lines = []
    for name, sub in schema.get("properties", {}).items():
        here = path + (name,)
        lines.append((depth, f"{name}: {describe(sub)}", here))
        if sub.get("type") == "object":
            lines += schema_outline(sub, depth + 1, here)
        elif sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            lines += schema_outline(sub["items"], depth + 1, here)
    return lines


def describe(sub: dict) -> str:
    """A property's type in a few words (its enum, range or length bound)."""
    if "enum" in sub:
        return "enum [" + ", ".join(map(str, sub["enum"])) + "]"
    kind = sub.get("type", "any")
    if "minimum" in sub or "maximum" in sub:
        return f"{kind} ({sub.get('minimum', '−∞')} … {sub.get('maximum', '∞')})"
    if kind == "array":
        return f"array (최대 {sub['maxItems']}개)" if "maxItems" in sub else "array"
    if "maxLength" in sub:
        return f"{kind} (최대 {sub['maxLength']}자)"
    return kind


# -- the per-step table -------------------------------------------------------------------------


def token_label(tokenizer, token_id: int) -> str:
    """A token as the learner reads it: its text with spaces and newlines visible."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return repr(text)[1:-1].replace(" ", "␣") or f"#{token_id}"


def top_text(tokenizer, pairs: list[tuple[int, float]]) -> str:
    return ", ".join(f"{token_label(tokenizer, t)} {p:.2f}" for t, p in pairs) or "—"


@dataclass
class StepRow:
    """One sampled step of one request, as the table shows it."""

    step: int
    token: str
    text: str  # the output so far
    num_allowed: int | None
    top_before: list[tuple[int, float]]
    top_after: list[tuple[int, float]]
    removed_mass: float | None
    mask_ms: float | None
    forced: bool  # the mask changed the most likely token
    path: list = field(default_factory=list)


def step_rows(records: list[StepRecord], tokenizer, request_id: str) -> list[StepRow]:
    """Every step in which the request sampled a token (a prefill chunk that sampled nothing is
    left out), with its mask report when the request asked for one."""
    rows, ids = [], []
    for record in records:
        scheduled = next((s for s in record.scheduled if s.request_id == request_id), None)
        new = record.new_tokens.get(request_id)
        if scheduled is None or not new:
            continue
        ids += new
        text = tokenizer.decode(ids)
        report = scheduled.mask_report
        masked = scheduled.num_allowed_tokens is not None
        rows.append(
            StepRow(
                step=record.step,
                token=token_label(tokenizer, new[-1]),
                text=text,
                num_allowed=scheduled.num_allowed_tokens,
                top_before=report.top_before if report else [],
                top_after=report.top_after if report else [],
                removed_mass=report.removed_mass if report else None,
                mask_ms=record.grammar_mask_seconds * 1000 if masked else None,
                forced=bool(report and report.top_after)
                and report.top_before[0][0] != report.top_after[0][0],
                path=json_path(text),
            )
        )
    return rows


def step_table(rows: list[StepRow], tokenizer, vocab_size: int, masked: bool) -> pd.DataFrame:
    """The table beside each side: per sampled step, the token, the allowed count, the top
    tokens before (and, under a mask, after), the mass removed and the mask time."""
    table = []
    for row in rows:
        line = {"스텝": row.step, "고른 토큰": row.token}
        if masked:
            line["허용 토큰 수"] = f"{row.num_allowed:,} / {vocab_size:,}"
        line["마스크 전 상위 5"] = top_text(tokenizer, row.top_before)
        if masked:
            line["마스크 후 상위 5"] = top_text(tokenizer, row.top_after)
            line["마스크가 지운 확률"] = row.removed_mass
            line["마스크 시간 (ms, 측정값)"] = row.mask_ms
            line["스키마 위치"] = ".".join(map(str, row.path)) or "(맨 바깥)"
        table.append(line)
    return pd.DataFrame(table)


def mask_summary(rows: list[StepRow]) -> dict:
    """Totals over the constrained steps: steps, the largest and mean removed mass, the steps
    whose top token the mask changed, the mean and largest mask time, the fewest tokens allowed."""
    reported = [r for r in rows if r.removed_mass is not None]
    times = [r.mask_ms for r in rows if r.mask_ms is not None]
    allowed = [r.num_allowed for r in rows if r.num_allowed is not None]
    return {
        "steps": len(rows),
        "max_removed": max((r.removed_mass for r in reported), default=None),
        "mean_removed": sum(r.removed_mass for r in reported) / len(reported) if reported else None,
        "forced_steps": sum(r.forced for r in rows),
        "mean_mask_ms": sum(times) / len(times) if times else None,
        "max_mask_ms": max(times, default=None),
        "min_allowed": min(allowed, default=None),
        "max_allowed": max(allowed, default=None),
    }


# -- does it parse? -----------------------------------------------------------------------------


def output_ok(preset: Preset, text: str) -> bool:
    """Whether an output is what the constraint asks: JSON that validates against the schema, a
    full regex match, or exactly one of the choices (surrounding whitespace allowed)."""
    import re

    if preset.kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), preset.spec)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if preset.kind == "regex":
        return re.fullmatch(preset.spec, text.strip()) is not None
    return text.strip() in preset.spec


@dataclass
class ParseRun:
    """The same prompts with and without the constraint, in one batch, greedy."""

    preset_label: str
    free_ok: int
    constrained_ok: int
    num_prompts: int
    free_texts: list[str]
    constrained_texts: list[str]
    steps: int
    wall_s: float
    conditions: dict = field(default_factory=dict)


def parse_rate(
    config: ConfigLike | None,
    label: str,
    prompts: list[str] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    engine_factory: Callable | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> ParseRun:
    """Run each prompt twice in one batch, asked in words only and under the constraint, and
    count the outputs that are valid (a constrained one cut by max_tokens counts as invalid)."""
    from ui.experiments.common import measurement_conditions

    preset = PRESETS[label]
    prompts = prompts or [preset.prompt]
    engine: EngineCore = (engine_factory or EngineCore)(make_config(config))
    free, constrained = [], []
    for i, prompt in enumerate(prompts):
        text = prompt
        if engine.tokenizer.chat_template:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        for side, so in ((free, None), (constrained, preset.params())):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so)
            side.append(engine.add_request(text, params, request_id=f"{'c' if so else 'f'}{i}"))
    wall, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests() and steps < 4 * max_tokens + 64:
        record = engine.step()
        steps += 1
        if on_step is not None:
            on_step(record)
    free_texts = [engine.tokenizer.decode(r.output_token_ids) for r in free]
    cons_texts = [engine.tokenizer.decode(r.output_token_ids) for r in constrained]
    return ParseRun(
        label,
        sum(output_ok(preset, t) for t in free_texts),
        sum(output_ok(preset, t) for t in cons_texts),
        len(prompts),
        free_texts,
        cons_texts,
        steps,
        time.perf_counter() - wall,
        measurement_conditions(engine, max_tokens=max_tokens, 방식="greedy, 한 배치"),
    )


def vocab_mask_bytes(vocab_size: int) -> int:
    """A packed bitmask's size: one bit per token in 32-bit words (계산값)."""
    return 4 * -(-vocab_size // 32)
