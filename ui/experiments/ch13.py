"""Chapter 13 · speculative decoding: n-gram drafts, what the model accepts, and what it costs.

Plain functions (no Streamlit): the prompts of the lab, the draft table of a run read from its
StepRecords, the acceptance rate and tokens per step measured against Leviathan et al.'s formula,
the token-for-token comparison of greedy outputs, and the speed of the same requests with and
without speculation at batch 1 and at a full batch.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tools.bench.spec_decode import SPEC_WORDS
from engine.trace import StepRecord
from ui.experiments.common import ConfigLike, make_config
from ui.tokens import show_bytes
from ui.trace_frames import spec_decode_dataframe

# The lab's prompts. The default 135M model copies a list or a quoted sentence faithfully, so its
# answer repeats its prompt: prompt lookup finds the drafts there. A story repeats nothing.
CODE_SNIPPET = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    '        subtotal += item["price"] * item["quantity"]\n'
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
PASSAGE = (
    "The river rises in the hills above the town. Every spring it floods the low fields, and "
    "every summer it shrinks to a thin silver line. The farmers plant late to wait for the water "
    "to go."
)
WORDS = SPEC_WORDS  # the bench's repetitive-workload words (engine/tools/bench/spec_decode.py)
TOPICS = [
    "a robot who learns to paint",
    "a lighthouse keeper and a storm",
    "a cat that runs a bakery",
    "a child who finds a map",
    "a dragon afraid of the dark",
    "a train that never stops",
    "a gardener on the moon",
    "a violin that plays itself",
]


def list_prompt(seed: int = 0, items: int = 6) -> str:
    """A numbered list to copy (seeded, so the same seed gives the same list)."""
    rng = random.Random(seed)
    lines = [
        f"{i + 1}. {rng.choice(WORDS)} {rng.choice(WORDS)} {rng.randint(10, 99)}"
        for i in range(items)
    ]
    return "Repeat this list exactly, one item per line:\n" + "\n".join(lines)


def story_prompt(i: int = 0) -> str:
    return f"Write a short story about {TOPICS[i % len(TOPICS)]}."


PROMPTS = {
    "목록 그대로 옮기기 (반복)": list_prompt(0),
    "인용문 옮기기 (반복)": f'Quote the first two sentences of this passage exactly:\n"{PASSAGE}"',
    "코드 고치기 (반복)": "Rename the variable `subtotal` to `total_before_tax` in this Python "
    "function and show the whole function:\n\n" + CODE_SNIPPET,
    "이야기 쓰기 (반복 없음)": story_prompt(0),
}
REPEATING = {label for label in PROMPTS if label.endswith("(반복)")}
# The lab's default: the first example prompt, 32 greedy tokens (the lab's max_tokens default).
DEFAULT_PROMPT, DEFAULT_MAX_TOKENS = next(iter(PROMPTS)), 32
# The speed comparison: the same kind of prompt, one request or a full batch of different ones.
SPEED_KINDS = {
    "반복하는 프롬프트 (목록 옮기기)": list_prompt,
    "반복 없는 프롬프트 (이야기)": story_prompt,
}
BATCHES = (1, 8)


def spec_config(k: int = 3, lookup_max: int = 3, lookup_min: int = 1) -> dict:
    """vLLM's `speculative_config` dict for n-gram (prompt lookup) drafts."""
    return {
        "method": "ngram",
        "num_speculative_tokens": int(k),
        "prompt_lookup_max": int(lookup_max),
        "prompt_lookup_min": int(min(lookup_min, lookup_max)),
    }


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Leviathan et al. (ICML'23): tokens per verifying step when each of k drafts is accepted
    independently with probability alpha, (1 - alpha^(k+1)) / (1 - alpha); k + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# -- reading a run ------------------------------------------------------------------------------


def token_text(tokenizer, token_id: int | None) -> str:
    """What one token holds, with a newline as ↵ and a space as ␣ (so a blank token shows)."""
    if token_id is None:
        return ""
    raw = show_bytes(tokenizer.token_bytes(int(token_id)))
    return raw.replace("\n", "↵").replace(" ", "␣") or "∅"


# Status codes of a draft position (the grid's colours).
REJECTED, ACCEPTED, MODEL_TOKEN = 0, 1, 2
STATUS_KO = {REJECTED: "버림", ACCEPTED: "받아들임", MODEL_TOKEN: "모델이 낸 토큰"}


def draft_table(
    records: list[StepRecord], tokenizer, request_id: str | None = None
) -> pd.DataFrame:
    """One row per (step, request) that verified drafts: the drafts as text, how many the model
    accepted, the ones it threw away, its own token (a correction after a rejection, or a bonus
    after all were accepted) and the tokens the step emitted."""
    df = spec_decode_dataframe(records)
    if request_id is not None:
        df = df[df["request_id"] == request_id]
    rows = []
    for r in df.itertuples(index=False):
        drafts = [token_text(tokenizer, t) for t in r.draft_token_ids]
        n = int(r.num_accepted_tokens)
        all_accepted = n == len(drafts)
        rows.append(
            {
                "스텝": int(r.step),
                "요청": r.request_id,
                "초안": " ".join(drafts),
                "초안 수": len(drafts),
                "받아들임": n,
                "받아들인 토큰": " ".join(drafts[:n]) or "—",
                "버린 토큰": " ".join(drafts[n:]) or "—",
                "모델 토큰": token_text(tokenizer, r.bonus_token_id),
                "모델 토큰 종류": "보너스" if all_accepted else "교정",
                "이 스텝 토큰": n + 1,
                "_drafts": drafts,
            }
        )
    columns = [
        "스텝",
        "요청",
        "초안",
        "초안 수",
        "받아들임",
        "받아들인 토큰",
        "버린 토큰",
        "모델 토큰",
        "모델 토큰 종류",
        "이 스텝 토큰",
        "_drafts",
    ]
    return pd.DataFrame(rows, columns=columns)


def draft_grid_figure(table: pd.DataFrame, k: int, max_rows: int = 16) -> go.Figure:
    """The last `max_rows` verifying steps as a grid: one row per step, draft positions 1..k
    (green accepted, red thrown away) and the model's own token (blue), each cell with its text."""
    table = table.tail(max_rows)
    columns = [f"초안 {i + 1}" for i in range(k)] + ["모델 토큰"]
    z, text, hover = [], [], []
    for r in table.to_dict("records"):
        drafts = list(r["_drafts"])
        n = int(r["받아들임"])
        zrow = [ACCEPTED if i < n else REJECTED for i in range(len(drafts))]
        zrow += [np.nan] * (k - len(drafts)) + [MODEL_TOKEN]
        trow = drafts + [""] * (k - len(drafts)) + [r["모델 토큰"]]
        z.append(zrow)
        text.append(trow)
        hover.append(
            [
                f"스텝 {r['스텝']} · {c}: {t or '—'} · "
                + ("초안 없음" if math.isnan(v) else STATUS_KO[int(v)])
                + (f" ({r['모델 토큰 종류']})" if v == MODEL_TOKEN else "")
                for c, t, v in zip(columns, trow, zrow)
            ]
        )
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=columns,
            y=[f"스텝 {s} · {req}" for s, req in zip(table["스텝"], table["요청"])],
            text=text,
            texttemplate="%{text}",
            customdata=hover,
            hovertemplate="%{customdata}<extra></extra>",
            zmin=-0.5,
            zmax=2.5,
            colorscale=[
                [0.0, "#f4a6a6"],
                [1 / 3, "#f4a6a6"],
                [1 / 3, "#9fd8a4"],
                [2 / 3, "#9fd8a4"],
                [2 / 3, "#a8c8f0"],
                [1.0, "#a8c8f0"],
            ],
            showscale=False,
            xgap=3,
            ygap=3,
        )
    )
    fig.update_layout(
        title="스텝마다의 초안: 초록 = 받아들임, 빨강 = 버림, 파랑 = 모델이 낸 토큰",
        height=max(220, 60 + 30 * len(table)),
        margin=dict(l=10, r=10, t=40, b=10),
        yaxis=dict(autorange="reversed"),
    )
    return fig


@dataclass
class SpecStats:
    """Counts read from a run's records (measured) and the formula at the measured alpha.

    Three rates that are easy to mix up, each with its own definition:
    - `acceptance_rate` (vLLM's "draft acceptance rate"): accepted drafts / proposed drafts;
    - `mean_acceptance_length` (vLLM's): 1 + accepted drafts per verifying step, the tokens a
      verifying step emits (the model's own token included);
    - `alpha` (Leviathan et al.'s alpha): the chance that a draft position is accepted given that
      the ones before it were, estimated from the positions the verifier actually reached:
      accepted / (accepted + verifying steps that rejected one). This is the alpha that
      (1 - alpha^(k+1)) / (1 - alpha) takes; the acceptance rate also counts the drafts behind a
      rejection, which the verifier never judged, and so reads lower.
    """

    k: int
    verify_steps: int  # (step, request) pairs that verified drafts
    proposed: int
    accepted: int
    decode_steps: int  # (step, request) decode pairs, with or without drafts
    decode_tokens: int  # tokens those decode pairs emitted
    rejected_steps: int = 0  # verifying steps that rejected a draft (not all accepted)
    draft_counts: list[int] = field(default_factory=list)  # drafts of each verifying step
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i
    reached_per_pos: list[int] = field(default_factory=list)  # judged at i (all before accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def alpha(self) -> float | None:
        judged = self.accepted + self.rejected_steps
        return self.accepted / judged if judged else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_verify_step(self) -> float | None:
        return self.mean_acceptance_length

    @property
    def tokens_per_decode_step(self) -> float | None:
        return self.decode_tokens / self.decode_steps if self.decode_steps else None

    @property
    def mean_drafts(self) -> float | None:
        return self.proposed / self.verify_steps if self.verify_steps else None

    @property
    def conditional_rate_per_pos(self) -> list[float | None]:
        """Per draft position: accepted there / judged there (all before it accepted)."""
        return [a / r if r else None for a, r in zip(self.accepted_per_pos, self.reached_per_pos)]

    @property
    def formula(self) -> float | None:
        """The formula at the measured alpha, averaged over the verifying steps with each step's
        own number of drafts (n-gram drafts can be fewer than k); k for every step gives
        `formula_at_k`."""
        a = self.alpha
        if a is None or not self.draft_counts:
            return None
        return sum(expected_tokens_per_step(a, n) for n in self.draft_counts) / len(
            self.draft_counts
        )

    @property
    def formula_at_k(self) -> float | None:
        a = self.alpha
        return None if a is None else expected_tokens_per_step(a, self.k)


def spec_stats(records: list[StepRecord], k: int, request_id: str | None = None) -> SpecStats:
    stats = SpecStats(k, 0, 0, 0, 0, 0, 0, [], [0] * k, [0] * k)
    for rec in records:
        for s in rec.scheduled:
            if s.phase != "decode" or (request_id is not None and s.request_id != request_id):
                continue
            stats.decode_steps += 1
            stats.decode_tokens += len(rec.new_tokens.get(s.request_id, []))
            if s.draft_token_ids:
                _count_verify_step(stats, len(s.draft_token_ids), s.num_accepted_tokens)
    return stats


def _count_verify_step(stats: SpecStats, drafts: int, accepted: int) -> None:
    """One verifying step: positions 0..accepted-1 accepted, position `accepted` (if a draft was
    there) judged and rejected, the ones behind it never judged."""
    stats.verify_steps += 1
    stats.proposed += drafts
    stats.accepted += accepted
    stats.rejected_steps += accepted < drafts
    stats.draft_counts.append(drafts)
    grow = drafts - len(stats.accepted_per_pos)
    if grow > 0:  # a run stepped with a larger k than the one asked about
        stats.accepted_per_pos += [0] * grow
        stats.reached_per_pos += [0] * grow
    for i in range(min(accepted + 1, drafts)):
        stats.reached_per_pos[i] += 1
        stats.accepted_per_pos[i] += i < accepted


def formula_figure(k: int, measured: SpecStats | None = None) -> go.Figure:
    """Tokens per verifying step against Leviathan et al.'s alpha: the formula's curve for k (and
    k ± 1 for shape), the measured mean acceptance length at the measured alpha."""
    alphas = np.linspace(0, 0.999, 101)
    fig = go.Figure()
    for kk in sorted({max(1, k - 1), k, k + 1}):
        fig.add_trace(
            go.Scatter(
                x=alphas,
                y=[expected_tokens_per_step(a, kk) for a in alphas],
                mode="lines",
                name=f"공식 k={kk} (계산값)",
                line=dict(width=3 if kk == k else 1, dash="solid" if kk == k else "dot"),
            )
        )
    if measured is not None and measured.alpha is not None:
        fig.add_trace(
            go.Scatter(
                x=[measured.alpha],
                y=[measured.tokens_per_verify_step],
                mode="markers",
                marker=dict(size=14, symbol="diamond", color="#d62728"),
                name="측정: 검증 스텝당 토큰 (측정값)",
            )
        )
    fig.update_layout(
        title=f"한 검증 스텝에 나오는 토큰 수: (1 − α^(k+1)) / (1 − α), k={k}",
        xaxis_title="α (앞 초안이 모두 맞았을 때 이 초안이 맞을 확률)",
        yaxis_title="토큰/스텝",
        height=320,
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def speedup_estimate(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected walltime improvement, (1 - alpha^(k+1)) / ((1 - alpha)(ck + 1)),
    with c the cost of one draft relative to one target forward (n-gram drafts: c ≈ 0). It
    assumes a verifying forward costs what a plain one does (memory-bound decode)."""
    return expected_tokens_per_step(alpha, k) / (c * k + 1)


def compare_outputs(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token-for-token comparison of two runs' outputs (paired in order): how many requests and
    tokens agree, and where the first difference is."""
    equal_requests = 0
    compared = 0
    first_diff = None
    for i, (x, y) in enumerate(zip(a, b)):
        n = min(len(x), len(y))
        compared += n
        same = x == y
        equal_requests += same
        if not same and first_diff is None:
            pos = next((j for j in range(n) if x[j] != y[j]), n)
            first_diff = (i, pos)
    return {
        "requests": min(len(a), len(b)),
        "equal_requests": equal_requests,
        "tokens_compared": compared,
        "all_equal": len(a) == len(b) and equal_requests == len(a),
        "first_diff": first_diff,
    }


# -- the speed comparison ----------------------------------------------------------------------


@dataclass
class PromptRun:
    """One run of prompts to the end. Times are the engine clock (measured step durations)."""

    label: str
    config: object
    records: list[StepRecord]
    requests: list[Request]
    elapsed_s: float
    wall_s: float
    conditions: dict = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def outputs(self) -> list[list[int]]:
        return [list(r.output_token_ids) for r in self.requests]


def blocks_needed(prompt_lens: list[int], max_tokens: int, k: int, block_size: int) -> int:
    """KV blocks for every request at once: prompt + output + the drafts of its last step."""
    return sum(math.ceil((p + max_tokens + k + 1) / block_size) for p in prompt_lens) + 1


def run_prompts(
    config: ConfigLike | None,
    prompts: list[str],
    max_tokens: int,
    label: str = "",
    engine_factory: Callable | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    max_steps: int = 2000,
    ignore_eos: bool = True,
) -> PromptRun:
    """Build an engine, add every prompt at once (chat template, greedy; with ignore_eos each
    request makes exactly max_tokens, without it a request may stop early as in the lab), step
    to the end."""
    from ui.experiments.common import measurement_conditions

    config = make_config(config)
    engine: EngineCore = (engine_factory or EngineCore)(config)
    params = SamplingParams(max_tokens=int(max_tokens), temperature=0.0, ignore_eos=ignore_eos)
    requests = []
    for i, prompt in enumerate(prompts):
        text = prompt
        if engine.tokenizer.chat_template:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        requests.append(engine.add_request(text, params, request_id=f"r{i}"))
    start = engine.clock.now()
    wall = time.perf_counter()
    records = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        record = engine.step()
        records.append(record)
        if on_step is not None:
            on_step(record)
    cond = measurement_conditions(engine, 배치=len(prompts), 출력=f"{max_tokens}토큰 (greedy)")
    return PromptRun(
        label,
        config,
        records,
        requests,
        engine.clock.now() - start,
        time.perf_counter() - wall,
        cond,
    )


def speed_prompts(kind: str, batch: int) -> list[str]:
    make = SPEED_KINDS[kind]
    return [make(i) for i in range(batch)]


def speed_steps(batches, max_tokens: int) -> int:
    """About how many steps the comparison takes (for its progress bar)."""
    return sum(2 * (max_tokens + 2) for _ in batches)


def measure_speedup(
    config: ConfigLike | None,
    spec: dict,
    kind: str,
    max_tokens: int = 24,
    batches=BATCHES,
    engine_factory: Callable | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> dict[tuple[int, bool], PromptRun]:
    """The same requests with and without speculation, at each batch size: {(batch, on): run}."""
    base = make_config(config)
    runs = {}
    for batch in batches:
        prompts = speed_prompts(kind, batch)
        for on in (False, True):
            cfg = make_config(
                base,
                speculative_config=spec if on else None,
                max_num_seqs=max(batch, base.max_num_seqs),
            )
            runs[(batch, on)] = run_prompts(
                cfg,
                prompts,
                max_tokens,
                "추측 디코딩 켬" if on else "추측 디코딩 끔",
                engine_factory=engine_factory,
                on_step=on_step,
            )
    return runs


def decode_seconds(records: list[StepRecord]) -> float:
    """Engine seconds of the steps that only decoded (the prompts' prefill left out: it is the
    same work with and without drafts)."""
    return sum(
        r.engine_duration
        for r in records
        if r.scheduled and all(s.phase == "decode" for s in r.scheduled)
    )


def speed_table(runs: dict[tuple[int, bool], PromptRun], k: int) -> pd.DataFrame:
    """One row per (batch, on/off): steps, tokens, engine time (all, and decode steps only),
    tokens/s, the acceptance rate and alpha; on the 'on' row the speedups (time off / time on,
    all and decode only) and whether the outputs were identical."""
    rows = []
    for (batch, on), run in sorted(runs.items(), key=lambda kv: kv[0]):
        stats = spec_stats(run.records, k)
        off = runs.get((batch, False))
        row = {
            "배치 (요청 수)": batch,
            "방식": run.label,
            "스텝 수": len(run.records),
            "출력 토큰": run.output_tokens,
            "시간 (s, 엔진 시계)": round(run.elapsed_s, 3),
            "처리량 (토큰/s)": round(run.output_tokens / run.elapsed_s, 1)
            if run.elapsed_s
            else None,
            "평균 스텝 시간 (ms)": round(1000 * run.elapsed_s / len(run.records), 1)
            if run.records
            else None,
            "decode 시간 (s)": round(decode_seconds(run.records), 3),
            "수락률 (받아들인 초안 ÷ 초안)": None
            if stats.acceptance_rate is None
            else round(stats.acceptance_rate, 2),
            "α (앞이 맞았을 때 맞을 확률)": None if stats.alpha is None else round(stats.alpha, 2),
            "속도 향상 (끔 시간 / 켬 시간)": None,
            "decode만 속도 향상": None,
            "출력 같음": None,
        }
        if on and off is not None and run.elapsed_s > 0:
            row["속도 향상 (끔 시간 / 켬 시간)"] = round(off.elapsed_s / run.elapsed_s, 2)
            decode_on = decode_seconds(run.records)
            if decode_on > 0:
                row["decode만 속도 향상"] = round(decode_seconds(off.records) / decode_on, 2)
            row["출력 같음"] = compare_outputs(off.outputs, run.outputs)["all_equal"]
        rows.append(row)
    return pd.DataFrame(rows)


def fmt_value(value) -> str:
    """A table cell for display: "—" for missing, 예/아니오 for booleans, numbers as written."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return "예" if value else "아니오"
    return str(value)


def display_table(df: pd.DataFrame) -> pd.DataFrame:
    """Every cell as text (Arrow-safe: no column mixes numbers and "—")."""
    return df.apply(lambda col: col.map(fmt_value))


def speed_figure(table: pd.DataFrame) -> go.Figure:
    """Engine time of each batch size, off and on side by side (lower is faster)."""
    fig = go.Figure()
    for label, color in (("추측 디코딩 끔", "#7f7f7f"), ("추측 디코딩 켬", "#2ca02c")):
        part = table[table["방식"] == label]
        fig.add_trace(
            go.Bar(
                x=[f"배치 {b}" for b in part["배치 (요청 수)"]],
                y=part["시간 (s, 엔진 시계)"],
                name=label,
                marker_color=color,
                text=part["평균 스텝 시간 (ms)"].map(lambda v: f"스텝 {v} ms"),
                textposition="outside",
            )
        )
    fig.update_layout(
        barmode="group",
        title="같은 요청을 끝내는 데 걸린 시간 (낮을수록 빠름, 측정값)",
        yaxis_title="s (엔진 시계)",
        height=340,
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig
