"""The KV connector, worker side: the copies the scheduler side planned (engine/kv_connector.py).

The worker runs a step's copies around its forward, synchronously, whole blocks, all layers:

    drops, stores (device → host tier)  →  swaps  →  loads (→ device)  →  forward  →  saves

Stores come first because the block the pool evicted may be handed to a request in this same step
and written by a load, a swap-in or the forward. A load that cannot be done (its K/V missing,
corrupted or of the wrong shape) fails its request only: the model runner leaves that request out
of the forward and the scheduler sends it back to be recomputed, so a bad transfer costs time,
never tokens.

The K/V of a transfer is one tensor, `[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]`
in the cache's dtype: every layer of the request's blocks, in block-table order. Blocks are whole:
a transfer of n tokens moves cdiv(n, block_size) blocks (kv_connector.kv_bytes).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
import zlib
from abc import ABC, abstractmethod
from typing import Callable

import torch

from engine.kv_connector import (
    KVConnectorMetadata,
    KVLoad,
    KVSave,
    KVTransferConfig,
    KVTransferRecord,
)

logger = logging.getLogger(__name__)


class KVChannel(ABC):
    """Where a producer's worker puts a request's K/V and a consumer's worker takes them."""

    @abstractmethod
    def send(self, key: str, kv: torch.Tensor, num_tokens: int) -> None:
        """Hand over `kv` (the layout above) holding `num_tokens` tokens under `key`."""

    @abstractmethod
    def recv(self, key: str) -> tuple[torch.Tensor, int] | None:
        """The K/V sent under `key` and its token count (taken: a key is received once), or
        None when nothing was sent under it."""

    def discard(self, key: str) -> None:
        """Forget what was sent under `key`: the consumer will not load it (its own prefix cache
        had the tokens, or the request ended first). A channel that keeps what it received until
        asked must drop it here; a channel that holds nothing has nothing to do."""


class InProcessChannel(KVChannel):
    """Two engines in one process: a dict. Found by name (kv_connector_extra_config["channel"])
    so that both engines' workers, built from plain configs, meet at the same one; a channel
    lives as long as a worker holds it."""

    _named: "weakref.WeakValueDictionary[str, InProcessChannel]" = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.entries: dict[str, tuple[torch.Tensor, int]] = {}

    @classmethod
    def named(cls, name: str) -> "InProcessChannel":
        with cls._lock:
            channel = cls._named.get(name)
            if channel is None:
                channel = cls._named[name] = cls()
            return channel

    def send(self, key: str, kv: torch.Tensor, num_tokens: int) -> None:
        self.entries[key] = (kv, num_tokens)

    def recv(self, key: str) -> tuple[torch.Tensor, int] | None:
        return self.entries.pop(key, None)

    def discard(self, key: str) -> None:
        self.entries.pop(key, None)

    @property
    def num_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv, _ in self.entries.values())


class KVConnectorWorker:
    """Moves blocks between this worker's KV cache and outside. Subclasses say where outside is
    (a channel, a host tier); this class gathers and scatters blocks and measures each copy."""

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0][0].device

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(self.kv_caches[0][0].shape[1:])

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of these blocks, all layers, K and V (the transfer layout)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        first = self.kv_caches[0][0]
        shape = (len(self.kv_caches), 2, len(block_ids), *first.shape[1:])
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
        for layer, (k, v) in enumerate(self.kv_caches):  # one copy, straight into place
            torch.index_select(k, 0, index, out=out[layer, 0])
            torch.index_select(v, 0, index, out=out[layer, 1])
        return out

    def scatter(self, kv: torch.Tensor, block_ids: list[int], start_block: int = 0) -> None:
        """Write blocks start_block.. of `kv` into `block_ids`; ValueError if `kv` does not fit
        this cache (other layers, heads, block size or too few blocks)."""
        end = start_block + len(block_ids)
        layers = len(self.kv_caches)
        if kv.dim() != 6 or kv.shape[0] != layers or kv.shape[1] != 2 or kv.shape[2] < end:
            raise ValueError(f"K/V of shape {tuple(kv.shape)} cannot fill blocks {block_ids}")
        if tuple(kv.shape[3:]) != self.block_shape:
            raise ValueError(f"K/V blocks {tuple(kv.shape[3:])} != cache {self.block_shape}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        part = kv[:, :, start_block:end].to(self.device, self.kv_caches[0][0].dtype)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[index] = part[layer, 0]
            v[index] = part[layer, 1]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _measure(self, direction: str, item: KVLoad | KVSave, copy: Callable[[], int]):
        """Run one copy; a KVTransferRecord with its bytes and measured seconds (ok=False and
        the error logged if it raised)."""
        start = time.perf_counter()
        try:
            num_bytes, ok = copy(), True
            self._sync()
        except Exception:  # noqa: BLE001 — a bad transfer fails its request only
            logger.exception(
                "KV %s of request %s (%s) failed", direction, item.request_id, item.key
            )
            num_bytes, ok = 0, False
        seconds = time.perf_counter() - start
        n = len(item.block_ids)
        return KVTransferRecord(
            item.request_id, item.key, direction, n, item.num_tokens, num_bytes, seconds, ok
        )

    # -- the step's copies (the model runner calls these) ---------------------------------------

    def store_kv(self, meta: KVConnectorMetadata) -> list[KVTransferRecord]:
        """Before swaps and loads: forget dropped keys, store evicted blocks (host tier)."""
        return []

    def start_load_kv(self, meta: KVConnectorMetadata) -> tuple[list[KVTransferRecord], set[str]]:
        """Before the forward: every load, measured; and the requests with a failed load."""
        records = [
            self._measure("load", load, lambda ld=load: self.load(ld)) for load in meta.loads
        ]
        return records, {r.request_id for r in records if not r.ok}

    def save_kv(self, meta: KVConnectorMetadata, skip: set[str]) -> list[KVTransferRecord]:
        """After the forward: every save (but those of `skip`, requests that did not run)."""
        saves = [s for s in meta.saves if s.request_id not in skip]
        return [self._measure("save", save, lambda sv=save: self.save(sv)) for save in saves]

    def load(self, load: KVLoad) -> int:
        raise ValueError(f"{type(self).__name__} has nothing to load from")

    def save(self, save: KVSave) -> int:
        raise ValueError(f"{type(self).__name__} has nothing to save to")


class ChannelConnectorWorker(KVConnectorWorker):
    """Prefill → decode: a producer saves each finished prompt's blocks to the channel, a
    consumer loads them into the blocks its scheduler allocated."""

    def __init__(self, config: KVTransferConfig, channel: KVChannel):
        super().__init__(config)
        self.channel = channel

    def store_kv(self, meta: KVConnectorMetadata) -> list[KVTransferRecord]:
        for key in meta.drops:  # sent, but the consumer will not load them
            self.channel.discard(key)
        return []

    def save(self, save: KVSave) -> int:
        kv = self.gather(save.block_ids)
        self.channel.send(save.key, kv, save.num_tokens)
        return kv.numel() * kv.element_size()

    def load(self, load: KVLoad) -> int:
        received = self.channel.recv(load.key)
        if received is None:
            raise KeyError(f"no K/V was sent under {load.key!r}")
        kv, num_tokens = received
        if num_tokens < load.num_tokens:
            raise ValueError(
                f"{num_tokens} tokens sent under {load.key!r}, {load.num_tokens} asked"
            )
        self.scatter(kv, load.block_ids, load.start_block)
        part = kv[:, :, load.start_block : load.start_block + len(load.block_ids)]
        return part.numel() * part.element_size()


class OffloadingConnectorWorker(KVConnectorWorker):
    """The host tier: evicted device blocks, each with a CRC-32 of its bytes checked on load (a
    corrupted block fails its load and is dropped; its request recomputes). Pinned memory on
    CUDA, so the copies run at full PCIe speed."""

    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        self.tier: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def used_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.tier.values())

    def store_kv(self, meta: KVConnectorMetadata) -> list[KVTransferRecord]:
        for key in meta.drops:
            self.tier.pop(key, None)
        return [
            self._measure("store", store, lambda s=store: self.store(s)) for store in meta.stores
        ]

    def store(self, store: KVSave) -> int:
        blocks = self.gather(store.block_ids)
        host = blocks.to("cpu")
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.tier[store.key] = (host, checksum(host))
        return host.numel() * host.element_size()

    def load(self, load: KVLoad) -> int:
        entry = self.tier.get(load.key)
        if entry is None:
            raise KeyError(f"tier block {load.key} is missing")
        host, crc = entry
        if checksum(host) != crc:
            del self.tier[load.key]
            raise ValueError(f"tier block {load.key} is corrupted (checksum mismatch)")
        self.scatter(host, load.block_ids)
        return host.numel() * host.element_size()


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of a host tensor's bytes."""
    return zlib.crc32(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def _in_process(config: KVTransferConfig) -> KVConnectorWorker:
    name = config.kv_connector_extra_config.get("channel")
    if not name:
        raise ValueError("InProcessConnector needs kv_connector_extra_config={'channel': name}")
    return ChannelConnectorWorker(config, InProcessChannel.named(str(name)))


# Worker sides by the connector's name (the scheduler sides are in engine/kv_connector.py).
KV_CONNECTOR_WORKERS: dict[str, Callable[[KVTransferConfig], KVConnectorWorker]] = {
    "InProcessConnector": _in_process,
    "OffloadingConnector": OffloadingConnectorWorker,
}


def make_kv_connector_worker(config: KVTransferConfig) -> KVConnectorWorker:
    if config.kv_connector not in KV_CONNECTOR_WORKERS:
        known = ", ".join(KV_CONNECTOR_WORKERS)
        raise ValueError(f"unknown kv_connector {config.kv_connector!r}; known: {known}")
    return KV_CONNECTOR_WORKERS[config.kv_connector](config)
