"""Chapter 04 · 지연 시간과 처리량: metric definitions, percentiles, the latest bench JSON."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ui.experiments.common import RunResult, _r

METRIC_DEFINITIONS = {
    "TTFT": "도착 → 첫 출력 토큰 (대기 + prefill 포함)",
    "TPOT": "(마지막 토큰 시각 − 첫 토큰 시각) / (출력 토큰 수 − 1); 토큰이 1개면 정의되지 않음(—)",
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
        row = {
            "지표": name,
            "n": len(values),
            "평균 (ms)": _r(values.mean()) if len(values) else None,
        }
        for p in percentiles:
            row[f"p{p} (ms)"] = _r(np.percentile(values, p)) if len(values) else None
        row["최대 (ms)"] = _r(values.max()) if len(values) else None
        rows.append(row)
    return pd.DataFrame(rows)


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
