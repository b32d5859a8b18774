"""The KV connector, prefill → decode in one process (engine/kv_connector.py,
engine/worker/kv_connector.py, engine/entrypoints/disagg.py).

The strongest check: a producer that only prefills and a consumer that loads the prompt's K/V and
decodes give the same greedy tokens as one engine, token for token, for a batch of prompts, with
chunked prefill on the producer and recompute preemption on the consumer; and every transfer
moves the bytes the config says (layers × 2 × KV heads × head_dim × dtype bytes × tokens, whole
blocks). A load that cannot be done costs a recompute, never a wrong token.
"""

from __future__ import annotations

import pytest
from conftest import TINY_CONFIG

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.entrypoints.disagg import make_disaggregated_pair
from engine.executor.abstract import ForkNotSupportedError
from engine.kv_cache import KVCacheManager
from engine.kv_connector import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVTransferConfig,
    kv_bytes,
    make_kv_connector,
)
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.utils import cdiv

BLOCK = 16
# tiny model, float32: layers × 2 × KV heads × head_dim × 4 bytes, per token
TINY_KV_BYTES_PER_TOKEN = (
    TINY_CONFIG["num_hidden_layers"] * 2 * TINY_CONFIG["num_key_value_heads"] * 16 * 4
)
# distinct prompts (no shared prefix), lengths around block edges: 17 = 16 + 1, 33, 48 = 3 × 16
PROMPT_LENGTHS = (17, 33, 48, 5, 40)


def prompts() -> dict[str, list[int]]:
    return {
        f"r{i}": [3 + (i * 389 + j * 7) % 1990 for j in range(n)]
        for i, n in enumerate(PROMPT_LENGTHS)
    }


def greedy(max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def config(tiny_model_dir, **overrides) -> EngineConfig:
    settings = dict(
        model=str(tiny_model_dir),
        device="cpu",
        num_kv_blocks=64,
        max_model_len=128,
        block_size=BLOCK,
    )
    return EngineConfig(**{**settings, **overrides})


def run_plain(engine: EngineCore, max_tokens: int = 20) -> dict[str, list[int]]:
    for request_id, ids in prompts().items():
        engine.add_request(
            prompt_token_ids=ids, sampling_params=greedy(max_tokens), request_id=request_id
        )
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: engine.get_request(rid).output_token_ids for rid in prompts()}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[int]]:
    return run_plain(EngineCore(config(tiny_model_dir)))


def test_prefill_decode_pair_gives_one_engines_tokens_and_moves_the_computed_bytes(
    tiny_model_dir, reference
):
    # producer: chunked prefill (8 tokens per request per step, 24 per step); consumer: a cache
    # of 8 blocks (128 tokens, one max_model_len request), far less than five requests need
    pair = make_disaggregated_pair(
        config(tiny_model_dir),
        prefill_overrides=dict(long_prefill_token_threshold=8, max_num_batched_tokens=24),
        decode_overrides=dict(num_kv_blocks=8),
    )
    for request_id, ids in prompts().items():
        pair.add_request(prompt_token_ids=ids, sampling_params=greedy(), request_id=request_id)
    steps = []
    while pair.has_unfinished_requests():
        steps.append(pair.step())
        assert len(steps) < 500
    tokens = {rid: pair.get_request(rid).output_token_ids for rid in prompts()}
    assert tokens == reference

    phases = {s.phase for step in steps if step.prefill for s in step.prefill.scheduled}
    assert "chunked_prefill" in phases  # the producer really chunked
    assert pair.decode.stats["preemptions"] > 0  # and the consumer really preempted
    assert pair.decode.stats["kv_failed_loads"] == 0

    transfers = {t.request_id: t for step in steps for t in step.transfers}
    assert set(transfers) == set(prompts())
    bytes_per_block = TINY_KV_BYTES_PER_TOKEN * BLOCK
    for request_id, ids in prompts().items():
        loaded = len(ids) - 1  # the consumer computes the last prompt token itself
        transfer = transfers[request_id]
        assert transfer.num_tokens == loaded
        assert transfer.num_bytes == cdiv(loaded, BLOCK) * bytes_per_block  # whole blocks
        assert transfer.num_bytes == kv_bytes(bytes_per_block, loaded, BLOCK)
        assert transfer.save_seconds > 0 and transfer.load_seconds > 0
    # the producer saved the whole prompt (its blocks, rounded up)
    saves = [r for step in steps if step.prefill for r in step.prefill.kv_transfers]
    assert sorted(r.num_bytes for r in saves) == sorted(
        cdiv(n, BLOCK) * bytes_per_block for n in PROMPT_LENGTHS
    )
    # the consumer's first step of each request: the loaded tokens, then one token computed
    admitted = [
        s for step in steps if step.decode for s in step.decode.scheduled if s.num_external_tokens
    ]
    assert sorted((s.num_external_tokens, s.num_tokens) for s in admitted) == sorted(
        (n - 1, 1) for n in PROMPT_LENGTHS
    )
    assert pair.prefill.stats["kv_save_blocks"] == sum(cdiv(n, BLOCK) for n in PROMPT_LENGTHS)
    assert pair.decode.stats["kv_load_blocks"] == sum(cdiv(n - 1, BLOCK) for n in PROMPT_LENGTHS)
    assert pair.decode.stats["kv_transfer_bytes"] == sum(t.num_bytes for t in transfers.values())


def test_a_load_that_cannot_be_done_is_recomputed_with_the_same_tokens(tiny_model_dir, reference):
    transfer = KVTransferConfig(
        "InProcessConnector", "kv_consumer", kv_connector_extra_config={"channel": "nothing-sent"}
    )
    consumer = EngineCore(config(tiny_model_dir, kv_transfer_config=transfer))
    for request_id, ids in prompts().items():
        request = consumer.add_request(
            prompt_token_ids=ids, sampling_params=greedy(), request_id=request_id
        )  # its K/V "are on the channel" — but nobody sent them
        request.kv_transfer_params = {"remote_request_id": request_id, "num_tokens": len(ids)}
    first = consumer.step()
    assert sorted(r.request_id for r in first.kv_transfers if not r.ok) == sorted(prompts())
    assert first.total_tokens == len(PROMPT_LENGTHS)  # scheduled (1 token each) ...
    assert not first.new_tokens  # ... but none ran: their blocks hold no valid K/V
    while consumer.has_unfinished_requests():
        consumer.step()
    assert {rid: consumer.get_request(rid).output_token_ids for rid in prompts()} == reference
    assert consumer.stats["kv_failed_loads"] == len(PROMPT_LENGTHS)
    events = [e.kind for e in consumer.get_request("r0").journey]
    assert "kv_load_failed" in events


def test_connector_settings_are_checked_and_a_connector_engine_is_not_forked(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig("InProcessConnector", "kv_sender")
    with pytest.raises(ValueError, match="offload_bytes"):
        KVTransferConfig("OffloadingConnector", "kv_both")
    with pytest.raises(ValueError, match="offload_bytes"):
        KVTransferConfig("OffloadingConnector", "kv_both", offload_bytes=-1)
    with pytest.raises(ValueError, match="unknown kv_connector 'Nope'"):
        make_kv_connector(KVTransferConfig("Nope"), BLOCK, 1024)
    offload = KVTransferConfig("OffloadingConnector", "kv_both", offload_bytes=1 << 20)
    with pytest.raises(ValueError, match="one worker only"):
        EngineConfig(kv_transfer_config=offload, tensor_parallel_size=2)
    engine = EngineCore(config(tiny_model_dir, kv_transfer_config=offload))
    with pytest.raises(ForkNotSupportedError, match="KV connector"):
        engine.fork()


class KeepsBlocksOneStep(KVConnectorBase_V1):
    """A connector that saves a finished request's blocks in the next step (as an asynchronous
    sender would): the scheduler must not free them before that step has run."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids):
        return True, {"remote_request_id": request.request_id, "num_tokens": request.num_tokens}


def test_blocks_a_connector_keeps_are_freed_after_the_next_step():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    connector = KeepsBlocksOneStep(KVTransferConfig("InProcessConnector", "kv_producer"), 4, 64)
    scheduler = Scheduler(SchedulerConfig(max_model_len=32), kv, connector)
    request = Request("a", list(range(10, 19)), SamplingParams(max_tokens=1))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [7]})
    assert request.is_finished and request.kv_transfer_params["num_tokens"] == 10
    assert kv.num_free_blocks == 8 - 3  # kept: the save runs in the next step
    out = scheduler.schedule()
    assert kv.num_free_blocks == 8 - 3
    scheduler.update_from_output(out, {})
    assert kv.num_free_blocks == 8


@pytest.mark.slow
def test_prefill_decode_pair_on_the_real_model(default_model_dir):
    settings = dict(model=str(default_model_dir), device="cpu", max_model_len=256, num_kv_blocks=64)
    texts = ["The capital of France is", "def fibonacci(n):", "KV caches hold"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = EngineCore(EngineConfig(**settings))
    pair = make_disaggregated_pair(EngineConfig(**settings))
    for i, text in enumerate(texts):
        plain.add_request(text, params, request_id=str(i))
        pair.add_request(text, params, request_id=str(i))
    while plain.has_unfinished_requests():
        plain.step()
    transfers = []
    while pair.has_unfinished_requests():
        transfers += pair.step().transfers
    for i in range(len(texts)):
        assert (
            pair.get_request(str(i)).output_token_ids == plain.get_request(str(i)).output_token_ids
        )
    cfg = plain.model_config
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32 on the CPU
    for t in transfers:
        assert t.num_bytes == cdiv(t.num_tokens, 16) * 16 * per_token


def test_a_consumer_loads_only_what_its_own_prefix_cache_lacks(tiny_model_dir):
    """Two requests with a 48-token shared prefix, one after the other: the consumer finds the
    prefix in its own cache for the second, loads only the blocks after it (start_block 3) and
    still gives one engine's tokens."""
    shared = [3 + (5 * j) % 1990 for j in range(48)]
    requests = {"first": shared + [7, 8, 9, 10], "second": shared + list(range(500, 530))}
    plain = EngineCore(config(tiny_model_dir))
    pair = make_disaggregated_pair(config(tiny_model_dir))
    loads = []
    for request_id, ids in requests.items():
        plain.add_request(prompt_token_ids=ids, sampling_params=greedy(), request_id=request_id)
        pair.add_request(prompt_token_ids=ids, sampling_params=greedy(), request_id=request_id)
        while plain.has_unfinished_requests():
            plain.step()
        while pair.has_unfinished_requests():
            step = pair.step()
            loads += [r for r in (step.decode.kv_transfers if step.decode else [])]
    for request_id in requests:
        assert (
            pair.get_request(request_id).output_token_ids
            == plain.get_request(request_id).output_token_ids
        )
    second = next(r for r in loads if r.request_id == "second")
    assert second.num_tokens == len(requests["second"]) - 1 - 48
    assert second.num_blocks == cdiv(len(requests["second"]) - 1, BLOCK) - 3


def test_what_a_consumer_never_loads_is_dropped_from_the_channel(tiny_model_dir):
    """The same 49-token prompt twice: the second time the consumer's own prefix cache holds the
    48 tokens it could load, so it loads nothing and the channel drops what the producer sent.
    Nothing stays on the channel."""
    prompt = [3 + (5 * j) % 1990 for j in range(49)]
    pair = make_disaggregated_pair(config(tiny_model_dir))
    channel = pair.decode.executor.worker.runner.kv_connector.channel
    loads = []
    for request_id in ("x", "y"):
        pair.add_request(prompt_token_ids=prompt, sampling_params=greedy(), request_id=request_id)
        while pair.has_unfinished_requests():
            step = pair.step()
            loads += [r.request_id for r in (step.decode.kv_transfers if step.decode else [])]
    assert loads == ["x"]
    assert pair.get_request("y").output_token_ids == pair.get_request("x").output_token_ids
    assert channel.entries == {}


def test_a_worker_without_the_connector_refuses_the_planned_copies(tiny_model_dir, caplog):
    """An engine whose scheduler has a connector but whose worker was built without one (a caller
    that builds its own Worker and forgets kv_transfer_config) used to decode from K/V that was
    never copied, silently; now the step fails (its requests fail, the log says why) and no
    token is produced."""
    import torch

    from engine.executor.uniproc import UniProcExecutor
    from engine.worker.worker import Worker

    producer = KVTransferConfig(
        "InProcessConnector", "kv_producer", kv_connector_extra_config={"channel": "no-worker"}
    )
    worker = Worker(str(tiny_model_dir), torch.device("cpu"), torch.float32, BLOCK, "torch")
    engine = EngineCore(
        config(tiny_model_dir, kv_transfer_config=producer), executor=UniProcExecutor(worker)
    )
    engine.add_request(prompt_token_ids=prompts()["r0"], sampling_params=greedy(1), request_id="a")
    while engine.has_unfinished_requests():
        engine.step()
    request = engine.get_request("a")
    assert request.output_token_ids == [] and "RuntimeError" in request.error
    assert "this worker has no KV connector" in caplog.text
