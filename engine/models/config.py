"""The architecture numbers of a Llama-family model, read from its config.json. Plain data, no
torch: the cost model, the presets and the simulator size models with it without loading one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LlamaConfig:
    """The architecture numbers from config.json that the forward pass needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None = (
        None  # Mistral-style local attention; we attend fully, so cap the context here
    )

    @classmethod
    def from_dict(cls, c: dict) -> "LlamaConfig":
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", None) or c.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            attention_bias=c.get("attention_bias", c.get("model_type") == "qwen2"),
            sliding_window=c.get("sliding_window") if c.get("use_sliding_window", True) else None,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "LlamaConfig":
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    @property
    def kv_elements_per_token(self) -> int:
        """K/V values one token stores: 2 (K and V) × layers × kv_heads × head_dim
        (× dtype size = bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def kv_bytes_per_block(self, cache_dtype, block_size: int) -> int:
        """Bytes of one KV block: `block_size` tokens in a cache of `cache_dtype` (a torch dtype,
        EngineConfig.kv_cache_dtype resolved)."""
        return self.kv_elements_per_token * cache_dtype.itemsize * block_size
