"""Chapter 05 · 메모리 예산과 dtype: our model loaded in each dtype, bytes and decode speed
measured."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.sampling_params import SamplingParams
from engine.utils import cdiv
from ui.experiments.common import ConfigLike, make_config, measurement_conditions
from ui.tokens import token_text

# The lab's defaults (the page's widgets start here; the claim tests run them).
DEFAULT_MODEL = "llama-3.1-8b"  # model preset of the calculator and the capacity run
DEFAULT_GPU = "h100-sxm"
DEFAULT_UTILIZATION = 0.9
DEFAULT_SEQ_LEN = 4096
DEFAULT_SIM_REQUESTS = 150
DTYPES = ["float32", "bfloat16", "float16"]
DEFAULT_NUM_TOKENS = 12


def _rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except Exception:  # pragma: no cover - psutil missing
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return None


class CudaMemoryProbe:
    """The CUDA caching allocator's own counters for one device (measured, this process):
    what torch has allocated now, and the highest it reached since the last reset."""

    source = "torch.cuda.memory_allocated / max_memory_allocated"

    def __init__(self, device):
        self.device = device

    def allocated(self) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


def memory_probe(device) -> CudaMemoryProbe | None:
    """A probe of the device's allocator on a GPU; None on a CPU (the process RSS is all there
    is, and it cannot tell activations from anything else)."""
    return CudaMemoryProbe(device) if device.type == "cuda" else None


@dataclass
class DtypeMeasurement:
    dtype: str
    param_count: int
    tensor_bytes: int  # engine.weight_bytes(): Σ numel × element_size of the weights (measured)
    computed_bytes: int  # params × bytes per element (계산값)
    rss_delta_bytes: int | None  # RSS after load − before (None: weights were already loaded)
    load_s: float | None
    tpot_ms: float
    decode_tokens_per_s: float
    ttft_ms: float
    num_tokens: int
    token_ids: list[int]
    text: str
    # On a GPU (torch.cuda's counters, measured): allocated by building the engine (weights if
    # not loaded yet, plus the KV cache), the KV cache alone, and the decode's activation peak
    # above that. None on a CPU.
    device_allocated_bytes: int | None = None
    kv_cache_bytes: int | None = None
    activation_peak_bytes: int | None = None
    agree_with: str | None = None
    first_divergence: int | None = None  # index of the first token that differs from the reference
    conditions: dict = field(default_factory=dict)


def measure_dtype(
    config: ConfigLike | None,
    dtype: str,
    prompt: str = "The capital of France is",
    num_tokens: int = 16,
    reference: DtypeMeasurement | None = None,
) -> DtypeMeasurement:
    """Load the model in `dtype` (if not loaded yet in this process), then time a greedy decode.

    Measured: weight bytes (engine.weight_bytes()), RSS delta of the load, TTFT and TPOT of one
    request (RequestMetrics, engine clock).
    Derived: decode tokens/s = 1000 / TPOT.
    """
    import torch

    from engine.artifact import inspect_artifact, resolve_model_path
    from engine.worker.worker import is_model_loaded, resolve_device, resolve_dtype

    config = make_config(
        config,
        dtype=dtype,
        num_kv_blocks=None,
        kv_cache_memory=None,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    device = resolve_device(config.device)
    torch_dtype = resolve_dtype(dtype, device)
    model_dir = resolve_model_path(config.model)
    already = is_model_loaded(model_dir, device, torch_dtype)
    config = make_config(config, num_kv_blocks=cdiv(256, config.block_size))
    probe = memory_probe(device)
    allocated0 = probe.allocated() if probe else None
    rss0 = _rss_bytes()
    t = time.perf_counter()
    engine = EngineCore(config)  # loads the weights (once per process) and allocates the KV cache
    load_s = None if already else time.perf_counter() - t
    rss1 = _rss_bytes()
    allocated1 = probe.allocated() if probe else None
    if probe:
        probe.reset_peak()
    rss_delta = None if already or rss0 is None or rss1 is None else rss1 - rss0
    nbytes = engine.weight_bytes()
    element = torch.tensor([], dtype=torch_dtype).element_size()
    params = inspect_artifact(model_dir).num_params  # counted from the safetensors header
    params_s = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params_s)
    while engine.has_unfinished_requests():
        engine.step()
    activation_peak = probe.peak() - allocated1 if probe else None
    m = request.metrics(clock="engine")
    n = m.num_output_tokens
    tpot = m.tpot if m.tpot is not None else 0.0
    text, _ = token_text(engine.tokenizer, request.output_token_ids)  # no U+FFFD at a cut
    divergence = None
    if reference is not None:
        pairs = zip(reference.token_ids, request.output_token_ids)
        divergence = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    return DtypeMeasurement(
        dtype=str(torch_dtype).replace("torch.", ""),
        param_count=params,
        tensor_bytes=nbytes,
        computed_bytes=params * element,
        rss_delta_bytes=rss_delta,
        load_s=load_s,
        tpot_ms=1000 * tpot,
        decode_tokens_per_s=1.0 / tpot if tpot > 0 else 0.0,
        ttft_ms=1000 * (m.ttft or 0.0),
        num_tokens=n,
        token_ids=list(request.output_token_ids),
        text=text,
        device_allocated_bytes=allocated1 - allocated0 if probe else None,
        kv_cache_bytes=engine.kv_cache_bytes() if probe else None,
        activation_peak_bytes=activation_peak,
        agree_with=reference.dtype if reference else None,
        first_divergence=divergence,
        conditions=measurement_conditions(
            engine, 배치=1, 프롬프트=f"{request.num_prompt_tokens} 토큰", 출력=f"{n} 토큰 (greedy)"
        ),
    )


# -- the budget in motion: the real scheduler on a simulated GPU --------------------------------


@dataclass
class CapacityRun:
    """One simulated run of `num_requests` requests of length L arriving together."""

    model: str
    hardware: str
    num_blocks: int  # the KV cache the memory plan gave (계산값)
    block_size: int
    kv_budget_bytes: int
    activation_bytes: int
    planned_requests: int  # KV tokens ÷ L: how many fit at once if each grows to L (계산값)
    peak_running: int  # the most requests the scheduler ran at once
    preemptions: int
    steps: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    duration_s: float
    records: list = field(repr=False, default_factory=list)


def simulate_capacity(
    model_preset: str,
    hardware: str,
    utilization: float,
    seq_len: int,
    num_requests: int,
    output_len: int = 256,
    max_num_batched_tokens: int = 8192,
) -> CapacityRun:
    """The calculator's budget, run: `num_requests` requests of `seq_len` tokens (prompt +
    `output_len`) arrive at once on a simulated engine whose KV cache comes from the same memory
    budget (engine/tools/simulator.py's plan). The real scheduler then admits, queues and preempts
    them; this reports what it did. Times are 계산값 (the cost model)."""
    from engine.tools.presets import load_model_preset
    from engine.tools.simulator import simulate
    from engine.tools.workload import SimRequest

    preset = load_model_preset(model_preset)
    seq_len = min(seq_len, preset.config.max_position_embeddings)
    output_len = min(output_len, seq_len // 2)
    prompt_len = seq_len - output_len
    filler = 1000 % preset.config.vocab_size
    workload = [
        # distinct prompts (a different first token each), so the prefix cache shares nothing
        SimRequest([(filler + i) % preset.config.vocab_size] * prompt_len, output_len)
        for i in range(num_requests)
    ]
    result = simulate(
        model_preset,
        hardware,
        rate=None,
        workload=workload,
        max_model_len=seq_len,
        max_num_seqs=max(num_requests, 1),
        max_num_batched_tokens=max(max_num_batched_tokens, seq_len // 4),
        gpu_memory_utilization=utilization,
        enable_prefix_caching=False,
    )
    kv = result.conditions["kv_cache"]
    running = [r.num_running for r in result.records]
    summary = result.summary
    return CapacityRun(
        model=result.conditions["model"]["name"],
        hardware=result.conditions["hardware"]["name"],
        num_blocks=kv["num_blocks"],
        block_size=kv["block_size"],
        kv_budget_bytes=kv["usable_bytes"]
        - kv["weight_bytes_per_gpu"]
        - kv["activation_reserve_bytes"],
        activation_bytes=kv["activation_reserve_bytes"],
        planned_requests=kv["num_blocks"] * kv["block_size"] // seq_len,
        peak_running=max(running, default=0),
        preemptions=summary["preemptions"],
        steps=summary["steps"],
        ttft_p50_s=summary["ttft_s"]["p50"],
        ttft_p90_s=summary["ttft_s"]["p90"],
        duration_s=summary["duration_s"],
        records=result.records,
    )
