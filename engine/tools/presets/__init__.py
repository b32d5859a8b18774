"""Model and hardware presets for the simulator: numbers only, each with its source.

- Model presets (`models/*.json`) are the shape fields of each model's Hugging Face config.json
  (no weights, no tokenizer), so `LlamaConfig.from_dict` reads them exactly as it reads a real
  artifact. `_name` and `_source` say which file the numbers were copied from.
- Hardware presets (`hardware/*.json`) are vendor-reported figures (datasheets), labelled as such,
  with any figure we are not sure of listed under `uncertain`. "This machine" is not a file: its
  figures are measured by the benchmark's ceilings (engine/tools/calibration.py builds it).
- Link presets (`links/*.json`) are the links a KV transfer between a prefill and a decode
  instance can cross (NVLink, InfiniBand, PCIe, Ethernet): the vendor's figure as printed, the
  one-way bandwidth a transfer uses (보고값), and an assumed per-transfer latency.

Chapter 05's memory calculator (ui/hardware_data.py) reads these same files: one copy of every
number, for the calculator and the simulator alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.models.config import LlamaConfig

PRESETS_DIR = Path(__file__).resolve().parent
GB = 10**9  # vendors' GB (10⁹ B), as datasheets print them
THIS_MACHINE = "this-machine"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PresetError(ValueError):
    """An unknown preset name, or a model that does not fit the hardware; one readable line."""


@dataclass
class ModelPreset:
    key: str  # the file name without .json, what the CLI takes
    name: str
    config: LlamaConfig
    source: str
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def num_parameters(self) -> int:
        """Computed from the shapes (Llama block: attention, gated MLP, two RMSNorms), the same
        count as ui/hardware_data.py's `param_count` and as the engine's loaded model:
        embedding V·h (+ LM head V·h unless tied)
        + L·(h·(H+2K)·d [+ biases] + H·d·h + 3·h·I + 2h) + h."""
        c = self.config
        h, d = c.hidden_size, c.head_dim
        q, kv = c.num_heads * d, c.num_kv_heads * d
        attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if c.attention_bias else 0)
        per_layer = attention + 3 * h * c.intermediate_size + 2 * h
        embedding = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        return embedding + c.num_layers * per_layer + h

    def kv_bytes(self, num_tokens: int, dtype: str = "bfloat16") -> int:
        """The K/V of `num_tokens` tokens (computed, 계산값): layers × 2 (K and V) × KV heads ×
        head_dim × dtype bytes × tokens: what a prefill instance hands a decode instance."""
        c = self.config
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * DTYPE_BYTES[dtype] * num_tokens


@dataclass
class HardwarePreset:
    key: str
    name: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s of dense matmuls in `dtype`
    interconnect_bandwidth: float  # bytes/s, total bidirectional as vendors print it (0: none)
    interconnect: str
    dtype: str  # the dtype the peak is for, and the simulated engine's dtype
    evidence: str  # "vendor-reported" or "measured"
    source: str
    uncertain: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.memory_bytes / GB:.0f} GB, "
            f"{self.memory_bandwidth / 1e9:,.0f} GB/s, "
            f"{self.peak_flops / 1e12:,.1f} TFLOP/s {self.dtype} ({self.evidence}: {self.source})"
        )


@dataclass(frozen=True)
class LinkPreset:
    """A link a KV transfer crosses: the vendor's figure (`reported`, as printed, often both
    directions together) and the one-way bandwidth a transfer from one GPU to another uses."""

    key: str
    name: str
    reported: str
    one_way_bandwidth: float  # bytes/s, one direction
    latency_s: float  # per transfer (assumed: see latency_evidence)
    evidence: str
    source: str
    latency_evidence: str

    def transfer_seconds(self, num_bytes: int) -> float:
        """Computed (계산값): bytes ÷ one-way bandwidth + latency. One transfer alone on the link:
        no queueing behind other transfers, no protocol overhead beyond the latency."""
        return num_bytes / self.one_way_bandwidth + self.latency_s

    def describe(self) -> str:
        return (
            f"{self.name}: {self.one_way_bandwidth / 1e9:,.1f} GB/s one way "
            f"({self.evidence}: {self.reported}; {self.source}), "
            f"+{1e6 * self.latency_s:.0f} µs per transfer ({self.latency_evidence})"
        )


def _names(folder: str) -> list[str]:
    return sorted(p.stem for p in (PRESETS_DIR / folder).glob("*.json"))


def model_preset_names() -> list[str]:
    return _names("models")


def hardware_preset_names() -> list[str]:
    return _names("hardware") + [THIS_MACHINE]


def link_preset_names() -> list[str]:
    return _names("links")


def load_link_preset(key: str) -> LinkPreset:
    path = PRESETS_DIR / "links" / f"{key.lower()}.json"
    if not path.is_file():
        raise PresetError(f"unknown link preset {key!r}; known: {', '.join(link_preset_names())}")
    raw = json.loads(path.read_text())
    return LinkPreset(
        key=path.stem,
        name=raw["name"],
        reported=raw["reported"],
        one_way_bandwidth=raw["one_way_gb_s"] * 1e9,
        latency_s=raw["latency_us"] * 1e-6,
        evidence=raw["evidence"],
        source=raw["source"],
        latency_evidence=raw["latency_evidence"],
    )


def _first(value):
    return value[0] if isinstance(value, list) else value


def model_config_from_dict(raw: dict, key: str, source: str) -> ModelPreset:
    """A preset from a config.json dict (a preset file's, or a real artifact's)."""
    return ModelPreset(
        key,
        raw.get("_name", key),
        LlamaConfig.from_dict(raw),
        source,
        _first(raw.get("bos_token_id")),
        _first(raw.get("eos_token_id")),
    )


def load_model_preset(key: str) -> ModelPreset:
    path = PRESETS_DIR / "models" / f"{key.lower()}.json"
    if not path.is_file():
        raise PresetError(f"unknown model preset {key!r}; known: {', '.join(model_preset_names())}")
    raw = json.loads(path.read_text())
    return model_config_from_dict(raw, path.stem, raw["_source"])


def model_preset_from_dir(model_dir: str | Path) -> ModelPreset:
    """The shapes of a real artifact (what calibration and the fidelity check simulate)."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    return model_config_from_dict(
        raw, model_dir.name, f"{model_dir / 'config.json'} (the artifact itself)"
    )


def load_hardware_preset(key: str) -> HardwarePreset:
    """A vendor preset by name. "this-machine" is measured, not read from a file:
    engine.tools.calibration.this_machine() builds it (the simulator asks it for that name)."""
    if key.lower() == THIS_MACHINE:
        raise PresetError(
            f"{THIS_MACHINE!r} is measured: engine.tools.calibration.this_machine() builds it"
        )
    path = PRESETS_DIR / "hardware" / f"{key.lower()}.json"
    if not path.is_file():
        raise PresetError(
            f"unknown hardware preset {key!r}; known: {', '.join(hardware_preset_names())}"
        )
    raw = json.loads(path.read_text())
    return HardwarePreset(
        key=path.stem,
        name=raw["name"],
        kind=raw["kind"],
        memory_bytes=int(raw["memory_gb"] * GB),
        memory_bandwidth=raw["memory_bandwidth_gb_s"] * 1e9,
        peak_flops=raw["bf16_dense_tflop_s"] * 1e12,
        interconnect_bandwidth=raw["interconnect_gb_s"] * 1e9,
        interconnect=raw["interconnect"],
        dtype="bfloat16",
        evidence=raw["evidence"],
        source=raw["source"],
        uncertain=list(raw.get("uncertain", [])),
    )
