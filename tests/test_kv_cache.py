"""KVCacheManager and BlockPool without a model: allocation, ref counts, prefix caching (including
forced hash collisions), LRU eviction of cached-free blocks, snapshots, and a random-operation
property test of the pool's bookkeeping."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache import BlockPool, KVCacheManager, chained_block_hash
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4  # block size used by most tests


def constant_hash(parent_hash, token_ids) -> int:
    """Every block hashes alike: only the token and parent verification can tell blocks apart."""
    return 7


def make_req(rid: str, tokens, max_tokens: int = 4) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0), eos_token_id=None
    )


def admit(kv: KVCacheManager, req: Request):
    """What the scheduler does at admission of a whole prompt: look up, allocate, then (as if the
    step ran) mark every token computed and cache the full blocks. Returns (hit ids, table ids)."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    assert num_hit_tokens == len(hits) * kv.block_size
    req.num_computed_tokens = 0
    blocks = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    assert blocks is not None, f"{req.request_id}: no room"
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return [b.block_id for b in hits], [b.block_id for b in blocks]


def check_consistent(kv: KVCacheManager) -> None:
    """ref counts = number of block tables holding a block; the free queue = blocks with ref 0."""
    holders: dict[int, int] = {}
    for rid, blocks in kv.req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
        for b in ids:
            holders[b] = holders.get(b, 0) + 1
    for block in kv.block_pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in kv.block_pool.free_queue), block
        if holders.get(block.block_id, 0) > 1:
            assert block.block_hash is not None, (
                f"block {block.block_id} shared but not a prefix-cache block"
            )
    cached_ids = {b.block_id for same in kv.block_pool.cached.values() for b in same}
    assert cached_ids == {b.block_id for b in kv.block_pool.blocks if b.block_hash is not None}
    snap = kv.snapshot()
    assert snap.num_used + snap.num_cached_free + snap.num_free == kv.num_blocks
    assert snap.num_used == sum(1 for b in kv.block_pool.blocks if b.ref_cnt > 0)
    assert snap.usage == pytest.approx(snap.num_used / kv.num_blocks)


# -- allocation and ref counts --------------------------------------------------------------------


def test_allocate_rounds_up_to_blocks_and_grows_on_demand():
    kv = KVCacheManager(8, BS)
    req = make_req("a", range(10, 19))  # 9 tokens → 3 blocks
    blocks = kv.allocate_slots(req, 9)
    assert len(blocks) == 3 and kv.num_free_blocks == 5
    req.num_computed_tokens = 9
    assert len(kv.allocate_slots(req, 3)) == 3  # 12 tokens still fit 3 blocks
    assert len(kv.allocate_slots(req, 4)) == 4  # 13 tokens need a 4th
    assert kv.block_ids("a") == [0, 1, 2, 3]  # a fresh pool hands out blocks in id order
    check_consistent(kv)


def test_allocate_fails_without_changing_anything():
    kv = KVCacheManager(4, BS)
    a, b = make_req("a", range(12)), make_req("b", range(100, 108))
    assert kv.allocate_slots(a, 12) is not None
    before = (kv.num_free_blocks, dict(kv.req_to_blocks))
    assert kv.allocate_slots(b, 8) is None  # needs 2 blocks, 1 free
    assert (kv.num_free_blocks, dict(kv.req_to_blocks)) == before
    assert "b" not in kv.req_to_blocks
    check_consistent(kv)


def test_free_returns_every_block_and_usage_drops_to_zero():
    kv = KVCacheManager(6, BS, enable_prefix_caching=False)
    a, b = make_req("a", range(9)), make_req("b", range(50, 55))
    admit(kv, a)
    admit(kv, b)
    assert kv.usage == pytest.approx(5 / 6)
    kv.free(a)
    check_consistent(kv)
    kv.free(b)
    check_consistent(kv)
    assert kv.usage == 0.0 and kv.num_free_blocks == 6
    snap = kv.snapshot()
    assert snap.num_free == 6 and snap.num_cached_free == 0 and snap.block_tables == {}


def test_double_free_of_a_block_is_caught():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


# -- prefix caching -------------------------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = KVCacheManager(16, BS)
    shared = list(range(100, 112))  # 3 full blocks
    a = make_req("a", shared + [1, 2])
    b = make_req("b", shared + [3, 4, 5])
    _, a_table = admit(kv, a)
    b_hits, b_table = admit(kv, b)
    assert b_hits == a_table[:3] and b_table[:3] == a_table[:3]
    assert set(b_table[3:]).isdisjoint(a_table)
    for block_id in a_table[:3]:
        assert kv.block_pool.blocks[block_id].ref_cnt == 2
    snap = kv.snapshot()
    assert sorted(snap.blocks[a_table[0]].owners) == ["a", "b"]
    check_consistent(kv)
    kv.free(a)
    assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in a_table[:3])
    check_consistent(kv)
    kv.free(b)
    check_consistent(kv)
    assert kv.snapshot().num_used == 0


def test_at_least_one_token_is_left_to_compute():
    kv = KVCacheManager(16, BS)
    tokens = list(range(200, 208))  # exactly 2 blocks
    admit(kv, make_req("a", tokens))
    hits, n = kv.get_computed_blocks(make_req("b", tokens))
    assert (
        n == 4 and len(hits) == 1
    )  # the last block must be recomputed for the last token's logits
    hits, n = kv.get_computed_blocks(make_req("c", tokens + [9]))
    assert n == 8


def test_lookup_does_not_touch_until_allocated():
    kv = KVCacheManager(8, BS)
    a = make_req("a", range(9))
    _, table = admit(kv, a)
    kv.free(a)
    hits, _ = kv.get_computed_blocks(make_req("b", range(9)))
    assert [h.block_id for h in hits] == table[:2]
    assert all(h.ref_cnt == 0 for h in hits) and kv.num_free_blocks == 8


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    a = make_req("a", range(13))
    admit(kv, a)
    assert kv.get_computed_blocks(make_req("b", range(13))) == ([], 0)
    kv.free(a)
    assert kv.snapshot().num_cached_free == 0


def test_hit_rate_counts_admitted_lookups():
    kv = KVCacheManager(16, BS)
    kv.record_prefix_lookup(10, 0)
    kv.record_prefix_lookup(10, 8)
    assert kv.snapshot().hit_rate == pytest.approx(0.4)
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    off.record_prefix_lookup(10, 8)
    assert off.snapshot().hit_rate == 0.0


def test_blocks_become_cached_only_when_full_and_computed():
    kv = KVCacheManager(8, BS)
    req = make_req("a", range(10))
    kv.allocate_slots(req, 6)  # a chunk of 6 tokens
    req.num_computed_tokens = 6
    kv.cache_full_blocks(req)
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, False]
    kv.allocate_slots(req, 4)
    req.num_computed_tokens = 10
    kv.cache_full_blocks(req)
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, False]
    expected = chained_block_hash(chained_block_hash(None, (0, 1, 2, 3)), (4, 5, 6, 7))
    assert kv.req_to_blocks["a"][1].block_hash == expected


# -- hash collisions ------------------------------------------------------------------------------

X, Y, Z, W = ([10 + i] * BS for i in range(4))
Y2 = [11, 11, 11, 12]  # like Y but for its last token


@pytest.mark.parametrize(
    "hash_fn", [constant_hash, chained_block_hash], ids=["constant_hash", "real_hash"]
)
def test_colliding_hashes_never_hand_out_other_tokens(hash_fn):
    kv = KVCacheManager(32, BS, hash_fn=hash_fn)
    a = make_req("a", X + Y + [1])
    _, a_table = admit(kv, a)
    # different first block: no hit at all, although every hash is equal
    for rid, tokens in [("b", W + Y + [1]), ("c", Y + X + [1]), ("d", Y2 + [1])]:
        hits, n = kv.get_computed_blocks(make_req(rid, tokens))
        assert (hits, n) == ([], 0), rid
    # same first block, second block differs in one token: only the first hits
    hits, n = kv.get_computed_blocks(make_req("e", X + Y2 + [1]))
    assert [h.block_id for h in hits] == a_table[:1] and n == BS
    hits, n = kv.get_computed_blocks(make_req("f", X + Y + [2, 3]))
    assert [h.block_id for h in hits] == a_table[:2] and n == 2 * BS
    check_consistent(kv)


def test_equal_tokens_under_a_different_parent_miss():
    """[X, Y] and [Z] are cached. [Z, Y]'s second block has the same (colliding) hash and the same
    tokens as the cached Y, but that Y's K/V was computed after X: it must miss."""
    kv = KVCacheManager(32, BS, hash_fn=constant_hash)
    _, xy_table = admit(kv, make_req("xy", X + Y + [1]))
    _, z_table = admit(kv, make_req("z", Z + [1]))
    hits, n = kv.get_computed_blocks(make_req("zy", Z + Y + [1]))
    assert [h.block_id for h in hits] == z_table[:1] and n == BS
    # and [X, Y] still finds its own chain
    hits, _ = kv.get_computed_blocks(make_req("xy2", X + Y + [5]))
    assert [h.block_id for h in hits] == xy_table[:2]


def test_two_chains_with_equal_tails_each_find_their_own():
    """[X, Y] and [Z, Y] both cached (all hashes equal): each prefix gets its own Y block back."""
    kv = KVCacheManager(32, BS, hash_fn=constant_hash)
    _, xy = admit(kv, make_req("xy", X + Y + [1]))
    _, zy = admit(kv, make_req("zy", Z + Y + [1]))
    assert xy[1] != zy[1]  # Z+Y got no hit from X+Y: it computed its own Y
    assert [h.block_id for h in kv.get_computed_blocks(make_req("q1", X + Y + [2]))[0]] == xy[:2]
    assert [h.block_id for h in kv.get_computed_blocks(make_req("q2", Z + Y + [2]))[0]] == zy[:2]
    assert kv.get_computed_blocks(make_req("q3", W + Y + [2]))[0] == []


def test_stale_parent_after_reuse_misses():
    """A cached child remembers its parent as (block id, generation): when the parent block is
    evicted and cached again with other tokens, the child no longer counts as its continuation."""
    pool = BlockPool(4)
    parent, child = pool.get_new_blocks(2)
    pool.cache_block(parent, 7, tuple(X), None)
    pool.cache_block(child, 7, tuple(Y), parent)
    assert pool.lookup(7, tuple(Y), parent) is child
    pool.free_blocks([parent])  # the parent is evicted and handed out again...
    while parent.block_id in pool.free_queue:
        pool.get_new_blocks(1)
    assert parent.block_hash is None
    pool.cache_block(parent, 7, tuple(Z), None)  # ...and now holds Z
    assert pool.lookup(7, tuple(Z), None) is parent
    assert pool.lookup(7, tuple(Y), parent) is None


def test_identical_prefix_computed_twice_is_cached_once():
    """Two requests admitted together compute the same prefix; only one copy enters the cache,
    the second request switches to that copy and frees its duplicate."""
    kv = KVCacheManager(32, BS)
    a, b = make_req("a", X + Y + [1]), make_req("b", X + Y + [2])
    # both admitted before either ran: no hits
    for req in (a, b):
        assert kv.get_computed_blocks(req) == ([], 0)
        assert kv.allocate_slots(req, req.num_tokens) is not None
    free_before = kv.num_free_blocks
    for req in (a, b):
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]  # b now uses a's copy...
    assert (
        kv.num_free_blocks == free_before + 2 and kv.num_deduplicated_blocks == 2
    )  # ...and gave its own back
    hits, _ = kv.get_computed_blocks(make_req("c", X + Y + [3]))
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2]
    check_consistent(kv)


def test_blocks_after_a_duplicated_prefix_can_be_hit():
    """The waste this fixes: b computed X, Y alongside a, then Z. Its Z block used to chain on b's
    own (uncached) copy of Y, so no later request could ever hit it."""
    kv = KVCacheManager(32, BS)
    a, b = make_req("a", X + Y + [1]), make_req("b", X + Y + Z + [2])
    for req in (a, b):
        assert kv.allocate_slots(req, req.num_tokens) is not None
        req.num_computed_tokens = req.num_tokens
    for req in (a, b):
        kv.cache_full_blocks(req)
    hits, num_hit = kv.get_computed_blocks(make_req("c", X + Y + Z + [3]))
    assert num_hit == 3 * BS and [h.block_id for h in hits] == kv.block_ids("b")[:3]
    check_consistent(kv)


def test_cache_salt_separates_tenants():
    """Equal prompts share blocks only under an equal salt (None counts as one salt)."""
    kv = KVCacheManager(32, BS)
    owner = make_req("owner", X + Y + [1])
    owner.cache_salt = "tenant-a"
    admit(kv, owner)
    owner.num_computed_tokens = owner.num_tokens
    kv.cache_full_blocks(owner)
    for salt, expected in (("tenant-a", 2 * BS), ("tenant-b", 0), (None, 0)):
        probe = make_req(f"probe-{salt}", X + Y + [2])
        probe.cache_salt = salt
        assert kv.get_computed_blocks(probe)[1] == expected, salt
    unsalted = make_req("plain", X + Y + [3])
    admit(kv, unsalted)
    unsalted.num_computed_tokens = unsalted.num_tokens
    kv.cache_full_blocks(unsalted)
    assert set(kv.block_ids("plain")).isdisjoint(kv.block_ids("owner"))
    check_consistent(kv)


# -- LRU eviction ---------------------------------------------------------------------------------


def test_freed_cached_blocks_are_reused_until_evicted_least_recently_freed_first():
    kv = KVCacheManager(6, BS)
    a = make_req("a", X + Y + [1])  # blocks 0, 1 (cached), 2 (partial)
    b = make_req("b", Z + W + [1])  # blocks 3, 4 (cached), 5 (partial)
    assert admit(kv, a)[1] == [0, 1, 2]
    assert admit(kv, b)[1] == [3, 4, 5]
    kv.free(a)  # tail first: 2, 1, 0
    kv.free(b)  # then 5, 4, 3
    assert list(kv.block_pool.free_queue) == [2, 1, 0, 5, 4, 3]
    snap = kv.snapshot()
    assert [s.status for s in snap.blocks] == [
        "cached",
        "cached",
        "free",
        "cached",
        "cached",
        "free",
    ]
    assert snap.num_cached_free == 4 and snap.num_used == 0

    # a hit revives cached-free blocks: they leave the free queue and are used again
    c = make_req("c", X + Y + [2])
    hits, table = admit(kv, c)
    assert hits == [0, 1] and table == [0, 1, 2]  # block 2 (plain free) was the first in line
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    assert list(kv.block_pool.free_queue) == [5, 4, 3]
    check_consistent(kv)

    # new tokens evict: the plain free block 5 first, then 4 = b's tail (freed before its head)
    d = make_req("d", [90] * 5)
    _, d_table = admit(kv, d)
    assert d_table == [5, 4]
    assert (
        kv.block_pool.blocks[5].token_ids == (90,) * 4
        and kv.block_pool.blocks[4].block_hash is None
    )  # W's copy is gone
    hits, n = kv.get_computed_blocks(make_req("e", Z + W + [1]))
    assert [h.block_id for h in hits] == [3] and n == BS  # W's block was evicted, Z's survives
    check_consistent(kv)

    # c frees its blocks; they go to the back of the queue (most recently freed)
    kv.free(c)
    assert list(kv.block_pool.free_queue) == [3, 2, 1, 0]
    check_consistent(kv)


def test_revived_block_moves_to_the_back_of_the_queue():
    kv = KVCacheManager(5, BS)
    a = make_req("a", X + [1])  # blocks 0 (cached) and 1
    admit(kv, a)
    kv.free(a)
    assert list(kv.block_pool.free_queue) == [2, 3, 4, 1, 0]
    b = make_req("b", X + [2])
    assert admit(kv, b)[0] == [0]
    kv.free(b)
    # 0 is now the most recently freed, so it outlives blocks freed before it
    assert list(kv.block_pool.free_queue)[-1] == 0
    admit(kv, make_req("c", [80] * 13))  # 4 blocks: everything but block 0
    assert kv.get_computed_blocks(make_req("d", X + [3]))[1] == BS


def test_evictable_hits_are_counted_as_unavailable():
    """A cached-free block that is about to be hit cannot also be handed out as a new block."""
    kv = KVCacheManager(4, BS)
    a = make_req("a", X + Y + [1])
    admit(kv, a)
    kv.free(a)  # 0, 1 cached-free; 4 blocks free in all
    too_big = make_req("b", X + Y + [3] * 9)  # 17 tokens: 5 blocks > 4
    hits, _ = kv.get_computed_blocks(too_big)
    assert kv.allocate_slots(too_big, too_big.num_tokens - 8, hits) is None
    assert kv.num_free_blocks == 4 and all(h.ref_cnt == 0 for h in hits)
    fits = make_req("c", X + Y + [3] * 8)  # 16 tokens: 4 blocks, 2 of them hits
    hits, n = kv.get_computed_blocks(fits)
    assert n == 8
    assert kv.allocate_slots(fits, 8, hits) is not None
    assert kv.num_free_blocks == 0
    check_consistent(kv)


# -- property test over random operations ---------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    collide=st.booleans(),
    num_ops=st.integers(5, 60),
)
def test_random_admit_grow_free_keeps_ref_counts_right(
    seed, num_blocks, block_size, collide, num_ops
):
    """Random admissions (from a few shared prefixes), growth and frees: ref counts always match
    the block tables, a block held by two requests is always a cached prefix block whose tokens
    equal both requests' tokens at that position, and everything is free once all are freed."""
    rng = random.Random(seed)
    kv = KVCacheManager(
        num_blocks, block_size, hash_fn=constant_hash if collide else chained_block_hash
    )
    prefixes = [
        [rng.randrange(3) for _ in range(rng.randrange(1, 4 * block_size + 2))] for _ in range(3)
    ]
    live: dict[str, Request] = {}
    for op in range(num_ops):
        choice = rng.random()
        if choice < 0.45 or not live:
            tail = [rng.randrange(3) for _ in range(rng.randrange(0, 3))]
            tokens = rng.choice(prefixes)[: rng.randrange(1, 100)] + tail
            req = make_req(f"r{op}", tokens or [0])
            hits, n = kv.get_computed_blocks(req)
            for i, h in enumerate(hits):  # a hit holds exactly this request's tokens
                assert h.token_ids == tuple(
                    req.all_token_ids[i * block_size : (i + 1) * block_size]
                )
            chunk = rng.randrange(1, req.num_tokens - n + 1)
            if kv.allocate_slots(req, chunk, hits) is not None:
                req.num_computed_tokens = n + chunk
                kv.cache_full_blocks(req)
                live[req.request_id] = req
        elif choice < 0.75:
            req = live[rng.choice(sorted(live))]
            req.output_token_ids.append(rng.randrange(3))  # grow by a token (or finish the prompt)
            todo = req.num_tokens - req.num_computed_tokens
            if kv.allocate_slots(req, todo) is not None:
                req.num_computed_tokens += todo
                kv.cache_full_blocks(req)
            else:
                req.output_token_ids.pop()
        else:
            req = live.pop(rng.choice(sorted(live)))
            kv.free(req)
        check_consistent(kv)
        for req in live.values():
            blocks = kv.req_to_blocks[req.request_id]
            assert len(blocks) * block_size >= req.num_computed_tokens
            for i, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert block.token_ids == tuple(
                        req.all_token_ids[i * block_size : (i + 1) * block_size]
                    )
                    parent = (blocks[i - 1].block_id, blocks[i - 1].generation) if i else None
                    assert block.parent_key == parent
    for req in list(live.values()):
        kv.free(req)
    check_consistent(kv)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.num_free_blocks == num_blocks and kv.usage == 0.0
