"""A hung worker, seen from the driver of the multi-process executor (engine/executor/multiproc.py).

A worker that dies closes its connections and the engine notices at once. A worker that hangs
(stopped by SIGSTOP, deadlocked, stuck in a collective with such a rank) closes nothing: the step
simply never ends. vLLM bounds each engine iteration (VLLM_ENGINE_ITERATION_TIMEOUT_S, 60 s) and
declares the engine dead past it; so does this engine (LLM_ENGINE_ITERATION_TIMEOUT_S,
engine/config.py). This module names the hung ranks for the error, and wakes stopped ones so that
shutdown's SIGTERM reaches them.
"""

from __future__ import annotations

import os
import signal

from engine.config import ENGINE_ITERATION_TIMEOUT_ENV


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R running, S sleeping, T stopped, Z zombie, ...);
    None where /proc does not have it (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0] if fields else None


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or by a tracer."""
    return process_state(pid) in ("T", "t")


def hung_step_message(what: str, timeout_s: float, processes: list) -> str:
    """Why a step was given up: the timeout that passed, and the stopped ranks if any."""
    stopped = [
        f"worker rank {rank} (pid {p.pid}) is stopped"
        for rank, p in enumerate(processes)
        if is_stopped(p.pid)
    ]
    cause = "; ".join(stopped) or "no worker answered (a rank is hung or deadlocked)"
    return (
        f"{what} did not finish within the engine iteration timeout ({timeout_s:g} s, "
        f"{ENGINE_ITERATION_TIMEOUT_ENV}): {cause}"
    )


def resume(pid: int) -> None:
    """SIGCONT: a stopped process acts on its pending SIGTERM only once it runs again."""
    try:
        os.kill(pid, signal.SIGCONT)
    except (ProcessLookupError, PermissionError):
        pass
