"""Run `python -m engine bench --quick` from the app, reporting its [k/5] stages as progress."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
STAGE = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)")


def run_quick_bench(
    on_progress: Callable[[float, str], None], timeout_s: float = 1800
) -> tuple[int, str]:
    """Run the quick benchmark in a child process; on_progress(fraction, text) per stage line.
    Returns (exit code, the last lines of its output)."""
    cmd = [sys.executable, "-m", "engine", "bench", "--quick"]
    start = time.perf_counter()
    tail: list[str] = []
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-20:]
            m = STAGE.match(line)
            if m:
                k, n = int(m.group(1)), int(m.group(2))
                elapsed = time.perf_counter() - start
                done = (k - 1) / n
                left = elapsed / done * (1 - done) if done > 0 else None
                text = f"단계 {k}/{n}: {m.group(3)[:60]}"
                if left:
                    text += f" · 남은 시간 약 {left:.0f} s"
                on_progress(done, text)
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                return -1, "\n".join(tail)
        code = proc.wait()
    on_progress(1.0, "완료")
    return code, "\n".join(tail)
