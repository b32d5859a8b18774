"""What one benchmark run measures: the workload, the probes, the ceilings' sizes, and which
optional sections run (kernels, speculative decoding, quantization variants, parallel)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

SIDE_ENGINE_KV_CACHE_BYTES = 1 << 30


def side_engine_kv_cache_memory(device: str) -> int | None:
    """The KV cache of an engine the bench builds beside its own (the calibration and fidelity
    engines, the quantization variants, the speculative one). On a GPU a fixed GiB: sized by
    profiling, it would find the bench engine's cache holding most of the memory and get 0
    blocks. On a CPU None, the engine's default (engine/config.py default_cpu_kv_cache_bytes):
    that GiB for the default model, far less for a tiny test model."""
    from engine.worker.worker import resolve_device

    return None if resolve_device(device).type == "cpu" else SIDE_ENGINE_KV_CACHE_BYTES


@dataclass
class BenchConfig:
    model: str | None = None  # None: the embedded default artifact
    device: str = "auto"
    dtype: str | None = None  # None: the engine's default for the device
    threads: int | None = None  # torch intra-op threads; None: torch's default
    quick: bool = False
    seed: int = 0
    # offline workload
    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 512)
    output_len: tuple[int, int] = (16, 256)
    max_num_seqs: int = 32  # the engine's maximum batch, and transformers' static batch size
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # batch-1 decode and overhead probes
    probe_prompt_len: int = 128
    probe_output_len: int = 128
    probe_repeats: int = 3
    # latency under load
    latency_requests: int = 32
    latency_rate_fractions: tuple[float, ...] = (0.25, 0.5, 1.0)  # × the offline request rate
    latency_rates: tuple[float, ...] | None = None  # requests/s; overrides the fractions
    # ceilings
    bandwidth_bytes: int = 256 << 20
    matmul_size: int = 2048
    ceiling_repeats: int = 10
    ceiling_budget_s: float = 20.0  # a matmul ceiling's repeats stop past this (timing.best_time)
    skip_transformers: bool = False
    kernels: str = "auto"  # "auto": our C++ CPU kernels when they build; "torch": the reference
    # weight-only quantization of the engine under test (engine/worker/quantization.py); None: off
    quantization: str | None = None
    quantization_group_size: int = 32
    # what the engine under test's linears compute in (EngineConfig.linear_precision); section 2
    # also runs "auto" when it picks bfloat16 on this CPU
    linear_precision: str = "float32"
    kv_cache_dtype: str = "auto"  # what the engine under test's KV cache holds (EngineConfig's)
    # section 8 (`--compare-quantization`): these variants side by side, (dtype, quantization)
    compare_variants: tuple[tuple[str, str | None], ...] | None = None
    kernel_section: bool = True  # section 6: our kernels against torch's, and the step both ways
    # speculative decoding (section 7, only with `--speculative ngram`)
    speculative: str | None = None  # "ngram" to run section 7
    speculative_config: dict | None = None  # None: DEFAULT_SPEC_CONFIG
    spec_num_requests: int = 8
    spec_output_len: int = 128
    # tensor / pipeline parallel (section 9, only when either is > 1): the same requests on
    # tp × pp worker processes against tp 1 (engine/tools/bench/parallel.py)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    trace: str | None = None  # a path: the offline engine run as a Perfetto trace (docs/traces.md)

    @classmethod
    def quick_config(cls, **overrides) -> "BenchConfig":
        """A smaller run (under a minute on a 2-core CPU) with the same structure."""
        values = dict(
            quick=True,
            num_requests=16,
            prompt_len=(16, 128),
            output_len=(16, 64),
            probe_prompt_len=64,
            probe_output_len=32,
            probe_repeats=2,
            latency_requests=8,
            latency_rate_fractions=(0.5, 1.0),
            bandwidth_bytes=128 << 20,
            matmul_size=1024,
            ceiling_repeats=5,
            ceiling_budget_s=3.0,
            kernel_section=False,
        )
        values.update(overrides)
        return cls(**values)
