"""The KV connector, scheduler side: K/V that exist outside this engine's device cache.

vLLM V1's shape (vllm/distributed/kv_transfer/kv_connector/v1/base.py, KVConnectorBase_V1),
made synchronous: the scheduler asks the connector, when it admits a request, how many of its
tokens beyond the device prefix hits are available elsewhere (a producer engine that prefilled
it, or a host-memory tier of evicted prefix blocks); it allocates device blocks for them and the
connector plans the copies. Each step the plan goes to the worker as plain data
(`KVConnectorMetadata` in `SchedulerOutput.kv_connector_metadata`), and the worker side
(engine/worker/kv_connector.py) moves whole blocks, all layers at once: stores to the tier and
loads before the forward, saves right after it.

Two connectors live here (both plain Python, no torch):
- `InProcessConnector`: prefill → decode. A `kv_producer` saves a request's blocks to a channel
  when its prompt is computed and hands `kv_transfer_params` to whoever sends the request on; a
  `kv_consumer` loads them for a request that carries those params and decodes.
- `OffloadingConnector` (`kv_both`): a bounded host tier (LRU by block hash) that receives the
  device prefix-cache blocks the block pool evicts and gives them back to later requests whose
  prefix continues there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from engine.kv_cache import chained_block_hash, first_parent_hash
from engine.request import Request
from engine.utils import cdiv

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's KVTransferConfig, the fields this engine uses. `kv_connector` names a registered
    connector (KV_CONNECTORS); `offload_bytes` sizes the OffloadingConnector's host tier;
    `kv_connector_extra_config` holds a connector's own settings (the in-process channel's name,
    a peer's address)."""

    kv_connector: str
    kv_role: str = "kv_both"
    offload_bytes: int = 0
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_connector must name a KV connector, e.g. 'InProcessConnector'")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if isinstance(self.offload_bytes, bool) or not isinstance(self.offload_bytes, int):
            raise ValueError(f"offload_bytes must be an int, got {self.offload_bytes!r}")
        if self.offload_bytes < 0:
            raise ValueError(f"offload_bytes must be >= 0, got {self.offload_bytes}")
        if self.kv_connector == "OffloadingConnector" and (
            self.kv_role != "kv_both" or self.offload_bytes <= 0
        ):
            raise ValueError("OffloadingConnector needs kv_role='kv_both' and offload_bytes > 0")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# -- what crosses to the worker (plain data) ---------------------------------------------------


@dataclass
class KVLoad:
    """Copy K/V from outside into device blocks, before the forward. `key` names the K/V (the
    producer's request id, or a tier block's hash); the sent K/V's block `start_block` goes to
    `block_ids[0]`, the next to `block_ids[1]`, and so on (blocks before `start_block` were
    device prefix hits)."""

    request_id: str
    key: str
    block_ids: list[int]
    num_tokens: int
    start_block: int = 0


@dataclass
class KVSave:
    """Copy device blocks out under `key`: after the forward (a save to a channel), or before
    it (a store of an evicted block to the host tier)."""

    request_id: str
    key: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVConnectorMetadata:
    """One step's copies. The worker runs them in this order: `drops` (tier keys to forget),
    `stores` (evicted device blocks to the tier; an evicted block may be handed out and written
    in this same step), then swaps, `loads`, the forward, and `saves`."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)
    stores: list[KVSave] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.stores or self.drops)


@dataclass
class KVTransferRecord:
    """One copy the worker made, measured: for the step record, the trace and the labs."""

    request_id: str
    key: str
    direction: str  # "load" (into the device), "save" (out, after the forward), "store" (to tier)
    num_blocks: int
    num_tokens: int
    num_bytes: int
    seconds: float
    ok: bool = True  # False: a load that failed (missing or corrupted); its request recomputes


def kv_bytes(bytes_per_block: int, num_tokens: int, block_size: int) -> int:
    """Bytes a transfer of `num_tokens` moves: whole blocks (layers × 2 × KV heads × head_dim ×
    dtype bytes × block_size each), the last one rounded up."""
    return cdiv(num_tokens, block_size) * bytes_per_block


# -- the scheduler side ------------------------------------------------------------------------


class KVConnectorBase_V1(ABC):  # noqa: N801 — vLLM's name
    """The scheduler side of a connector (vLLM's KVConnectorRole.SCHEDULER)."""

    def __init__(self, config: KVTransferConfig, block_size: int, bytes_per_block: int):
        self.config = config
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block  # all layers, K and V, one block
        self.hash_fn: Callable = chained_block_hash  # the device cache's (Scheduler sets it)
        self.stats: dict[str, int] = {}

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of `request`, after its `num_computed_tokens` device prefix hits, whose K/V can
        be loaded instead of computed. Leaves at least the last prompt token to compute."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request was admitted with `num_external_tokens` external tokens; `block_ids` is
        its whole block table. Called while `request.num_computed_tokens` is still its device
        prefix hits."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's copies (drains what was planned since the last call)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(keep the blocks until a save planned in the next step has run?, the
        kv_transfer_params a consumer needs to load this request's K/V, or None)."""
        return False, None

    def request_load_failed(self, request: Request) -> None:
        """The worker could not load this request's K/V (missing, corrupted): it recomputes, and
        the connector must not offer the same K/V again."""

    def block_evicted(self, block_hash: int, token_ids: tuple[int, ...], block_id: int) -> None:
        """The device prefix cache gave up a cached block (its K/V still intact until the step's
        forward)."""


class InProcessConnector(KVConnectorBase_V1):
    """Prefill → decode. The producer saves each request's blocks once its prompt is computed
    (right after that step's forward, before its blocks can be freed) under the request's id;
    the consumer loads them for a request whose kv_transfer_params name that id, once: a
    consumer request preempted later recomputes its tokens itself."""

    def __init__(self, config: KVTransferConfig, block_size: int, bytes_per_block: int):
        super().__init__(config, block_size, bytes_per_block)
        self._saved: dict[str, int] = {}  # request id → tokens saved (producer)
        self._loaded: set[str] = set()  # requests whose one load was planned (consumer)
        self._loads: list[KVLoad] = []
        self._drops: list[str] = []  # keys sent but never to be loaded: the channel forgets them
        self.stats = {"saves": 0, "loads": 0, "load_tokens": 0, "failed_loads": 0}

    def _key_to_load(self, request: Request) -> str | None:
        """The key of K/V sent for this consumer request and not taken yet, else None."""
        params = request.kv_transfer_params
        if not self.config.is_kv_consumer or not params or request.request_id in self._loaded:
            return None
        key = params.get("remote_request_id")
        return None if key is None else str(key)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self._key_to_load(request) is None:
            return 0
        available = min(
            int(request.kv_transfer_params.get("num_tokens", 0)), request.num_tokens - 1
        )
        return max(available - num_computed_tokens, 0)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        key = self._key_to_load(request)
        if key is None:
            return
        self._loaded.add(request.request_id)
        if num_external_tokens <= 0:  # its own prefix cache had all of it: drop what was sent
            self._drops.append(key)
            return
        start = request.num_computed_tokens // self.block_size
        end = cdiv(request.num_computed_tokens + num_external_tokens, self.block_size)
        load = KVLoad(request.request_id, key, block_ids[start:end], num_external_tokens, start)
        self._loads.append(load)
        self.stats["loads"] += 1
        self.stats["load_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        saves = []
        if self.config.is_kv_producer:
            for s in scheduler_output.scheduled:
                if s.produces_token and s.request_id not in self._saved:
                    num_tokens = s.num_computed_tokens + s.num_tokens - len(s.draft_token_ids)
                    blocks = s.block_ids[: cdiv(num_tokens, self.block_size)]
                    saves.append(KVSave(s.request_id, s.request_id, blocks, num_tokens))
                    self._saved[s.request_id] = num_tokens
                    self.stats["saves"] += 1
        (loads, self._loads), (drops, self._drops) = (self._loads, []), (self._drops, [])
        return KVConnectorMetadata(loads=loads, saves=saves, drops=drops)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        key = self._key_to_load(request)
        if key is not None:  # ended (aborted, failed) before it was admitted: drop what was sent
            self._drops.append(key)
        self._loaded.discard(request.request_id)
        num_tokens = self._saved.pop(request.request_id, None)
        if num_tokens is None:
            return False, None
        return False, {"remote_request_id": request.request_id, "num_tokens": num_tokens}

    def request_load_failed(self, request: Request) -> None:
        self.stats["failed_loads"] += 1


class OffloadingConnector(KVConnectorBase_V1):
    """A host-memory tier under the device prefix cache. The block pool's evictions are stored
    (LRU by block hash, at most offload_bytes); a request whose chain of full-block hashes
    continues in the tier after its device hits loads those blocks. A hit is trusted when the
    chained hash and the block's own token ids match (the chained hash covers the prefix)."""

    def __init__(self, config: KVTransferConfig, block_size: int, bytes_per_block: int):
        super().__init__(config, block_size, bytes_per_block)
        self.capacity_blocks = config.offload_bytes // bytes_per_block
        self.tier: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # hash → token ids, LRU
        self._pinned: set[int] = set()  # hashes a request admitted this step loads
        self._planned: dict[str, list[int]] = {}  # request id → tier hashes matched, in order
        self._loads: list[KVLoad] = []
        self._stores: list[KVSave] = []
        self._drops: list[str] = []
        self._inflight: dict[str, list[int]] = {}  # this step's loads by request (for failures)
        self._step_loading: dict[str, list[int]] = {}
        self.stats = {
            "tier_hit_tokens": 0,
            "loads": 0,
            "stores": 0,
            "tier_evictions": 0,
            "failed_loads": 0,
            "skipped_stores": 0,
        }

    @property
    def used_bytes(self) -> int:
        return len(self.tier) * self.bytes_per_block

    def _chain(self, request: Request) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, token ids) of each full block the request may take from a cache (the last
        prompt token is always computed)."""
        tokens, size = request.all_token_ids, self.block_size
        parent, chain = first_parent_hash(request.cache_salt), []
        for i in range((len(tokens) - 1) // size):
            chunk = tuple(tokens[i * size : (i + 1) * size])
            parent = self.hash_fn(parent, chunk)
            chain.append((parent, chunk))
        return chain

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        matched = []
        for block_hash, chunk in self._chain(request)[num_computed_tokens // self.block_size :]:
            if self.tier.get(block_hash) != chunk:
                break
            matched.append(block_hash)
        for block_hash in matched:  # a hit is a use (LRU), and safe from eviction this step
            self.tier.move_to_end(block_hash)
            self._pinned.add(block_hash)
        self._planned[request.request_id] = matched
        return len(matched) * self.block_size

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        matched = self._planned.pop(request.request_id, [])
        num_blocks = num_external_tokens // self.block_size
        if num_blocks <= 0:
            return
        start = request.num_computed_tokens // self.block_size
        for i, block_hash in enumerate(matched[:num_blocks]):
            block_id = block_ids[start + i]
            load = KVLoad(request.request_id, tier_key(block_hash), [block_id], self.block_size)
            self._loads.append(load)
        self._step_loading[request.request_id] = matched[:num_blocks]
        self.stats["tier_hit_tokens"] += num_blocks * self.block_size
        self.stats["loads"] += num_blocks

    def block_evicted(self, block_hash: int, token_ids: tuple[int, ...], block_id: int) -> None:
        if block_hash in self.tier:
            if self.tier[block_hash] == token_ids:
                self.tier.move_to_end(block_hash)
                return
            self._forget(block_hash)  # same hash, other tokens: the newer block wins
        if not self._make_room():
            self.stats["skipped_stores"] += 1
            return
        self.tier[block_hash] = token_ids
        self._stores.append(KVSave("", tier_key(block_hash), [block_id], self.block_size))
        self.stats["stores"] += 1

    def _make_room(self) -> bool:
        """Evict least recently used tier blocks (never one loaded this step) until one fits."""
        while len(self.tier) >= self.capacity_blocks:
            victim = next((h for h in self.tier if h not in self._pinned), None)
            if victim is None:
                return False
            self._forget(victim)
            self.stats["tier_evictions"] += 1
        return True

    def _forget(self, block_hash: int) -> None:
        """Drop a hash from the tier; the worker drops its copy (or never makes it, when the
        store was planned in this same step)."""
        del self.tier[block_hash]
        key = tier_key(block_hash)
        stores = [s for s in self._stores if s.key != key]
        if len(stores) == len(self._stores):
            self._drops.append(key)
        self._stores = stores

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._loads, stores=self._stores, drops=self._drops)
        self._loads, self._stores, self._drops = [], [], []
        self._inflight, self._step_loading = self._step_loading, {}
        self._pinned.clear()
        self._planned.clear()
        return meta

    def request_load_failed(self, request: Request) -> None:
        """A tier block was missing or corrupted: forget every block this request was loading
        (the worker has dropped the bad one), so no later request tries them again."""
        self.stats["failed_loads"] += 1
        for block_hash in self._inflight.pop(request.request_id, []):
            if block_hash in self.tier:
                self._forget(block_hash)


def tier_key(block_hash: int) -> str:
    return f"block:{block_hash:x}" if block_hash >= 0 else f"block:-{-block_hash:x}"


# Scheduler-side classes by the name in KVTransferConfig.kv_connector (vLLM: KVConnectorFactory).
# A connector with its own transport (a channel between processes) registers its name here with
# the scheduler side it uses, and its worker side in engine/worker/kv_connector.py.
KV_CONNECTORS: dict[str, type[KVConnectorBase_V1]] = {
    "InProcessConnector": InProcessConnector,
    # prefill → decode across processes: the same plan, the K/V over torch.distributed
    # (engine/worker/kv_p2p.py)
    "P2pGlooConnector": InProcessConnector,
    "OffloadingConnector": OffloadingConnector,
}


def make_kv_connector(
    config: KVTransferConfig, block_size: int, bytes_per_block: int
) -> KVConnectorBase_V1:
    """The scheduler side of the connector `config` names; ValueError for an unknown name."""
    if config.kv_connector not in KV_CONNECTORS:
        raise ValueError(
            f"unknown kv_connector {config.kv_connector!r}; known: {', '.join(KV_CONNECTORS)}"
        )
    return KV_CONNECTORS[config.kv_connector](config, block_size, bytes_per_block)
