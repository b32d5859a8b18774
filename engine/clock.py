"""Two clocks for one engine: wall time, and engine time.

Wall time (time.perf_counter) includes everything, also a learner's pause between two presses of
"next step". Engine time advances only while the engine works — by each step's measured duration —
and jumps forward to a request's arrival when the engine is idle. In step mode it answers "how
long would this have taken if the engine had run on its own", which is what TTFT and TPOT mean.
A simulated executor advances it by computed durations instead of measured ones.
"""

from __future__ import annotations

import time


class EngineClock:
    def __init__(self) -> None:
        self._elapsed = 0.0  # engine seconds before the current step
        self._step_wall_start: float | None = None

    def now(self) -> float:
        """Engine seconds since the engine started (inside a step: plus the step's time so far)."""
        if self._step_wall_start is None:
            return self._elapsed
        return self._elapsed + (time.perf_counter() - self._step_wall_start)

    def start_step(self) -> None:
        self._step_wall_start = time.perf_counter()

    def end_step(self, duration: float | None = None) -> float:
        """Close the step: advance by `duration` (simulated) or by the wall time it took.
        Returns it."""
        measured = (
            time.perf_counter() - self._step_wall_start
            if self._step_wall_start is not None
            else 0.0
        )
        step_time = measured if duration is None else duration
        self._elapsed += step_time
        self._step_wall_start = None
        return step_time

    def advance_to(self, engine_time: float) -> None:
        """An idle engine waits for the next arrival: jump forward to it (never backwards)."""
        self._elapsed = max(self._elapsed, engine_time)
