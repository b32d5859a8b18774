"""Chapter 10 · prefix caching: shared system prompts, multi-turn chat, the hash chain of one
request, LRU eviction in a small cache and cache_salt isolation (no Streamlit here).

Every number these functions return is read from the engine: hit tokens from the scheduler's
records (ScheduledRecord.num_prefix_hit_tokens, StepRecord.prefix_cache_queries / hits), reference
counts from KV snapshots, TTFT from RequestMetrics on the engine clock. Block hashes are recomputed
here with the engine's own functions (engine.kv_cache.chained_block_hash, first_parent_hash) to
draw the chain; the engine's cache is only read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import plotly.graph_objects as go

from engine.core import EngineCore
from engine.kv_cache import KVSnapshot, chained_block_hash, first_parent_hash
from engine.sampling_params import SamplingParams
from engine.trace import StepRecord
from ui.experiments.common import RequestSpec, RunResult, Workload, _r, prompt_ids

EngineFactory = Callable[..., EngineCore]  # make_engine(**EngineConfig overrides)

# -- the prompts -------------------------------------------------------------------------------

# English: the default 135M model answers English sensibly. The system prompt is long on purpose
# (several full blocks of 16 tokens), as real ones are.
SYSTEM_PROMPT = (
    "You are the friendly help desk assistant of Sunrise Bakery, a small neighbourhood bakery. "
    "The bakery opens at 7 am and closes at 7 pm from Monday to Saturday, and at 2 pm on Sunday. "
    "It sells sourdough bread, croissants, cinnamon rolls, gluten-free muffins and birthday "
    "cakes that must be ordered two days ahead. Payment by card or cash is welcome. "
    "Answer every customer question in one short, polite sentence."
)
QUESTIONS = [
    "What time do you open on Sunday?",
    "Do you sell gluten-free bread?",
    "Can I order a birthday cake for tomorrow?",
    "Do you take credit cards?",
    "Is there a place to park nearby?",
    "Do you have coffee?",
]
# Multi-turn chat: (user, assistant). The assistant's answers are fixed sentences standing in for
# the model's own replies, so that every turn's prompt is known before the run.
CHAT = [
    ("What time do you open on Sunday?", "We open at 7 am and close at 2 pm on Sunday."),
    ("And do you have croissants then?", "Yes, fresh croissants are ready from 7 am."),
    ("Can I order a birthday cake too?", "Of course, please order it two days ahead."),
    ("Can I pay by card?", "Yes, both card and cash are welcome."),
    ("Thank you! Anything new this week?", "Our new cinnamon rolls are very popular."),
]

SCENARIOS = {"공유 시스템 프롬프트": "shared", "멀티턴 대화": "chat"}
CACHING_MODES = {"prefix caching 켬": True, "prefix caching 끔": False}

# The lab's defaults (the page's sliders and the claim test read these).
LAB_MAX_TOKENS = 8
LAB_BUDGET = 512
LAB_MAX_MODEL_LEN = 1024
DEFAULT_REQUESTS = 4
DEFAULT_GAP_MS = {"shared": 100.0, "chat": 1500.0}


def lab_overrides(caching: bool, num_kv_blocks: int) -> dict:
    """One side of the lab: the same engine settings, prefix caching on or off. Each prompt's
    prefill fits one step (no per-request cap: long_prefill_token_threshold 0, vLLM's default),
    so a request arriving a gap later finds every whole block of the one before, as the chapter
    computes; with the engine's cap of 64 a ~110-token prompt takes two steps and a request that
    arrives between them finds only the first chunk's blocks."""
    return {
        "enable_prefix_caching": caching,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
        "max_num_batched_tokens": LAB_BUDGET,
        "max_model_len": LAB_MAX_MODEL_LEN,
        "num_kv_blocks": num_kv_blocks,
    }


def _encode(tokenizer, text: str, first: bool) -> list[int]:
    """Pieces are encoded separately and concatenated, so equal pieces give equal token ids
    whatever follows them (a BPE merge across the boundary would blur the shared prefix)."""
    return tokenizer.encode(text) if first else tokenizer.encode_plain(text)


def shared_prefix_prompts(tokenizer, num_questions: int) -> list[list[int]]:
    """One prompt per question: the same system prompt, then the question."""
    system = _encode(tokenizer, SYSTEM_PROMPT, True)
    return [
        system + _encode(tokenizer, f"\n\nQuestion: {q}\nAnswer:", False)
        for q in QUESTIONS[:num_questions]
    ]


def chat_prompts(tokenizer, num_turns: int) -> list[list[int]]:
    """Turn k's prompt = the system prompt + every earlier turn (question and answer) + the new
    question: each prompt starts with the whole previous one."""
    ids = _encode(tokenizer, SYSTEM_PROMPT, True)
    prompts = []
    for user, assistant in CHAT[:num_turns]:
        prompts.append(ids + _encode(tokenizer, f"\n\nUser: {user}\nAssistant:", False))
        ids = prompts[-1] + _encode(tokenizer, f" {assistant}", False)
    return prompts


def prefix_workload(
    tokenizer, scenario: str, num_requests: int, gap_ms: float, max_tokens: int = 8
) -> Workload:
    """The lab's workload: request i arrives at i * gap_ms on the engine clock (gap 0: all in one
    step, so none can hit what another computes in that same step)."""
    if scenario == "chat":
        prompts, prefix = chat_prompts(tokenizer, num_requests), "턴"
    else:
        prompts, prefix = shared_prefix_prompts(tokenizer, num_requests), "질문"
    return Workload(
        [
            RequestSpec(len(p), max_tokens, i * gap_ms, f"{prefix}-{i + 1}", prompt_token_ids=p)
            for i, p in enumerate(prompts)
        ]
    )


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_hit_tokens(num_tokens: int, cached_prefix: int, block_size: int) -> int:
    """계산값: the tokens a request can find in the cache when `cached_prefix` of its tokens are
    held there: whole blocks only, and never its last token (the model must run on it to give
    the first output token's logits)."""
    return min(cached_prefix, num_tokens - 1) // block_size * block_size


# -- the lab's numbers -------------------------------------------------------------------------


def hit_tokens_by_request(records: list[StepRecord]) -> dict[str, int]:
    hits: dict[str, int] = {}
    for rec in records:
        for s in rec.scheduled:
            hits[s.request_id] = hits.get(s.request_id, 0) + s.num_prefix_hit_tokens
    return hits


def hit_totals(records: list[StepRecord]) -> tuple[int, int]:
    """(prompt tokens looked up, of those found) over the run."""
    return (
        sum(r.prefix_cache_queries for r in records),
        sum(r.prefix_cache_hits for r in records),
    )


def step_hits_table(records: list[StepRecord]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "스텝": r.step,
                "조회 토큰": r.prefix_cache_queries,
                "히트 토큰": r.prefix_cache_hits,
                "히트율 (%)": None
                if r.prefix_cache_hit_rate is None
                else round(100 * r.prefix_cache_hit_rate, 1),
            }
            for r in records
        ],
        columns=["스텝", "조회 토큰", "히트 토큰", "히트율 (%)"],
    )


def num_shared_blocks(snapshot: KVSnapshot) -> int:
    return sum(1 for b in snapshot.blocks if b.ref_cnt > 1)


def most_shared_record(records: list[StepRecord]) -> StepRecord | None:
    """The step whose snapshot had the most blocks used by two or more requests (the latest of
    equals), else the last step."""
    if not records:
        return None
    best = max(range(len(records)), key=lambda i: (num_shared_blocks(records[i].kv), i))
    return records[best] if num_shared_blocks(records[best].kv) else records[-1]


def decode_steps_by_request(records: list[StepRecord]) -> dict[str, int]:
    steps: dict[str, int] = {}
    for rec in records:
        for s in rec.scheduled:
            if s.phase == "decode":
                steps[s.request_id] = steps.get(s.request_id, 0) + 1
    return steps


@dataclass
class PrefixComparison:
    runs: dict[str, RunResult]  # label → run (caching on first)
    table: pd.DataFrame  # one row per request
    hit_rate: float | None  # the on side's hits / queries over the run (measured)


def prefix_comparison(runs: dict[str, RunResult]) -> PrefixComparison:
    """Per request: prompt tokens, hit tokens and prompt tokens computed (caching on), TTFT on and
    off and their difference (engine clock), decode steps on both sides, whether the outputs are
    the same token ids."""
    on_label = next(k for k, r in runs.items() if r.config.enable_prefix_caching)
    off_label = next((k for k in runs if k != on_label), None)
    on = runs[on_label]
    off = runs.get(off_label) if off_label else None
    hits = hit_tokens_by_request(on.records)
    dec_on = decode_steps_by_request(on.records)
    dec_off = decode_steps_by_request(off.records) if off else {}
    t_on = on.request_table().set_index("request_id")
    t_off = off.request_table().set_index("request_id") if off else None
    out_off = {r.request_id: list(r.output_token_ids) for r in off.requests} if off else {}
    rows = []
    block_size = on.config.block_size
    for i, r in enumerate(on.requests):
        rid = r.request_id
        shared = max(
            (common_prefix_len(r.prompt_token_ids, e.prompt_token_ids) for e in on.requests[:i]),
            default=0,
        )
        ttft_on = t_on.loc[rid, "ttft_ms"]
        ttft_off = t_off.loc[rid, "ttft_ms"] if t_off is not None and rid in t_off.index else None
        rows.append(
            {
                "요청": rid,
                "프롬프트 토큰": r.num_prompt_tokens,
                "앞 요청과 같은 앞부분 (토큰)": shared,
                "최대 가능 히트 (계산값)": expected_hit_tokens(
                    r.num_prompt_tokens, shared, block_size
                ),
                "히트 토큰 (켬)": hits.get(rid, 0),
                "계산한 프롬프트 토큰 (켬)": r.num_prompt_tokens - hits.get(rid, 0),
                "TTFT 켬 (ms)": _r(ttft_on),
                "TTFT 끔 (ms)": _r(ttft_off),
                "TTFT 차이 (끔−켬, ms)": None
                if ttft_off is None or ttft_on is None
                else _r(ttft_off - ttft_on),
                "decode 스텝 (켬)": dec_on.get(rid, 0),
                "decode 스텝 (끔)": dec_off.get(rid) if off else None,
                "출력 토큰 같음": None
                if rid not in out_off
                else ("예" if out_off[rid] == list(r.output_token_ids) else "아니오"),
            }
        )
    queries, found = hit_totals(on.records)
    return PrefixComparison(runs, pd.DataFrame(rows), found / queries if queries else None)


# -- figures -----------------------------------------------------------------------------------

FREE_COLOR = "#eeeeee"
CACHED_COLOR = "#c7e9c0"
REF_COLORS = ["#9ecae1", "#fd8d3c", "#d94801"]  # ref_cnt 1, 2, ≥3


GRID_WIDTH_PX = 640  # the narrowest width the page gives a grid (a lab column, a laptop screen)
MIN_FONT_PX, MAX_FONT_PX = 8, 13


def cell_font_px(columns: int, longest_label: int) -> int | None:
    """A font size at which the longest label fits its cell (a glyph ≈ 0.7 × the font size wide,
    a 4 px pad), or None when even the smallest readable font would not (hover only then)."""
    if longest_label <= 0:
        return MAX_FONT_PX
    cell = GRID_WIDTH_PX / max(columns, 1) - 4
    size = int(cell / (0.7 * longest_label))
    return None if size < MIN_FONT_PX else min(size, MAX_FONT_PX)


def _grid_cell(block, labels: dict[int, str]) -> tuple[float, str, str]:
    """(colour index, cell text, state in words) of one block. The cell text is short: the
    block's label if the caller named its contents, else the ref count of a shared block only
    (a ref-1 or cached block is told by its colour and its hover)."""
    label = labels.get(block.block_id, "")
    if block.ref_cnt:
        text = label or (str(block.ref_cnt) if block.ref_cnt > 1 else "")
        return 1 + min(block.ref_cnt, 3), text, f"사용 중 · ref_cnt {block.ref_cnt}"
    if block.status == "cached":
        return 1, label, "빈 블록 (prefix 캐시 보관, ref_cnt 0)"
    return 0, "", "빈 블록"


def shared_grid_figure(
    snapshot: KVSnapshot,
    title: str = "",
    columns: int = 16,
    labels: dict[int, str] | None = None,
    height: int | None = None,
) -> go.Figure:
    """The KV blocks coloured by reference count: how many requests' block tables list each block
    (≥ 2 = one copy of K/V read by several requests). `labels` (block id → text) names what a
    block holds, e.g. "A2" for the third block of prompt A. Cell texts are short and sized to
    the cell (cell_font_px); the legend sits under the grid, clear of the cells."""
    labels = labels or {}
    n = snapshot.num_blocks
    columns = max(1, min(columns, n))
    rows = math.ceil(n / columns)
    colors = [FREE_COLOR, CACHED_COLOR, *REF_COLORS]
    k = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / k, c], [(i + 1) / k, c]]
    z = [[math.nan] * columns for _ in range(rows)]
    text = [[""] * columns for _ in range(rows)]
    hover = [[""] * columns for _ in range(rows)]
    for b in snapshot.blocks:
        r, c = divmod(b.block_id, columns)
        z[r][c], text[r][c], state = _grid_cell(b, labels)
        held = f"<br>내용: {labels[b.block_id]}" if b.block_id in labels else ""
        hover[r][c] = (
            f"블록 #{b.block_id}<br>{state}<br>소유: {', '.join(b.owners) or '없음'}{held}"
        )
    font = cell_font_px(columns, max((len(t) for row in text for t in row), default=0))
    if font is None:  # too narrow for any readable label: colours and hover only
        text = [[""] * columns for _ in range(rows)]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            customdata=hover,
            texttemplate="%{text}",
            textfont=dict(size=font or MIN_FONT_PX),
            colorscale=scale,
            zmin=-0.5,
            zmax=k - 0.5,
            showscale=False,
            xgap=2,
            ygap=2,
            hovertemplate="%{customdata}<extra></extra>",
            hoverongaps=False,
        )
    )
    _grid_legend(fig)
    fig.update_yaxes(autorange="reversed", showticklabels=False, showgrid=False, zeroline=False)
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    fig.update_layout(
        title=title
        or f"블록별 참조 수: 공유 블록 {num_shared_blocks(snapshot)}개, 캐시 보관 "
        f"{snapshot.num_cached_free}개",
        height=(height or max(160, 60 + 30 * rows)) + 50,  # + the legend's row under the grid
        margin=dict(l=10, r=10, t=40, b=50),
        legend=dict(orientation="h", yanchor="top", y=-0.04, x=0.0, font=dict(size=11)),
        plot_bgcolor="white",
    )
    return fig


def _grid_legend(fig: go.Figure) -> None:
    """One legend entry per cell colour (empty traces: the heatmap itself has no legend)."""
    legend = [
        ("빈 블록", FREE_COLOR),
        ("캐시 보관 (ref 0)", CACHED_COLOR),
        ("ref 1 (한 요청)", REF_COLORS[0]),
        ("ref 2 (공유)", REF_COLORS[1]),
        ("ref ≥3 (공유)", REF_COLORS[2]),
    ]
    for name, c in legend:
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=name,
                marker=dict(symbol="square", size=12, color=c, line=dict(color="#999", width=1)),
            )
        )


def hit_rate_figure(records: list[StepRecord], title: str = "") -> go.Figure:
    """Per step: prompt tokens looked up and found in the prefix cache (admissions only)."""
    t = step_hits_table(records)
    t = t[t["조회 토큰"] > 0]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=t["스텝"], y=t["조회 토큰"], name="조회한 프롬프트 토큰", opacity=0.5))
    fig.add_trace(
        go.Bar(
            x=t["스텝"],
            y=t["히트 토큰"],
            name="캐시에서 찾은 토큰",
            text=[f"{v:.0f}%" for v in t["히트율 (%)"]],
            textposition="outside",
        )
    )
    fig.update_layout(
        barmode="overlay",
        height=300,
        title=title or "스텝별 prefix 캐시 조회와 히트 (막대 위: 그 스텝의 히트율)",
        xaxis_title="스텝",
        xaxis=dict(type="category"),
        yaxis_title="토큰",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def ttft_figure(table: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    for col, name in (("TTFT 끔 (ms)", "prefix caching 끔"), ("TTFT 켬 (ms)", "prefix caching 켬")):
        if col in table and table[col].notna().any():
            fig.add_trace(go.Bar(x=table["요청"], y=table[col], name=name))
    fig.update_layout(
        barmode="group",
        height=300,
        title="요청별 TTFT (엔진 시계, ms)",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


# -- the hash chain of one request ---------------------------------------------------------------


@dataclass
class BlockLink:
    index: int
    start: int  # first token position
    num_tokens: int
    full: bool
    parent_hash: int | None
    block_hash: int | None  # None for a partial block: it is never cached


def block_chain(token_ids: list[int], block_size: int, salt: str | None = None) -> list[BlockLink]:
    """The chain the engine builds (KVCacheManager.cache_full_blocks): block i's hash is
    hash(block i−1's hash, block i's tokens); the first block chains on the salt's hash (None
    without a salt); a partial last block gets no hash."""
    links = []
    parent = first_parent_hash(salt)
    for i in range(math.ceil(len(token_ids) / block_size)):
        chunk = tuple(token_ids[i * block_size : (i + 1) * block_size])
        full = len(chunk) == block_size
        h = chained_block_hash(parent, chunk) if full else None
        links.append(BlockLink(i, i * block_size, len(chunk), full, parent, h))
        if h is not None:
            parent = h
    return links


def short_hash(h: int | None) -> str:
    return "—" if h is None else f"{h & 0xFFFFFFFF:08x}"


def hash_chain_figure(chains: dict[str, list[BlockLink]], block_size: int) -> go.Figure:
    """One row of boxes per prompt. A full block shows its (shortened) hash; an arrow carries the
    hash into the next block. In a row after the first, a block whose hash equals the first row's
    block at the same place is green (a hit is possible), else red; a partial block is grey."""
    fig = go.Figure()
    names = list(chains)
    ref = chains[names[0]] if names else []
    xs, ys, labels = [], [], []
    for row, name in enumerate(names):
        y = -row
        for link in chains[name]:
            x0, x1 = link.index * 1.2, link.index * 1.2 + 1.0
            if not link.full:
                color = "#dddddd"
            elif row == 0:
                color = "#9ecae1"
            else:
                same = link.index < len(ref) and ref[link.index].block_hash == link.block_hash
                color = "#a1d99b" if same else "#fc9272"
            fig.add_shape(
                type="rect",
                x0=x0,
                x1=x1,
                y0=y - 0.35,
                y1=y + 0.35,
                fillcolor=color,
                line=dict(color="#555", width=1),
                layer="below",
            )
            xs.append((x0 + x1) / 2)
            ys.append(y)
            labels.append(
                f"블록 {link.index}<br>토큰 {link.start}–{link.start + link.num_tokens - 1}"
                + (
                    f"<br>#{short_hash(link.block_hash)}"
                    if link.full
                    else f"<br>{link.num_tokens}/{block_size} 해시 없음"
                )
            )
            if link.index > 0 and link.full:
                fig.add_annotation(
                    x=x0,
                    y=y,
                    ax=x0 - 0.2,
                    ay=y,
                    xref="x",
                    yref="y",
                    axref="x",
                    ayref="y",
                    showarrow=True,
                    arrowhead=2,
                    arrowsize=1,
                    arrowwidth=1.5,
                    text="",
                )
        fig.add_annotation(
            x=-0.15, y=y, text=name, showarrow=False, xanchor="right", font=dict(size=12)
        )
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="text",
            text=labels,
            textfont=dict(size=10),
            hoverinfo="text",
            showlegend=False,
        )
    )
    width = max((len(c) for c in chains.values()), default=1)
    fig.update_xaxes(visible=False, range=[-1.8, width * 1.2])
    fig.update_yaxes(visible=False, range=[-len(names) + 0.4, 0.6])
    fig.update_layout(
        height=110 + 90 * len(names),
        title="블록별 해시 사슬 (앞 블록의 해시 + 이 블록의 토큰 → 이 블록의 해시) · 초록: 첫 줄과 "
        "같은 해시 · 빨강: 다른 해시 · 회색: 덜 찬 블록 (해시 없음)",
        margin=dict(l=10, r=10, t=40, b=10),
        plot_bgcolor="white",
    )
    return fig


# -- small sequential runs on a fresh engine ------------------------------------------------------


@dataclass
class SentRequest:
    name: str
    num_prompt_tokens: int
    hit_tokens: int  # measured: ScheduledRecord.num_prefix_hit_tokens at admission
    salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    decode_steps: int = 0
    snapshot: KVSnapshot | None = None  # after it finished


def send_and_finish(
    engine: EngineCore,
    token_ids: list[int],
    name: str,
    salt: str | None = None,
    max_tokens: int = 4,
    max_steps: int = 500,
) -> SentRequest:
    """Add one request and step the engine until it is idle; what the cache gave it."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = engine.add_request(
        None, params, request_id=name, prompt_token_ids=list(token_ids), cache_salt=salt
    )
    records = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        records.append(engine.step())
    return SentRequest(
        name,
        len(token_ids),
        hit_tokens_by_request(records).get(name, 0),
        salt,
        list(request.output_token_ids),
        decode_steps_by_request(records).get(name, 0),
        engine.kv_cache_manager.snapshot(),
    )


def seed_prompt(engine: EngineCore, length: int, variant: int = 0) -> list[int]:
    return prompt_ids(engine, length, variant)


@dataclass
class HashChainResult:
    block_size: int
    prompt_len: int
    change_pos: int
    chains: dict[str, list[BlockLink]]
    sent: list[SentRequest]  # first, the same again, the changed one
    expected: dict[str, int]  # 계산값 per request name


def hash_chain_experiment(
    make_engine: EngineFactory,
    prompt_len: int,
    change_pos: int,
    block_size: int = 16,
    progress: Callable[[], None] | None = None,
) -> HashChainResult:
    """Send a prompt, then the same prompt again, then a copy with one token changed at
    `change_pos`; measure the hit tokens of each (caching on, a fresh engine)."""
    max_len = max(256, prompt_len + 8)
    engine = make_engine(
        enable_prefix_caching=True,
        block_size=block_size,
        num_kv_blocks=2 * math.ceil(max_len / block_size),  # nothing gets evicted
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
    )
    ids = seed_prompt(engine, prompt_len)
    changed = list(ids)
    pos = min(max(change_pos, 0), prompt_len - 1)
    changed[pos] = (changed[pos] + 1) % engine.model_config.vocab_size
    names = ["처음", "같은 프롬프트 다시", f"토큰 {pos} 하나 바꿈"]
    sent = []
    for prompt, name in ((ids, names[0]), (ids, names[1]), (changed, names[2])):
        sent.append(send_and_finish(engine, prompt, name))
        if progress is not None:
            progress()
    expected = {
        names[0]: 0,
        names[1]: expected_hit_tokens(prompt_len, prompt_len, block_size),
        names[2]: expected_hit_tokens(prompt_len, pos, block_size),
    }
    chains = {names[0]: block_chain(ids, block_size), names[2]: block_chain(changed, block_size)}
    return HashChainResult(block_size, prompt_len, pos, chains, sent, expected)


@dataclass
class LruResult:
    num_blocks: int
    block_size: int
    rows: pd.DataFrame  # one row per stage
    snapshots: dict[str, KVSnapshot]  # stage → snapshot after it
    contents: dict[str, dict[int, str]]  # stage → {block id: "A0", "B3", ...} cached then
    resent_hit_tokens: int
    expected_full_hit: int  # 계산값: A's hit tokens if nothing had been evicted


LRU_A_LEN = 68  # 4 full blocks of 16 and a partial one
LRU_B_BLOCKS = 6


def lru_experiment(
    make_engine: EngineFactory,
    num_blocks: int,
    block_size: int = 16,
    max_tokens: int = 4,
    progress: Callable[[], None] | None = None,
) -> LruResult:
    """A small cache: A runs and finishes (its full blocks stay cached-free), B (another prompt)
    needs blocks and takes free ones in LRU order, evicting A's cached ones (A's last blocks
    first: a request frees its blocks tail first); then A is sent again."""
    a_len = LRU_A_LEN * block_size // 16
    b_len = LRU_B_BLOCKS * block_size - max_tokens
    engine = make_engine(
        enable_prefix_caching=True,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_model_len=num_blocks * block_size,
        max_num_batched_tokens=max(256, num_blocks * block_size),
    )
    a = seed_prompt(engine, a_len, 0)
    b = seed_prompt(engine, b_len, 3)
    rows, snaps = [], {}
    chain = [link.block_hash for link in block_chain(a, block_size) if link.full]
    chain_b = [link.block_hash for link in block_chain(b, block_size) if link.full]
    contents = {}

    def holders() -> dict[int, str]:
        """Which cached block holds which prompt's block i (read from the engine's cache)."""
        found = {}
        for name, hashes in (("A", chain), ("B", chain_b)):
            for i, h in enumerate(hashes):
                for block in engine.kv_cache_manager.block_pool.cached.get(h, ()):
                    found[block.block_id] = f"{name}{i}"
        return found

    def a_cached() -> int:
        """A's full blocks whose K/V the cache still holds (looked up by A's chained hashes)."""
        return sum(1 for h in chain if h in engine.kv_cache_manager.block_pool.cached)

    stages = [
        (a, "A", "① A 실행 → 끝남"),
        (b, "B", f"② B ({b_len}토큰, 다른 프롬프트) 실행 → 끝남"),
        (a, "A 다시", "③ A를 다시 보냄"),
    ]
    sent = []
    for ids, name, stage in stages:
        sent.append(send_and_finish(engine, ids, name, max_tokens=max_tokens))
        if progress is not None:
            progress()
        snaps[stage] = sent[-1].snapshot
        contents[stage] = holders()
        rows.append(
            {
                "단계": stage,
                "그 요청의 히트 토큰": sent[-1].hit_tokens,
                "캐시 보관 블록": sent[-1].snapshot.num_cached_free,
                "캐시에 남은 A의 꽉 찬 블록": f"{a_cached()}/{len(chain)}",
            }
        )
    return LruResult(
        num_blocks,
        block_size,
        pd.DataFrame(rows),
        snaps,
        contents,
        sent[-1].hit_tokens,
        expected_hit_tokens(a_len, a_len, block_size),
    )


SALT_SEQUENCE = [
    ("tenant-A", "처음 (tenant-A)"),
    ("tenant-B", "같은 프롬프트, 다른 salt"),
    ("tenant-A", "같은 프롬프트, 같은 salt"),
    (None, "같은 프롬프트, salt 없음"),
]


def salt_experiment(
    make_engine: EngineFactory,
    prompt_len: int = 80,
    block_size: int = 16,
    progress: Callable[[], None] | None = None,
) -> pd.DataFrame:
    """The same prompt four times on one engine with caching on: salts tenant-A, tenant-B,
    tenant-A, none. Measured hit tokens beside the 계산값 of what equal salts may share."""
    engine = make_engine(
        enable_prefix_caching=True,
        block_size=block_size,
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    ids = seed_prompt(engine, prompt_len, 1)
    rows, seen = [], set()
    for i, (salt, what) in enumerate(SALT_SEQUENCE):
        sent = send_and_finish(engine, ids, f"salt-{i + 1}", salt=salt)
        if progress is not None:
            progress()
        expected = expected_hit_tokens(prompt_len, prompt_len, block_size) if salt in seen else 0
        seen.add(salt)
        rows.append(
            {
                "순서": i + 1,
                "요청": what,
                "cache_salt": salt or "없음",
                "프롬프트 토큰": prompt_len,
                "히트 토큰 (측정값)": sent.hit_tokens,
                "같은 salt가 앞서 계산한 만큼 (계산값)": expected,
            }
        )
    return pd.DataFrame(rows)
