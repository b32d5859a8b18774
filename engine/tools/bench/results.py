"""Where the benchmark's results live (bench-results/latest.json) and the name of the machine
they were measured on: a number without its conditions is not a measurement."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[3] / "bench-results"  # the repository root


LATEST_RESULTS = RESULTS_DIR / "latest.json"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{name} ({os.cpu_count()} logical CPUs)"


def save_results(results: dict, path: str | Path | None = None) -> Path:
    path = Path(path) if path else LATEST_RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False))
    return path


def load_latest_results(path: str | Path | None = None) -> dict | None:
    """The last benchmark's results (bench-results/latest.json), or None if it never ran."""
    path = Path(path) if path else LATEST_RESULTS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
