"""Engine-driving comparisons for chapters 04–08, as plain functions (no Streamlit here).

Each function builds real EngineCore instances, runs a workload on them and returns dataclasses or
pandas DataFrames. Every number in the results is either measured on this run (times, token
counts, block tables) or derived from measured numbers by a formula named in the docstring, so a
page can label it 측정값 or 계산값 honestly.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from engine.core import EngineConfig, EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.trace import StepRecord
from engine.utils import cdiv

# A varied seed text (Korean and English, code and prose) that prompts of any length are cut from.
SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. 서울은 대한민국의 수도이며 한강이 도시를 가로지릅니다. "
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Large language models generate text one token at a time, reading their own past through a KV cache. "
    "추론 서버는 여러 요청을 묶어 한 번에 처리하고, 스케줄러는 매 스텝 누구에게 몇 토큰을 줄지 정합니다. "
)

ConfigLike = EngineConfig | dict


# -- workloads -----------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    prompt_len: int  # prompt tokens
    max_tokens: int  # output tokens (ignore_eos, so exactly this many unless max_model_len cuts)
    arrival_ms: float = 0.0  # offset from the run's start; the request is added when it is due
    name: str | None = None


@dataclass
class Workload:
    requests: list[RequestSpec]

    @classmethod
    def uniform(cls, num_requests: int, prompt_len: int, max_tokens: int, gap_ms: float = 0.0) -> "Workload":
        return cls([RequestSpec(prompt_len, max_tokens, i * gap_ms) for i in range(num_requests)])

    def describe(self) -> str:
        lens = [r.prompt_len for r in self.requests]
        outs = [r.max_tokens for r in self.requests]
        return (f"요청 {len(self.requests)}개, 프롬프트 {min(lens)}–{max(lens)} 토큰, "
                f"출력 {min(outs)}–{max(outs)} 토큰")


def prompt_ids(engine: EngineCore, length: int, variant: int = 0) -> list[int]:
    """`length` token ids cut from the seed text, shifted per variant so prompts differ."""
    base = engine.tokenizer.encode(SEED_TEXT)
    start = (variant * 7) % len(base)
    ids = (base[start:] + base) * (length // len(base) + 2)
    return ids[:length]


def make_config(config: ConfigLike | None = None, **overrides) -> EngineConfig:
    """A copy of `config` (an EngineConfig, a dict of its fields, or None for the defaults) with the
    overrides applied; an unknown setting raises TypeError."""
    if isinstance(config, dict):
        config = EngineConfig(**config)
    return dataclasses.replace(config or EngineConfig(), **overrides)


# -- one run -------------------------------------------------------------------------------------


@dataclass
class RunResult:
    label: str
    config: EngineConfig
    records: list[StepRecord]
    requests: list[Request]  # in workload order
    specs: list[RequestSpec]
    t0: float  # perf_counter at the start of the run
    wall_s: float  # first arrival → last step's end
    conditions: dict = field(default_factory=dict)
    num_blocks: int = 0
    block_size: int = 16
    max_model_len: int = 0

    # --- per request (measured) ---
    def request_table(self) -> pd.DataFrame:
        """One row per request, times in ms (measured from the engine's timestamps)."""
        rows = []
        for spec, r in zip(self.specs, self.requests):
            scheduled = [e.time for e in r.journey if e.kind == "scheduled"]
            itl = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
            ttft = None if r.first_token_time is None else r.first_token_time - r.arrival_time
            e2e = None if r.finish_time is None else r.finish_time - r.arrival_time
            n = r.num_output_tokens
            tpot = (r.token_times[-1] - r.first_token_time) / (n - 1) if n >= 2 and r.first_token_time else None
            rows.append({
                "request_id": r.request_id,
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": n,
                "arrival_ms": 1000 * (r.arrival_time - self.t0),
                "queue_ms": 1000 * (scheduled[0] - r.arrival_time) if scheduled else None,
                "ttft_ms": None if ttft is None else 1000 * ttft,
                "tpot_ms": None if tpot is None else 1000 * tpot,
                "mean_itl_ms": 1000 * float(np.mean(itl)) if itl else None,
                "max_itl_ms": 1000 * max(itl) if itl else None,
                "e2e_ms": None if e2e is None else 1000 * e2e,
                "finish_ms": None if r.finish_time is None else 1000 * (r.finish_time - self.t0),
                "first_step": next((e.step for e in r.journey if e.kind == "scheduled"), None),
                "finish_step": next((e.step for e in r.journey if e.kind == "finished"), None),
                "preemptions": r.num_preemptions,
                "finish_reason": r.finish_reason,
            })
        return pd.DataFrame(rows)

    def itl_samples_ms(self) -> pd.DataFrame:
        """Every inter-token gap of every request (request_id, token index, ms, wall time)."""
        rows = []
        for r in self.requests:
            for i, (a, b) in enumerate(zip(r.token_times, r.token_times[1:]), start=2):
                rows.append({"request_id": r.request_id, "token": i, "itl_ms": 1000 * (b - a),
                             "time_ms": 1000 * (b - self.t0)})
        return pd.DataFrame(rows, columns=["request_id", "token", "itl_ms", "time_ms"])

    def step_table(self) -> pd.DataFrame:
        """One row per step: tokens, requests, duration (ms), phases present, start (ms)."""
        rows = []
        for rec in self.records:
            phases = {s.phase for s in rec.scheduled}
            rows.append({"step": rec.step, "start_ms": 1000 * (rec.start_time - self.t0),
                         "duration_ms": 1000 * rec.duration, "num_tokens": rec.total_tokens,
                         "num_requests": len(rec.scheduled), "num_running": rec.num_running,
                         "num_waiting": rec.num_waiting, "prefill_tokens": sum(
                             s.num_tokens for s in rec.scheduled if s.phase != "decode"),
                         "decode_tokens": sum(1 for s in rec.scheduled if s.phase == "decode"),
                         "kind": "mixed" if len(phases) > 1 else (next(iter(phases)) if phases else "idle")})
        return pd.DataFrame(rows)

    @property
    def output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens / wall time (tokens per second): 계산값 from measured counts and times."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        t = self.request_table()
        return {
            "방식": self.label,
            "요청 수": len(self.requests),
            "스텝 수": len(self.records),
            "전체 시간 (s)": round(self.wall_s, 3),
            "출력 토큰": self.output_tokens,
            "처리량 (토큰/s)": round(self.throughput, 1),
            "TTFT 평균 (ms)": _r(t["ttft_ms"].mean()),
            "TTFT 최대 (ms)": _r(t["ttft_ms"].max()),
            "E2E 평균 (ms)": _r(t["e2e_ms"].mean()),
            "E2E 최대 (ms)": _r(t["e2e_ms"].max()),
            "TPOT 평균 (ms)": _r(t["tpot_ms"].mean()),
        }


def _r(x, nd: int = 1):
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else round(float(x), nd)


def measurement_conditions(engine: EngineCore, **extra) -> dict:
    """Device, dtype, model, threads and date: what a 측정값 must name."""
    import torch

    cond = {
        "장치": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "모델": Path(engine.model_dir).name,
        "스레드": torch.get_num_threads(),
    }
    cond.update(extra)
    cond["날짜"] = _dt.date.today().isoformat()
    return cond


def run_workload(config: ConfigLike | None, workload: Workload, label: str = "", max_steps: int = 2000,
                 engine_factory: Callable[[EngineConfig], EngineCore] | None = None,
                 on_step: Callable[[StepRecord], None] | None = None) -> RunResult:
    """Build an engine, add each request when its arrival time is due, step until all finish.

    Requests arrive by wall-clock offset (`arrival_ms`); while the engine is idle and the next
    request is not yet due, the run waits for it (so arrival gaps are real).
    """
    config = make_config(config)
    engine = (engine_factory or EngineCore)(config)
    specs = list(workload.requests)
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_ms)
    requests: list[Request | None] = [None] * len(specs)
    prompts = [prompt_ids(engine, s.prompt_len, i) for i, s in enumerate(specs)]
    records: list[StepRecord] = []
    pending = list(order)
    t0 = time.perf_counter()

    def admit_due(now: float) -> None:
        while pending and t0 + specs[pending[0]].arrival_ms / 1000 <= now:
            i = pending.pop(0)
            spec = specs[i]
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            requests[i] = engine.add_request(None, params, request_id=spec.name or f"r{i}",
                                             prompt_token_ids=prompts[i],
                                             arrival_time=t0 + spec.arrival_ms / 1000)

    for _ in range(max_steps):
        admit_due(time.perf_counter())
        if not engine.has_unfinished_requests():
            if not pending:
                break
            time.sleep(max(0.0, t0 + specs[pending[0]].arrival_ms / 1000 - time.perf_counter()))
            continue
        record = engine.step()
        records.append(record)
        if on_step is not None:
            on_step(record)
    end = max((r.finish_time or 0.0) for r in requests if r is not None) if records else t0
    cond = measurement_conditions(engine, 요청=len(specs), 최대동시요청=config.max_num_seqs,
                                  토큰예산=config.max_num_batched_tokens)
    return RunResult(label or config.scheduling_policy, config, records, [r for r in requests if r is not None],
                     specs, t0, end - t0, cond, engine.num_blocks, config.block_size, engine.max_model_len)


# -- chapter 04: latency percentiles -------------------------------------------------------------

METRIC_DEFINITIONS = {
    "TTFT": "도착 → 첫 출력 토큰 (대기 + prefill 포함)",
    "TPOT": "(마지막 토큰 시각 − 첫 토큰 시각) / (출력 토큰 수 − 1)",
    "ITL": "연속한 두 출력 토큰 사이의 간격 (모든 요청의 간격을 모두 표본으로)",
    "E2E": "도착 → 마지막 토큰",
    "처리량": "전체 출력 토큰 수 / (첫 도착 → 마지막 완료) 시간",
}


def percentile_table(result: RunResult, percentiles=(50, 90, 99)) -> pd.DataFrame:
    """n, mean and percentiles (numpy linear interpolation) of TTFT, TPOT, ITL, E2E in ms."""
    t = result.request_table()
    samples = {
        "TTFT": t["ttft_ms"].dropna().to_numpy(),
        "TPOT": t["tpot_ms"].dropna().to_numpy(),
        "ITL": result.itl_samples_ms()["itl_ms"].to_numpy(),
        "E2E": t["e2e_ms"].dropna().to_numpy(),
    }
    rows = []
    for name, values in samples.items():
        row = {"지표": name, "n": len(values), "평균 (ms)": _r(values.mean()) if len(values) else None}
        for p in percentiles:
            row[f"p{p} (ms)"] = _r(np.percentile(values, p)) if len(values) else None
        row["최대 (ms)"] = _r(values.max()) if len(values) else None
        rows.append(row)
    return pd.DataFrame(rows)


# -- chapter 05: dtype measurement ---------------------------------------------------------------


def _rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except Exception:  # pragma: no cover - psutil missing
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return None


@dataclass
class DtypeMeasurement:
    dtype: str
    param_count: int
    tensor_bytes: int  # Σ numel × element_size over the loaded model's tensors (measured)
    computed_bytes: int  # params × bytes per element (계산값)
    rss_delta_bytes: int | None  # process RSS after load − before (None: weights were already loaded)
    load_s: float | None
    tpot_ms: float
    decode_tokens_per_s: float
    ttft_ms: float
    num_tokens: int
    token_ids: list[int]
    text: str
    agree_with: str | None = None
    first_divergence: int | None = None  # index of the first token that differs from the reference
    conditions: dict = field(default_factory=dict)


def model_tensor_bytes(model) -> tuple[int, int]:
    """(parameter count, bytes) of every distinct tensor the model holds (shared storage counted once)."""
    import torch

    seen, count, nbytes = set(), 0, 0
    tensors = []
    if isinstance(model, torch.nn.Module):
        tensors = list(model.parameters()) + list(model.buffers())
    else:
        for value in vars(model).values():
            tensors.extend(_collect_tensors(value))
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        if t.is_floating_point():
            count += t.numel()
        nbytes += t.numel() * t.element_size()
    return count, nbytes


def _collect_tensors(value, depth: int = 0) -> list:
    import torch

    if depth > 4:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, torch.nn.Module):
        return list(value.parameters()) + list(value.buffers())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _collect_tensors(v, depth + 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _collect_tensors(v, depth + 1)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return [t for v in vars(value).values() for t in _collect_tensors(v, depth + 1)]
    return []


def measure_dtype(config: ConfigLike | None, dtype: str, prompt: str = "The capital of France is",
                  num_tokens: int = 16, reference: DtypeMeasurement | None = None) -> DtypeMeasurement:
    """Load the model in `dtype` (if not loaded yet in this process), then time a greedy decode.

    Measured: tensor bytes of the loaded weights, RSS delta of the load, TTFT and TPOT of one request.
    Derived: decode tokens/s = 1000 / TPOT.
    """
    import torch

    from engine.artifact import resolve_model_path
    from engine.worker import _loaded_models, load_model, resolve_device, resolve_dtype

    config = make_config(config, dtype=dtype, num_kv_blocks=None, kv_cache_memory=None,
                         max_model_len=256, enable_prefix_caching=False)
    device = resolve_device(config.device)
    torch_dtype = resolve_dtype(dtype, device)
    model_dir = resolve_model_path(config.model)
    key = (str(Path(model_dir).resolve()), str(device), torch_dtype)
    already = key in _loaded_models
    rss0 = _rss_bytes()
    t = time.perf_counter()
    model = load_model(model_dir, device, torch_dtype)
    load_s = None if already else time.perf_counter() - t
    rss1 = _rss_bytes()
    rss_delta = None if already or rss0 is None or rss1 is None else rss1 - rss0
    params, nbytes = model_tensor_bytes(model)
    element = torch.tensor([], dtype=torch_dtype).element_size()

    config.num_kv_blocks = cdiv(256, config.block_size)
    engine = EngineCore(config)
    params_s = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params_s)
    while engine.has_unfinished_requests():
        engine.step()
    n = request.num_output_tokens
    tpot = (request.token_times[-1] - request.first_token_time) / max(n - 1, 1)
    text = engine.tokenizer.decode(request.output_token_ids)
    divergence = None
    if reference is not None:
        divergence = next((i for i, (a, b) in enumerate(zip(reference.token_ids, request.output_token_ids)) if a != b),
                          None)
    return DtypeMeasurement(
        dtype=str(torch_dtype).replace("torch.", ""), param_count=params, tensor_bytes=nbytes,
        computed_bytes=params * element, rss_delta_bytes=rss_delta, load_s=load_s,
        tpot_ms=1000 * tpot, decode_tokens_per_s=1.0 / tpot if tpot > 0 else 0.0,
        ttft_ms=1000 * (request.first_token_time - request.arrival_time), num_tokens=n,
        token_ids=list(request.output_token_ids), text=text,
        agree_with=reference.dtype if reference else None, first_divergence=divergence,
        conditions=measurement_conditions(engine, 배치=1, 프롬프트=f"{request.num_prompt_tokens} 토큰",
                                          출력=f"{n} 토큰 (greedy)"),
    )


# -- chapter 06: contiguous reservation vs paged blocks ------------------------------------------


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
    """Compare the paged engine's measured blocks with a contiguous reservation replayed on the same run.

    Per step, for the requests holding KV after the step (the engine's block tables):
      used (measured)        = tokens whose K/V are in the cache (num_computed + scheduled this step)
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
        rows.append({
            "step": rec.step, "live_requests": len(live), "used_slots": used,
            "paged_reserved": paged_reserved, "paged_internal_frag": paged_reserved - used,
            "paged_free": pool - paged_reserved, "paged_unusable": 0,
            "contiguous_requests": len(placed), "contiguous_used": used_contig,
            "contiguous_reserved": contig_reserved, "contiguous_internal_frag": contig_reserved - used_contig,
            "contiguous_free": contig_free, "contiguous_unusable": contig_unusable,
        })
    per_step = pd.DataFrame(rows)

    def summarise(name: str, prefix: str, used_col: str, unusable_col: str, concurrent: int) -> dict:
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

    summary = pd.DataFrame([
        summarise(f"연속 예약 (R = {reservation})", "contiguous", "contiguous_used", "contiguous_unusable",
                  int(per_step["contiguous_requests"].max()) if len(per_step) else 0),
        summarise(f"블록 방식 (블록 {bs} 토큰)", "paged", "used_slots", "paged_unusable", paged_max),
    ])
    return FragmentationResult(per_step, summary, reservation, pool, rejected, pool // max(r_max, 1), paged_max, r_max)


def block_tables_frame(record: StepRecord) -> pd.DataFrame:
    """Logical block index → physical block id per live request (from the step's KV snapshot)."""
    rows = [{"request_id": rid, "logical": i, "physical": b}
            for rid, blocks in record.kv.block_tables.items() for i, b in enumerate(blocks)]
    return pd.DataFrame(rows, columns=["request_id", "logical", "physical"])


# -- chapter 07: sequential vs static vs continuous ----------------------------------------------


def batching_workload(num_requests: int = 6, late_ms: float = 400.0) -> Workload:
    """Output lengths that differ a lot (so a static batch waits for its longest) and two late arrivals."""
    outs = [8, 40, 12, 32, 10, 24, 16, 36][:num_requests]
    prompts = [24, 16, 40, 20, 32, 28, 18, 36][:num_requests]
    specs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        arrival = 0.0 if i < max(num_requests - 2, 1) else late_ms * (i - num_requests + 3)
        specs.append(RequestSpec(p, o, arrival))
    return Workload(specs)


BATCHING_MODES = {
    "순차 실행": dict(max_num_seqs=1, scheduling_policy="fcfs"),
    "정적 배칭": dict(scheduling_policy="static"),
    "continuous batching": dict(scheduling_policy="fcfs"),
}


def batch_waste(result: RunResult) -> dict:
    """Slots held idle, from the step records (계산값).

    idle slots = max_num_seqs × steps − Σ scheduled requests per step
    static padding = Σ over batches (batch size × batch steps) − Σ (request, step) pairs that did work,
      a batch being the steps between two moments with nothing running. Only static batching holds a
      finished request's slot until its batch ends; sequential and continuous runs reuse it (padding 0).
    """
    slots = result.config.max_num_seqs
    worked = sum(len(r.scheduled) for r in result.records)
    idle = slots * len(result.records) - worked
    padding = 0
    batches: list[set[str]] = []
    current: set[str] = set()
    steps_in_batch = 0
    worked_in_batch = 0
    for rec in result.records:
        current |= {s.request_id for s in rec.scheduled}
        steps_in_batch += 1
        worked_in_batch += len(rec.scheduled)
        if rec.num_running == 0:
            padding += len(current) * steps_in_batch - worked_in_batch
            batches.append(current)
            current, steps_in_batch, worked_in_batch = set(), 0, 0
    if current:
        padding += len(current) * steps_in_batch - worked_in_batch
        batches.append(current)
    if result.config.scheduling_policy != "static":
        padding = 0
    hol_steps = sum(1 for r in result.records for reason in r.unscheduled.values()
                    if reason in ("static_batch_in_progress", "max_num_seqs"))
    return {"idle_slot_steps": idle, "padding_slot_steps": padding, "num_batches": len(batches),
            "blocked_request_steps": hol_steps, "worked_request_steps": worked}


def compare_batching(config: ConfigLike | None, workload: Workload, batch_size: int = 4,
                     engine_factory=None) -> dict[str, RunResult]:
    """The same workload under each mode of BATCHING_MODES, one fresh engine each."""
    results = {}
    for label, overrides in BATCHING_MODES.items():
        overrides = dict(overrides)
        overrides.setdefault("max_num_seqs", batch_size)
        results[label] = run_workload(make_config(config, **overrides), workload, label, engine_factory=engine_factory)
    return results


def batching_summary(results: dict[str, RunResult]) -> pd.DataFrame:
    rows = []
    for label, res in results.items():
        row = res.summary()
        waste = batch_waste(res)
        t = res.request_table()
        row.update({
            "대기 최대 (ms)": _r(t["queue_ms"].max()),
            "빈 자리 (슬롯·스텝)": waste["idle_slot_steps"],
            "패딩 낭비 (슬롯·스텝)": waste["padding_slot_steps"],
            "막힌 대기 (요청·스텝)": waste["blocked_request_steps"],
            "평균 스텝 (ms)": _r(1000 * np.mean([r.duration for r in res.records])) if res.records else None,
        })
        rows.append(row)
    return pd.DataFrame(rows)


# -- chapter 08: chunked prefill and the token budget --------------------------------------------


def long_prompt_workload(long_prompt_len: int = 420, num_short: int = 3, short_prompt_len: int = 16,
                         short_max_tokens: int = 40, long_arrival_ms: float = 250.0,
                         long_max_tokens: int = 8) -> Workload:
    specs = [RequestSpec(short_prompt_len, short_max_tokens, 0.0, f"짧은-{i}") for i in range(num_short)]
    specs.append(RequestSpec(long_prompt_len, long_max_tokens, long_arrival_ms, "긴-프롬프트"))
    return Workload(specs)


@dataclass
class ChunkedComparison:
    runs: dict[str, RunResult]
    summary: pd.DataFrame


def compare_chunked_prefill(config: ConfigLike | None, workload: Workload, budget: int, max_num_seqs: int,
                            engine_factory=None) -> ChunkedComparison:
    """Run the workload with chunked prefill on (budget as given) and off (budget raised to the longest
    prompt, since an unchunked prompt must fit one step). Summary per run (times measured):
      long request TTFT; others' max and mean ITL; largest step (tokens, ms)."""
    longest = max(s.prompt_len for s in workload.requests)
    # Unchunked, a whole request (prompt + output, as recomputed after a preemption) must fit one
    # step, so the engine requires budget >= max_model_len: the "off" run caps max_model_len at the
    # longest request and raises the budget to it.
    longest_request = max(s.prompt_len + s.max_tokens for s in workload.requests)
    runs = {}
    for label, chunked, b in (("chunked prefill 켬", True, budget),
                              ("chunked prefill 끔", False, max(budget, longest_request))):
        extra = {} if chunked else {"max_model_len": b}
        cfg = make_config(config, enable_chunked_prefill=chunked, max_num_batched_tokens=b,
                          max_num_seqs=max_num_seqs, enable_prefix_caching=False, **extra)
        runs[label] = run_workload(cfg, workload, label, engine_factory=engine_factory)
    rows = []
    for label, res in runs.items():
        t = res.request_table()
        is_long = t["prompt_tokens"] == longest
        others = res.itl_samples_ms()
        others = others[others["request_id"].isin(t.loc[~is_long, "request_id"])]
        steps = res.step_table()
        long_steps = steps[steps["prefill_tokens"] > 0]
        rows.append({
            "실행": label,
            "토큰 예산": res.config.max_num_batched_tokens,
            "최대 동시 요청": res.config.max_num_seqs,
            "긴 요청 TTFT (ms)": _r(t.loc[is_long, "ttft_ms"].max()),
            "긴 요청 prefill 스텝 수": int(sum(1 for rec in res.records for s in rec.scheduled
                                          if s.phase != "decode" and s.num_prompt_tokens == longest)),
            "다른 요청 ITL 평균 (ms)": _r(others["itl_ms"].mean()) if len(others) else None,
            "다른 요청 ITL 최대 (ms)": _r(others["itl_ms"].max()) if len(others) else None,
            "다른 요청 TTFT 최대 (ms)": _r(t.loc[~is_long, "ttft_ms"].max()),
            "최대 스텝 토큰": int(steps["num_tokens"].max()) if len(steps) else 0,
            "최대 스텝 시간 (ms)": _r(steps["duration_ms"].max()) if len(steps) else None,
            "prefill 포함 스텝 수": len(long_steps),
            "전체 시간 (s)": round(res.wall_s, 3),
        })
    return ChunkedComparison(runs, pd.DataFrame(rows))


# -- chapter 04: the latest benchmark JSON -------------------------------------------------------


def latest_bench() -> dict | None:
    """`engine.bench.load_latest_results()` if that module exists and found a result; else None."""
    try:
        from engine import bench  # written by another part of the project; may be absent
    except Exception:
        return None
    loader = getattr(bench, "load_latest_results", None)
    if loader is None:
        return None
    try:
        return loader()
    except Exception:
        return None
