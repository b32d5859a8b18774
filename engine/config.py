"""Engine settings in one place: every default the engine, the CLI and the app share lives here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.kv_connector import KVTransferConfig
from engine.utils import cdiv

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # the step's token budget
DEFAULT_MAX_NUM_SEQS = 32  # requests running at once
# With chunked prefill, the most prompt tokens one request takes in one step (0: no cap). vLLM's
# default is 0 (it sets 4% of max_model_len only with max_num_partial_prefills > 1); ours caps
# at 64 because on a CPU a step costs about its token count, so one long prompt taking the whole
# 512-token budget makes every short request behind it wait for its entire prefill (issue 32:
# 4-token requests behind a 4,001-token prompt got their first token after 7-10 s, not 0.2-0.4 s).
# The price is the long prompt's own TTFT: more, smaller steps (docs/performance.md).
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 64
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # at most, given neither a block count nor a size
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S: a step that runs longer than this means a hung worker
# (stopped, deadlocked): its requests fail and /health reports the engine unhealthy.
ENGINE_ITERATION_TIMEOUT_ENV = "LLM_ENGINE_ITERATION_TIMEOUT_S"
DEFAULT_ENGINE_ITERATION_TIMEOUT_S = 60.0
# What a float32 CPU engine's linears compute in (engine/kernels/linear_precision.py).
LINEAR_PRECISIONS = ("float32", "bfloat16", "auto")
# What the KV cache holds: "auto" (the model's dtype) or "bfloat16" (under a float32 model: half
# the bytes per token, rounded as written). vLLM's CacheConfig.cache_dtype, same name and "auto".
KV_CACHE_DTYPES = ("auto", "bfloat16")


def engine_iteration_timeout_s(value: float | None = None) -> float:
    """`value`, else $LLM_ENGINE_ITERATION_TIMEOUT_S, else 60 s; refused unless positive."""
    source = "engine_iteration_timeout_s"
    if value is None:
        raw = os.environ.get(ENGINE_ITERATION_TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_ENGINE_ITERATION_TIMEOUT_S
        source = ENGINE_ITERATION_TIMEOUT_ENV
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{source} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_linear_precision(precision: str, device, dtype, quantization=None) -> None:
    """Refuse a `linear_precision` no engine runs: bfloat16 linears (or "auto", which may pick
    them) exist only in a float32 engine on a CPU without weight quantization. `device` and
    `dtype` as EngineConfig holds them ("auto" and None are fine: resolved later) or resolved."""
    if precision not in LINEAR_PRECISIONS:
        raise ValueError(f"linear_precision must be one of {LINEAR_PRECISIONS}, got {precision!r}")
    if precision == "float32":
        return
    dtype_name = str(dtype).removeprefix("torch.")
    device_type = str(device).split(":")[0]
    if quantization:
        why = f"quantization={quantization!r} already sets the linears' weights"
    elif dtype_name not in ("None", "float32"):
        why = f"dtype={dtype_name!r} runs every op in that dtype (linear_precision is for float32)"
    elif device_type not in ("auto", "cpu"):
        why = f"device={str(device)!r}: bfloat16 linears are a CPU path (a GPU runs dtype=bfloat16)"
    else:
        return
    raise ValueError(
        f"linear_precision={precision!r} needs a float32 engine on a CPU without quantization: "
        + why
    )


def check_kv_cache_dtype(kv_cache_dtype: str, dtype) -> None:
    """Refuse a `kv_cache_dtype` no engine runs: a bfloat16 cache holds float32 or bfloat16
    models' K/V (a float16 model's K/V would lose range in it)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    if kv_cache_dtype == "bfloat16" and dtype_name not in ("None", "auto", "float32", "bfloat16"):
        raise ValueError(
            "kv_cache_dtype='bfloat16' holds a float32 or bfloat16 model's K/V, "
            f"not dtype={dtype!r}"
        )


def default_cpu_kv_cache_bytes(
    bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int
) -> int:
    """The KV cache a CPU engine takes when it is given neither a size nor a block count:
    DEFAULT_CPU_KV_CACHE_BYTES, but no more than `max_num_seqs` requests of `max_model_len` tokens
    can hold at once. For the default model that is the whole GiB; a tiny model's GiB would be
    131,072 blocks that only ever keep finished prefixes, and allocating them (every page
    touched, a Python object a block) took 0.5-3 s an engine. `bytes_per_block`: the whole
    model's, all layers and heads."""
    most = max_num_seqs * cdiv(max_model_len, block_size) * bytes_per_block
    return min(DEFAULT_CPU_KV_CACHE_BYTES, most)


@dataclass
class EngineConfig:
    model: str | Path | None = None  # None: the embedded default artifact
    device: str = "auto"
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes (CPU default: default_cpu_kv_cache_bytes)
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's name: with chunked prefill, no request takes more than this many prompt tokens in one
    # step (0: no cap), so one long prompt cannot take the whole budget while short ones wait.
    # Default 64, not vLLM's 0: see DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD.
    long_prefill_token_threshold: int = DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "recompute"  # or "swap": a preempted request's K/V wait in host memory
    num_swap_blocks: int | None = None  # swap space in blocks; None = as many as the KV cache has
    # Weight-only quantization (engine/worker/quantization.py): None, "int8" (per output channel),
    # "int4" (group-wise scale + min, `quantization_group_size` input channels per group) or
    # "gguf" (the default artifact's own Q4_1 blocks). Activations and KV stay in `dtype`.
    quantization: str | None = None
    quantization_group_size: int = 32
    kernels: str = "auto"  # "auto": our C++ CPU kernels if they build; "torch": never
    # What a float32 CPU engine's linear layers (lm_head too) compute in: "float32" (default:
    # greedy outputs equal transformers' float32), "bfloat16" (bfloat16 weights, float32
    # activations cast for each matmul; everything else stays float32) or "auto" (bfloat16 when
    # the CPU has AMX / AVX512-BF16 and a load-time timing shows it faster):
    # engine/kernels/linear_precision.py.
    linear_precision: str = "float32"
    # vLLM's name: what the KV cache stores (KV_CACHE_DTYPES). "auto": the model's dtype;
    # "bfloat16" under a float32 model halves the bytes a decode step reads from the cache.
    kv_cache_dtype: str = "auto"
    # vLLM's name: True runs every step eagerly; False lets decode-only steps on CUDA replay
    # captured CUDA graphs (engine/worker/cuda_graphs.py). No effect on a CPU.
    enforce_eager: bool = False
    keep_finished: int = 1000  # finished requests kept for the app's plots
    # Speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m} (engine/spec_decode/). None: off.
    speculative_config: dict | None = None
    # vLLM's names: worker processes that split the model (engine/executor/multiproc.py). tp cuts
    # every layer's heads and MLP columns across ranks; pp gives each rank a run of layers.
    # 1 × 1: one worker in this process (UniProcExecutor).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How long one step may run before the engine counts as hung (None: the environment's
    # LLM_ENGINE_ITERATION_TIMEOUT_S, else 60 s). Past it the multi-process executor fails the
    # step and stops its workers; /health answers 503 meanwhile with any executor.
    engine_iteration_timeout_s: float | None = None
    # vLLM's name: a KV connector (engine/kv_connector.py): prefill → decode between engines, or
    # a host-memory tier under the prefix cache. None: K/V live only in this engine's cache.
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        """Refuse settings no engine can run with, before anything is loaded (nano-vllm's place
        for the checks). The checks that need the model's context length are in
        `resolve_max_model_len`."""
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: no cap), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.num_swap_blocks is not None and self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        self.engine_iteration_timeout_s = engine_iteration_timeout_s(
            self.engine_iteration_timeout_s
        )
        parallel = (self.tensor_parallel_size, self.pipeline_parallel_size) != (1, 1)
        if self.kv_transfer_config is not None and parallel:
            raise ValueError(
                "a KV connector (kv_transfer_config) runs with one worker only; supported: "
                "tensor_parallel_size=1 and pipeline_parallel_size=1"
            )
        check_linear_precision(self.linear_precision, self.device, self.dtype, self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        if self.quantization and (self.tensor_parallel_size, self.pipeline_parallel_size) != (1, 1):
            raise ValueError(
                f"quantization {self.quantization!r} runs with one worker only; "
                "supported: tensor_parallel_size=1 and pipeline_parallel_size=1"
            )

    def resolve_max_model_len(
        self, max_position_embeddings: int, sliding_window: int | None
    ) -> int:
        """The longest request this engine serves: `max_model_len`, else the model's context,
        never past a sliding window (full attention equals sliding-window attention only up to
        the window). Without chunked prefill a request is prefilled (or, after preemption,
        recomputed) in one step, so one step must hold the longest request; vLLM refuses the
        same way."""
        max_model_len = self.max_model_len or max_position_embeddings
        if sliding_window:
            max_model_len = min(max_model_len, sliding_window)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len ({max_model_len})"
            )
        return max_model_len
