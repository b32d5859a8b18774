"""The executor interface: hand each step to the worker(s) and return what they produced.

engine/executor/uniproc.py runs one worker in this process; engine/executor/multiproc.py runs one
worker process per rank (tensor and pipeline parallel; the same step broadcast to all, the output
rank's samples returned); engine/tools/simulator.py has a simulated one (timings from a cost
model).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.scheduler_output import SchedulerOutput
from engine.worker.model_runner import ModelRunnerOutput


class ExecutorDiedError(RuntimeError):
    """The executor cannot go on (a worker process died, failed or hung); the engine stops."""


class ForkNotSupportedError(ValueError):
    """This executor's KV cache cannot be copied into a second engine."""


class Executor(ABC):
    num_blocks: int
    num_swap_blocks: int = 0  # host-memory blocks for swap preemption (0: none)

    @abstractmethod
    def initialize(self, max_model_len: int, num_swap_blocks: int | None = 0, **cache_args) -> int:
        """Load weights, size and allocate the KV cache, and a swap space of `num_swap_blocks`
        blocks in host memory (None: as many as the device has); return the device blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of model weights over all workers."""

    @abstractmethod
    def kv_cache_bytes(self) -> int:
        """Bytes of KV-cache memory over all workers."""

    def fork(self, block_map: dict[int, int], num_blocks: int, num_swap_blocks: int, clock):
        """An executor for a fork of the engine (EngineCore.fork): the same model, its own KV
        cache of `num_blocks` blocks holding this one's blocks renumbered by `block_map`, and
        `clock`, the forked engine's clock. Executors that cannot copy their cache refuse."""
        raise ForkNotSupportedError(f"{type(self).__name__} cannot fork its KV cache")

    def shutdown(self) -> None:
        pass
