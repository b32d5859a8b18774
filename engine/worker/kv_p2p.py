"""Prefill → decode across processes: a KV channel over torch.distributed point-to-point.

    producer server (kv_producer, rank 0)                consumer server (kv_consumer, rank 1)
      hosts the rendezvous (a TCPStore at --kv-peer)  ◄──  joins it
      save_kv → send(key, kv, num_tokens):                  a listener thread receives every
        header (int64: key length, tokens, dtype,   ──►     message into a bounded buffer;
        shape), key (uint8), payload (uint8 view)           start_load_kv → recv(key) takes it

The way vLLM's P2pNcclConnector works (vllm/distributed/kv_transfer/kv_connector/v1/p2p/), in its
"PUT" mode: the producer pushes a request's K/V as soon as its prefill is done, the consumer
keeps what arrives in a receive store (vLLM: recv_store, bounded by kv_buffer_size) until its
scheduler asks for that key. vLLM sends the metadata over ZMQ and the tensor over NCCL; here both
go over one dedicated two-rank process group: gloo (CPU tensors over TCP), and on CUDA the
payload over an NCCL group beside it (the header stays on gloo, as vLLM's stays on ZMQ). The
groups are built on their own TCPStore and never touch torch.distributed's default group, so a
server may also run the multi-process executor.

Failure, as engine/executor/multiproc.py handles it (a clear error, no hang): a peer that dies
closes its connections, which fails the listener's pending receive at once; the channel is then
dead, every waiting recv() raises KVTransferError naming the peer and the cause, and later calls
fail at once (the server keeps serving what needs no transfer). A key that never arrives fails
its recv() after recv_timeout_s; a send the consumer does not take within send_timeout_s fails.
gloo cannot wait for a point-to-point message in slices (a timed-out wait closes the pair), so
the listener waits for the next header without a deadline (a peer's death ends that wait), and
only a message already started, and a send, are bounded; a timeout there kills the channel.
The channel's threads are daemons; close() aborts its groups.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
import weakref
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.kv_connector import KVTransferConfig
from engine.worker.kv_connector import KV_CONNECTOR_WORKERS, ChannelConnectorWorker, KVChannel

logger = logging.getLogger(__name__)

PRODUCER_RANK, CONSUMER_RANK = 0, 1
CONNECT_TIMEOUT_S = 300.0  # the peer's server may still be loading its model
# A send or a load runs inside an engine step, which stalls every running request while it waits:
# both stay well under the engine iteration timeout (60 s). A proxy hands the consumer its
# kv_transfer_params only after the producer's send returned (the consumer had taken the K/V off
# the wire), so a load normally finds its K/V waiting; a missing one is given up after
# RECV_TIMEOUT_S and its request recomputes.
SEND_TIMEOUT_S = 20.0
RECV_TIMEOUT_S = 10.0
DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM: kv_buffer_size (1e9 by default)
POLL_S = 0.2
CLOSE_WAIT_S = 1.0  # for the listener to leave its group once the group is let go (best effort)
MAX_DROPPED_KEYS = 1024  # dropped keys remembered, so that their recv() fails at once
MAX_DIMS = 8
# The listener's wait for the next header: unbounded in effect (an idle producer sends nothing;
# a dead one fails the wait at once), as the executor's control group waits (CONTROL_IDLE_TIMEOUT
# in engine/executor/transport.py, which this data-path module may not import).
IDLE_TIMEOUT = timedelta(days=30)
HEADER_LEN = 4 + MAX_DIMS  # key bytes, num_tokens, dtype code, ndim, dims
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int64)


class KVTransferError(RuntimeError):
    """A request's K/V could not cross: the peer is gone, never connected, or the wait timed
    out. The message names the peer and the cause."""


def parse_peer(text: str) -> tuple[str, int]:
    """HOST:PORT → (host, port), checked."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--kv-peer must be HOST:PORT, got {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--kv-peer's port must be a number, got {port!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"--kv-peer's port must be in 1..65535, got {number}")
    return host.strip("[]"), number


def _header(key: bytes, num_tokens: int, payload: torch.Tensor) -> torch.Tensor:
    if payload.dim() > MAX_DIMS:
        raise ValueError(f"a KV tensor has at most {MAX_DIMS} dimensions, got {payload.dim()}")
    if payload.dtype not in DTYPES:
        raise ValueError(f"a KV tensor's dtype is one of {DTYPES}, got {payload.dtype}")
    dims = list(payload.shape) + [0] * (MAX_DIMS - payload.dim())
    fields = [len(key), num_tokens, DTYPES.index(payload.dtype), payload.dim(), *dims]
    return torch.tensor(fields, dtype=torch.int64)


class P2pGlooChannel(KVChannel):
    """One end of the producer → consumer channel (see the module docstring). The producer
    (rank 0) hosts the rendezvous at (host, port) and sends; the consumer (rank 1) joins it and
    receives into a bounded buffer. Both connect in the background: a server starts while its
    peer is still loading; a send or recv waits for the connection within its own timeout."""

    def __init__(
        self,
        role: str,
        host: str,
        port: int,
        device: torch.device | str = "cpu",
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        send_timeout_s: float = SEND_TIMEOUT_S,
        recv_timeout_s: float = RECV_TIMEOUT_S,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ):
        if role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"a P2P KV channel's role is kv_producer or kv_consumer, got {role!r}")
        self.role, self.host, self.port = role, host, port
        self.rank = PRODUCER_RANK if role == "kv_producer" else CONSUMER_RANK
        self.device = torch.device(device)
        self.connect_timeout_s = connect_timeout_s
        self.send_timeout_s, self.recv_timeout_s = send_timeout_s, recv_timeout_s
        self.buffer_bytes = buffer_bytes
        self.peer_name = f"the KV {'consumer' if self.rank == PRODUCER_RANK else 'producer'}"
        self._cond = threading.Condition()
        self._received: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()
        self._buffered = 0
        self._dropped: OrderedDict[str, str] = OrderedDict()
        self._send_lock = threading.Lock()
        self._store = self._control = self._data = None
        self.connected = False
        self.error: str | None = None  # why the channel is dead
        self.closing = False
        self.sent_bytes = self.received_bytes = self.dropped = 0
        if self.rank == PRODUCER_RANK:  # a taken port fails the server's start, not later
            self._store = self._rendezvous()
        _OPEN.add(self)
        target = self._connect_then_listen if self.rank == CONSUMER_RANK else self._connect
        self._thread = threading.Thread(target=target, name=f"kv-p2p-{role}", daemon=True)
        self._thread.start()

    # -- connection ---------------------------------------------------------------------------

    def _rendezvous(self):
        """The pair's TCPStore: hosted by the producer (ValueError if it cannot listen there),
        joined by the consumer (which waits for it up to connect_timeout_s)."""
        host = self.rank == PRODUCER_RANK
        try:
            return dist.TCPStore(
                self.host, self.port, world_size=2, is_master=host, wait_for_workers=False,
                timeout=timedelta(seconds=self.connect_timeout_s),
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 — torch's own errors, named below
            if not host:
                raise
            raise ValueError(
                f"the KV producer cannot host the pair's rendezvous at {self.address} "
                f"(--kv-peer): {error}"
            ) from None

    def _connect(self) -> None:
        """Join the two-rank groups (the producer hosts the rendezvous); on failure the channel
        is dead with the cause."""
        try:
            if self._store is None:
                self._store = self._rendezvous()
            self._control = dist.ProcessGroupGloo(
                dist.PrefixStore("kv_control", self._store), self.rank, 2, IDLE_TIMEOUT
            )
            if self.device.type == "cuda":  # NCCL for the payload, as the executor does
                self._data = dist.ProcessGroupNCCL(
                    dist.PrefixStore("kv_data", self._store), self.rank, 2
                )
            else:
                self._data = self._control
        except Exception as error:  # noqa: BLE001 — any failure to meet the peer
            self._die(f"could not connect to {self.peer_name} at {self.address}: {error}")
            return
        with self._cond:
            self.connected = True
            self._cond.notify_all()
        logger.info("KV channel (%s) connected at %s", self.role, self.address)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _die(self, why: str) -> None:
        with self._cond:
            if self.error is None and not self.closing:
                self.error = why
                logger.error("KV channel (%s) is dead: %s", self.role, why)
            self._cond.notify_all()

    def _await_connection(self, deadline: float, what: str) -> None:
        with self._cond:
            while not self.connected and self.error is None and not self.closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(
                        f"{what}: {self.peer_name} at {self.address} has not connected"
                    )
                self._cond.wait(min(left, POLL_S))
            self._raise_if_dead(what)

    def _raise_if_dead(self, what: str) -> None:
        if self.closing:
            raise KVTransferError(f"{what}: the KV channel is closed")
        if self.error is not None:
            raise KVTransferError(f"{what}: {self.error}")

    # -- the producer's side ------------------------------------------------------------------

    def send(self, key: str, kv: torch.Tensor, num_tokens: int) -> None:
        """Push one request's K/V (any shape, at most MAX_DIMS dimensions) to the consumer.
        Returns once the consumer has taken it off the wire; raises KVTransferError if the
        consumer is gone or does not take it within send_timeout_s (the channel is then dead:
        gloo closes a pair whose wait timed out)."""
        if self.rank != PRODUCER_RANK:
            raise ValueError("only the kv_producer's channel sends")
        key_bytes = key.encode()
        if not key_bytes or kv.numel() == 0 or num_tokens < 1:
            raise ValueError("a KV transfer needs a key, a non-empty tensor and num_tokens >= 1")
        what = f"sending the K/V of {key!r} to {self.peer_name}"
        deadline = time.monotonic() + self.send_timeout_s
        self._await_connection(deadline, what)
        payload = kv.contiguous()
        raw = payload.reshape(-1).view(torch.uint8)
        if self._data is self._control:
            raw = raw.cpu()
        messages = (
            (self._control, _header(key_bytes, num_tokens, payload)),
            (self._control, torch.frombuffer(bytearray(key_bytes), dtype=torch.uint8)),
            (self._data, raw),
        )
        with self._send_lock:
            try:
                for group, tensor in messages:
                    left = max(deadline - time.monotonic(), 0.001)
                    group.send([tensor], CONSUMER_RANK, 0).wait(timedelta(seconds=left))
            except RuntimeError as error:
                self._die(f"{self.peer_name} at {self.address} failed: {error}")
                raise KVTransferError(f"{what}: {self.error or error}") from None
        self.sent_bytes += raw.numel()

    # -- the consumer's side ------------------------------------------------------------------

    def _connect_then_listen(self) -> None:
        self._connect()
        while self.connected and self.error is None and not self.closing:
            try:
                key, tensor, num_tokens = self._receive_one()
            except Exception as error:  # noqa: BLE001 — the peer died or the message broke
                self._die(f"{self.peer_name} at {self.address} is gone: {error}")
                return
            self._keep(key, tensor, num_tokens)

    def _receive_one(self) -> tuple[str, torch.Tensor, int]:
        """The next message: its header (waited for without a deadline: an idle producer sends
        nothing), then its key and payload, bounded by recv_timeout_s."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._control.recv([header], PRODUCER_RANK, 0).wait()
        key_len, num_tokens, dtype_code, ndim, *dims = header.tolist()
        bounded = timedelta(seconds=self.recv_timeout_s)
        key = torch.empty(key_len, dtype=torch.uint8)
        self._control.recv([key], PRODUCER_RANK, 0).wait(bounded)
        dtype, shape = DTYPES[dtype_code], dims[:ndim]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._data.recv([raw], PRODUCER_RANK, 0).wait(bounded)
        if raw.is_cuda:
            torch.cuda.synchronize(raw.device)
        return bytes(key.tolist()).decode(), raw.view(dtype).reshape(shape), num_tokens

    def _keep(self, key: str, tensor: torch.Tensor, num_tokens: int) -> None:
        """Into the receive buffer, oldest dropped first past buffer_bytes (vLLM bounds its
        receive store by kv_buffer_size too); a dropped key's recv() fails at once."""
        nbytes = tensor.numel() * tensor.element_size()
        self.received_bytes += nbytes
        with self._cond:
            if key in self._received:
                self._buffered -= self._nbytes(self._received.pop(key)[0])
            if nbytes > self.buffer_bytes:  # never fits: drop it alone
                self._drop(key, f"{nbytes} bytes exceed the receive buffer ({self.buffer_bytes})")
                self._cond.notify_all()
                return
            while self._received and self._buffered + nbytes > self.buffer_bytes:
                old, (old_tensor, _) = self._received.popitem(last=False)
                self._buffered -= self._nbytes(old_tensor)
                self._drop(old, "the receive buffer was full")
            self._received[key] = (tensor, num_tokens)
            self._buffered += nbytes
            self._cond.notify_all()

    @staticmethod
    def _nbytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()

    def _drop(self, key: str, why: str) -> None:
        logger.warning("KV channel: dropped the K/V of %r: %s", key, why)
        self.dropped += 1
        self._dropped[key] = why
        while len(self._dropped) > MAX_DROPPED_KEYS:
            self._dropped.popitem(last=False)

    def recv(self, key: str, timeout_s: float | None = None) -> tuple[torch.Tensor, int]:
        """The K/V sent under `key` and its token count, taken out of the buffer; waits up to
        timeout_s (default recv_timeout_s) for it to arrive. Raises KVTransferError when it does
        not (timed out, dropped from a full buffer, the producer gone) rather than KVChannel's
        None, so the failed load's log says why; its request recomputes either way."""
        if self.rank != CONSUMER_RANK:
            raise ValueError("only the kv_consumer's channel receives")
        what = f"receiving the K/V of {key!r} from {self.peer_name}"
        wait_s = self.recv_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        with self._cond:
            while key not in self._received:
                if key in self._dropped:
                    raise KVTransferError(f"{what}: dropped: {self._dropped[key]}")
                self._raise_if_dead(what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTransferError(f"{what}: it did not arrive within {wait_s:g} s")
                self._cond.wait(min(left, POLL_S))
            tensor, num_tokens = self._received.pop(key)
            self._buffered -= self._nbytes(tensor)
        return tensor, num_tokens

    def discard(self, key: str) -> None:
        """The consumer will not load `key` (KVConnectorMetadata.drops): free its buffer space.
        K/V that arrives after its discard waits in the buffer until the bound pushes it out."""
        with self._cond:
            entry = self._received.pop(key, None)
            if entry is not None:
                self._buffered -= self._nbytes(entry[0])

    def has(self, key: str) -> bool:
        with self._cond:
            return key in self._received

    # -- both ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        """What /health and the trace can show of the channel."""
        return {
            "role": self.role,
            "peer": self.address,
            "connected": self.connected and self.error is None,
            "error": self.error,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "buffered_bytes": self._buffered,
            "dropped": self.dropped,
        }

    def close(self) -> None:
        """Fail every waiting recv(), abort the groups, let them go and wait briefly for the
        listener to leave. Runs at interpreter exit for a channel still open (see
        `_close_open_channels`)."""
        self._let_go()
        self._wait_for_listener()

    def _let_go(self) -> None:
        with self._cond:
            self.closing = True
            self._cond.notify_all()
        for group in {id(g): g for g in (self._data, self._control) if g is not None}.values():
            try:
                group.abort()
            except Exception:  # noqa: BLE001 — already broken
                pass
        self._data = self._control = self._store = None  # ends the listener's wait
        _OPEN.discard(self)

    def _wait_for_listener(self) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)


_OPEN: "weakref.WeakSet[P2pGlooChannel]" = weakref.WeakSet()


@atexit.register
def _close_open_channels() -> None:
    """A gloo group still referenced while the interpreter shuts down, or a listener that wakes
    then (its peer's group just went) and drops its pending receive while the interpreter
    finalizes, ends the process in std::terminate (exit code 134: the receive's destructor
    cannot take the GIL back). So every channel is let go first, which is what wakes a
    listener whose peer is in this process; then the listeners are waited for; then the groups
    are collected, all before the interpreter's last rites."""
    channels = list(_OPEN)
    for channel in channels:
        channel._let_go()
    for channel in channels:
        channel._wait_for_listener()
    gc.collect()


CHANNEL_SETTINGS = ("connect_timeout_s", "send_timeout_s", "recv_timeout_s", "buffer_bytes")


class P2pConnectorWorker(ChannelConnectorWorker):
    """P2pGlooConnector's worker side: the channel worker of engine/worker/kv_connector.py over a
    P2pGlooChannel, opened once the KV cache is registered (the cache's device decides gloo or
    NCCL for the payload). kv_connector_extra_config: "kv_peer" ("HOST:PORT", required) and
    optionally the channel's CHANNEL_SETTINGS."""

    def __init__(self, config: KVTransferConfig):
        if config.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(
                f"P2pGlooConnector's kv_role is kv_producer or kv_consumer, got {config.kv_role!r}"
            )
        extra = config.kv_connector_extra_config
        self.peer = parse_peer(str(extra.get("kv_peer", "")))
        self.settings = {k: extra[k] for k in CHANNEL_SETTINGS if k in extra}
        super().__init__(config, None)

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().register_kv_caches(kv_caches)
        if self.channel is None:
            host, port = self.peer
            self.channel = P2pGlooChannel(
                self.config.kv_role, host, port, self.device, **self.settings
            )


# The worker side's registry (engine/worker/kv_connector.py) cannot import this module, which
# imports it; the Worker imports this module, and so the name is registered.
KV_CONNECTOR_WORKERS["P2pGlooConnector"] = P2pConnectorWorker
