"""The worker: one per device. It owns the device, the weights and the KV-cache memory.

On a CPU the cache size is given (a block count or a number of bytes). On CUDA the worker first
runs a profiling forward at the largest step size, then gives the cache a fraction of what is
left of the GPU's memory, as vLLM does. Either way, a cache that cannot hold one request of the
maximum model length is refused at start-up, with both numbers in the error.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    default_cpu_kv_cache_bytes,
)
from engine.kernels.linear_precision import bfloat16_library, resolve_linear_precision
from engine.kv_connector import KVTransferConfig
from engine.layers.attention import build_attention_metadata
from engine.layers.sharding import ParallelContext
from engine.models.llama import LlamaModel
from engine.scheduler_output import SchedulerOutput
from engine.utils import cdiv
from engine.worker.bfloat16_linears import layer_matrices, with_bfloat16_linears
from engine.worker.kv_connector import make_kv_connector_worker
from engine.worker.kv_p2p import P2pConnectorWorker  # noqa: F401 — registers P2pGlooConnector
from engine.worker.model_runner import ModelRunner, ModelRunnerOutput
from engine.worker.quantization import (
    DEFAULT_GROUP_SIZE,
    gguf_source,
    quantize_model,
    with_dtype,
)

_weights_lock = threading.Lock()
_loaded_models: dict[tuple[str, str, torch.dtype], LlamaModel] = {}


def load_model(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, linear_precision="float32"
) -> LlamaModel:
    """Weights are read-only during inference, so engines in one process share one copy. With
    bfloat16 linears (`linear_precision`, engine/kernels/linear_precision.py) the float32
    weights are read for the conversion (and "auto"'s timing) and dropped, unless an engine of
    this process runs them."""
    key = (str(Path(model_dir).resolve()), str(device), dtype)
    with _weights_lock:
        base = _loaded_models.get(key)

        def float_weights() -> LlamaModel:
            nonlocal base
            base = base or LlamaModel.from_pretrained(model_dir, device=device, dtype=dtype)
            return base

        def matrices() -> list[torch.Tensor]:  # read only when "auto" times them
            return layer_matrices(float_weights())

        choice = resolve_linear_precision(linear_precision, device, dtype, matrices)
        if choice["precision"] == "float32":
            _loaded_models[key] = float_weights()
            return _loaded_models[key]
        bf16_key = key + ("bfloat16 linears", bfloat16_library())  # the library's layout
        if bf16_key not in _loaded_models:
            _loaded_models[bf16_key] = with_bfloat16_linears(float_weights(), choice["why"])
        shared = _loaded_models[bf16_key]  # its record says why the engine that loaded it chose
        return shared.rebuilt(linear_precision={**shared.linear_precision, "why": choice["why"]})


def is_model_loaded(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these weights are already in this process (the next load is then free)."""
    with _weights_lock:
        return (str(Path(model_dir).resolve()), str(device), dtype) in _loaded_models


_quantized_models: dict[tuple, LlamaModel] = {}


def load_quantized_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    method: str,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> LlamaModel:
    """The model at `model_dir` with weight-only quantized linears (engine/worker/quantization.py),
    shared by the engines of this process like the float weights are. Quantized from the float32
    weights (reused when already loaded, else loaded for the conversion and dropped); the norms
    and biases then take `dtype`."""
    key = (str(Path(model_dir).resolve()), str(device), dtype, method, group_size)
    with _weights_lock:
        if key not in _quantized_models:
            f32 = torch.float32
            base = _loaded_models.get((key[0], str(device), f32))
            if base is None:  # loaded for the conversion only, then dropped
                base = LlamaModel.from_pretrained(model_dir, device=device, dtype=f32)
            gguf_path = gguf_source(model_dir) if method == "gguf" else None
            quantized = quantize_model(base, method, group_size, gguf_path)
            _quantized_models[key] = with_dtype(quantized, dtype)
        return _quantized_models[key]


@dataclass
class DeviceMemory:
    """What the GPU driver reports now (torch.cuda.mem_get_info), in bytes."""

    name: str
    total: int
    free: int
    allocated_by_torch: int


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The GPU's name and memory (measured now); None on a CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        torch.cuda.get_device_name(device), total, free, torch.cuda.memory_allocated(device)
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Default: bfloat16 on CUDA, float32 on CPU."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; choose float32, bfloat16 or float16")
    return names[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What the KV cache holds (EngineConfig.kv_cache_dtype): the model's dtype for "auto"."""
    return dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype, torch.device("cpu"))


class CacheTooSmallError(ValueError):
    """The KV cache cannot hold one request of max_model_len; the numbers travel with it."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int):
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.blocks_needed = cdiv(max_model_len, block_size)
        super().__init__(
            f"KV cache of {num_blocks} blocks ({num_blocks * block_size} tokens) cannot hold one "
            f"request of max_model_len={max_model_len} tokens ({self.blocks_needed} blocks); "
            "add KV memory or lower max_model_len"
        )


class Worker:
    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        kernels: str = "auto",
        quantization: str | None = None,
        quantization_group_size: int = 32,
        parallel: ParallelContext | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        linear_precision: str = "float32",
        kv_cache_dtype: torch.dtype | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.linear_precision = linear_precision  # float32 / bfloat16 / auto linears (config.py)
        # tensor / pipeline parallel: this worker's rank and its communication (its process
        # holds only its shard; engine/executor/multiproc.py); None: one worker, all weights
        self.parallel = parallel or ParallelContext()
        self.quantization = quantization  # weight-only int8/int4/gguf (quantization.py)
        self.quantization_group_size = quantization_group_size
        self.kernels = kernels  # "auto": our C++ kernels where they build and apply; "torch": never
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # what the KV cache holds
        self.block_size = block_size
        self.model: LlamaModel | None = None
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self.kv_transfer_config = kv_transfer_config  # a KV connector's worker side, if any

    def load_model(self) -> None:
        # The weights are shared by every engine of the process; the kernel choice is this worker's.
        if (self.parallel.tp, self.parallel.pp) != (1, 1):  # this rank's shard, in its process
            model = LlamaModel.from_pretrained(
                self.model_dir, self.device, self.dtype, parallel=self.parallel
            )
            choice = resolve_linear_precision(self.linear_precision, self.device, self.dtype)
            if choice["precision"] == "bfloat16":  # the driver's choice (multiproc.py)
                model = with_bfloat16_linears(model, choice["why"])
        elif self.quantization:
            model = load_quantized_model(
                self.model_dir,
                self.device,
                self.dtype,
                self.quantization,
                self.quantization_group_size,
            )
        else:
            model = load_model(self.model_dir, self.device, self.dtype, self.linear_precision)
        self.model = model.with_kernels(self.kernels)

    @property
    def bytes_per_block(self) -> int:
        return self.model.cfg.kv_bytes_per_block(self.kv_cache_dtype, self.block_size)

    def determine_num_blocks(
        self,
        max_model_len: int,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> int:
        if num_kv_blocks is None:
            if kv_cache_memory is None:
                if self.device.type == "cuda":
                    kv_cache_memory = self._profile_free_gpu_memory(
                        gpu_memory_utilization, max_num_batched_tokens
                    )
                else:  # as the default engine would (EngineCore passes its own max_num_seqs)
                    kv_cache_memory = default_cpu_kv_cache_bytes(
                        self.bytes_per_block, self.block_size, max_model_len, DEFAULT_MAX_NUM_SEQS
                    )
            num_kv_blocks = kv_cache_memory // self.bytes_per_block
        blocks_needed = cdiv(max_model_len, self.block_size)
        if num_kv_blocks < blocks_needed:
            raise CacheTooSmallError(num_kv_blocks, self.block_size, max_model_len)
        return num_kv_blocks

    def _profile_free_gpu_memory(self, utilization: float, num_tokens: int) -> int:
        """Run the largest step once on a scratch cache, then see what the GPU has left."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = cdiv(num_tokens, self.block_size)
        scratch = self.model.allocate_kv_cache(blocks, self.block_size, self.kv_cache_dtype)
        meta = build_attention_metadata(
            [num_tokens], [0], [list(range(blocks))], self.block_size, self.device
        )
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        self.model.forward(
            ids, pos, scratch, meta, torch.tensor([num_tokens - 1], device=self.device)
        )
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(int(total * utilization) - peak, 0)

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache tensors this worker allocated (K and V, all layers)."""
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for k, v in self.runner.kv_caches
        )

    def initialize_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        """The KV cache on the device, and (for swap preemption) a swap space in host memory:
        pinned on CUDA so copies run at full PCIe speed; on a CPU a separate pool of tensors."""
        self.num_blocks = num_blocks
        kv_caches = self.model.allocate_kv_cache(num_blocks, self.block_size, self.kv_cache_dtype)
        swap_caches = []
        if num_swap_blocks > 0:
            pin = self.device.type == "cuda"
            swap_caches = [
                tuple(
                    t.new_zeros((num_swap_blocks, *t.shape[1:]), device="cpu").pin_memory()
                    if pin
                    else torch.zeros((num_swap_blocks, *t.shape[1:]), dtype=t.dtype)
                    for t in layer
                )
                for layer in kv_caches
            ]
        self.runner = ModelRunner(self.model, kv_caches, self.block_size, swap_caches)
        if self.kv_transfer_config is not None:
            self.runner.kv_connector = make_kv_connector_worker(self.kv_transfer_config)
            self.runner.kv_connector.register_kv_caches(kv_caches)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def fork(self, block_map: dict[int, int], num_blocks: int, num_swap_blocks: int) -> "Worker":
        """A second worker on the same (shared, read-only) weights with its own KV cache of
        `num_blocks` blocks: block `old` of this cache copied to block `block_map[old]`. The swap
        space is copied when it keeps its size (a fork that changes the preemption mode starts
        with an empty one), and seeded requests' random generators continue where they are."""
        twin = copy.copy(self)
        twin.runner = None  # its own, never this worker's (a lazy worker allocates on first use)
        twin.initialize_cache(num_blocks, num_swap_blocks)
        if block_map:
            old_ids = torch.tensor(list(block_map.keys()), device=self.device)
            new_ids = torch.tensor(list(block_map.values()), device=self.device)
            for source, target in zip(self.runner.kv_caches, twin.runner.kv_caches):
                for k_or_v in (0, 1):
                    target[k_or_v][new_ids] = source[k_or_v][old_ids]
        swap = self.runner.swap_caches
        if swap and num_swap_blocks == swap[0][0].shape[0]:
            for source, target in zip(swap, twin.runner.swap_caches):
                for k_or_v in (0, 1):
                    target[k_or_v].copy_(source[k_or_v])
        for name in ("sampler", "rejection_sampler"):
            generators = getattr(self.runner, name).generators
            getattr(twin.runner, name).generators = copy.deepcopy(generators)
        return twin
