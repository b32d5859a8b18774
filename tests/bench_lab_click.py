"""What one 다음 스텝 costs the server, without a browser: CPU seconds per click of the lab.

    .venv/bin/python tests/bench_lab_click.py --warm 20 --clicks 10

Runs tests/classroom_fragment_app.py (chapter 00's lab alone, the default model) under AppTest,
queues three prompts, steps --warm times (the figures have some history), then clicks 다음 스텝
--clicks times. For each click it reads the process's CPU seconds (user + system, every thread:
what the server pays; not wall time, so a busy shared machine slows it down but barely changes
it) and, separately, the CPU seconds spent inside `EngineCore.step`. Printed: the median click,
the engine step, and the rest (the lab's own rerun: figures, tables, Streamlit's marshalling).

AppTest reruns the whole (tiny) script where the real server reruns only the lab's fragment; the
script holds nothing but the lab, so the two differ by a few milliseconds. The websocket send is
not included; tests/load_classroom.py measures a real server with real browsers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "KV 캐시가 무엇인지 한 문장으로 설명해 주세요.",
]


def cpu() -> float:
    return time.process_time()  # user + system, every thread of this process


def profile_fragments(out: Path) -> None:
    """Profile every fragment run (the lab) from now on; cumulative stats written to `out`."""
    import cProfile
    import functools
    import pstats

    import streamlit as st

    fragment = st.fragment
    profile = cProfile.Profile()

    def profiled(func=None, *, run_every=None):
        def wrap(f):
            @functools.wraps(f)
            def run(*a, **k):
                profile.enable()
                try:
                    return f(*a, **k)
                finally:
                    profile.disable()
                    pstats.Stats(profile).dump_stats(out)

            return fragment(run, run_every=run_every)

        return wrap(func) if func is not None else wrap

    st.fragment = profiled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm", type=int, default=20, help="steps before measuring")
    ap.add_argument("--clicks", type=int, default=10, help="measured clicks")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3, choices=[1, 2, 3], help="prompts queued")
    ap.add_argument("--profile", type=Path, help="cProfile the measured clicks' lab runs to here")
    args = ap.parse_args()

    from streamlit.testing.v1 import AppTest

    from engine.core import EngineCore

    engine_cpu = [0.0]
    step = EngineCore.step

    def timed_step(self, *a, **k):
        t = cpu()
        try:
            return step(self, *a, **k)
        finally:
            engine_cpu[0] += cpu() - t

    EngineCore.step = timed_step
    at = AppTest.from_file(str(ROOT / "tests" / "classroom_fragment_app.py"), default_timeout=600)
    at.run()
    at.number_input(key="main_max_tokens").set_value(args.max_tokens).run()
    for prompt in PROMPTS[: args.requests]:
        at.text_area(key="main_custom").input(prompt)
        at.button(key="main_add_custom").click().run()
    for _ in range(args.warm):
        at.button(key="main_step").click().run()
    if args.profile:
        profile_fragments(args.profile)
    totals, engines = [], []
    for _ in range(args.clicks):
        engine_cpu[0] = 0.0
        t = cpu()
        at.button(key="main_step").click().run()
        totals.append(cpu() - t)
        engines.append(engine_cpu[0])
    assert not at.exception, [e.value for e in at.exception]
    rest = [a - b for a, b in zip(totals, engines)]
    med = statistics.median
    load = os.getloadavg()
    print(
        f"{args.clicks} clicks after {args.warm} warm steps ({args.requests} requests, max_tokens "
        f"{args.max_tokens}), load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, "
        f"{time.strftime('%H:%M:%S')}"
    )
    print(
        f"  CPU-s per click  median {med(totals):.3f}  (engine step {med(engines):.3f}, "
        f"lab rerun {med(rest):.3f}; lab rerun min {min(rest):.3f} max {max(rest):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
