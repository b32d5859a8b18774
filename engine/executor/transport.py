"""The transport of the multi-process executor (engine/executor/multiproc.py): the data group's
collectives inside the forward, counted and timed (`Comm`), and the control plane, a gloo group
whose rank 0 is the driver (`ControlGroup`), with the torchrun environment it may be joined
through.
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 600.0  # torch.distributed's own timeout for a collective


# -- the data group: communication, counted ---------------------------------------------------


class Comm:
    """This rank's collectives, timed and counted. With tp 1 all_reduce is the identity."""

    def __init__(self, rank: int, tp: int, pp: int, tp_group=None):
        self.rank, self.tp, self.pp = rank, tp, pp
        self.tp_group = tp_group
        self.prev_rank = rank - tp if rank >= tp else None  # same tp rank, previous stage
        self.next_rank = rank + tp if rank + tp < tp * pp else None
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.all_reduce_count = 0
        self.all_reduce_bytes = 0
        self.p2p_bytes = 0

    def _sync(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return t
        self._sync(t)
        start = time.perf_counter()
        dist.all_reduce(t, group=self.tp_group)
        self._sync(t)
        self.seconds += time.perf_counter() - start
        self.all_reduce_count += 1
        self.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def send(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        self._sync(t)
        start = time.perf_counter()
        dist.send(t, self.next_rank)
        self.seconds += time.perf_counter() - start
        self.p2p_bytes += t.numel() * t.element_size()

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Includes the wait for the previous stage to finish (the pipeline's idle time)."""
        t = torch.empty(shape, dtype=dtype, device=device)
        start = time.perf_counter()
        dist.recv(t, self.prev_rank)
        self._sync(t)
        self.seconds += time.perf_counter() - start
        self.p2p_bytes += t.numel() * t.element_size()
        return t


# -- the control plane: messages down, replies up, over a gloo group ----------------------------

# A worker waits this long for the driver's next message (an idle server sends none); the driver
# bounds its own waits (STARTUP_TIMEOUT_S, the engine iteration timeout). A peer that dies closes
# its connections, which fails a pending collective at once: no timeout is needed to notice that.
CONTROL_IDLE_TIMEOUT = timedelta(days=30)


def env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value or "")
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def torchrun_rank() -> int | None:
    """This process's rank when a launcher such as torchrun started it (RANK and WORLD_SIZE in
    the environment), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return env_int("RANK")


def check_torchrun_world(tp: int, pp: int) -> int:
    """This torchrun process's rank, after checking that torchrun started exactly tp × pp
    processes (ValueError otherwise, before anything is loaded)."""
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    if world != tp * pp:
        raise ValueError(
            f"torchrun started WORLD_SIZE={world} processes, but tensor_parallel_size × "
            f"pipeline_parallel_size = {tp} × {pp} = {tp * pp}; one process per rank: "
            "--nnodes × --nproc-per-node must equal tp × pp"
        )
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside 0..{world - 1}")
    return rank


def check_local_gpus(device: torch.device) -> None:
    """Under torchrun the GPUs are counted per machine: one process per GPU on each."""
    if device.type == "cuda":
        local = env_int("LOCAL_WORLD_SIZE", 1)
        if local > torch.cuda.device_count():
            raise ValueError(
                f"torchrun starts {local} processes on this machine (--nproc-per-node), but it "
                f"has {torch.cuda.device_count()} CUDA device(s): one process per GPU"
            )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _to_tensor(obj) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _from_tensor(t: torch.Tensor, length: int):
    return pickle.loads(t[:length].numpy().tobytes())


def wait_at_most(seconds: float):
    return lambda work: work.wait(timedelta(seconds=seconds))


class ControlGroup:
    """The control plane: a gloo process group (CPU tensors over TCP) whose rank 0 is the
    driver, the process that runs the engine core. broadcast() carries one message from the
    driver to every rank (e.g. a step's SchedulerOutput); gather() brings one reply per rank back
    to the driver (the sampled tokens, timings). A message is pickled into a uint8 tensor and
    costs two collectives (its length, then its bytes). `wait(work)` waits for one collective:
    a worker just waits; the driver bounds the wait and watches its workers."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def broadcast(self, message=None, wait=None) -> tuple[object, int]:
        """The driver's message, on every rank, and its size in bytes."""
        wait = wait or (lambda work: work.wait())
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        data = _to_tensor(message) if self.rank == 0 else None
        length = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
        wait(self.group.broadcast([length], opts))
        if data is None:
            data = torch.empty(int(length), dtype=torch.uint8)
        wait(self.group.broadcast([data], opts))
        return (message if self.rank == 0 else _from_tensor(data, int(length))), int(length)

    def gather(self, reply, wait=None) -> list | None:
        """Every rank's reply in rank order, on the driver; None on the other ranks."""
        wait = wait or (lambda work: work.wait())
        data = _to_tensor(reply)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        wait(self.group.allgather([lengths], [torch.tensor([data.numel()], dtype=torch.int64)]))
        longest = max(int(n) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        received = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        wait(self.group.gather([received] if self.rank == 0 else [], [padded], opts))
        if self.rank != 0:
            return None
        return [_from_tensor(t, int(n)) for t, n in zip(received, lengths)]


def leave_world() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def join_torchrun_world(device: torch.device) -> ControlGroup:
    """A process torchrun started: join its world (the data group, torchrun's rendezvous from
    the environment) and the gloo control group beside it, whose rank 0 is RANK 0."""
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    if device.type == "cuda":
        torch.cuda.set_device(env_int("LOCAL_RANK", 0) % torch.cuda.device_count())
    dist.init_process_group(
        backend_for(device), init_method="env://", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    return ControlGroup(dist.new_group(backend="gloo", timeout=CONTROL_IDLE_TIMEOUT), rank, world)
