"""Chapter 04 · 지연 시간과 처리량: the lab's default workload and its claim, metric
definitions, percentiles, the journey's waits next to the table's, the latest bench JSON."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from engine.request import Request
from engine.tools.workload import percentile
from ui import figures
from ui.experiments.common import RunResult, Workload, _r

# The lab's defaults: six requests arrive at once, four may run. r4 and r5 wait in the queue until
# r0–r3 finish, and that wait is most of their TTFT: the chapter's "TTFT includes the wait".
DEFAULT_REQUESTS = 6
DEFAULT_PROMPT_LEN = 32
DEFAULT_OUTPUT_LEN = 24
DEFAULT_MAX_NUM_SEQS = 4
DEFAULT_GAP_MS = 0

CLAIM = (
    "요청 6개가 한꺼번에 도착하지만 동시에 돌 수 있는 요청은 4개라서, r4·r5는 앞의 네 요청이 "
    "끝날 때까지 대기열에서 기다립니다. 그 대기가 고스란히 TTFT에 더해져 r4·r5의 TTFT는 "
    "r0–r3보다 몇 배 길고, 스윔레인의 대기열 막대는 표의 대기와 같은 길이입니다."
)


def lab_workload(
    num_requests: int = DEFAULT_REQUESTS,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    gap_ms: float = DEFAULT_GAP_MS,
) -> Workload:
    """The lab's workload (its sliders' values; the defaults are the claim's workload)."""
    return Workload.uniform(num_requests, prompt_len, output_len, gap_ms)


def engine_overrides(max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> dict:
    """The lab engine's settings over the sidebar's: the slider's concurrency, and no prefix
    caching (the prompts share text; a hit would hide part of the prefill being measured)."""
    return dict(max_num_seqs=max_num_seqs, enable_prefix_caching=False)


@dataclass
class QueueEffect:
    """What the default run shows: who waited for a running slot, and what it cost their TTFT."""

    waited: list[str]  # requests first scheduled after some other request had finished
    served: list[str]  # the others
    min_waited_ttft_ms: float | None
    max_served_ttft_ms: float | None
    min_wait_share: float | None  # of the waited requests: the smallest wait / TTFT

    @property
    def ttft_ratio(self) -> float | None:
        """The waited requests' shortest TTFT over the served requests' longest (the claim: >1)."""
        if not self.min_waited_ttft_ms or not self.max_served_ttft_ms:
            return None
        return self.min_waited_ttft_ms / self.max_served_ttft_ms


def queue_effect(result: RunResult) -> QueueEffect:
    """Split the requests into those that had to wait for another to finish and those that did
    not (by steps, not by times), and compare their TTFTs (engine clock)."""
    t = result.request_table()
    first_finish = t["finish_step"].min()
    late = t["first_step"] > first_finish
    waited, served = t[late], t[~late]
    shares = (waited["queue_ms"] / waited["ttft_ms"]).dropna()
    return QueueEffect(
        list(waited["request_id"]),
        list(served["request_id"]),
        _r(waited["ttft_ms"].min()) if len(waited) else None,
        _r(served["ttft_ms"].max()) if len(served) else None,
        float(shares.min()) if len(shares) else None,
    )


def journey_waits(requests: list[Request], t0: float | None = None) -> pd.DataFrame:
    """Per request, the table's 대기 (RequestMetrics.queue_time, engine clock) next to what the
    swimlane draws before its first scheduling: the tokenize segment and the 대기열 segment (ms).
    tokenize + 대기열 = 대기, so a learner can check one view against the other."""
    spec = figures.journey_spec(requests, t0, clock="engine")
    segments: dict[tuple[str, str], float] = {}
    for trace in spec["data"]:
        if trace.get("name") not in ("tokenize", "대기열"):
            continue
        for start, end, *_rest, rid in trace["customdata"]:
            segments.setdefault((rid, trace["name"]), end - start)
    rows = []
    for r in requests:
        queue = r.metrics("engine").queue_time
        rows.append(
            {
                "요청": r.request_id,
                "대기 (표, ms)": None if queue is None else round(1000 * queue, 2),
                "tokenize 막대 (ms)": _r(segments.get((r.request_id, "tokenize")), 3),
                "대기열 막대 (ms)": _r(segments.get((r.request_id, "대기열")), 2),
            }
        )
    return pd.DataFrame(rows)


METRIC_DEFINITIONS = {
    "TTFT": "도착 → 첫 출력 토큰 (대기 + prefill 포함)",
    "TPOT": "(마지막 토큰 시각 − 첫 토큰 시각) / (출력 토큰 수 − 1); 토큰이 1개면 정의되지 않음(—)",
    "ITL": "연속한 두 출력 토큰 사이의 간격 (모든 요청의 간격을 모두 표본으로)",
    "E2E": "도착 → 마지막 토큰",
    "처리량": "전체 출력 토큰 수 / (첫 도착 → 마지막 완료) 시간",
}


def percentile_table(result: RunResult, percentiles=(50, 90, 99)) -> pd.DataFrame:
    """n, mean and percentiles (engine/tools/workload.py's, linear interpolation as numpy's) of
    TTFT, TPOT, ITL, E2E in ms."""
    t = result.request_table()
    samples = {
        "TTFT": t["ttft_ms"].dropna().to_numpy(),
        "TPOT": t["tpot_ms"].dropna().to_numpy(),
        "ITL": result.itl_samples_ms()["itl_ms"].to_numpy(),
        "E2E": t["e2e_ms"].dropna().to_numpy(),
    }
    rows = []
    for name, values in samples.items():
        row = {
            "지표": name,
            "n": len(values),
            "평균 (ms)": _r(values.mean()) if len(values) else None,
        }
        for p in percentiles:
            row[f"p{p} (ms)"] = _r(percentile(values, p))
        row["최대 (ms)"] = _r(values.max()) if len(values) else None
        rows.append(row)
    return pd.DataFrame(rows)


def batch1_line(b1: dict) -> str:
    """The bench's batch-1 decode against its roofline: the bandwidth sampled just before and
    after that decode, and (bench runs since 2026-12-05) the run's best sample beside it."""
    line = f"bench의 배치 1 decode: {b1['tokens_per_s']:.1f} 토큰/s = 루프라인의 "
    line += f"{100 * (b1.get('fraction_of_roofline') or 0):.0f}%"
    if b1.get("fraction_of_best_roofline") and b1.get("bandwidth_gb_s"):
        line += (
            f" (바로 앞뒤에서 잰 대역폭 {b1['bandwidth_gb_s']:.1f} GB/s 기준; 이 실행의 "
            f"최고 대역폭 기준으로는 {100 * b1['fraction_of_best_roofline']:.0f}%)"
        )
    return line


def bench_conditions(c: dict) -> dict:
    """The evidence conditions of a bench result's numbers: the machine, threads, dtype, model,
    date, and the load average of the run (바쁨 when other programs shared the machine)."""
    cond = {
        "장치": c.get("device_name") or c.get("device"),
        "스레드": c.get("threads"),
        "dtype": c.get("dtype"),
        "모델": c.get("model_name"),
        "날짜": c.get("date"),
    }
    if "load_before" in c:  # a run under other programs' load carries their noise: say so
        busy = " (바쁨: 다른 프로그램과 함께 측정)" if c.get("busy") else ""
        cond["부하 평균"] = f"{c['load_before']:.2f}→{c['load_after']:.2f}{busy}"
    return cond


def latest_bench() -> dict | None:
    """`engine.tools.bench.results.load_latest_results()` if it found a result; else None."""
    try:
        from engine.tools.bench import results as bench  # may be absent
    except Exception:
        return None
    loader = getattr(bench, "load_latest_results", None)
    if loader is None:
        return None
    try:
        return loader()
    except Exception:
        return None
