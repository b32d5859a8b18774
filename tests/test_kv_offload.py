"""The OffloadingConnector: a host tier under the device prefix cache (engine/kv_connector.py,
engine/worker/kv_connector.py).

A shared prefix evicted from the device cache comes back from the tier instead of being
recomputed, with the same greedy tokens (chunked prefill too); the counters of a scripted run are
exact; the tier never holds more than offload_bytes, and its worker copy holds exactly the blocks
the scheduler side believes it has; a corrupted or missing tier block fails its load and the
request recomputes, with the same tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_connector import KVTransferConfig, tier_key
from engine.sampling_params import SamplingParams

BLOCK = 16
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * BLOCK  # tiny model: layers × K,V × kv heads × head_dim × 4
SHARED = [3 + (7 * j) % 1990 for j in range(50)]  # a 50-token "system prompt": 3 full blocks
OTHER = [5 + (11 * j) % 1990 for j in range(100)]  # an unrelated 100-token prompt


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine(tiny_model_dir, offload_blocks: int | None, **overrides) -> EngineCore:
    """8 device blocks (128 tokens): two prompts of this test cannot stay cached together."""
    transfer = None
    if offload_blocks is not None:
        transfer = KVTransferConfig(
            "OffloadingConnector", "kv_both", offload_bytes=offload_blocks * BYTES_PER_BLOCK
        )
    settings = dict(
        model=str(tiny_model_dir),
        device="cpu",
        num_kv_blocks=8,
        max_model_len=128,
        block_size=BLOCK,
        kv_transfer_config=transfer,
    )
    return EngineCore(EngineConfig(**{**settings, **overrides}))


def run_one(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int = 4) -> list:
    core.add_request(
        prompt_token_ids=prompt, sampling_params=greedy(max_tokens), request_id=request_id
    )
    records = []
    while core.has_unfinished_requests():
        records.append(core.step())
    return core.get_request(request_id).output_token_ids, records


SCRIPT = [("a", SHARED + [7, 8, 9]), ("b", OTHER), ("c", SHARED + [40, 41, 42, 43])]


def run_script(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list]]:
    tokens, records = {}, {}
    for request_id, prompt in SCRIPT:
        tokens[request_id], records[request_id] = run_one(core, request_id, prompt)
    return tokens, records


def tier_of(core: EngineCore):
    return core.executor.worker.runner.kv_connector


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_an_evicted_prefix_comes_back_from_the_tier_with_the_same_tokens(tiny_model_dir, chunked):
    overrides = dict(long_prefill_token_threshold=8) if chunked else {}
    recomputed, plain_records = run_script(engine(tiny_model_dir, None, **overrides))
    core = engine(tiny_model_dir, 4, **overrides)
    tokens, records = run_script(core)
    assert tokens == recomputed

    # "a" leaves blocks 0, 1, 2 of SHARED cached (free queue: 4..7, then a's blocks tail first);
    # "b" takes 7 of the 8 blocks and evicts SHARED's 2nd and 3rd: two stores. "c" hits the
    # 1st on the device and loads the 2nd and 3rd from the tier (32 tokens) instead of computing.
    c_admission = next(r for r in records["c"] if r.scheduled)
    (c,) = c_admission.scheduled
    assert (c.num_prefix_hit_tokens, c.num_external_tokens) == (16, 32)
    assert c_admission.timings["kv_transfer"] == sum(t.seconds for t in c_admission.kv_transfers)
    assert c.num_computed_tokens == 48 and c.num_tokens == len(SCRIPT[2][1]) - 48
    plain_c = next(r for r in plain_records["c"] if r.scheduled).scheduled[0]
    assert (plain_c.num_prefix_hit_tokens, plain_c.num_computed_tokens) == (16, 16)

    connector = core.kv_connector
    stored_by_b = sum(r.kv_transfer_totals("store")[0] for r in records["b"])
    assert stored_by_b == 2
    assert connector.stats["loads"] == 2 and connector.stats["tier_hit_tokens"] == 32
    assert core.stats["kv_load_blocks"] == 2
    assert core.stats["kv_store_blocks"] == connector.stats["stores"]
    moved = core.stats["kv_load_blocks"] + core.stats["kv_store_blocks"]
    assert core.stats["kv_transfer_bytes"] == moved * BYTES_PER_BLOCK
    assert connector.stats["failed_loads"] == 0 and core.stats["kv_failed_loads"] == 0
    assert tier_of(core).used_bytes == connector.used_bytes <= 4 * BYTES_PER_BLOCK


def test_counters_of_a_scripted_run_are_exact(tiny_model_dir):
    """Tier of 2 blocks. a: 3 blocks of SHARED cached. b (7 blocks): evicts SHARED's 2nd and 3rd
    → 2 stores, tier full. c: 1 device hit, 2 tier hits (pinned), it needs 4 blocks of which one
    is the hit: 3 new ones from the free queue (b's tail first: 1 uncached, then b's 6th and
    5th cached blocks) → 2 more evictions from the device, which cannot be stored (the tier's two
    blocks are being loaded in this step): skipped."""
    core = engine(tiny_model_dir, 2)
    run_script(core)
    stats = core.kv_connector.stats
    assert stats == {
        "tier_hit_tokens": 32,
        "loads": 2,
        "stores": 2,
        "tier_evictions": 0,
        "failed_loads": 0,
        "skipped_stores": 2,
    }
    # d: b again. Its first 5 blocks are still cached on the device; c's arrival evicted its
    # 5th and 6th (never stored), so d computes them again; its own allocations evict c's...
    tokens, _ = run_one(core, "d", OTHER)
    assert stats["stores"] >= 2 and stats["tier_evictions"] == stats["stores"] - 2
    assert len(core.kv_connector.tier) <= 2
    assert set(tier_of(core).tier) == {tier_key(h) for h in core.kv_connector.tier}


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_tier_block_is_recomputed_with_the_same_tokens(tiny_model_dir, damage):
    recomputed, _ = run_script(engine(tiny_model_dir, None))
    core = engine(tiny_model_dir, 4)
    tokens = {}
    for request_id, prompt in SCRIPT[:2]:
        tokens[request_id], _ = run_one(core, request_id, prompt)
    worker_tier = tier_of(core).tier
    assert len(worker_tier) == 2
    key = sorted(worker_tier)[0]
    if damage == "corrupt":
        host, _ = worker_tier[key]
        host.mul_(-4.0)  # every K and V of the block: wrong tokens if it were loaded
    else:
        del worker_tier[key]
    tokens["c"], records = run_one(core, "c", SCRIPT[2][1])
    assert tokens == recomputed
    failed = [t for r in records for t in r.kv_transfers if not t.ok]
    assert [t.key for t in failed] == [key]
    assert core.stats["kv_failed_loads"] == 1 and core.kv_connector.stats["failed_loads"] == 1
    assert "kv_load_failed" in [e.kind for e in core.get_request("c").journey]
    assert key not in worker_tier  # a corrupted block is dropped, a missing one stays gone
    assert set(worker_tier) == {tier_key(h) for h in core.kv_connector.tier}


PREFIXES = [SHARED, OTHER[:40], OTHER[40:90]]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 5)), min_size=1, max_size=6
    ),
    st.integers(1, 3),
)
def test_the_tier_never_exceeds_its_size_and_matches_its_index(tiny_model_dir, requests, blocks):
    """Random sequences of requests (shared prefixes, random tails, several at once): after every
    step the tier holds at most offload_bytes, on both sides, and the worker holds exactly the
    blocks the scheduler side lists; tokens equal an engine's without the tier."""
    core = engine(tiny_model_dir, blocks)
    plain = engine(tiny_model_dir, None)
    for i, (prefix, tail, max_tokens) in enumerate(requests):
        prompt = PREFIXES[prefix][:60] + [100 + (i * 13 + j) % 1800 for j in range(tail)]
        for target in (core, plain):
            target.add_request(
                prompt_token_ids=prompt, sampling_params=greedy(max_tokens), request_id=str(i)
            )
    limit = blocks * BYTES_PER_BLOCK
    while core.has_unfinished_requests():
        core.step()
        assert core.kv_connector.used_bytes <= limit
        assert tier_of(core).used_bytes <= limit
        assert set(tier_of(core).tier) == {tier_key(h) for h in core.kv_connector.tier}
    while plain.has_unfinished_requests():
        plain.step()
    for i in range(len(requests)):
        assert (
            core.get_request(str(i)).output_token_ids == plain.get_request(str(i)).output_token_ids
        )


def test_generate_takes_a_tier_size_in_mebibytes(tiny_model_dir, capsys):
    from engine.entrypoints.cli import build_parser, engine_config

    args = build_parser().parse_args(
        ["generate", "hi", "--model", str(tiny_model_dir), "--kv-offload-mb", "1.5"]
    )
    transfer = engine_config(args).kv_transfer_config
    assert (transfer.kv_connector, transfer.kv_role) == ("OffloadingConnector", "kv_both")
    assert transfer.offload_bytes == 3 * 2**19
    plain = build_parser().parse_args(["generate", "hi", "--model", str(tiny_model_dir)])
    assert engine_config(plain).kv_transfer_config is None
    args = build_parser().parse_args(
        [
            "generate",
            "hi",
            "--model",
            str(tiny_model_dir),
            "--kv-offload-mb",
            "1",
            "--max-tokens",
            "3",
            "--device",
            "cpu",
        ]
    )
    assert args.func(args) == 0
    assert "[kv connector] {'tier_hit_tokens': 0" in capsys.readouterr().err


def run_batch(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    for request_id, prompt in prompts.items():
        core.add_request(
            prompt_token_ids=prompt, sampling_params=greedy(max_tokens), request_id=request_id
        )
    while core.has_unfinished_requests():
        core.step()
    return {rid: core.get_request(rid).output_token_ids for rid in prompts}


def test_preempted_requests_reload_their_evicted_prefix_with_the_same_tokens(tiny_model_dir):
    """Four requests on one shared prefix outgrow 8 device blocks: recompute preemptions free
    their blocks, full blocks are evicted to the tier, and resumed requests load them back (a
    load on resume, not only on a first admission). Every token equals a roomy engine's."""
    prompts = {f"r{i}": SHARED + [100 + 9 * i + j for j in range(30)] for i in range(4)}
    expected = run_batch(engine(tiny_model_dir, None, num_kv_blocks=64), prompts, 40)
    core = engine(tiny_model_dir, 6)
    assert run_batch(core, prompts, 40) == expected
    assert core.scheduler.num_preemptions > 0
    assert core.kv_connector.stats["loads"] > 0 and core.kv_connector.stats["failed_loads"] == 0
    assert tier_of(core).used_bytes == core.kv_connector.used_bytes <= 6 * BYTES_PER_BLOCK
