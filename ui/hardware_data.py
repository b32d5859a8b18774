"""Model shapes and GPU memory sizes for chapter 05's memory calculator.

The numbers are the engine's own presets (engine/tools/presets/: each model's public `config.json`
shapes and each GPU's data-sheet figures, with their sources), the same ones the simulator runs;
this module only names them for the page. The parameter count used by the calculator is
*computed* from the shapes (`param_count`), and the model card's rounded count is kept beside it
for comparison. GPU memory sizes are vendor-reported, in the vendor's GB (10⁹ B).
No Streamlit import here: the data and formulas are testable on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9  # the lesson's convention: 1 GB = 10⁹ B

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    reported_params: float  # model card / lesson, rounded (보고값)
    source: str
    qkv_bias: bool = False

    @property
    def param_count(self) -> int:
        """Parameters computed from the config (Llama-style block: attention, gated MLP,
        2 RMSNorms).

        embedding V×h (+ LM head V×h unless tied)
          + layers × (h×H×d + 2×h×K×d + H×d×h + 3×h×I + 2h) + h
        """
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return embed + self.num_layers * per_layer + h

    def weight_bytes(self, dtype: str) -> int:
        """Weights = parameters × bytes per parameter."""
        return self.param_count * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) × layers × kv heads × head_dim × bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float  # vendor-reported, GB = 10⁹ B
    bandwidth_gbps: float  # vendor-reported memory bandwidth, GB/s
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)


# The calculator's names for the engine's presets (engine/tools/presets/: config.json shapes, vendor
# figures, each with its source), and each model card's rounded parameter count (보고값).
MODEL_PRESETS = {
    "smollm2-135m-instruct": ("SmolLM2-135M-Instruct (우리 모델)", 0.1345e9),
    "llama-3.1-8b": ("Llama-3.1-8B", 8.03e9),
    "llama-3.1-70b": ("Llama-3.1-70B", 70.6e9),
    "qwen2.5-7b": ("Qwen2.5-7B", 7.62e9),
    "mistral-7b-v0.3": ("Mistral-7B-v0.3", 7.25e9),
}
GPU_PRESETS = {
    "h100-sxm": "H100 SXM 80GB",
    "h200": "H200 141GB",
    "a100-40gb-sxm": "A100 40GB",
    "a100-80gb-sxm": "A100 80GB",
    "l4": "L4 24GB",
    "rtx-4090": "RTX 4090 24GB",
}


def _model_spec(key: str) -> ModelSpec:
    from engine.tools.presets import load_model_preset

    preset = load_model_preset(key)
    c = preset.config
    name, reported = MODEL_PRESETS[key]
    return ModelSpec(
        name,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        c.tie_word_embeddings,
        reported,
        preset.source,
        qkv_bias=c.attention_bias,
    )


def _gpu_spec(key: str) -> GPUSpec:
    from engine.tools.presets import load_hardware_preset

    hw = load_hardware_preset(key)
    return GPUSpec(GPU_PRESETS[key], hw.memory_bytes / GB, hw.memory_bandwidth / 1e9, hw.source)


MODELS: dict[str, ModelSpec] = {m.name: m for m in map(_model_spec, MODEL_PRESETS)}
GPUS: dict[str, GPUSpec] = {g.name: g for g in map(_gpu_spec, GPU_PRESETS)}
# display name → preset key (what the simulator takes)
MODEL_KEYS = {name: key for key, (name, _) in MODEL_PRESETS.items()}
GPU_KEYS = {name: key for key, name in GPU_PRESETS.items()}


@dataclass
class MemoryBudget:
    model: str
    gpu: str
    dtype: str
    kv_dtype: str
    utilization: float
    headroom_bytes: int
    seq_len: int
    usable_bytes: int  # device memory × utilization
    weight_bytes: int
    kv_budget_bytes: int  # may be negative: the weights alone do not fit
    kv_bytes_per_token: int
    token_capacity: int
    max_requests: int

    @property
    def fits(self) -> bool:
        return self.kv_budget_bytes > 0


def memory_budget(
    model: str | ModelSpec,
    gpu: str | GPUSpec,
    dtype: str = "bfloat16",
    utilization: float = 0.9,
    headroom_gb: float = 2.0,
    seq_len: int = 4096,
    kv_dtype: str | None = None,
) -> MemoryBudget:
    """KV budget = memory × utilization − weights − headroom;
    requests = budget / (KV per token × L)."""
    m = MODELS[model] if isinstance(model, str) else model
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    kv_dtype = kv_dtype or dtype
    usable = int(g.memory_bytes * utilization)
    weights = m.weight_bytes(dtype)
    headroom = int(headroom_gb * GB)
    budget = usable - weights - headroom
    per_token = m.kv_bytes_per_token(kv_dtype)
    tokens = max(budget, 0) // per_token
    return MemoryBudget(
        m.name,
        g.name,
        dtype,
        kv_dtype,
        utilization,
        headroom,
        seq_len,
        usable,
        weights,
        budget,
        per_token,
        tokens,
        tokens // max(seq_len, 1),
    )
