"""What the app draws: a StepRecord per engine step (plain data; ui/trace_frames.py turns records
and journeys into DataFrames)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.kv_cache import KVSnapshot
from engine.kv_connector import KVTransferRecord

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "output_processing")


@dataclass
class MaskReport:
    """One sampled row before and after its grammar mask (asked for with
    SamplingParams.report_top_tokens): the most likely tokens as (token id, probability) under the
    model's distribution (softmax of the logits), then under the masked one (renormalized over the
    allowed tokens), and the probability the mask took away: 1 − the allowed tokens' sum. A row
    without a mask reports the same list twice and 0 removed."""

    top_before: list[tuple[int, float]]
    top_after: list[tuple[int, float]]
    removed_mass: float
    num_allowed: int


@dataclass
class ScheduledRecord:
    request_id: str
    phase: str  # prefill / chunked_prefill / decode
    num_tokens: int
    num_computed_tokens: int  # before the step
    num_prompt_tokens: int
    num_prefix_hit_tokens: int = 0  # admitted this step with this many tokens already cached
    num_recomputed_tokens: int = 0  # of num_tokens, computed before and lost to a preemption
    # Speculative decoding (a decode that verified drafts; num_tokens = 1 + len(draft_token_ids)):
    draft_token_ids: list[int] = field(default_factory=list)  # proposed
    num_accepted_tokens: int = 0  # the drafts the model agreed with (a prefix of them)
    bonus_token_id: int | None = None  # the model's own token after them (correction or bonus)
    num_external_tokens: int = 0  # admitted with this many tokens loaded by the KV connector
    num_allowed_tokens: int | None = None  # structured outputs: tokens its grammar mask allowed
    mask_report: MaskReport | None = None  # if its SamplingParams.report_top_tokens asked

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)


@dataclass
class StepRecord:
    step: int
    start_time: float  # perf_counter seconds
    timings: dict[str, float]  # seconds per phase (PHASES)
    scheduled: list[ScheduledRecord]
    unscheduled: dict[str, str]  # request_id → reason
    preempted: list[str]
    token_budget: int
    max_num_seqs: int
    num_running: int
    num_waiting: int
    new_tokens: dict[str, list[int]]
    finished: dict[str, str]  # request_id → finish reason
    kv: KVSnapshot
    # RequestOutput per request that advanced
    outputs: list = field(default_factory=list, repr=False)
    engine_start_time: float = (
        0.0  # on the engine clock (engine/clock.py): seconds since it started
    )
    engine_duration: float = (
        0.0  # engine seconds this step took (measured, or computed by a simulator)
    )
    num_swapped_out_blocks: int = (
        0  # swap preemption: blocks copied to host memory before the forward
    )
    num_swapped_in_blocks: int = 0  # and copied back for resumed requests
    swap_seconds: float = 0.0  # measured time of those copies
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache in this step (admissions)
    prefix_cache_hits: int = 0  # of those, found
    # Multi-process executor (tensor / pipeline parallel): per worker rank, measured in the step:
    # rank, tp_rank, pp_rank, step_s, compute_s, comm_s, all_reduce_count, all_reduce_bytes,
    # p2p_bytes, control_bytes, round_trip_s. Empty with the in-process executor.
    workers: list[dict] = field(default_factory=list)
    # KV connector (engine/kv_connector.py): each copy of the step, measured: loads into the
    # device cache, saves out after the forward, stores of evicted blocks to the host tier
    kv_transfers: list[KVTransferRecord] = field(default_factory=list)

    def kv_transfer_totals(self, direction: str) -> tuple[int, int, float]:
        """(blocks, bytes, measured seconds) of the step's KV copies in one direction."""
        records = [r for r in self.kv_transfers if r.direction == direction and r.ok]
        return (
            sum(r.num_blocks for r in records),
            sum(r.num_bytes for r in records),
            sum(r.seconds for r in records),
        )

    # Structured outputs: measured seconds to compute this step's grammar masks (inside the
    # "schedule" timing), and how many requests sampled under a mask.
    grammar_mask_seconds: float = 0.0
    num_masked_requests: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries
            if self.prefix_cache_queries
            else None
        )

    @property
    def num_recomputed_tokens(self) -> int:
        return sum(s.num_recomputed_tokens for s in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def duration(self) -> float:
        """Wall seconds of the step's timed phases."""
        return sum(self.timings.values())


def record_to_dict(record: StepRecord) -> dict:
    """Plain data (JSON-friendly) of a step, without the text outputs."""
    data = asdict(record)
    data.pop("outputs", None)
    data["kv"]["blocks"] = [asdict(b) for b in record.kv.blocks]  # built on demand, so not a field
    return data
