"""The in-process executor: one worker in this process, the step a plain function call."""

from __future__ import annotations

from engine.executor.abstract import Executor
from engine.scheduler_output import SchedulerOutput
from engine.worker.model_runner import ModelRunnerOutput
from engine.worker.worker import Worker


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

    def fork(self, block_map: dict[int, int], num_blocks: int, num_swap_blocks: int, clock):
        twin = UniProcExecutor(self.worker.fork(block_map, num_blocks, num_swap_blocks))
        twin.num_blocks, twin.num_swap_blocks = num_blocks, num_swap_blocks
        return twin
