"""Model shapes and GPU memory sizes kept as data, for chapter 05's memory calculator.

Model numbers are copied from each model's public `config.json` on the Hugging Face Hub (the
source is named per entry); the parameter count used by the calculator is *computed* from those
numbers (`param_count`), and the model card's rounded count is kept beside it for comparison.
GPU memory sizes are vendor-reported (product data sheets), in the vendor's GB (10⁹ B).
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


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec(
            "SmolLM2-135M-Instruct (우리 모델)",
            30,
            576,
            9,
            3,
            64,
            1536,
            49152,
            True,
            0.1345e9,
            "HuggingFaceTB/SmolLM2-135M-Instruct config.json",
        ),
        ModelSpec(
            "Llama-3.1-8B",
            32,
            4096,
            32,
            8,
            128,
            14336,
            128256,
            False,
            8.03e9,
            "meta-llama/Llama-3.1-8B config.json",
        ),
        ModelSpec(
            "Llama-3.1-70B",
            80,
            8192,
            64,
            8,
            128,
            28672,
            128256,
            False,
            70.6e9,
            "meta-llama/Llama-3.1-70B config.json",
        ),
        ModelSpec(
            "Qwen2.5-7B",
            28,
            3584,
            28,
            4,
            128,
            18944,
            152064,
            False,
            7.62e9,
            "Qwen/Qwen2.5-7B config.json",
            qkv_bias=True,
        ),
        ModelSpec(
            "Mistral-7B-v0.1",
            32,
            4096,
            32,
            8,
            128,
            14336,
            32000,
            False,
            7.24e9,
            "mistralai/Mistral-7B-v0.1 config.json",
        ),
    ]
}

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec("H100 SXM 80GB", 80, 3350, "NVIDIA H100 Tensor Core GPU data sheet"),
        GPUSpec("H200 141GB", 141, 4800, "NVIDIA H200 Tensor Core GPU data sheet"),
        GPUSpec("A100 40GB", 40, 1555, "NVIDIA A100 Tensor Core GPU data sheet"),
        GPUSpec("A100 80GB", 80, 2039, "NVIDIA A100 Tensor Core GPU data sheet (SXM)"),
        GPUSpec("L4 24GB", 24, 300, "NVIDIA L4 Tensor Core GPU data sheet"),
        GPUSpec("RTX 4090 24GB", 24, 1008, "NVIDIA GeForce RTX 4090 specifications"),
    ]
}


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

    @property
    def kv_bytes_per_request(self) -> int:
        return self.kv_bytes_per_token * self.seq_len


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
