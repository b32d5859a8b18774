"""The cost model: how long one engine step takes, computed from the step's batch.

A step runs every weight matrix once over all its tokens, attention once per request, and (with
tensor parallelism) two all-reduces per layer. Each part is limited either by moving bytes or by
doing arithmetic, whichever takes longer (the roofline):

    linear group g: max(bytes_g / (bandwidth × e_mem),
                        2 × tokens × params_g / (peak × e_flop) × (1 + ramp / tokens))
    attention r:    max(KV bytes read_r / bandwidth, attention FLOPs_r / peak) / e_attn
    all-reduce:     2 × layers × (2(N−1)/N × tokens × hidden × bytes / (link × e_link) + latency)
    step            = overhead + per-request overhead × requests + linears + attention + all-reduce

The efficiencies e_* say how much of the hardware's peak each part reaches. A matmul over few
rows reaches less of the peak FLOP/s than a big one (the work is too small to fill the machine);
`ramp` says by how much: a step of `tokens` rows computes as if it had tokens + ramp (on this
2-core CPU oneDNN ran 32 rows at 90 GFLOP/s and 512 rows at over 200). They are fitted from
the real engine's step times on this machine (engine/tools/calibration.py); for a vendor preset
they are assumptions, labelled as such, unless the caller passes fitted ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.models.config import LlamaConfig
from engine.tools.presets import DTYPE_BYTES, HardwarePreset


@dataclass
class Efficiency:
    """Fractions of peak each part of a step reaches, and fixed costs (seconds)."""

    linear_memory: float = 0.75  # of memory bandwidth, when a linear is bound by reading weights
    linear_compute: float = 0.55  # of peak FLOP/s, when a linear is bound by arithmetic
    linear_compute_ramp_tokens: float = 0.0  # extra rows a small matmul costs as (see above)
    attention: float = 0.5  # of the attention roofline (KV bytes or FLOPs, whichever is slower)
    interconnect: float = 0.7  # of the link's per-direction bandwidth, for all-reduces
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce (launch and sync)
    step_overhead_s: float = 2e-3  # per step: scheduling, input preparation, output processing
    per_request_s: float = 0.0  # per scheduled request: its share of the same bookkeeping
    evidence: str = (
        "assumed: typical fractions for a tuned GPU server (vLLM-class), not fitted; "
        "run a calibration on the GPU for fitted ones"
    )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepCost:
    """One step's computed time and its parts (seconds); `terms` are at 100 % efficiency."""

    linear_s: float
    attention_s: float
    allreduce_s: float
    overhead_s: float
    total_s: float
    memory_bound: bool  # whether the layers' linears were limited by bandwidth
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def model_s(self) -> float:
        """The forward pass alone (what a real step's "forward" timing measures)."""
        return self.linear_s + self.attention_s + self.allreduce_s


def compute_seconds(compute_s: float, rows: float, e: Efficiency) -> float:
    """A group of linears' arithmetic at e's efficiency, with the small-matmul ramp for `rows`."""
    return compute_s * (1 + e.linear_compute_ramp_tokens / max(rows, 1)) / e.linear_compute


def memory_bound(memory_s: float, compute_s: float, rows: float, e: Efficiency) -> bool:
    """Whether a group of linears is limited by reading its weights (not by arithmetic)."""
    return memory_s / e.linear_memory >= compute_seconds(compute_s, rows, e)


def linear_seconds(memory_s: float, compute_s: float, rows: float, e: Efficiency) -> float:
    """One group of linears: the slower of reading its weights and computing with them."""
    return max(memory_s / e.linear_memory, compute_seconds(compute_s, rows, e))


def step_parts(t: dict, e: Efficiency) -> dict[str, float]:
    """A step's seconds by part, from its roofline terms (CostModel.terms) and efficiencies."""
    return {
        "layers": linear_seconds(t["layer_memory_s"], t["layer_compute_s"], t["tokens"], e),
        "head": linear_seconds(t["head_memory_s"], t["head_compute_s"], t["sampled"], e),
        "attention": t["attention_s"] / e.attention,
        "allreduce": t["allreduce_transfer_s"] / e.interconnect
        + t["allreduce_count"] * e.allreduce_latency_s,
        "overhead": e.step_overhead_s + e.per_request_s * t["requests"],
    }


def layers_memory_bound(t: dict, e: Efficiency) -> bool:
    """Whether the layers' linears are limited by reading their weights (not by arithmetic)."""
    return memory_bound(t["layer_memory_s"], t["layer_compute_s"], t["tokens"], e)


class CostModel:
    def __init__(
        self,
        model: LlamaConfig,
        hardware: HardwarePreset,
        tensor_parallel_size: int = 1,
        efficiency: Efficiency | None = None,
        dtype: str | None = None,
    ):
        self.model = model
        self.hardware = hardware
        self.tp = tensor_parallel_size
        self.efficiency = efficiency or Efficiency()
        self.dtype = dtype or hardware.dtype
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        c = model
        h, d = c.hidden_size, c.head_dim
        # Parameters of each operator group, per GPU (tensor parallel splits every matrix N ways).
        per_layer = {
            "qkv": h * (c.num_heads + 2 * c.num_kv_heads) * d,
            "o": c.num_heads * d * h,
            "gate_up": 2 * h * c.intermediate_size,
            "down": c.intermediate_size * h,
        }
        self.layer_params = {k: v / self.tp for k, v in per_layer.items()}
        self.lm_head_params = c.vocab_size * h / self.tp
        self.kv_heads_per_gpu = max(c.num_kv_heads // self.tp, 1)  # replicated when N > KV heads
        # per GPU
        self.kv_bytes_per_token = 2 * c.num_layers * self.kv_heads_per_gpu * d * self.dtype_bytes
        self.heads_per_gpu = c.num_heads / self.tp

    # -- the terms (seconds at 100 % of peak) -------------------------------------------------

    def terms(self, batch: list[tuple[int, int]], num_sampled: int) -> dict[str, float]:
        """Roofline terms of one step. `batch`: (new tokens, tokens already cached) per request;
        `num_sampled`: requests that produce a token (rows of the LM head)."""
        hw, c, b = self.hardware, self.model, self.dtype_bytes
        tokens = sum(n for n, _ in batch)
        layer_mem = layer_flop = 0.0
        for params in self.layer_params.values():
            layer_mem += c.num_layers * params * b / hw.memory_bandwidth
            layer_flop += c.num_layers * 2 * tokens * params / hw.peak_flops
        head_mem = self.lm_head_params * b / hw.memory_bandwidth if num_sampled else 0.0
        head_flop = 2 * num_sampled * self.lm_head_params / hw.peak_flops
        attention = 0.0
        for new, cached in batch:
            kv_read = (cached + new) * self.kv_bytes_per_token
            # each new token i attends to cached + i + 1 keys: QKᵀ and PV, 2 FLOP per multiply-add
            pairs = new * cached + new * (new + 1) / 2
            flops = 4 * c.num_layers * self.heads_per_gpu * c.head_dim * pairs
            attention += max(kv_read / hw.memory_bandwidth, flops / hw.peak_flops)
        allreduce_bytes = tokens * c.hidden_size * b
        ring = 2 * (self.tp - 1) / self.tp if self.tp > 1 else 0.0
        # per direction
        link = hw.interconnect_bandwidth / 2 if hw.interconnect_bandwidth else float("inf")
        return {
            "tokens": tokens,
            "requests": len(batch),
            "sampled": num_sampled,
            "layer_memory_s": layer_mem,
            "layer_compute_s": layer_flop,
            "head_memory_s": head_mem,
            "head_compute_s": head_flop,
            "attention_s": attention,
            "allreduce_count": 2 * c.num_layers if self.tp > 1 else 0,
            "allreduce_transfer_s": 2 * c.num_layers * ring * allreduce_bytes / link
            if self.tp > 1
            else 0.0,
        }

    # -- the step time --------------------------------------------------------------------------

    def step_cost(self, batch: list[tuple[int, int]], num_sampled: int) -> StepCost:
        t = self.terms(batch, num_sampled)
        p = step_parts(t, self.efficiency)
        total = sum(p.values())
        return StepCost(
            p["layers"] + p["head"],
            p["attention"],
            p["allreduce"],
            p["overhead"],
            total,
            layers_memory_bound(t, self.efficiency),
            t,
        )
