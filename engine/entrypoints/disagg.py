"""Prefill → decode in one process: two engines, a producer that only prefills and a consumer that
decodes, joined by an InProcessConnector channel (engine/kv_connector.py,
engine/worker/kv_connector.py).

A request goes to the producer with max_tokens=1, as vLLM's disaggregation proxy sends it; when it
finishes there, its kv_transfer_params ({"remote_request_id", "num_tokens"}) go with the original
request to the consumer, which loads the prompt's K/V (all but the last prompt token) into its own
blocks, computes the last prompt token and decodes. Greedy tokens are the same as one engine's.
`DisaggregatedPair.step()` advances both engines once (lockstep), for the labs.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_connector import KVTransferConfig, KVTransferRecord
from engine.request import Request
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.trace import StepRecord


@dataclass
class PairTransfer:
    """One request's K/V crossing from the producer to the consumer: the producer's save (after
    its prefill's forward) and the consumer's load (before its forward), measured on each side."""

    request_id: str
    num_tokens: int  # tokens loaded into the consumer's cache (the last prompt token is computed)
    num_bytes: int  # bytes loaded (whole blocks)
    save_seconds: float
    load_seconds: float

    @property
    def seconds(self) -> float:
        return self.save_seconds + self.load_seconds


@dataclass
class PairStep:
    """What one lockstep step did: each engine's record (None when it had nothing to do), the
    requests handed from the producer to the consumer, and the transfers completed."""

    prefill: StepRecord | None
    decode: StepRecord | None
    handed_over: list[str] = field(default_factory=list)
    transfers: list[PairTransfer] = field(default_factory=list)


class DisaggregatedPair:
    """A producer engine (kv_role "kv_producer") and a consumer engine ("kv_consumer") that share
    one KV channel."""

    def __init__(self, prefill: EngineCore, decode: EngineCore):
        for engine, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
            transfer = engine.config.kv_transfer_config
            if transfer is None or transfer.kv_role != role:
                raise ValueError(f"the {role.split('_')[1]} engine needs kv_role={role!r}")
        self.prefill, self.decode = prefill, decode
        self._prefilling: dict[str, Request] = {}  # consumer requests waiting for their prefill
        self._saves: dict[str, KVTransferRecord] = {}  # producer saves not yet loaded, by key
        self._ids = itertools.count()

    def add_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        **kwargs,
    ) -> Request:
        """Validate the request once (the consumer's limits), prefill it on the producer with
        max_tokens=1, and keep it for the consumer. Returns the consumer's request: its output is
        the answer. Raises InvalidRequestError for bad input."""
        request_id = request_id or f"pair-{next(self._ids)}"
        if request_id in self._prefilling or self.decode.get_request(request_id) is not None:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        request = self.decode.make_request(
            prompt, sampling_params, request_id, prompt_token_ids, **kwargs
        )
        prefill_params = dataclasses.replace(
            request.sampling_params, n=1, max_tokens=1, min_tokens=0, structured_outputs=None
        )
        self.prefill.add_request(
            sampling_params=prefill_params,
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        self._prefilling[request_id] = request
        return request

    def step(self) -> PairStep:
        """The producer's step, the hand-over of what it finished, then the consumer's step."""
        prefill = self.prefill.step() if self.prefill.has_unfinished_requests() else None
        handed = self._hand_over(prefill) if prefill is not None else []
        decode = self.decode.step() if self.decode.has_unfinished_requests() else None
        transfers = self._transfers(prefill, decode)
        return PairStep(prefill, decode, handed, transfers)

    def _hand_over(self, record: StepRecord) -> list[str]:
        """Producer requests that finished go to the consumer with their kv_transfer_params. One
        that failed there goes without (the consumer then computes its prompt itself)."""
        handed = []
        for request_id in record.finished:
            request = self._prefilling.pop(request_id, None)
            if request is None:
                continue
            produced = self.prefill.get_request(request_id)
            params = produced.kv_transfer_params if produced is not None else None
            if produced is not None and produced.error is None and params:
                request.kv_transfer_params = dict(params)
            self.decode.queue_request(request)
            handed.append(request_id)
        return handed

    def _transfers(self, prefill: StepRecord | None, decode: StepRecord | None):
        if prefill is not None:
            for record in prefill.kv_transfers:
                if record.direction == "save" and record.ok:
                    self._saves[record.key] = record
        transfers = []
        for record in decode.kv_transfers if decode is not None else []:
            if record.direction != "load":
                continue
            save = self._saves.pop(record.key, None)
            if record.ok:
                save_seconds = save.seconds if save is not None else 0.0
                transfers.append(
                    PairTransfer(
                        record.request_id,
                        record.num_tokens,
                        record.num_bytes,
                        save_seconds,
                        record.seconds,
                    )
                )
        return transfers

    def has_unfinished_requests(self) -> bool:
        return bool(
            self._prefilling
            or self.prefill.has_unfinished_requests()
            or self.decode.has_unfinished_requests()
        )

    def get_request(self, request_id: str) -> Request | None:
        """The consumer's request (its output is the answer), also while it prefills."""
        return self._prefilling.get(request_id) or self.decode.get_request(request_id)

    def shutdown(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def pair_configs(config: EngineConfig, channel: str | None = None) -> tuple[EngineConfig, ...]:
    """The producer's and the consumer's configs: `config` with an InProcessConnector on one
    channel (a fresh name unless given)."""
    channel = channel or f"pair-{uuid.uuid4().hex[:12]}"

    def with_role(role: str) -> EngineConfig:
        extra = {"channel": channel}
        transfer = KVTransferConfig("InProcessConnector", role, kv_connector_extra_config=extra)
        return dataclasses.replace(config, kv_transfer_config=transfer)

    return with_role("kv_producer"), with_role("kv_consumer")


def make_disaggregated_pair(
    config: EngineConfig | None = None,
    prefill_overrides: dict | None = None,
    decode_overrides: dict | None = None,
) -> DisaggregatedPair:
    """Two engines from one EngineConfig: the same (shared, read-only) weights and tokenizer,
    each its own KV cache, one InProcessChannel. `*_overrides` change one side's settings (a
    smaller cache for the consumer, chunked prefill on the producer)."""
    producer_config, consumer_config = pair_configs(config or EngineConfig())
    prefill = EngineCore(producer_config, **(prefill_overrides or {}))
    decode = EngineCore(consumer_config, tokenizer=prefill.tokenizer, **(decode_overrides or {}))
    return DisaggregatedPair(prefill, decode)
