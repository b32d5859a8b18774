"""Chapter 06 · 블록 단위 KV 관리: a contiguous reservation replayed on a paged run."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from engine.core import EngineCore
from engine.trace import StepRecord
from ui.experiments.ch00 import chat_prompt_ids
from ui.experiments.common import RequestSpec, RunResult, Workload, _r

# The comparison's defaults (the page's sliders start here; the claim test runs them).
DEFAULT_NUM_REQUESTS = 6
DEFAULT_MAX_OUT = 32
DEFAULT_MAX_LEN = 256
MIN_BLOCKS = 48  # the comparison's KV pool, at least (and at least one max-length request)


LIVE_PROMPTS = [
    ("What is the capital of France?", 40, 0.0),
    ("What is the capital of France?", 24, 1.0),  # the same prompt, one step later
    ("Write a Python function that returns the n-th Fibonacci number.", 32, 1.0),
]


def live_workload(engine: EngineCore) -> Workload:
    """The step-by-step lab's requests (the lab's presets, chat template applied, ignore_eos so
    each grows past its prefill blocks): the second repeats the first prompt a moment later, so
    with prefix caching on its table lists the first one's full prompt blocks (shared)."""
    specs = []
    for prompt, max_tokens, arrival_ms in LIVE_PROMPTS:
        ids = chat_prompt_ids(engine, prompt)
        specs.append(RequestSpec(len(ids), max_tokens, arrival_ms, prompt_token_ids=ids))
    return Workload(specs)


def paged_workload(num_requests: int, max_out: int) -> Workload:
    """Up to eight requests of mixed prompt (20–60 tokens) and output lengths (a fraction of
    `max_out`), four at once and the rest 150 ms apart on the engine clock."""
    prompts = [20, 44, 28, 60, 36, 24, 52, 32]
    outs = [max(4, int(max_out * f)) for f in (0.3, 1.0, 0.5, 0.7, 0.2, 0.9, 0.4, 0.6)]
    arrivals = [0, 0, 0, 0, 150, 300, 450, 600]
    return Workload([RequestSpec(prompts[i], outs[i], arrivals[i]) for i in range(num_requests)])


@dataclass
class FragmentationResult:
    per_step: pd.DataFrame  # one row per step, slots (token positions) for both schemes
    summary: pd.DataFrame  # one row per scheme
    reservation: str  # "max_model_len" or "prompt+max_tokens"
    pool_slots: int
    contiguous_rejected: list[str]  # requests that found no contiguous region at admission
    contiguous_capacity: int  # requests of the largest reservation the pool could hold at once
    paged_max_concurrent: int  # measured: most requests holding blocks at once
    largest_reservation: int = 0  # R_max (slots)


def _first_fit(free: list[tuple[int, int]], size: int) -> int | None:
    for i, (start, length) in enumerate(free):
        if length >= size:
            free[i] = (start + size, length - size)
            if free[i][1] == 0:
                free.pop(i)
            return start
    return None


def _release(free: list[tuple[int, int]], start: int, size: int) -> None:
    free.append((start, size))
    free.sort()
    merged: list[tuple[int, int]] = []
    for s, n in free:
        if merged and merged[-1][0] + merged[-1][1] == s:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((s, n))
    free[:] = merged


def fragmentation(result: RunResult, reservation: str = "max_model_len") -> FragmentationResult:
    """Compare the paged engine's measured blocks with a contiguous reservation replayed on the
    same run.

    Per step, for the requests holding KV after the step (the engine's block tables):
      used (measured)        = tokens whose K/V are in the cache (num_computed + scheduled this
                               step)
      paged reserved (meas.) = blocks in the request's block table × block_size
      contiguous reserved    = R per request from admission to finish, R = max_model_len or
                               prompt + max_tokens (계산값)
      internal fragmentation = reserved − used
      unusable (contiguous)  = free slots in holes smaller than R_max, on a pool of the same size
                               (first-fit replay of the same admissions and finishes); paged: 0,
                               since any free block serves any request.
    """
    bs = result.block_size
    pool = result.num_blocks * bs
    by_id = {r.request_id: r for r in result.requests}
    spec_of = {r.request_id: s for r, s in zip(result.requests, result.specs)}

    def reserve_of(rid: str) -> int:
        if reservation == "max_model_len":
            return result.max_model_len
        req = by_id[rid]
        return req.num_prompt_tokens + spec_of[rid].max_tokens

    r_max = max((reserve_of(rid) for rid in by_id), default=1)
    tokens_in_cache: dict[str, int] = {}
    free = [(0, pool)]
    placed: dict[str, int] = {}
    rejected: list[str] = []
    rows = []
    paged_max = 0
    for rec in result.records:
        for s in rec.scheduled:
            tokens_in_cache[s.request_id] = s.num_computed_tokens + s.num_tokens
        live = rec.kv.block_tables
        # contiguous replay: admit newcomers (first-fit), release the finished
        for rid in live:
            if rid not in placed and rid not in rejected:
                start = _first_fit(free, reserve_of(rid))
                if start is None:
                    rejected.append(rid)
                else:
                    placed[rid] = start
        for rid in list(placed):
            if rid not in live:
                _release(free, placed.pop(rid), reserve_of(rid))
        used = sum(tokens_in_cache.get(rid, 0) for rid in live)
        used_contig = sum(tokens_in_cache.get(rid, 0) for rid in live if rid in placed)
        paged_reserved = sum(len(blocks) * bs for blocks in live.values())
        contig_reserved = sum(reserve_of(rid) for rid in placed)
        contig_free = pool - contig_reserved
        contig_unusable = sum(n for _, n in free if n < r_max)
        paged_max = max(paged_max, len(live))
        rows.append(
            {
                "step": rec.step,
                "live_requests": len(live),
                "used_slots": used,
                "paged_reserved": paged_reserved,
                "paged_internal_frag": paged_reserved - used,
                "paged_free": pool - paged_reserved,
                "paged_unusable": 0,
                "contiguous_requests": len(placed),
                "contiguous_used": used_contig,
                "contiguous_reserved": contig_reserved,
                "contiguous_internal_frag": contig_reserved - used_contig,
                "contiguous_free": contig_free,
                "contiguous_unusable": contig_unusable,
            }
        )
    per_step = pd.DataFrame(rows)

    summary = fragmentation_summary(per_step, reservation, bs, paged_max)
    return FragmentationResult(
        per_step, summary, reservation, pool, rejected, pool // max(r_max, 1), paged_max, r_max
    )


def fragmentation_summary(
    per_step: pd.DataFrame, reservation: str, block_size: int, paged_max: int
) -> pd.DataFrame:
    """One row per scheme: step means of reserved, used, internal fragmentation and unusable
    slots, utilization (used / reserved over the run) and the most requests held at once."""

    def summarise(
        name: str, prefix: str, used_col: str, unusable_col: str, concurrent: int
    ) -> dict:
        reserved = per_step[f"{prefix}_reserved"].sum()
        used = per_step[used_col].sum()
        return {
            "방식": name,
            "평균 예약량 (칸)": _r(per_step[f"{prefix}_reserved"].mean()),
            "평균 사용량 (칸)": _r(per_step[used_col].mean()),
            "평균 내부 단편화 (칸)": _r(per_step[f"{prefix}_internal_frag"].mean()),
            "평균 쓸 수 없는 메모리 (칸)": _r(per_step[unusable_col].mean()),
            "사용률 = 사용량/예약량 (%)": _r(100 * used / reserved) if reserved else None,
            "최대 동시 요청": concurrent,
        }

    return pd.DataFrame(
        [
            summarise(
                f"연속 예약 (R = {reservation})",
                "contiguous",
                "contiguous_used",
                "contiguous_unusable",
                int(per_step["contiguous_requests"].max()) if len(per_step) else 0,
            ),
            summarise(
                f"블록 방식 (블록 {block_size} 토큰)",
                "paged",
                "used_slots",
                "paged_unusable",
                paged_max,
            ),
        ]
    )


def shared_blocks(record: StepRecord) -> dict[int, list[str]]:
    """Physical blocks listed in more than one request's block table (prefix-cache sharing:
    identical full prompt blocks are stored once), each with the requests that list it."""
    owners: dict[int, list[str]] = {}
    for rid, blocks in record.kv.block_tables.items():
        for b in blocks:
            owners.setdefault(b, []).append(rid)
    return {b: rids for b, rids in sorted(owners.items()) if len(rids) > 1}


def block_tables_frame(record: StepRecord) -> pd.DataFrame:
    """Logical block index → physical block id per live request (from the step's KV snapshot)."""
    rows = [
        {"request_id": rid, "logical": i, "physical": b}
        for rid, blocks in record.kv.block_tables.items()
        for i, b in enumerate(blocks)
    ]
    return pd.DataFrame(rows, columns=["request_id", "logical", "physical"])
