"""The executor: hands each step to the worker(s) and returns what they produced.

`UniProcExecutor` runs one worker in this process. engine/multiproc_executor.py runs one worker
process per rank (tensor and pipeline parallel; the same step broadcast to all, the output
rank's samples returned); engine/simulator.py has a simulated one (timings from a cost model).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.model_runner import ModelRunnerOutput
from engine.scheduler_output import SchedulerOutput
from engine.worker import Worker


class ExecutorDiedError(RuntimeError):
    """The executor cannot go on (a worker process died, failed or hung); the engine stops."""


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

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    """One worker in this process: the step is a plain function call."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.num_blocks = 0

    def initialize(self, max_model_len: int, num_swap_blocks: int | None = 0, **cache_args) -> int:
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks(max_model_len, **cache_args)
        self.num_swap_blocks = self.num_blocks if num_swap_blocks is None else num_swap_blocks
        self.worker.initialize_cache(self.num_blocks, self.num_swap_blocks)
        return self.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def weight_bytes(self) -> int:
        return self.worker.weight_bytes()

    def kv_cache_bytes(self) -> int:
        return self.worker.kv_cache_bytes()
