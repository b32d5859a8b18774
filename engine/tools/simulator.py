"""What-if at scale: the engine's own scheduler and KV-cache manager on a virtual clock.

A real step runs the model; a simulated step asks a cost model how long the model *would* take
on the chosen hardware (engine/tools/cost_model.py) and makes up the sampled tokens. Everything else
is the real engine, unchanged: EngineCore, Scheduler, KVCacheManager, the journeys, StepRecords
and RequestMetrics. So a learner on a laptop can ask "1,000 requests at 4 per second on an H100
with Llama-3.1-8B: what are TTFT and TPOT, and does the KV cache run out?" and get the answer the
same scheduler would produce, in seconds.

    engine = make_simulated_engine("llama-3.1-8b", "h100-sxm", max_num_seqs=64)
    engine.add_request(prompt_token_ids=[...], sampling_params=SamplingParams(max_tokens=100))
    record = engine.step()        # a StepRecord whose engine_duration is the computed step time

    result = simulate("llama-3.1-8b", "h100-sxm", rate=4, num_requests=1000)

The output-length model is the one benchmark simulators use: each request's target length is
drawn from the workload; the simulated sampler emits a non-EOS token until the target, then EOS
(or, with ignore_eos, lets max_tokens end the request).

Tensor and pipeline parallel (chapter 12 at scale): with tensor_parallel_size ×
pipeline_parallel_size > 1 the simulated executor also reports what the real one
(engine/executor/multiproc.py) reports, from the preset's shapes instead of tensors: `layout()`
(which rank holds which layers, heads, MLP columns, shard shapes and bytes, computed with the
real executor's own `stage_layers`, `head_ranges` and `mlp_range`) and, per step, one `workers`
entry per rank (compute vs communication seconds, all-reduce count and bytes, activation bytes
sent between stages), computed by the cost model. `SimulatedExecutor.worker_timings` has the
formula.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

from engine.clock import EngineClock
from engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    EngineConfig,
    default_cpu_kv_cache_bytes,
)
from engine.executor.abstract import Executor
from engine.layers.sharding import (
    all_reduces_per_step,
    head_ranges,
    mlp_range,
    stage_layers,
    valid_tensor_parallel_sizes,
)
from engine.request import Request, RequestMetrics
from engine.sample.sampler import SampleResult
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.tools.cost_model import CostModel, Efficiency, StepCost, step_parts
from engine.tools.presets import (
    DTYPE_BYTES,
    GB,
    THIS_MACHINE,
    HardwarePreset,
    ModelPreset,
    PresetError,
    load_hardware_preset,
    load_model_preset,
)
from engine.tools.workload import SimRequest, percentiles, poisson_workload, run_workload
from engine.trace import StepRecord
from engine.utils import cdiv
from engine.worker.model_runner import ModelRunnerOutput

RUNTIME_RESERVE_BYTES = 1 * GB  # assumed: CUDA context, kernels' workspace, allocator slack


# ---------------------------------------------------------------------------------------------
# A tokenizer stand-in: presets have no tokenizer of their vocabulary


class SimTokenizer:
    """Ids ↔ placeholder text. Enough for the output processor (it decodes ids to text) and for
    a text prompt (one id per whitespace-separated word, stable across runs)."""

    def __init__(
        self, vocab_size: int, bos_token_id: int | None = None, eos_token_id: int | None = None
    ):
        self._vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.bos_token, self.eos_token = "<s>", "</s>"
        self.special_token_ids = {t for t in (bos_token_id, eos_token_id) if t is not None}
        self.chat_template = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def token_to_id(self, token: str) -> int | None:
        return {"<s>": self.bos_token_id, "</s>": self.eos_token_id}.get(token)

    def _word_id(self, word: str) -> int:
        low = max(self.special_token_ids, default=-1) + 1
        return low + zlib.crc32(word.encode()) % (self._vocab_size - low)

    def encode(self, text: str) -> list[int]:
        bos = [self.bos_token_id] if self.bos_token_id is not None else []
        return bos + [self._word_id(w) for w in text.split()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """One " ·" per token: placeholder text of the right length (runs for every token)."""
        specials = (
            sum(1 for t in token_ids if t in self.special_token_ids) if skip_special_tokens else 0
        )
        return " ·" * (len(token_ids) - specials)

    def token_pieces(self, text: str) -> list[tuple[int, str]]:
        return [(self._word_id(w), w) for w in text.split()]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return " ".join(f"{m['role']}: {m['content']}" for m in messages)


# ---------------------------------------------------------------------------------------------
# A virtual engine clock


class VirtualClock(EngineClock):
    """Engine time that moves only by computed step durations, never by wall time.

    The real clock's "now" inside a step is the step's start plus the wall time so far, so a token
    recorded at the end of a step is stamped with (about) the step's end. Here the executor sets
    the step's computed duration as soon as it knows it, and "now" inside the step is its start
    plus that: tokens are stamped at the step's computed end, decisions at its start."""

    def __init__(self) -> None:
        super().__init__()
        self.step_duration: float | None = None  # of the step in progress, once computed

    def now(self) -> float:
        return self._elapsed + (self.step_duration or 0.0)

    def start_step(self) -> None:
        self.step_duration = None

    def end_step(self, duration: float | None = None) -> float:
        step_time = duration if duration is not None else (self.step_duration or 0.0)
        self._elapsed += step_time
        self.step_duration = None
        return step_time


# ---------------------------------------------------------------------------------------------
# KV capacity from the memory budget


@dataclass
class MemoryPlan:
    """Per GPU: usable memory − weights − activation reserve = KV budget (computed)."""

    usable_bytes: int  # memory × gpu_memory_utilization
    weight_bytes: int  # per GPU (weights split over tensor-parallel ranks)
    activation_bytes: int  # the largest step's activations + logits, plus a runtime reserve
    kv_budget_bytes: int
    bytes_per_block: (
        int  # per GPU: 2 × layers × KV heads per GPU × head_dim × dtype bytes × block size
    )
    num_blocks: int
    formula: str = (
        "blocks = (memory × gpu_memory_utilization − weights/(tp × pp) − activation reserve) ÷ "
        "(2 × ⌈layers/pp⌉ × KV heads/tp × head_dim × dtype bytes × block_size)"
    )


def plan_memory(
    preset: ModelPreset,
    hardware: HardwarePreset,
    tp: int,
    block_size: int,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    pp: int = 1,
) -> MemoryPlan:
    """Chapter 05's budget, per GPU. Raises PresetError, saying by how much, if it does not fit.
    With pipeline parallel (pp stages) each GPU holds 1/pp of the weights and the KV cache of
    its stage's layers (the largest stage: ceil(layers / pp))."""
    c, b = preset.config, DTYPE_BYTES[hardware.dtype]
    usable = int(hardware.memory_bytes * utilization)
    weights = preset.num_parameters() * b // (tp * pp)
    # Activations of the largest step: a few hidden-sized vectors and the MLP's two intermediate
    # ones per token, plus float32 logits of every sampling row (computed estimate).
    per_token = (
        4 * c.hidden_size
        + (2 * c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim) // tp
    )
    activations = (
        max_num_batched_tokens * per_token * b
        + max_num_seqs * c.vocab_size * 4
        + RUNTIME_RESERVE_BYTES
    )
    kv_heads = max(c.num_kv_heads // tp, 1)
    per_block = 2 * math.ceil(c.num_layers / pp) * kv_heads * c.head_dim * b * block_size
    budget = usable - weights - activations
    if budget < per_block:
        gpus = f"{tp}" if pp == 1 else f"{tp * pp} (tp {tp} × pp {pp})"
        raise PresetError(
            f"{preset.name} does not fit {hardware.name} × {gpus}: per GPU it needs "
            f"{weights / GB:.1f} GB of "
            f"{hardware.dtype} weights + {activations / GB:.1f} GB activation reserve, but "
            f"{hardware.memory_bytes / GB:.0f} GB × {utilization:.2f} = {usable / GB:.1f} GB "
            "is usable: "
            f"{(weights + activations - usable) / GB:.1f} GB short (before any KV cache); "
            f"try a larger --tensor-parallel-size or a GPU with more memory"
        )
    return MemoryPlan(usable, weights, activations, budget, per_block, budget // per_block)


# ---------------------------------------------------------------------------------------------
# The simulated executor


class SimulatedExecutor(Executor):
    """An Executor with no weights and no tensors: each step's time comes from the cost model,
    its tokens from the output-length model.

    With tensor_parallel_size × pipeline_parallel_size > 1 it stands for MultiprocExecutor's
    worker processes on that many GPUs: `layout()` says what each rank would hold and every
    step's output carries one `workers` entry per rank (see `worker_timings`). The scheduler
    sees none of it: its decisions do not depend on tp or pp (only the KV capacity does)."""

    def __init__(
        self,
        preset: ModelPreset,
        hardware: HardwarePreset,
        block_size: int,
        tensor_parallel_size: int = 1,
        efficiency: Efficiency | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        output_len: Callable[[str], int | None] | None = None,
        filler_token_id: int | None = None,
        pipeline_parallel_size: int = 1,
    ):
        tp, pp, cfg = tensor_parallel_size, pipeline_parallel_size, preset.config
        for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if tp not in valid_tensor_parallel_sizes(cfg):
            raise ValueError(
                f"{preset.name} has {cfg.num_heads} attention heads and {cfg.num_kv_heads} KV "
                f"heads (MLP width {cfg.intermediate_size}), which {tp} GPUs cannot share evenly; "
                f"sizes that work: {', '.join(map(str, valid_tensor_parallel_sizes(cfg)))}"
            )
        if pp > cfg.num_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} is more stages than {preset.name}'s "
                f"{cfg.num_layers} layers"
            )
        if tp * pp > 1 and not hardware.interconnect_bandwidth:
            raise ValueError(
                f"{hardware.name} has no interconnect figure: tensor or pipeline parallel "
                "cannot be simulated"
            )
        self.preset, self.hardware, self.block_size = preset, hardware, block_size
        self.tp, self.pp = tp, pp
        self.max_num_seqs = max_num_seqs
        self.cost_model = CostModel(preset.config, hardware, tensor_parallel_size, efficiency)
        self.output_len = output_len or (lambda request_id: None)  # None: max_tokens ends it
        specials = {preset.bos_token_id, preset.eos_token_id}
        self.filler_token_id = (
            filler_token_id
            if filler_token_id is not None
            else next(t for t in range(preset.config.vocab_size) if t not in specials)
        )
        self.num_emitted: dict[str, int] = {}  # tokens sampled so far per live request
        self.costs: list[StepCost] = []  # one per executed step, in order (what the lab plots)
        self.memory: MemoryPlan | None = None
        self.num_blocks = 0
        self.clock = VirtualClock()  # the engine's clock (make_simulated_engine installs it)
        self._layout: list[dict] = []

    def initialize(
        self,
        max_model_len: int,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        num_swap_blocks: int | None = 0,
    ) -> int:
        """The KV capacity from the memory budget. A swap space only counts blocks here: the
        cost model has no term for the copies (swap preemption is simulated as free)."""
        from engine.worker.worker import CacheTooSmallError

        self.memory = plan_memory(
            self.preset,
            self.hardware,
            self.tp,
            self.block_size,
            gpu_memory_utilization,
            max_num_batched_tokens,
            self.max_num_seqs,
            self.pp,
        )
        if num_kv_blocks is None:
            if kv_cache_memory is None and self.hardware.kind == "cpu":  # as the real engine
                kv_cache_memory = default_cpu_kv_cache_bytes(
                    self.memory.bytes_per_block * self.tp * self.pp,
                    self.block_size,
                    max_model_len,
                    self.max_num_seqs,
                )
            if kv_cache_memory is not None:  # bytes over all GPUs, like the real engine's setting
                num_kv_blocks = kv_cache_memory // (self.memory.bytes_per_block * self.tp * self.pp)
            else:
                num_kv_blocks = self.memory.num_blocks
        needed = cdiv(max_model_len, self.block_size)
        if num_kv_blocks < needed:
            raise CacheTooSmallError(num_kv_blocks, self.block_size, max_model_len)
        self.num_blocks = num_kv_blocks
        self.num_swap_blocks = num_kv_blocks if num_swap_blocks is None else num_swap_blocks
        self._layout = self._compute_layout() if self.tp * self.pp > 1 else []
        return num_kv_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_ids:
            self.num_emitted.pop(request_id, None)
        if scheduler_output.is_empty:
            return ModelRunnerOutput({}, simulated_duration=0.0)
        producing = [s for s in scheduler_output.scheduled if s.produces_token]
        cost = self.cost_model.step_cost(
            [(s.num_tokens, s.num_computed_tokens) for s in scheduler_output.scheduled],
            len(producing),
        )
        workers: list[dict] = []
        if self.tp * self.pp > 1:
            workers, model_s = self.worker_timings(cost)
            if self.pp > 1:  # the stages' hand-offs add to the step
                terms = {**cost.terms, "p2p_s": model_s - cost.model_s}
                cost = dataclasses.replace(cost, total_s=cost.overhead_s + model_s, terms=terms)
            control = len(pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL))
            for w in workers:
                w["control_bytes"] = control  # what the real executor sends each worker
                w["round_trip_s"] = model_s  # computed: no pipes, no processes here
        self.costs.append(cost)
        # tokens of this step are stamped at its computed end
        self.clock.step_duration = cost.total_s
        sampled = {
            s.request_id: [SampleResult(self._next_token(s.request_id, s.sampling_params))]
            for s in producing
        }
        forward = cost.total_s - cost.overhead_s
        timings = {"prepare_inputs": 0.0, "forward": forward, "sample": 0.0}  # computed
        return ModelRunnerOutput(sampled, timings, simulated_duration=cost.total_s, workers=workers)

    def worker_timings(self, cost: StepCost) -> tuple[list[dict], float]:
        """Per rank, what MultiprocExecutor's workers measure, computed from the step's cost
        (all computed values, seconds), and the forward's total time over all stages.

        With L layers, stage s running n_s of them, T tokens in the step, hidden size h and
        b bytes per value:

            compute_s(s)  = n_s / L × (linear layers + attention) [+ lm_head on the last stage]
            all-reduce(s) = n_s / L × the cost model's all-reduce term
                          = 2 n_s × (2(tp−1)/tp × T·h·b / (link/2 × e_link) + latency), tp > 1
            hand-off      = T·h·b / (link/2 × e_link) + latency, per stage boundary (pp > 1)
            start(s)      = Σ_{j<s} (compute_s(j) + all-reduce(j) + hand-off)
            step_s(s)     = start(s) + compute_s(s) + all-reduce(s) [+ hand-off if s < pp − 1]
            comm_s(s)     = step_s(s) − compute_s(s)

        So, as in the real executor, the stages run one after the other (only one works at a
        time) and a later stage's communication includes its wait for the earlier ones (the real
        worker's receive includes that wait too). The step's fixed overhead (scheduling, input
        preparation, output processing) is the engine's, not a worker's. The forward's total is
        start(pp − 1) + compute_s + all-reduce of the last stage: with pp 1 exactly the cost
        model's forward, with pp > 1 that plus (pp − 1) hand-offs. Counts and bytes:
        all_reduce_count = 2 n_s (tp > 1; all_reduces_per_step's figure for the largest stage),
        all_reduce_bytes = count × T·h·b, p2p_bytes = T·h·b per neighbour stage (received from
        the previous, sent to the next)."""
        c, e = self.preset.config, self.cost_model.efficiency
        b = self.cost_model.dtype_bytes
        t = cost.terms
        tokens = int(t["tokens"])
        layers_s = step_parts(t, e)["layers"]
        head_s = cost.linear_s - layers_s
        per_layer = (layers_s + cost.attention_s) / c.num_layers
        allreduce_per_layer = cost.allreduce_s / c.num_layers
        hidden_bytes = tokens * c.hidden_size * b
        link = self.hardware.interconnect_bandwidth / 2  # per direction
        hand_off = hidden_bytes / (link * e.interconnect) + e.allreduce_latency_s
        workers, start, total = [], 0.0, 0.0
        for pp_rank, layers in enumerate(stage_layers(c.num_layers, self.pp)):
            last = pp_rank == self.pp - 1
            compute = len(layers) * per_layer + (head_s if last else 0.0)
            allreduce = len(layers) * allreduce_per_layer
            step = start + compute + allreduce + (0.0 if last else hand_off)
            count = 2 * len(layers) if self.tp > 1 else 0
            for tp_rank in range(self.tp):
                workers.append(
                    {
                        "rank": pp_rank * self.tp + tp_rank,
                        "tp_rank": tp_rank,
                        "pp_rank": pp_rank,
                        "step_s": step,
                        "compute_s": compute,
                        "comm_s": step - compute,
                        "all_reduce_count": count,
                        "all_reduce_bytes": count * hidden_bytes,
                        "p2p_bytes": hidden_bytes * ((pp_rank > 0) + (not last)),
                    }
                )
            total = start + compute + allreduce
            start = step
        return workers, total

    def _compute_layout(self) -> list[dict]:
        """Per rank, what MultiprocExecutor's rank_layout() reports, from the shapes:
        the same split (engine/models/llama.py's shard_weights) — q/k/v and gate/up cut
        by heads and columns, o and down by rows, layers by stage — and the same replication:
        with tp > 1 every rank of a stage holds its embedding / lm_head and norms whole, and
        with tp > KV heads each KV head's K and V rows are on tp / KV heads ranks. Those bytes
        are each rank's replicated_bytes. Weight bytes summed over the ranks are therefore the
        model's plus the extra copies. (The KV capacity, plan_memory, divides all weights by
        tp × pp, as vLLM's vocab-parallel embedding would; this layout is this engine's.)"""
        c, b = self.preset.config, DTYPE_BYTES[self.hardware.dtype]
        h, d = c.hidden_size, c.head_dim
        embed = [c.vocab_size, h]
        out = []
        for pp_rank, layers in enumerate(stage_layers(c.num_layers, self.pp)):
            first, last = pp_rank == 0, pp_rank == self.pp - 1
            n = len(layers)
            for tp_rank in range(self.tp):
                q, kv = head_ranges(c, self.tp, tp_rank)
                inter = mlp_range(c, self.tp, tp_rank)
                rows = (len(q) + 2 * len(kv)) * d
                shapes = {
                    "input_norm": [h],
                    "qkv": [rows, h],
                    **({"qkv_bias": [rows]} if c.attention_bias else {}),
                    "o": [h, len(q) * d],
                    "post_norm": [h],
                    "gate_up": [2 * len(inter), h],
                    "down": [h, len(inter)],
                }
                per_layer = sum(math.prod(s) for s in shapes.values())
                # a tied lm_head is the embedding's storage: one matrix when a stage holds both
                matrices = first + last - (first and last and c.tie_word_embeddings)
                norms = (2 * n + last) * h
                params = n * per_layer + matrices * c.vocab_size * h + last * h
                replicated = 0
                if self.tp > 1:
                    replicated += (matrices * c.vocab_size * h + norms) * b
                if self.tp > c.num_kv_heads:
                    kv_rows = 2 * len(kv) * d
                    replicated += n * kv_rows * (h + (1 if c.attention_bias else 0)) * b
                kv_per_block = 2 * n * len(kv) * d * b * self.block_size
                out.append(
                    {
                        "rank": pp_rank * self.tp + tp_rank,
                        "tp_rank": tp_rank,
                        "pp_rank": pp_rank,
                        "pid": None,  # no process: simulated
                        "device": f"{self.hardware.name} #{pp_rank * self.tp + tp_rank} "
                        "(simulated)",
                        "is_output_rank": tp_rank == 0 and last,
                        "layers": [layers.start, layers.stop],
                        "q_heads": [q.start, q.stop],
                        "kv_heads": [kv.start, kv.stop],
                        "mlp_columns": [inter.start, inter.stop],
                        "holds_embedding": first,
                        "holds_lm_head": last,
                        "weight_bytes": params * b,
                        "replicated_bytes": replicated,
                        "shapes": {
                            **({"embed": embed} if first else {}),
                            **shapes,
                            **({"lm_head": embed} if last else {}),
                        },
                        "num_layers": n,
                        "kv_bytes_per_block": kv_per_block,
                        "kv_cache_bytes": kv_per_block * self.num_blocks,
                    }
                )
        return out

    def layout(self) -> list[dict]:
        """MultiprocExecutor.layout()'s dicts, computed from the preset's shapes (no tensors):
        empty for tp 1 × pp 1, like the real engine's single in-process worker."""
        return [dict(r) for r in self._layout]

    def all_reduces_per_step(self) -> int:
        """Derived, as for the real executor: 2 per layer a rank runs (tp > 1)."""
        return all_reduces_per_step(self.preset.config, self.tp, self.pp)

    def _next_token(self, request_id: str, params: SamplingParams) -> int:
        """Non-EOS until the request's target length, then EOS (ignored under ignore_eos)."""
        count = self.num_emitted.get(request_id, 0) + 1
        self.num_emitted[request_id] = count
        target = self.output_len(request_id)
        eos = self.preset.eos_token_id
        if target is not None and count >= target and eos is not None and not params.ignore_eos:
            return eos
        return self.filler_token_id

    def fork(self, block_map: dict[int, int], num_blocks: int, num_swap_blocks: int, clock):
        """No tensors to copy: the same cost model and output lengths, its own counters, the
        forked engine's (virtual) clock."""
        twin = copy.copy(self)
        twin.num_emitted = dict(self.num_emitted)
        twin.costs = list(self.costs)
        twin.num_blocks, twin.num_swap_blocks, twin.clock = num_blocks, num_swap_blocks, clock
        return twin

    def weight_bytes(self) -> int:
        """The model's bytes; with several ranks, their sum (replicated parts counted on every
        rank that holds them), as MultiprocExecutor.weight_bytes()."""
        if self._layout:
            return sum(r["weight_bytes"] for r in self._layout)
        return self.preset.num_parameters() * DTYPE_BYTES[self.hardware.dtype]

    def kv_cache_bytes(self) -> int:
        if self._layout:
            return sum(r["kv_cache_bytes"] for r in self._layout)
        return self.num_blocks * self.memory.bytes_per_block * self.tp if self.memory else 0


def _resolve(
    model_preset: str | ModelPreset, hardware: str | HardwarePreset
) -> tuple[ModelPreset, HardwarePreset]:
    preset = load_model_preset(model_preset) if isinstance(model_preset, str) else model_preset
    if isinstance(hardware, str) and hardware.lower() == THIS_MACHINE:
        from engine.tools.calibration import this_machine

        return preset, this_machine()
    hw = load_hardware_preset(hardware) if isinstance(hardware, str) else hardware
    return preset, hw


def default_efficiency(hardware: HardwarePreset) -> Efficiency:
    """This machine: the calibration's fitted factors. A vendor preset: the assumed defaults."""
    if hardware.evidence == "measured":
        from engine.tools.calibration import load_calibration

        calibration = load_calibration()
        if calibration is not None:
            return calibration.efficiency
    return Efficiency()


def make_simulated_engine(
    model_preset: str | ModelPreset = "smollm2-135m-instruct",
    hardware: str | HardwarePreset = "h100-sxm",
    tensor_parallel_size: int = 1,
    efficiency: Efficiency | None = None,
    output_len: Callable[[str], int | None] | None = None,
    pipeline_parallel_size: int = 1,
    **engine_config,
):
    """An EngineCore whose executor is simulated: `step()`, `add_request()`, journeys and records
    work as on the real engine. `engine_config`: EngineConfig fields (max_num_seqs, ...);
    max_model_len defaults to min(8192, the model's). The engine's config carries the
    tensor / pipeline parallel sizes (as a real parallel engine's does)."""
    from engine.core import EngineCore

    preset, hw = _resolve(model_preset, hardware)
    engine_config["tensor_parallel_size"] = tensor_parallel_size
    engine_config["pipeline_parallel_size"] = pipeline_parallel_size
    engine_config.setdefault("dtype", hw.dtype)
    # A long-context preset (128k) would need a KV cache for one 128k request to start; a course
    # workload is far shorter, so the default context is 8192 (pass max_model_len to change it).
    engine_config.setdefault("max_model_len", min(8192, preset.config.max_position_embeddings))
    engine_config.setdefault("device", "cpu")  # where the control path runs; no model is loaded
    config = EngineConfig(**engine_config)
    executor = SimulatedExecutor(
        preset,
        hw,
        config.block_size,
        tensor_parallel_size,
        efficiency or default_efficiency(hw),
        config.max_num_seqs,
        output_len,
        pipeline_parallel_size=pipeline_parallel_size,
    )
    tokenizer = SimTokenizer(preset.config.vocab_size, preset.bos_token_id, preset.eos_token_id)
    engine = EngineCore(config, executor=executor, model_config=preset.config, tokenizer=tokenizer)
    # before any request exists: each request keeps its engine's clock
    engine.clock = executor.clock
    return engine


# ---------------------------------------------------------------------------------------------
# A whole workload


@dataclass
class SimulationResult:
    records: list[StepRecord]
    requests: list[Request]
    metrics: list[RequestMetrics]  # engine clock, one per request in workload order
    summary: dict
    conditions: dict
    costs: list[StepCost] = field(default_factory=list, repr=False)


def summarize(metrics: list[RequestMetrics], records: list[StepRecord]) -> dict:
    """Latency percentiles and throughput on the engine clock (seconds)."""
    first = min(m.arrival_time for m in metrics)
    last = max(m.finish_time for m in metrics if m.finish_time is not None)
    output_tokens = sum(m.num_output_tokens for m in metrics)
    span = last - first
    return {
        "requests": len(metrics),
        "ttft_s": percentiles([m.ttft for m in metrics if m.ttft is not None]),
        "tpot_s": percentiles([m.tpot for m in metrics if m.tpot is not None]),
        "e2e_s": percentiles([m.e2e for m in metrics if m.e2e is not None]),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(m.num_prompt_tokens for m in metrics),
        "output_tokens_per_s": output_tokens / span if span > 0 else None,
        "requests_per_s": len(metrics) / span if span > 0 else None,
        "duration_s": span,
        "steps": len(records),
        "preemptions": sum(len(r.preempted) for r in records),
        "max_kv_usage": max((r.kv.usage for r in records), default=0.0),
    }


def simulation_conditions(engine, preset: ModelPreset, hw: HardwarePreset, workload: dict) -> dict:
    """What a simulation's numbers rest on: the model's shapes, the hardware's figures (with
    their evidence), the efficiencies, the KV cache computed from memory, the engine's settings
    and the workload."""
    executor: SimulatedExecutor = engine.executor
    memory = executor.memory
    conditions = {
        "model": {
            "name": preset.name,
            "source": preset.source,
            "num_parameters": preset.num_parameters(),
            "num_parameters_evidence": "computed from the config's shapes",
        },
        "hardware": {
            "name": hw.name,
            "evidence": hw.evidence,
            "source": hw.source,
            "uncertain": hw.uncertain,
            "memory_gb": hw.memory_bytes / GB,
            "memory_bandwidth_gb_s": hw.memory_bandwidth / 1e9,
            "peak_tflop_s": hw.peak_flops / 1e12,
            "dtype": hw.dtype,
        },
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "pipeline_parallel_size": engine.config.pipeline_parallel_size,
        "efficiency": executor.cost_model.efficiency.as_dict(),
        "kv_cache": {
            "num_blocks": engine.num_blocks,
            "block_size": engine.config.block_size,
            "bytes_per_block_per_gpu": memory.bytes_per_block,
            "weight_bytes_per_gpu": memory.weight_bytes,
            "activation_reserve_bytes": memory.activation_bytes,
            "usable_bytes": memory.usable_bytes,
            "evidence": "computed",
            "formula": memory.formula,
        },
        "engine": {
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "max_model_len": engine.max_model_len,
            "enable_prefix_caching": engine.config.enable_prefix_caching,
            "scheduling_policy": engine.config.scheduling_policy,
        },
        "workload": workload,
    }
    return conditions


def simulate(
    model_preset: str | ModelPreset = "llama-3.1-8b",
    hardware: str | HardwarePreset = "h100-sxm",
    rate: float | None = 4.0,
    num_requests: int = 1000,
    prompt_len: tuple[int, int] = (32, 1024),
    output_len: tuple[int, int] = (32, 512),
    seed: int = 0,
    tensor_parallel_size: int = 1,
    efficiency: Efficiency | None = None,
    workload: list[SimRequest] | None = None,
    keep_outputs: bool = False,
    pipeline_parallel_size: int = 1,
    **engine_config,
) -> SimulationResult:
    """Run a workload through a simulated engine. `rate`: Poisson arrivals per second (None: all
    at once). `engine_config`: EngineConfig fields (max_num_seqs, max_num_batched_tokens, ...);
    max_model_len defaults to 8192 here, so that long-context presets fit a tight memory budget."""
    preset, hw = _resolve(model_preset, hardware)
    arrivals = (
        "given by the caller" if workload is not None else "Poisson" if rate else "all at t=0"
    )
    if workload is None:
        workload = poisson_workload(
            num_requests,
            rate,
            prompt_len,
            output_len,
            preset.config.vocab_size,
            seed,
            {preset.bos_token_id, preset.eos_token_id} - {None},
        )
    targets = {f"sim-{i}": w.output_len for i, w in enumerate(workload)}
    wall_start = time.perf_counter()
    engine = make_simulated_engine(
        preset,
        hw,
        tensor_parallel_size,
        efficiency,
        targets.get,
        pipeline_parallel_size=pipeline_parallel_size,
        **engine_config,
    )
    records, requests = run_workload(engine, workload, keep_outputs)
    wall = time.perf_counter() - wall_start
    metrics = [r.metrics(clock="engine") for r in requests]
    summary = summarize(metrics, records)
    summary["wall_s"] = wall
    executor: SimulatedExecutor = engine.executor
    workload_conditions = {
        "num_requests": len(workload),
        "rate_req_s": rate,
        "prompt_len": list(prompt_len),
        "output_len": list(output_len),
        "seed": seed,
        "arrivals": arrivals,
        "output_length_model": "target drawn per request, EOS at the target",
    }
    conditions = simulation_conditions(engine, preset, hw, workload_conditions)
    return SimulationResult(records, requests, metrics, summary, conditions, list(executor.costs))


def _flops(tflop_s: float) -> str:
    return f"{tflop_s:,.1f} TFLOP/s" if tflop_s >= 1 else f"{1000 * tflop_s:,.1f} GFLOP/s"


def format_result(result: SimulationResult) -> str:
    s, c = result.summary, result.conditions
    hw, kv, eff = c["hardware"], c["kv_cache"], c["efficiency"]

    def ms(p: dict) -> str:
        return " / ".join(
            "—" if p[k] is None else f"{1000 * p[k]:.1f}" for k in ("p50", "p90", "p99")
        )

    rate = c["workload"]["rate_req_s"]
    tp, pp = c["tensor_parallel_size"], c.get("pipeline_parallel_size", 1)
    gpus = f"{tp}" if pp == 1 else f"{tp * pp} (tp {tp} × pp {pp})"
    lines = [
        f"Simulated: {c['model']['name']} on {hw['name']} × {gpus} "
        f"({hw['dtype']}), {s['requests']} requests, "
        f"{'Poisson ' + format(rate, 'g') + '/s' if rate else 'all at once'}",
        f"  hardware ({hw['evidence']}): {hw['memory_gb']:.0f} GB, "
        f"{hw['memory_bandwidth_gb_s']:,.0f} GB/s, "
        f"{_flops(hw['peak_tflop_s'])} — {hw['source']}",
        f"  efficiencies: linear memory {eff['linear_memory']:.2f}, "
        f"linear compute {eff['linear_compute']:.2f} "
        f"(+{eff.get('linear_compute_ramp_tokens', 0):.0f} rows per matmul), "
        f"attention {eff['attention']:.2f}, step overhead {1000 * eff['step_overhead_s']:.2f} ms "
        f"({eff['evidence']})",
        f"  KV cache (computed): {kv['num_blocks']:,} blocks of {kv['block_size']} tokens "
        f"= {kv['num_blocks'] * kv['block_size']:,} tokens; "
        f"weights {kv['weight_bytes_per_gpu'] / GB:.1f} GB per device",
        "",
        "  latency (engine clock, ms)   p50 / p90 / p99",
        f"    TTFT                       {ms(s['ttft_s'])}",
        f"    TPOT                       {ms(s['tpot_s'])}",
        f"    E2E                        {ms(s['e2e_s'])}",
        f"  throughput                   {s['output_tokens_per_s']:,.1f} output tokens/s, "
        f"{s['requests_per_s']:.2f} requests/s",
        f"  preemptions                  {s['preemptions']}   "
        f"(peak KV usage {100 * s['max_kv_usage']:.0f} %)",
        f"  simulated time               {s['duration_s']:,.1f} s in {s['steps']:,} steps",
        f"  wall time                    {s['wall_s']:.1f} s (measured, this machine)",
        "  all latencies are computed by the cost model (engine/tools/cost_model.py), not measured",
    ]
    return "\n".join(lines)
