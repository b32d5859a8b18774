"""Chapter 15 · prefill/decode disaggregation and the host KV tier (no Streamlit here).

What the chapter's lab computes: the K/V bytes a request hands from a prefill engine to a decode
engine (계산값 from the model config) and the time they would take over each link preset (계산값:
bytes ÷ one-way bandwidth + the preset's assumed latency; the bandwidth is the vendor's figure).
Measured numbers (ITL, TTFT, copy seconds, tier counters) are read from the real engines' records
by the functions below them; nothing here invents a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from engine.tools.presets import link_preset_names, load_link_preset

# -- bytes and links -----------------------------------------------------------------------------


@dataclass(frozen=True)
class KVBytes:
    """The K/V of `tokens` tokens of one model: what crosses the link for one request."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    tokens: int

    @property
    def per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def total(self) -> int:
        return self.per_token * self.tokens

    def formula(self) -> str:
        return (
            f"{self.num_layers}층 × 2 (K, V) × KV 헤드 {self.num_kv_heads} × head_dim "
            f"{self.head_dim} × {self.dtype_bytes} B × {self.tokens:,}토큰 = {self.total:,} B"
        )


def kv_bytes_of(model_config, dtype_bytes: int, tokens: int) -> KVBytes:
    """The bytes from a model's config (engine.model_config: a LlamaConfig)."""
    return KVBytes(
        model_config.num_layers,
        model_config.num_kv_heads,
        model_config.head_dim,
        int(dtype_bytes),
        int(tokens),
    )


def link_names() -> dict[str, str]:
    """Link preset key → its name (NVLink, PCIe, InfiniBand, Ethernet), fastest first."""
    presets = [load_link_preset(key) for key in link_preset_names()]
    presets.sort(key=lambda p: -p.one_way_bandwidth)
    return {p.key: p.name for p in presets}


def link_rows(num_bytes: int) -> pd.DataFrame:
    """Per link preset: its one-way bandwidth (the vendor's figure), its assumed latency and the
    time `num_bytes` would take alone on it (계산값)."""
    rows = []
    for key in link_names():
        link = load_link_preset(key)
        rows.append(
            {
                "링크": link.name,
                "한 방향 대역폭 (GB/s)": round(link.one_way_bandwidth / 1e9, 3),
                "가정한 지연 (µs)": round(1e6 * link.latency_s),
                "예상 전송 시간 (ms, 계산값)": round(1e3 * link.transfer_seconds(num_bytes), 3),
            }
        )
    return pd.DataFrame(rows)


def link_time(key: str, num_bytes: int) -> tuple[float, str, str]:
    """(seconds over the link, the link's figure as its vendor prints it, the source)."""
    link = load_link_preset(key)
    return link.transfer_seconds(num_bytes), link.reported, link.source
