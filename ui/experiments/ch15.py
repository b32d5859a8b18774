"""Chapter 15 · prefill/decode disaggregation and the host KV tier (no Streamlit here).

What the chapter's lab computes: the K/V bytes a request hands from a prefill engine to a decode
engine (계산값 from the model config) and the time they would take over each link preset (계산값:
bytes ÷ one-way bandwidth + the preset's assumed latency; the bandwidth is the vendor's figure).
Measured numbers (ITL, TTFT, copy seconds, tier counters) are read from the real engines' records
by the functions below them; nothing here invents a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import plotly.graph_objects as go

from engine.tools.presets import link_preset_names, load_link_preset
from ui.experiments.ch08 import LONG_NAME, long_prompt_workload
from ui.experiments.common import (
    RunResult,
    Workload,
    WorkloadFeeder,
    prompt_ids,
    run_feeders_in_lockstep,
)

# -- bytes and links -----------------------------------------------------------------------------


@dataclass(frozen=True)
class KVBytes:
    """The K/V of `tokens` tokens of one model: what crosses the link for one request."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    tokens: int

    @property
    def per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def total(self) -> int:
        return self.per_token * self.tokens

    def formula(self) -> str:
        return (
            f"{self.num_layers}층 × 2 (K, V) × KV 헤드 {self.num_kv_heads} × head_dim "
            f"{self.head_dim} × {self.dtype_bytes} B × {self.tokens:,}토큰 = {self.total:,} B"
        )


def kv_bytes_of(model_config, dtype_bytes: int, tokens: int) -> KVBytes:
    """The bytes from a model's config (engine.model_config: a LlamaConfig)."""
    return KVBytes(
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
        int(dtype_bytes),
        int(tokens),
    )


def link_names() -> dict[str, str]:
    """Link preset key → its name (NVLink, PCIe, InfiniBand, Ethernet), fastest first."""
    presets = [load_link_preset(key) for key in link_preset_names()]
    presets.sort(key=lambda p: -p.one_way_bandwidth)
    return {p.key: p.name for p in presets}


def link_rows(num_bytes: int) -> pd.DataFrame:
    """Per link preset: its one-way bandwidth (the vendor's figure), its assumed latency and the
    time `num_bytes` would take alone on it (계산값)."""
    rows = []
    for key in link_names():
        link = load_link_preset(key)
        rows.append(
            {
                "링크": link.name,
                "한 방향 대역폭 (GB/s)": round(link.one_way_bandwidth / 1e9, 3),
                "가정한 지연 (µs)": round(1e6 * link.latency_s),
                "예상 전송 시간 (ms, 계산값)": round(1e3 * link.transfer_seconds(num_bytes), 3),
            }
        )
    return pd.DataFrame(rows)


def link_time(key: str, num_bytes: int) -> tuple[float, str, str]:
    """(seconds over the link, the link's figure as its vendor prints it, the source)."""
    link = load_link_preset(key)
    return link.transfer_seconds(num_bytes), link.reported, link.source


# -- the host tier: device hit, tier hit, miss --------------------------------------------------

TIER_CASES = ("장치에서 찾음", "계층에서 찾음", "못 찾음")
TIER_PREFIX_BLOCKS = 6  # the shared system prompt: six full blocks
TIER_QUESTION = 5  # tokens after it (each request's own question)
TIER_MAX_TOKENS = 4


@dataclass
class TierCase:
    """What the request that came back (the shared prefix with a new question) got."""

    case: str
    ttft_s: float  # engine clock: arrival → first token (measured)
    steps_to_first_token: int
    device_hit_tokens: int  # found in the device prefix cache
    tier_hit_tokens: int  # loaded from the host tier (ScheduledRecord.num_external_tokens)
    computed_prompt_tokens: int
    load_bytes: int
    load_seconds: float  # measured copies host tier → device
    tier_stats: dict  # the connector's counters after the run ({} without a tier)
    output_token_ids: list[int]
    ttft_runs_s: list[float] = field(default_factory=list)  # every repeat's TTFT


def _send(engine, token_ids: list[int], name: str) -> tuple[object, list]:
    """Add one request and step the engine until it is idle: (request, the steps' records)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=TIER_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = engine.add_request(None, params, request_id=name, prompt_token_ids=list(token_ids))
    records = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        records.append(engine.step())
    return request, records


def _case_of(case: str, engine, request, records: list) -> TierCase:
    from engine.request import RequestMetrics

    rid = request.request_id
    mine = [(rec, s) for rec in records for s in rec.scheduled if s.request_id == rid]
    first = next(
        i
        for i, (_, s) in enumerate(mine)
        if s.num_computed_tokens + s.num_tokens >= s.num_prompt_tokens
    )
    loads = [t for rec in records for t in rec.kv_transfers if t.direction == "load" and t.ok]
    connector = engine.scheduler.kv_connector
    return TierCase(
        case,
        RequestMetrics.from_request(request, clock="engine").ttft,
        first + 1,
        sum(s.num_prefix_hit_tokens for _, s in mine),
        sum(s.num_external_tokens for _, s in mine),
        sum(s.num_tokens for _, s in mine if s.phase != "decode"),
        sum(t.num_bytes for t in loads if t.request_id == rid),
        sum(t.seconds for t in loads if t.request_id == rid),
        dict(getattr(connector, "stats", {})) if connector is not None else {},
        list(request.output_token_ids),
    )


TIER_BLOCKS = 10  # the device cache: B's prompt takes all of it, evicting A's cached prefix
TIER_BUDGET = 32  # tokens per step: a prefill computed from scratch takes several steps


def tier_engine_overrides(block_size: int, tier_blocks: int, bytes_per_token: int) -> dict:
    """A small device cache (TIER_BLOCKS blocks) and, with tier_blocks > 0, a host tier of that
    many blocks (OffloadingConnector, kv_both)."""
    from engine.kv_connector import KVTransferConfig

    overrides = dict(
        enable_prefix_caching=True,
        block_size=block_size,
        num_kv_blocks=TIER_BLOCKS,
        max_model_len=TIER_BLOCKS * block_size,
        max_num_batched_tokens=TIER_BUDGET,
        kv_transfer_config=None,
    )
    if tier_blocks > 0:
        overrides["kv_transfer_config"] = KVTransferConfig(
            "OffloadingConnector",
            "kv_both",
            offload_bytes=tier_blocks * block_size * bytes_per_token,
        )
    return overrides


def tier_prompts(engine, block_size: int) -> dict[str, list[int]]:
    """A: the shared prefix + question 1; B: another prompt that fills the device cache;
    A2: the shared prefix + question 2 (the request that comes back)."""
    prefix = prompt_ids(engine, TIER_PREFIX_BLOCKS * block_size, 0)
    q1, q2 = prompt_ids(engine, TIER_QUESTION, 5), prompt_ids(engine, TIER_QUESTION, 9)
    b_len = TIER_BLOCKS * block_size - TIER_MAX_TOKENS - 2
    return {"A": prefix + q1, "B": prompt_ids(engine, b_len, 3), "A2": prefix + q2}


TIER_REPEATS = 3  # each case this many times, interleaved; the median TTFT is shown


def tier_experiment(
    make_engine,
    block_size: int,
    bytes_per_token: int,
    tier_blocks: int = 32,
    repeats: int = TIER_REPEATS,
    progress=None,
) -> list[TierCase]:
    """The same request (shared prefix + a new question) in three situations, each on a fresh
    engine: its prefix still in the device cache (A, then A2), evicted to the host tier (A, B
    that fills the cache, then A2; tier on), evicted with no tier (the same, tier off). The three
    run in turn `repeats` times, each turn starting with the next case (a busy machine slows them
    alike, and no case always runs first); each case keeps the run with the median TTFT, and
    every run's TTFT."""
    plans = [
        (TIER_CASES[0], tier_blocks, ("A", "A2")),
        (TIER_CASES[1], tier_blocks, ("A", "B", "A2")),
        (TIER_CASES[2], 0, ("A", "B", "A2")),
    ]
    runs: dict[str, list[TierCase]] = {case: [] for case, _, _ in plans}
    for turn in range(max(1, repeats)):
        for case, blocks, order in plans[turn % 3 :] + plans[: turn % 3]:  # none always first
            engine = make_engine(**tier_engine_overrides(block_size, blocks, bytes_per_token))
            prompts = tier_prompts(engine, block_size)
            for name in order:
                request, records = _send(engine, prompts[name], name)
            runs[case].append(_case_of(case, engine, request, records))
            if progress is not None:
                progress()
    return [_median_run(found) for found in runs.values()]


def _median_run(found: list[TierCase]) -> TierCase:
    ordered = sorted(found, key=lambda c: c.ttft_s)
    middle = ordered[len(ordered) // 2]
    middle.ttft_runs_s = [c.ttft_s for c in found]
    return middle


def tier_table(cases: list[TierCase]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "경우": c.case,
                "TTFT 중앙값 (ms, 엔진 시계)": round(1e3 * c.ttft_s, 2),
                "반복한 TTFT (ms)": ", ".join(f"{1e3 * t:.1f}" for t in c.ttft_runs_s),
                "첫 토큰까지 스텝": c.steps_to_first_token,
                "장치에서 찾은 토큰": c.device_hit_tokens,
                "계층에서 불러온 토큰": c.tier_hit_tokens,
                "계산한 프롬프트 토큰": c.computed_prompt_tokens,
                "불러온 바이트": c.load_bytes,
                "불러오기 시간 (ms)": round(1e3 * c.load_seconds, 3),
            }
            for c in cases
        ]
    )


# -- colocated vs split, in lockstep --------------------------------------------------------------

LAB_LONG_LEN = 420  # the long prompt that arrives while the short requests decode (ch08's)
LAB_MAX_MODEL_LEN = 1024
SIDE_LABELS = {
    "colocated": "함께 배치",
    "prefill": "분리: prefill 엔진",
    "decode": "분리: decode 엔진",
}


LONG_ARRIVAL_STEP = 6  # the long prompt arrives before each engine's 6th step


def lab_workload(long_len: int = LAB_LONG_LEN) -> Workload:
    """Three short requests decode 40 tokens each; the long prompt arrives while they do, before
    each engine's LONG_ARRIVAL_STEP-th step (chapter 08's workload, its arrival counted in steps:
    StepArrivalFeeder)."""
    return long_prompt_workload(long_prompt_len=long_len)


def step_due(clock, busy: bool, steps_done: int, arrival_step: int | None) -> float | None:
    """When a request that arrives before step `arrival_step` is due on an engine's clock: now
    once `steps_done` steps ran (or the engine is idle), else never yet (inf); None for a request
    whose arrival is in milliseconds. Counting steps keeps the overlap the lab is about (a long
    prefill among running decodes) on every machine: on the tiny model a step takes 0.5 ms and
    a 250 ms arrival came after the short requests had finished."""
    if arrival_step is None:
        return None
    if steps_done >= arrival_step - 1 or not busy:
        return clock.now()
    return float("inf")


class StepArrivalFeeder(WorkloadFeeder):
    """The colocated side: WorkloadFeeder with the long prompt's arrival counted in steps."""

    def _due(self, i: int) -> float:
        arrival_step = LONG_ARRIVAL_STEP if self.names[i] == LONG_NAME else None
        engine = self.engine
        due = step_due(
            engine.clock, engine.has_unfinished_requests(), engine.scheduler.step_index,
            arrival_step,
        )  # fmt: skip
        return super()._due(i) if due is None else due


def lab_overrides() -> dict:
    """Every engine of the lab: one step takes a whole prompt (no chunking), so a long prefill
    lands in one step with whatever else runs."""
    return dict(
        max_model_len=LAB_MAX_MODEL_LEN,
        max_num_batched_tokens=LAB_MAX_MODEL_LEN,
        long_prefill_token_threshold=0,
        max_num_seqs=8,
    )


def pair_overrides(channel: str) -> tuple[dict, dict]:
    """The prefill and the decode engine's overrides: the lab's, plus an InProcessConnector on
    one channel (its name: this session's, so two sessions never meet)."""
    from engine.kv_connector import KVTransferConfig

    extra = {"channel": channel}
    return tuple(
        {
            **lab_overrides(),
            "kv_transfer_config": KVTransferConfig(
                "InProcessConnector", role, kv_connector_extra_config=extra
            ),
        }
        for role in ("kv_producer", "kv_consumer")
    )


class PairDriver:
    """Feeds a workload to a DisaggregatedPair on the prefill engine's clock (the front door) and
    steps the pair; the lab steps it through its two side feeders, prefill first."""

    def __init__(self, pair, workload: Workload):
        self.pair = pair
        self.specs = list(workload.requests)
        self.names = workload.names()
        self.pending = sorted(range(len(self.specs)), key=lambda i: self.specs[i].arrival_ms)
        self.requests: list = [None] * len(self.specs)  # the consumer's requests (the answers)
        self.rejected: dict[str, str] = {}
        self.start = pair.prefill.clock.now()
        self.transfers: list = []  # PairTransfer, in the order they completed
        self.steps_done = 0  # lockstep steps of the pair
        self._decode_record = None
        self._prompts = [
            prompt_ids(pair.prefill, s.prompt_len, i) for i, s in enumerate(self.specs)
        ]

    def _due(self, i: int) -> float:
        arrival_step = LONG_ARRIVAL_STEP if self.names[i] == LONG_NAME else None
        pair = self.pair
        due = step_due(
            pair.prefill.clock, pair.has_unfinished_requests(), self.steps_done, arrival_step
        )
        return self.start + self.specs[i].arrival_ms / 1000 if due is None else due

    def admit_due(self) -> None:
        from engine.sampling_params import InvalidRequestError, SamplingParams

        clock = self.pair.prefill.clock
        if not self.pair.has_unfinished_requests() and self.pending:
            clock.advance_to(self._due(self.pending[0]))  # idle: the next arrival comes
        while self.pending and self._due(self.pending[0]) <= clock.now() + 1e-12:
            i = self.pending.pop(0)
            params = SamplingParams(
                max_tokens=self.specs[i].max_tokens, temperature=0.0, ignore_eos=True
            )
            try:
                self.requests[i] = self.pair.add_request(
                    None, params, request_id=self.names[i], prompt_token_ids=self._prompts[i]
                )
            except InvalidRequestError as exc:
                self.rejected[self.names[i]] = str(exc)

    def step_prefill(self):
        """One lockstep step of the pair: the prefill engine's record (the decode engine's is
        kept for its side's feeder, which asks for it next)."""
        self.admit_due()
        if not self.pair.has_unfinished_requests():
            self._decode_record = None
            return None
        step = self.pair.step()
        self.steps_done += 1
        self.transfers += step.transfers
        self._decode_record = step.decode
        return step.prefill

    def take_decode_record(self):
        record, self._decode_record = self._decode_record, None
        return record


class PairSideFeeder:
    """One side (the prefill or the decode engine) of a PairDriver, in the shape of
    common.WorkloadFeeder that the shared lab and result_of read."""

    def __init__(self, driver: PairDriver, side: str):
        self.driver, self.side = driver, side
        self.engine = driver.pair.prefill if side == "prefill" else driver.pair.decode
        self.specs, self.names, self.rejected = driver.specs, driver.names, driver.rejected
        self.start = driver.start

    @property
    def pending(self) -> list[int]:
        """Requests not arrived yet, and (decode side) those still on the prefill engine."""
        waiting = list(self.driver.pending)
        if self.side == "decode":
            waiting += [
                i
                for i, r in enumerate(self.driver.requests)
                if r is not None and self.engine.get_request(r.request_id) is None
            ]
        return waiting

    @property
    def requests(self) -> list:
        if self.side == "decode":
            return self.driver.requests
        return [r and self.engine.get_request(r.request_id) for r in self.driver.requests]

    @property
    def done(self) -> bool:
        return not self.driver.pending and not self.driver.pair.has_unfinished_requests()

    def step(self):
        if self.side == "prefill":
            return self.driver.step_prefill()
        return self.driver.take_decode_record()

    def added(self) -> list:
        return [(s, r) for s, r in zip(self.specs, self.requests) if r is not None]

    def fork(self, engine):
        raise ValueError("분리된 엔진 쌍은 갈라 볼 수 없습니다 (두 엔진이 한 채널을 함께 씁니다)")


def side_feeders(colocated, pair, workload: Workload) -> dict:
    """Side name → feeder: the colocated engine's WorkloadFeeder, the pair's two side feeders."""
    driver = PairDriver(pair, workload)
    return {
        "colocated": StepArrivalFeeder(colocated, workload),
        "prefill": PairSideFeeder(driver, "prefill"),
        "decode": PairSideFeeder(driver, "decode"),
    }


def run_lockstep_sides(feeders: dict, max_steps: int = 2000) -> dict[str, RunResult]:
    """Step every side in turn (the lab's lockstep) until none has work; side label → run."""
    return run_feeders_in_lockstep(feeders, max_steps, SIDE_LABELS)


def short_itl_rows(run: RunResult, long_name: str = LONG_NAME) -> pd.DataFrame:
    """Every gap between two output tokens of the short requests (engine clock, measured), with
    the tokens the step that produced the later token computed: a step that also prefilled the
    long prompt computed hundreds."""
    tokens_in_step = {rec.step: sum(s.num_tokens for s in rec.scheduled) for rec in run.records}
    long_in_step = {
        rec.step: sum(
            s.num_tokens for s in rec.scheduled if s.request_id == long_name and s.phase != "decode"
        )
        for rec in run.records
    }
    token_steps = _token_steps(run.records)
    rows = []
    for request in run.requests:
        if request.request_id == long_name:
            continue
        times = request.metrics("engine").token_times
        steps = token_steps.get(request.request_id, [])
        for k in range(1, min(len(times), len(steps))):
            rows.append(
                {
                    "요청": request.request_id,
                    "토큰": k + 1,
                    "ITL (ms)": 1e3 * (times[k] - times[k - 1]),
                    "그 스텝의 토큰 수": tokens_in_step.get(steps[k], 0),
                    "그 스텝에서 계산한 긴 프롬프트 토큰": long_in_step.get(steps[k], 0),
                }
            )
    return pd.DataFrame(rows)


def _token_steps(records: list) -> dict[str, list[int]]:
    """Request id → the step numbers in which it produced each output token, in order."""
    steps: dict[str, list[int]] = {}
    for rec in records:
        for s in rec.scheduled:
            if s.num_computed_tokens + s.num_tokens >= s.num_prompt_tokens:
                steps.setdefault(s.request_id, []).append(rec.step)
    return steps


def transfer_table(driver: PairDriver) -> pd.DataFrame:
    """Per request that crossed: tokens and bytes loaded (measured), the bytes the formula gives
    (whole blocks), the producer's save and the consumer's load time (measured)."""
    connector = driver.pair.decode.kv_connector
    size, per_block = connector.block_size, connector.bytes_per_block
    return pd.DataFrame(
        [
            {
                "요청": t.request_id,
                "불러온 토큰": t.num_tokens,
                "옮긴 바이트 (측정값)": t.num_bytes,
                "블록 단위 바이트 (계산값)": -(-t.num_tokens // size) * per_block,
                "내보내기 (ms)": round(1e3 * t.save_seconds, 3),
                "불러오기 (ms)": round(1e3 * t.load_seconds, 3),
            }
            for t in driver.transfers
        ]
    )


SEGMENT_COLORS = {"prefill 엔진": "#4C78A8", "전송": "#E45756", "decode 엔진": "#54A24B"}


def crossing_segments(driver: PairDriver) -> list[dict]:
    """Per request: where each part starts (ms after the workload's start: its arrival, then one
    after the other) and how long it took, each measured on its own engine's clock: the prefill
    on the prefill engine (arrival → its one token), the transfer (save + load), the decode on
    the decode engine (first scheduled → finished, or → now while it runs)."""
    transfers = {t.request_id: t for t in driver.transfers}
    out = []
    for spec, name, consumer in zip(driver.specs, driver.names, driver.requests):
        produced = driver.pair.prefill.get_request(name)
        if consumer is None or produced is None or produced.finish_time is None:
            continue
        p = produced.metrics("engine")
        parts = [("prefill 엔진", p.finish_time - p.arrival_time)]
        if name in transfers:
            parts.append(("전송", transfers[name].seconds))
            c = consumer.metrics("engine")
            if c.first_scheduled_time is not None:
                end = c.finish_time if c.finish_time is not None else driver.pair.decode.clock.now()
                parts.append(("decode 엔진", end - c.first_scheduled_time))
        start = spec.arrival_ms
        for part, seconds in parts:
            out.append({"요청": name, "구간": part, "시작 (ms)": start, "길이 (ms)": 1e3 * seconds})
            start += 1e3 * seconds
    return out


def crossing_figure(driver: PairDriver) -> go.Figure:
    fig = go.Figure()
    segments = crossing_segments(driver)
    for part, color in SEGMENT_COLORS.items():
        mine = [s for s in segments if s["구간"] == part]
        fig.add_trace(
            go.Bar(
                y=[s["요청"] for s in mine],
                x=[s["길이 (ms)"] for s in mine],
                base=[s["시작 (ms)"] for s in mine],
                orientation="h",
                name=part,
                marker_color=color,
                hovertemplate="%{y}: %{x:.2f} ms<extra>" + part + "</extra>",
            )
        )
    fig.update_layout(
        barmode="overlay",
        height=120 + 40 * len(driver.specs),
        title="요청마다 prefill → 전송 → decode (구간마다 그 엔진의 시계로 잰 길이)",
        xaxis_title="ms (워크로드 시작부터)",
        yaxis=dict(autorange="reversed"),
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


def itl_figure(colocated: pd.DataFrame, split: pd.DataFrame) -> go.Figure:
    """The first short request's gaps between tokens on both sides; the colocated gaps whose step
    also prefilled the long prompt are marked."""
    fig = go.Figure()
    for label, table in (("함께 배치", colocated), ("분리 (decode 엔진)", split)):
        if table.empty:
            continue
        first = table[table["요청"] == table["요청"].iloc[0]]
        fig.add_trace(
            go.Scatter(x=first["토큰"], y=first["ITL (ms)"], mode="lines+markers", name=label)
        )
    if not colocated.empty:
        first = colocated[colocated["요청"] == colocated["요청"].iloc[0]]
        hit = first[first["그 스텝에서 계산한 긴 프롬프트 토큰"] > 0]
        fig.add_trace(
            go.Scatter(
                x=hit["토큰"],
                y=hit["ITL (ms)"],
                mode="markers",
                marker=dict(size=14, symbol="star", color="#E45756"),
                name="긴 프롬프트 prefill과 같은 스텝",
            )
        )
    fig.update_layout(
        height=320,
        title="짧은 요청 하나의 토큰 간격 (ITL, 엔진 시계)",
        xaxis_title="출력 토큰 번호",
        yaxis_title="ms",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig


# -- the simulator's P:D sweep --------------------------------------------------------------------

SWEEP_MODEL = "llama-3.1-8b"
SWEEP_PROMPTS = (512, 4096)  # tokens, uniform (long prompts: prefill weighs)
SWEEP_OUTPUTS = (32, 256)
SWEEP_REQUESTS = 80
SWEEP_SLO = (0.5, 0.025)  # assumed targets: TTFT 500 ms, TPOT 25 ms
SWEEP_GPUS = ("h100-sxm", "h200", "a100-80gb-sxm", "a100-40gb-sxm")


def pd_sweep(hardware: str, total_gpus: int, rate: float, link: str):
    """engine/tools/disagg_sim.sweep_pd_ratio on this chapter's workload and SLO (계산값: the
    cost model on a virtual clock)."""
    from engine.tools.disagg_sim import SLO, sweep_pd_ratio

    return sweep_pd_ratio(
        SWEEP_MODEL,
        hardware,
        total_gpus,
        link,
        slo=SLO(*SWEEP_SLO),
        rate=rate,
        num_requests=SWEEP_REQUESTS,
        prompt_len=SWEEP_PROMPTS,
        output_len=SWEEP_OUTPUTS,
    )


def sweep_table(sweep) -> pd.DataFrame:
    """One row per deployment, in Korean, milliseconds."""

    def ms(x):
        return None if x is None else round(1e3 * x, 1)

    return pd.DataFrame(
        [
            {
                "배치": "함께 배치"
                if row["deployment"] == "colocated"
                else f"P:D {row['deployment']}",
                "TTFT p50 (ms)": ms(row["ttft_p50_s"]),
                "TTFT p99 (ms)": ms(row["ttft_p99_s"]),
                "TPOT p50 (ms)": ms(row["tpot_p50_s"]),
                "TPOT p99 (ms)": ms(row["tpot_p99_s"]),
                "전송 p50 (ms)": ms(row["transfer_p50_s"]),
                "SLO를 지킨 비율": round(row["goodput_share"], 3),
                "goodput (요청/초)": round(row["goodput_req_s"] or 0.0, 2),
                "출력 처리량 (토큰/초)": round(row["output_tokens_per_s"] or 0.0, 1),
            }
            for row in sweep.rows
        ]
    )


def sweep_figure(table: pd.DataFrame, best: str) -> go.Figure:
    colors = ["#E45756" if b == f"P:D {best}" else "#4C78A8" for b in table["배치"]]
    fig = go.Figure(
        go.Bar(
            x=table["배치"],
            y=table["goodput (요청/초)"],
            marker_color=colors,
            text=[f"{v:.0%}" for v in table["SLO를 지킨 비율"]],
            textposition="outside",
        )
    )
    fig.update_layout(
        height=320,
        title=f"배치별 goodput (막대 위: SLO를 지킨 요청의 비율) · 빨강: 가장 좋은 분리 {best}",
        yaxis_title="요청/초",
        margin=dict(l=10, r=10, t=40, b=10),
    )
    return fig
