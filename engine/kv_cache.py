"""The KV-cache manager: which physical blocks hold which request's K/V (control path only).

The memory itself (tensors) belongs to the worker; this module only hands out block ids.

- BlockPool: all blocks, a free queue in LRU order, reference counts, and the prefix cache
  (block hash → block). A freed block whose contents are still valid stays in the prefix cache
  ("cached-free") until it is handed out again, which evicts it: least recently freed first.
- KVCacheManager: per-request block tables, allocation for the tokens a step schedules,
  prefix-cache lookups at admission, and freeing on finish, abort or preemption.

Prefix caching: a *full* block is identified by a chained hash of (parent block's hash, this
block's token ids), so equal hashes mean equal whole prefixes. A hit is trusted only after the
candidate's token ids and its parent block are compared: a hash collision then costs a miss, never
another request's K/V. A request's `cache_salt` enters its first block's hash and key, so requests
with different salts (tenants) never share blocks: a cache hit shortens TTFT, which would let one
user probe another's prompt by timing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from engine.request import Request
from engine.utils import cdiv

BlockHashFn = Callable[[int | None, tuple[int, ...]], int]


def chained_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and cached
    token_ids: tuple[int, ...] | None = None  # the tokens it holds, for hit verification
    parent_key: tuple | None = None  # (block_id, generation) of the previous block; for a first
    #                                  block ("salt", cache_salt) or None
    generation: int = 0  # bumped each time the block is cached anew, so stale parents are seen


@dataclass
class BlockState:
    """One block in a KV snapshot."""

    block_id: int
    status: str  # "used", "free" or "cached" (free but holding reusable prefix K/V)
    owners: list[str]
    ref_cnt: int


@dataclass
class KVSnapshot:
    """The KV cache after a step. Cheap to take (it runs every step): the per-block view that the
    block-grid plot draws is built from the block tables only when `blocks` is first read."""

    num_blocks: int
    block_size: int
    block_tables: dict[str, list[int]]
    cached_free_ids: tuple[int, ...]  # free blocks still holding reusable prefix K/V
    num_used: int
    num_cached_free: int
    num_free: int
    usage: float  # used blocks / all blocks
    prefix_cache_queries: int  # tokens looked up in the prefix cache so far
    prefix_cache_hits: int  # of those, tokens found

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @cached_property
    def blocks(self) -> list[BlockState]:
        """One BlockState per block. A block's owners are the requests whose tables list it (its
        reference count is their number); an unowned block is cached-free or plain free."""
        owners: dict[int, list[str]] = {}
        for request_id, block_ids in self.block_tables.items():
            for block_id in block_ids:
                owners.setdefault(block_id, []).append(request_id)
        cached = set(self.cached_free_ids)
        states = []
        for block_id in range(self.num_blocks):
            users = owners.get(block_id, [])
            status = "used" if users else "cached" if block_id in cached else "free"
            states.append(BlockState(block_id, status, users, len(users)))
        return states


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, list[KVCacheBlock]] = {}  # block hash → blocks with that hash
        # ids of free blocks still holding cached K/V (for snapshots), and a frozen copy of it
        # that snapshots share until it changes (a long run holds thousands of them)
        self.cached_free: set[int] = set()
        self._cached_free_view: tuple[int, ...] | None = ()
        self.enable_caching = enable_caching
        # Called with (hash, token ids, block id) when a cached block is handed out again (a KV
        # connector stores it to a host tier before this step's forward overwrites it).
        self.on_evict: Callable[[int, tuple[int, ...], int], None] | None = None

    def cached_free_view(self) -> tuple[int, ...]:
        if self._cached_free_view is None:
            self._cached_free_view = tuple(self.cached_free)
        return self._cached_free_view

    def _mark_cached_free(self, block_id: int) -> None:
        self.cached_free.add(block_id)
        self._cached_free_view = None

    def _unmark_cached_free(self, block_id: int) -> None:
        if block_id in self.cached_free:
            self.cached_free.remove(block_id)
            self._cached_free_view = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out, cached-free ones included (they get evicted)."""
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the front of the free queue (least recently freed first)."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        taken = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._unmark_cached_free(block.block_id)
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block.block_hash, block.token_ids, block.block_id)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """A prefix hit: one more request uses these blocks; cached-free ones leave the free
        queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
                self._unmark_cached_free(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference; blocks nobody uses go to the back of the free queue.
        Callers pass a request's blocks tail first, so a prefix's last blocks are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is not None:
                    self._mark_cached_free(block.block_id)

    def lookup(
        self,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent: KVCacheBlock | None,
        salt: str | None = None,
    ) -> KVCacheBlock | None:
        """The cached block holding exactly `token_ids` after `parent`, verified, else None."""
        parent_key = _parent_key(parent, salt)
        for block in self.cached.get(block_hash, ()):
            if block.token_ids == token_ids and block.parent_key == parent_key:
                return block
        return None

    def cache_block(
        self,
        block: KVCacheBlock,
        block_hash: int,
        token_ids: tuple[int, ...],
        parent: KVCacheBlock | None,
        salt: str | None = None,
    ) -> KVCacheBlock:
        """Register a full block in the prefix cache. Returns the canonical block for this prefix:
        `block` itself, or an identical block cached before it (two requests computed the same
        prefix in the same step); the caller then uses that one and frees its duplicate."""
        if not self.enable_caching or block.block_hash is not None:
            return block
        twin = self.lookup(block_hash, token_ids, parent, salt)
        if twin is not None:
            return twin
        block.generation += 1
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_key = _parent_key(parent, salt)
        self.cached.setdefault(block_hash, []).append(block)
        if block.ref_cnt == 0:
            self._mark_cached_free(block.block_id)
        return block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same_hash = self.cached[block.block_hash]
        same_hash.remove(block)
        if not same_hash:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent_key = None


def _parent_key(parent: KVCacheBlock | None, salt: str | None) -> tuple | None:
    if parent is not None:
        return (parent.block_id, parent.generation)
    return ("salt", salt) if salt is not None else None


def first_parent_hash(salt: str | None) -> int | None:
    """The hash a request's first block chains on: its salt's, so salts split the cache."""
    return None if salt is None else hash(("cache_salt", salt))


class SwapSpace:
    """Blocks in host memory that hold swapped-out requests' K/V (swap preemption, chapter 09).
    Bounded: when it is full, the scheduler falls back to recompute."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks))
        self.req_to_swap_ids: dict[str, list[int]] = {}

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: BlockHashFn = chained_block_hash,
        num_swap_blocks: int = 0,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.hash_fn = hash_fn
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_hashes: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_deduplicated_blocks = 0  # blocks freed because an identical one was cached first
        self.swap_space = SwapSpace(num_swap_blocks)

    # -- admission ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks for a request about to be admitted.

        At least one token is always left to compute: the model must run on the last prompt
        token to produce logits for the first output token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        parent_hash, parent = first_parent_hash(request.cache_salt), None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hash = self.hash_fn(parent_hash, chunk)
            block = self.block_pool.lookup(block_hash, chunk, parent, request.cache_salt)
            if block is None:
                break
            hits.append(block)
            parent_hash, parent = block_hash, block
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup towards the hit rate (tokens found / tokens asked)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation --------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) if blocks run out."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_to_allocate = num_needed - len(blocks) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.num_free_blocks - evictable_hits:
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks = (
            blocks + new_computed_blocks + self.block_pool.get_new_blocks(max(num_to_allocate, 0))
        )
        self.req_to_blocks[request.request_id] = blocks
        return blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Register every block that became full of computed tokens (called after a step ran).
        A block whose twin was cached first is replaced by the twin in the request's table, so
        the request's later blocks chain on the canonical block and can be hit too."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id, [])
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        for i in range(len(hashes), num_full):
            chunk = tuple(request.token_ids(i * self.block_size, (i + 1) * self.block_size))
            parent_hash = hashes[i - 1] if i else first_parent_hash(request.cache_salt)
            block_hash = self.hash_fn(parent_hash, chunk)
            hashes.append(block_hash)
            parent = blocks[i - 1] if i else None
            canonical = self.block_pool.cache_block(
                blocks[i], block_hash, chunk, parent, request.cache_salt
            )
            if canonical is not blocks[i]:  # same K/V already cached: keep one copy
                self.block_pool.touch([canonical])
                self.block_pool.free_blocks([blocks[i]])
                blocks[i] = canonical
                self.num_deduplicated_blocks += 1

    def free_rejected_blocks(self, request: Request) -> int:
        """Speculative decoding: after verification the request's `num_computed_tokens` went back
        to what was accepted. Blocks past those that hold its computed tokens then hold only the
        rejected drafts' K/V: give them back (tail first) and return how many. Rejected K/V in
        the last kept block need no cleaning: those slots are simply overwritten later."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_needed = cdiv(request.num_computed_tokens, self.block_size)
        if len(blocks) <= num_needed:
            return 0
        rejected = blocks[num_needed:]
        del blocks[num_needed:]
        self.block_pool.free_blocks(list(reversed(rejected)))
        return len(rejected)

    def free(self, request: Request) -> None:
        """Release a request's blocks (finish, abort or preemption), tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_hashes.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))

    # -- swap preemption ----------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Give the request's device blocks up, its K/V to be copied to swap blocks first.
        Returns (device block, swap block) pairs, or None (and no change) if the swap space is
        too full. Only blocks that hold computed tokens are copied."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_to_copy = min(cdiv(request.num_computed_tokens, self.block_size), len(blocks))
        if num_to_copy > len(self.swap_space.free_ids):
            return None
        swap_ids = [self.swap_space.free_ids.pop() for _ in range(num_to_copy)]
        self.swap_space.req_to_swap_ids[request.request_id] = swap_ids
        pairs = [(b.block_id, s) for b, s in zip(blocks, swap_ids)]
        self.free(request)
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh device blocks for a swapped-out request's tokens plus `num_new_tokens`. Returns
        (swap block, device block) pairs to copy back, or None (and no change) if blocks run out."""
        swap_ids = self.swap_space.req_to_swap_ids[request.request_id]
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        blocks = self.block_pool.get_new_blocks(num_needed)
        self.req_to_blocks[request.request_id] = blocks
        del self.swap_space.req_to_swap_ids[request.request_id]
        self.swap_space.free_ids.extend(reversed(swap_ids))
        return [(s, b.block_id) for s, b in zip(swap_ids, blocks)]

    def drop_swapped(self, request: Request) -> None:
        """A swapped-out request ended (abort, error): its swap blocks are free again."""
        swap_ids = self.swap_space.req_to_swap_ids.pop(request.request_id, [])
        self.swap_space.free_ids.extend(reversed(swap_ids))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    # -- what the app and tests look at --------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.block_pool.num_free_blocks / self.num_blocks

    def snapshot(self) -> KVSnapshot:
        block_tables = {
            rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items()
        }
        cached_free = self.block_pool.cached_free_view()
        num_used = self.num_blocks - self.block_pool.num_free_blocks
        return KVSnapshot(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            block_tables=block_tables,
            cached_free_ids=cached_free,
            num_used=num_used,
            num_cached_free=len(cached_free),
            num_free=self.num_blocks - num_used - len(cached_free),
            usage=num_used / self.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    # -- a fork of the engine (EngineCore.fork) ------------------------------------------------

    def resize(self, num_blocks: int) -> dict[int, int]:
        """Keep every block in use and as many free ones as fit in `num_blocks` (the ones the
        free queue would hand out last are kept: the front of the queue is what would be evicted
        next anyway), renumber them 0..num_blocks-1 in their old order, and add fresh blocks
        when growing. Returns old id → new id for the kept blocks (whose K/V must be copied).
        Raises ValueError when the blocks in use do not fit."""
        pool = self.block_pool
        num_used = len(pool.blocks) - len(pool.free_queue)
        if num_blocks < max(num_used, 1):
            raise ValueError(
                f"{num_blocks} KV blocks cannot hold the {num_used} blocks the running requests "
                "use now; keep at least that many"
            )
        num_dropped = max(len(pool.blocks) - num_blocks, 0)
        dropped = list(pool.free_queue.values())[:num_dropped]
        for block in dropped:  # (_renumber rebuilds the cached-free set from what is left)
            pool._evict(block)
            del pool.free_queue[block.block_id]
        gone = {id(b) for b in dropped}
        kept = [b for b in pool.blocks if id(b) not in gone]
        block_map = {b.block_id: new_id for new_id, b in enumerate(kept)}
        self._renumber(kept, block_map, num_blocks)
        return block_map

    def _renumber(self, kept: list[KVCacheBlock], block_map: dict[int, int], n: int) -> None:
        """Give the kept blocks their new ids (parents keyed by id follow; a parent that was
        dropped leaves a key no block has, so its children are never hit) and rebuild the pool's
        id-keyed views, free-queue order unchanged, fresh blocks at the back."""
        pool = self.block_pool
        for block in kept:
            key = block.parent_key
            if key is not None and key[0] != "salt":
                parent = block_map.get(key[0])
                block.parent_key = (parent, key[1]) if parent is not None else ("dropped", key)
            block.block_id = block_map[block.block_id]
        fresh = [KVCacheBlock(i) for i in range(len(kept), n)]
        order = list(pool.free_queue.values()) + fresh
        pool.blocks = kept + fresh
        pool.free_queue = OrderedDict((b.block_id, b) for b in order)
        pool.cached_free = {b.block_id for b in order if b.block_hash is not None}
        pool._cached_free_view = None
        self.num_blocks = n

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off from now on. Off forgets every cached hash (cached-free
        blocks become plain free ones); on hashes running requests' full blocks from the next
        step, as if they had been cached all along."""
        self.enable_prefix_caching = self.block_pool.enable_caching = enabled
        if enabled:
            return
        pool = self.block_pool
        for block in pool.blocks:
            pool._evict(block)
        pool.cached_free.clear()
        pool._cached_free_view = None
        self.req_to_hashes.clear()

    def resize_swap_space(self, num_blocks: int) -> None:
        """A fork that changes the preemption mode: a fresh swap space (nothing may be swapped)."""
        if self.swap_space.req_to_swap_ids:
            raise ValueError("requests are swapped out: the swap space cannot be replaced")
        self.swap_space = SwapSpace(num_blocks)
