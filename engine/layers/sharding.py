"""Who holds what under tensor and pipeline parallelism: the pure maths, no tensors.

Rank layout, as vLLM numbers it: rank = pp_rank * tp + tp_rank, so the workers of one pipeline
stage are consecutive and form one tensor-parallel group. A rank holds the layers of its stage
(`stage_layers`), its query and KV heads (`head_ranges`) and its columns of the MLP
(`mlp_range`); engine/layers/linear.py cuts each weight by these ranges, the simulator and the
chapter-12 page plan with them without loading a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.models.config import LlamaConfig

if TYPE_CHECKING:  # for the annotations only: the plan needs no tensors
    import torch

# Each worker is a whole Python process with its own copy of the replicated weights; on a CPU more
# than this many is a mistake, not a plan. On CUDA the limit is the number of GPUs.
MAX_CPU_WORLD_SIZE = 16


def valid_tensor_parallel_sizes(cfg: LlamaConfig) -> list[int]:
    """tp sizes this model can be cut into: tp divides the query heads and the MLP width, and
    either divides the KV heads (split) or is a multiple of them (replicated)."""
    return [
        tp
        for tp in range(1, cfg.num_heads + 1)
        if cfg.num_heads % tp == 0
        and cfg.intermediate_size % tp == 0
        and (cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0)
    ]


def check_parallel_sizes(
    cfg: LlamaConfig, tp: int, pp: int, device: torch.device | None = None
) -> None:
    """Refuse sizes that cannot work, before any process starts (ValueError, with what works)."""
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    valid = valid_tensor_parallel_sizes(cfg)
    if tp not in valid:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide this model ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}); "
            f"sizes that work: {', '.join(map(str, valid))}"
        )
    if pp > cfg.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is more stages than the model's {cfg.num_layers} layers; "
            f"sizes that work: 1 to {cfg.num_layers}"
        )
    world = tp * pp
    if device is not None and device.type == "cuda":
        import torch  # only to count the GPUs: the plan itself needs no tensors

        count = torch.cuda.device_count()
        if world > count:
            raise ValueError(
                f"tensor_parallel_size × pipeline_parallel_size = {world} workers, but only "
                f"{count} CUDA device(s): one worker per GPU"
            )
    elif world > MAX_CPU_WORLD_SIZE:
        raise ValueError(
            f"tensor_parallel_size × pipeline_parallel_size = {world} CPU worker processes; at "
            f"most {MAX_CPU_WORLD_SIZE} (each one is a process with its own weights)"
        )


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Consecutive layers per stage, as even as possible; earlier stages take the remainder
    (the last stage also runs lm_head)."""
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def head_ranges(cfg: LlamaConfig, tp: int, tp_rank: int) -> tuple[range, range]:
    """The query heads and the KV heads tp rank `tp_rank` holds. Query head j reads KV head
    j // (num_heads / num_kv_heads), so a rank's query heads read exactly its KV heads."""
    q_per_rank = cfg.num_heads // tp
    q = range(tp_rank * q_per_rank, (tp_rank + 1) * q_per_rank)
    if cfg.num_kv_heads >= tp:
        kv_per_rank = cfg.num_kv_heads // tp
        kv = range(tp_rank * kv_per_rank, (tp_rank + 1) * kv_per_rank)
    else:  # more ranks than KV heads: each KV head lives on tp / num_kv_heads ranks
        head = tp_rank // (tp // cfg.num_kv_heads)
        kv = range(head, head + 1)
    return q, kv


def mlp_range(cfg: LlamaConfig, tp: int, tp_rank: int) -> range:
    width = cfg.intermediate_size // tp
    return range(tp_rank * width, (tp_rank + 1) * width)


def describe_layout(layout: list[dict]) -> str:
    """A few lines for the CLI: which rank holds what."""
    lines = []
    for r in layout:
        lines.append(
            f"rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}): layers "
            f"{r['layers'][0]}-{r['layers'][1] - 1}, query heads {r['q_heads'][0]}-"
            f"{r['q_heads'][1] - 1}, KV heads {r['kv_heads'][0]}-{r['kv_heads'][1] - 1}, "
            f"weights {r['weight_bytes'] / 2**20:.1f} MiB "
            f"({r['replicated_bytes'] / 2**20:.1f} MiB replicated), "
            f"KV cache {r['kv_cache_bytes'] / 2**20:.1f} MiB"
        )
    return "\n".join(lines)


def all_reduces_per_step(model_config: LlamaConfig, tp: int, pp: int) -> int:
    """Derived: 2 all-reduces per layer on every rank (after o, after down) when tp > 1; each
    rank runs its stage's layers."""
    if tp == 1:
        return 0
    return 2 * math.ceil(model_config.num_layers / pp)


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in a tensor × pipeline parallel world (rank = pp_rank × tp +
    tp_rank) and its communication: `comm` has all_reduce(t) inside the tensor-parallel group
    and send(t) / recv(shape, dtype, device) to the next / from the previous stage
    (engine/executor/multiproc.py's Comm). The default is one process with no peers."""

    tp: int = 1
    pp: int = 1
    rank: int = 0
    comm: object = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_output_rank(self) -> bool:
        """The first worker of the last stage (vLLM's driver worker): computes the logits and
        samples; lm_head is replicated, so one copy suffices."""
        return self.rank == self.tp * (self.pp - 1)
