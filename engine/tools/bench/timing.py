"""Timing helpers every section shares: the best of N timed calls (the machine's best, not its
average) and a guarded ratio of two rates."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(
    fn, device: torch.device, repeats: int, budget_s: float = 20.0, inner: int = 1
) -> float:
    """Shortest of `repeats` timed calls (after one warm-up): the machine's best, not its
    average. Past `budget_s` seconds, and after at least 2 calls, it stops early: a CPU without
    bfloat16 instructions takes ~40 s for one 2048² bfloat16 matmul, and ten of them would add
    minutes to the bench for no better an answer. `inner` calls run back to back per timing
    (the time is their mean): a GPU kernel of tens of microseconds would otherwise be timed
    together with the launch and the synchronisation around it."""
    return best_times({"call": fn}, device, repeats, budget_s, inner)["call"]


def best_times(
    fns: dict, device: torch.device, repeats: int, budget_s: float = 60.0, inner: int = 1
) -> dict:
    """name: best_time of fns[name], the calls taking turns (each warmed up once, then one
    timing of each per round). Paths compared with each other share each minute of the machine;
    timed one after another, a slow minute of a VM lands on one of them (docs/performance.md,
    twenty-ninth session). Past `budget_s`, after two rounds, it stops."""
    for fn in fns.values():
        fn()
    sync(device)
    best, began = dict.fromkeys(fns, float("inf")), time.perf_counter()
    for i in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            best[name] = min(best[name], (time.perf_counter() - start) / inner)
        if i >= 1 and time.perf_counter() - began > budget_s:
            break
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    """a ÷ b, or None when either is missing (or zero)."""
    return a / b if a and b else None
