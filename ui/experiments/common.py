"""The workload and run code the chapter experiments share (no Streamlit here).

A workload is a list of RequestSpec (prompt length, output length, arrival offset). Arrivals are
placed on the engine clock (engine/clock.py): when the engine is idle and the next request is due
later, the clock jumps to its arrival; when a step passes an arrival, the request is added with
its own offset. So a run never sleeps, and every latency is read from the engine clock through the
one metrics definition, engine.request.RequestMetrics.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Request, RequestMetrics
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.trace import StepRecord

# A varied seed text (Korean and English, code and prose) that prompts of any length are cut from.
SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "서울은 대한민국의 수도이며 한강이 도시를 가로지릅니다. "
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Large language models generate text one token at a time, reading their own past through a "
    "KV cache. 추론 서버는 여러 요청을 묶어 한 번에 처리하고, "
    "스케줄러는 매 스텝 누구에게 몇 토큰을 줄지 정합니다. "
)

ConfigLike = EngineConfig | dict


# -- tables ------------------------------------------------------------------------------------

MISSING = "—"


def _cell_text(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"


def display_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The table as a learner reads it, Arrow-safe: a column that is all numbers stays numeric;
    one with gaps or mixed kinds becomes text with "—" for the gaps (a column mixing numbers and
    strings makes Streamlit log a pyarrow traceback on every render)."""
    out = df.copy()
    for name in out.columns:
        column = out[name]
        numeric = pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)
        if numeric and not column.isna().any():
            continue
        if pd.api.types.is_bool_dtype(column):
            continue
        out[name] = [_cell_text(v) for v in column.tolist()]
    return out


# -- workloads -----------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    prompt_len: int  # prompt tokens
    max_tokens: int  # output tokens (ignore_eos, so exactly this many unless max_model_len cuts)
    arrival_ms: float = 0.0  # offset on the engine clock from the run's start
    name: str | None = None
    priority: int = 0
    prompt_token_ids: list[int] | None = None  # the exact prompt (default: cut from SEED_TEXT)
    cache_salt: str | None = None  # prefix-cache isolation (EngineCore.add_request)


@dataclass
class Workload:
    requests: list[RequestSpec]

    @classmethod
    def uniform(
        cls, num_requests: int, prompt_len: int, max_tokens: int, gap_ms: float = 0.0
    ) -> "Workload":
        return cls([RequestSpec(prompt_len, max_tokens, i * gap_ms) for i in range(num_requests)])

    def describe(self) -> str:
        lens = [r.prompt_len for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return (
            f"요청 {len(self.requests)}개, 프롬프트 {min(lens)}–{max(lens)} 토큰, "
            f"출력 {min(outs)}–{max(outs)} 토큰"
        )

    def names(self) -> list[str]:
        return [s.name or f"r{i}" for i, s in enumerate(self.requests)]


def prompt_ids(engine: EngineCore, length: int, variant: int = 0) -> list[int]:
    """`length` token ids cut from the seed text, shifted per variant so prompts differ.

    Byte-level BPE splits a Hangul syllable (3 UTF-8 bytes) over several tokens, so a cut at any
    token offset may start or end inside a character (shown as U+FFFD). The cut starts at the
    first offset from `variant * 7` on where both of its ends fall on character boundaries: the
    prompt is real text, and an output's first bytes never complete a character the prompt
    began."""
    tokenizer = engine.tokenizer
    base = tokenizer.encode(SEED_TEXT)
    n = len(base)
    starts_char = _char_starts(tokenizer, base)
    first = (variant * 7) % n
    for shift in range(n):
        start = (first + shift) % n
        # the prompt repeats base[start:] + base; the token right after the cut begins a character
        after = length % (2 * n - start)
        after = start + after if after < n - start else after - (n - start)
        if starts_char[start] and starts_char[after]:
            break
    else:
        start = first  # a seed text without two boundaries (never with the one above)
    ids = (base[start:] + base) * (length // n + 2)
    return ids[:length]


def _char_starts(tokenizer, ids: list[int]) -> list[bool]:
    """Per token: whether its bytes begin a character (not a UTF-8 continuation byte)."""
    token_bytes = getattr(tokenizer, "token_bytes", None)
    if token_bytes is None:  # a tokenizer without byte access: every offset counts as a boundary
        return [True] * len(ids)
    return [not (b := token_bytes(t)) or (b[0] & 0xC0) != 0x80 for t in ids]


def make_config(config: ConfigLike | None = None, **overrides) -> EngineConfig:
    """A copy of `config` (an EngineConfig, a dict of its fields, or None for the defaults) with the
    overrides applied; an unknown setting raises TypeError."""
    if isinstance(config, dict):
        config = EngineConfig(**config)
    return dataclasses.replace(config or EngineConfig(), **overrides)


class WorkloadFeeder:
    """Feeds a workload to one engine on the engine clock, one step at a time.

    step(): admit every request whose arrival is due; if the engine is idle and the next arrival is
    later, advance the engine clock to it; run one EngineCore.step(); admit arrivals the step
    passed. Returns the StepRecord, or None when the workload is done. A request the engine refuses
    (e.g. longer than max_model_len) is kept in `rejected` with the engine's message.
    """

    def __init__(self, engine: EngineCore, workload: Workload):
        self.engine = engine
        self.specs = list(workload.requests)
        self.names = workload.names()
        self.pending = sorted(range(len(self.specs)), key=lambda i: self.specs[i].arrival_ms)
        self.requests: list[Request | None] = [None] * len(self.specs)
        self.rejected: dict[str, str] = {}
        self.start = engine.clock.now()  # engine seconds; arrivals are offsets from here
        self._prompts = [
            list(s.prompt_token_ids) if s.prompt_token_ids else prompt_ids(engine, s.prompt_len, i)
            for i, s in enumerate(self.specs)
        ]

    def _due(self, i: int) -> float:
        return self.start + self.specs[i].arrival_ms / 1000

    def admit_due(self) -> None:
        now = self.engine.clock.now()
        while self.pending and self._due(self.pending[0]) <= now + 1e-12:
            i = self.pending.pop(0)
            spec = self.specs[i]
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            try:
                self.requests[i] = self.engine.add_request(
                    None,
                    params,
                    request_id=self.names[i],
                    prompt_token_ids=self._prompts[i],
                    priority=spec.priority,
                    engine_arrival_time=self._due(i),
                    cache_salt=spec.cache_salt,
                )
            except InvalidRequestError as exc:
                self.rejected[self.names[i]] = str(exc)

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished_requests()

    def step(self) -> StepRecord | None:
        self.admit_due()
        if not self.engine.has_unfinished_requests():
            if not self.pending:
                return None
            self.engine.clock.advance_to(self._due(self.pending[0]))
            self.admit_due()
            if not self.engine.has_unfinished_requests():
                return self.step() if self.pending else None
        record = self.engine.step()
        self.admit_due()
        return record

    def fork(self, engine: EngineCore) -> "WorkloadFeeder":
        """The same workload feeding `engine`, a fork of this feeder's engine
        (EngineCore.fork): what has arrived is the fork's copy, what has not arrives there on
        the fork's own clock."""
        twin = copy.copy(self)
        twin.engine = engine
        twin.pending = list(self.pending)
        twin.requests = [r and engine.get_request(r.request_id) for r in self.requests]
        twin.rejected = dict(self.rejected)
        return twin

    def added(self) -> list[tuple[RequestSpec, Request]]:
        return [(s, r) for s, r in zip(self.specs, self.requests) if r is not None]


# -- one run -------------------------------------------------------------------------------------


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


@dataclass
class RunResult:
    """One workload run. Times are engine-clock seconds (t0 = the run's start on that clock)."""

    label: str
    config: EngineConfig
    records: list[StepRecord]
    requests: list[Request]  # in workload order (rejected ones left out)
    specs: list[RequestSpec]
    t0: float  # engine clock at the start of the run
    elapsed_s: float  # engine clock: run start → last finish
    conditions: dict = field(default_factory=dict)
    num_blocks: int = 0
    block_size: int = 16
    max_model_len: int = 0
    rejected: dict = field(default_factory=dict)  # request name → the engine's reason
    wall_s: float = 0.0  # wall clock: first step start → last step end (includes nothing else)

    def metrics(self) -> list[RequestMetrics]:
        return [r.metrics(clock="engine") for r in self.requests]

    # --- per request (measured) ---
    def request_table(self) -> pd.DataFrame:
        """One row per request, times in ms on the engine clock (RequestMetrics)."""
        rows = []
        for r, m in zip(self.requests, self.metrics()):
            itl = m.itl
            rows.append(
                {
                    "request_id": r.request_id,
                    "prompt_tokens": m.num_prompt_tokens,
                    "output_tokens": m.num_output_tokens,
                    "arrival_ms": 1000 * (m.arrival_time - self.t0),
                    "queue_ms": _ms(m.queue_time),
                    "ttft_ms": _ms(m.ttft),
                    "tpot_ms": _ms(m.tpot),
                    "mean_itl_ms": 1000 * float(np.mean(itl)) if itl else None,
                    "max_itl_ms": 1000 * max(itl) if itl else None,
                    "e2e_ms": _ms(m.e2e),
                    "finish_ms": None
                    if m.finish_time is None
                    else 1000 * (m.finish_time - self.t0),
                    "first_step": next((e.step for e in r.journey if e.kind == "scheduled"), None),
                    "finish_step": next((e.step for e in r.journey if e.kind == "finished"), None),
                    "preemptions": m.num_preemptions,
                    "finish_reason": r.finish_reason,
                }
            )
        return pd.DataFrame(rows, columns=list(REQUEST_COLUMNS_KO))

    def itl_samples_ms(self) -> pd.DataFrame:
        """Every inter-token gap of every request (request_id, token index, ms, engine time)."""
        rows = []
        for r, m in zip(self.requests, self.metrics()):
            for i, (a, b) in enumerate(zip(m.token_times, m.token_times[1:]), start=2):
                rows.append(
                    {
                        "request_id": r.request_id,
                        "token": i,
                        "itl_ms": 1000 * (b - a),
                        "time_ms": 1000 * (b - self.t0),
                    }
                )
        return pd.DataFrame(rows, columns=["request_id", "token", "itl_ms", "time_ms"])

    def step_table(self) -> pd.DataFrame:
        """One row per step: tokens, requests, duration (ms), phases present, start (engine ms)."""
        rows = []
        for rec in self.records:
            phases = {s.phase for s in rec.scheduled}
            rows.append(
                {
                    "step": rec.step,
                    "start_ms": 1000 * (rec.engine_start_time - self.t0),
                    "duration_ms": 1000 * rec.engine_duration,
                    "num_tokens": rec.total_tokens,
                    "num_requests": len(rec.scheduled),
                    "num_running": rec.num_running,
                    "num_waiting": rec.num_waiting,
                    "prefill_tokens": sum(
                        s.num_tokens for s in rec.scheduled if s.phase != "decode"
                    ),
                    "decode_tokens": sum(1 for s in rec.scheduled if s.phase == "decode"),
                    "kind": "mixed"
                    if len(phases) > 1
                    else (next(iter(phases)) if phases else "idle"),
                }
            )
        return pd.DataFrame(rows)

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens / engine time (tokens per second): 계산값 from measured counts and
        times."""
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        t = self.request_table()
        return {
            "방식": self.label,
            "요청 수": len(self.requests),
            "스텝 수": len(self.records),
            "전체 시간 (s)": round(self.elapsed_s, 3),
            "출력 토큰": self.output_tokens,
            "처리량 (토큰/s)": round(self.throughput, 1),
            "TTFT 평균 (ms)": _r(t["ttft_ms"].mean()),
            "TTFT 최대 (ms)": _r(t["ttft_ms"].max()),
            "E2E 평균 (ms)": _r(t["e2e_ms"].mean()),
            "E2E 최대 (ms)": _r(t["e2e_ms"].max()),
            "TPOT 평균 (ms)": _r(t["tpot_ms"].mean()),
        }


# Korean headers for request_table() (pages show these, never the English column names).
REQUEST_COLUMNS_KO = {
    "request_id": "요청",
    "prompt_tokens": "프롬프트 토큰",
    "output_tokens": "출력 토큰",
    "arrival_ms": "도착 (ms)",
    "queue_ms": "대기 (ms)",
    "ttft_ms": "TTFT (ms)",
    "tpot_ms": "TPOT (ms)",
    "mean_itl_ms": "ITL 평균 (ms)",
    "max_itl_ms": "ITL 최대 (ms)",
    "e2e_ms": "E2E (ms)",
    "finish_ms": "완료 (ms)",
    "first_step": "첫 스텝",
    "finish_step": "완료 스텝",
    "preemptions": "선점 횟수",
    "finish_reason": "종료 이유",
}


def korean_table(
    df: pd.DataFrame, columns: list[str] | None = None, digits: int = 1
) -> pd.DataFrame:
    """A request table for display: Korean headers, rounded numbers, "—" for missing values."""
    if columns is not None:
        df = df[columns]
    return display_frame(df.rename(columns=REQUEST_COLUMNS_KO).round(digits))


def _r(x, nd: int = 1):
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else round(float(x), nd)


def is_simulated(engine) -> bool:
    """Whether the engine runs on engine/tools/simulator.py's cost model (its times are 계산값)."""
    from engine.tools.simulator import SimulatedExecutor

    return isinstance(getattr(engine, "executor", None), SimulatedExecutor)


def simulated_conditions(engine) -> dict:
    """The 계산값 conditions of a simulated engine: presets, efficiency factors, KV capacity."""
    executor = engine.executor
    return {
        "모델 프리셋": executor.preset.name,
        "하드웨어": f"{executor.hardware.name} × {executor.tp} ({executor.hardware.evidence})",
        "효율 계수": "가정값" if "assumed" in executor.cost_model.efficiency.evidence else "보정값",
        "KV 블록": f"{engine.num_blocks:,}",
        "시계": "가상 시계 (비용 모델)",
    }


def measurement_conditions(engine: EngineCore, **extra) -> dict:
    """Device, dtype, model, threads, clock and date: what a 측정값 must name (for a simulated
    engine, what its 계산값 assumed)."""
    import torch

    if is_simulated(engine):
        return {**simulated_conditions(engine), **extra}

    cond = {
        "장치": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "모델": Path(engine.model_dir).name,
        "스레드": torch.get_num_threads(),
        "시계": "엔진 시계 (스텝 시간만 셈)",
    }
    cond.update(extra)
    cond["날짜"] = _dt.date.today().isoformat()
    return cond


def expected_steps(workload: Workload, config: EngineConfig) -> int:
    """About how many steps a workload takes (for a progress bar, not a measurement)."""
    budget = max(config.max_num_batched_tokens, 1)
    seqs = max(config.max_num_seqs, 1)
    work = [(s.prompt_len, s.max_tokens) for s in workload.requests]
    if not work:
        return 0
    longest = max(-(-p // budget) + o for p, o in work)
    spread = -(-sum(p for p, _ in work) // budget) + -(-sum(o for _, o in work) // seqs)
    return max(longest, spread, 1)


def result_of(feeder: WorkloadFeeder, records: list[StepRecord], label: str) -> RunResult:
    """A RunResult from a feeder that was stepped (to the end, or as far as it went)."""
    engine = feeder.engine
    config = engine.config
    added = feeder.added()
    finishes = [r.metrics("engine").finish_time for _, r in added]
    finishes = [f for f in finishes if f is not None]
    end = max(finishes) if finishes else feeder.start
    wall = 0.0
    if records:
        wall = records[-1].start_time + records[-1].duration - records[0].start_time
    cond = measurement_conditions(
        engine,
        요청=len(feeder.specs),
        최대동시요청=config.max_num_seqs,
        토큰예산=config.max_num_batched_tokens,
    )
    return RunResult(
        label or config.scheduling_policy,
        config,
        list(records),
        [r for _, r in added],
        [s for s, _ in added],
        feeder.start,
        end - feeder.start,
        cond,
        engine.num_blocks,
        config.block_size,
        engine.max_model_len,
        dict(feeder.rejected),
        wall,
    )


def run_workload(
    config: ConfigLike | None,
    workload: Workload,
    label: str = "",
    max_steps: int = 2000,
    engine_factory: Callable[[EngineConfig], EngineCore] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> RunResult:
    """Build an engine, feed the workload on the engine clock, step until all requests finish."""
    config = make_config(config)
    engine = (engine_factory or EngineCore)(config)
    feeder = WorkloadFeeder(engine, workload)
    records: list[StepRecord] = []
    for _ in range(max_steps):
        record = feeder.step()
        if record is None:
            break
        records.append(record)
        if on_step is not None:
            on_step(record)
    return result_of(feeder, records, label)


def run_lockstep(
    configs: dict[str, ConfigLike], workload: Workload, engine_factory=None, max_steps: int = 2000
) -> dict[str, RunResult]:
    """The same workload on one fresh engine per config, stepped in lockstep as the lab does (one
    step of each in turn): a busy machine slows every engine alike, so their engine clocks stay
    comparable."""
    factory = engine_factory or EngineCore
    feeders = {
        label: WorkloadFeeder(factory(make_config(c)), workload) for label, c in configs.items()
    }
    return run_feeders_in_lockstep(feeders, max_steps)


def run_feeders_in_lockstep(
    feeders: dict, max_steps: int = 2000, labels: dict[str, str] | None = None
) -> dict[str, RunResult]:
    """Step every feeder in turn (the lab's lockstep) until none has work; label → run (a key's
    label is `labels[key]`, else the key)."""
    records: dict[str, list] = {key: [] for key in feeders}
    for _ in range(max_steps):
        stepped = False
        for key, feeder in feeders.items():
            record = feeder.step()
            if record is not None:
                records[key].append(record)
                stepped = True
        if not stepped:
            break
    labels = labels or {}
    return {
        labels.get(key, key): result_of(feeder, records[key], labels.get(key, key))
        for key, feeder in feeders.items()
    }
