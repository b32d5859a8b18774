"""A multi-process executor on torch.distributed: tensor parallel and pipeline parallel.

    engine core (one scheduler) = the driver, rank 0 of a gloo *control group*
        │  each step's SchedulerOutput, broadcast over the control group to every rank
        ▼
    worker rank 0 … rank N-1   (gloo on CPU, NCCL on CUDA: the *data group*)
        │  tensor parallel: all-reduce inside each layer; pipeline parallel: hidden states
        │  sent stage to stage
        ▼
    the output rank (first worker of the last stage) samples; its new tokens and every rank's
    timings (compute vs communication) are gathered back to the driver over the control group

Rank layout, as vLLM numbers it: rank = pp_rank * tp + tp_rank, so the workers of one pipeline
stage are consecutive and form one tensor-parallel group.

Every rank runs the one model of engine/models/llama.py, `LlamaModel`, built from its shard: the
parallel linear layers of engine/layers/linear.py cut the weights and all-reduce, the Worker and
ModelRunner are the in-process engine's own. This module adds the processes and the transport.

Tensor parallel (Megatron-LM's split, as vLLM does it), per layer:
- column-parallel: the fused q/k/v matrix is cut by heads (each rank computes its query heads and
  the KV heads they read), gate/up by columns of the MLP's intermediate size. No communication:
  each rank's output is a complete slice of the activations.
- row-parallel: o and down are cut by their input columns, so each rank's output is a partial
  sum of the full result; one all-reduce after o and one after down make it whole. Two
  all-reduces per layer, each of num_tokens × hidden_size values.
- KV heads: split across ranks when tp divides num_kv_heads; when tp > num_kv_heads (and is a
  multiple of it) each KV head is replicated on tp / num_kv_heads ranks, as vLLM does. Each rank's
  KV cache then holds only its KV heads.
- embedding and lm_head are *replicated* (every rank of a stage holds them whole): simpler than
  vLLM's vocab-parallel split (which cuts the vocabulary across ranks and needs an all-reduce
  after the embedding and a gather of the logits), at the cost of memory. `layout()` states the
  replicated bytes per rank. RMSNorm weights are replicated too (they are tiny).

Pipeline parallel: the layers are split into consecutive stages; the first stage embeds, each
stage sends its output hidden states to the next (point-to-point send/recv), the last stage
applies the final norm and lm_head and samples. In this engine one step runs through the stages
one after the other, so only one stage works at a time. vLLM does more: it keeps several batches
(virtual engines) in flight, so that while stage 2 runs step t, stage 1 already runs step t+1,
filling the pipeline bubble; and it splits huge prefills across steps. Pipeline parallel here
shows the memory split and the hand-off, not the throughput.

Two process groups, as vLLM keeps a `cpu_group` beside its device group: the *data group* (the
ranks' collectives inside the forward, NCCL on CUDA) and the *control group* (gloo, CPU tensors
over TCP) that carries the control path: the driver broadcasts each message (a pickled
SchedulerOutput, as a uint8 tensor) and gathers one reply per rank. Everything goes over the
network, so the ranks may sit on different machines. Two launches, one protocol:
- spawned (the default, one machine): this process is the driver and holds no shard; it starts
  one worker per rank (torch.multiprocessing: forked where safe, as vLLM does, else spawned; see
  engine/executor/start_method.py) and hosts the control group's rendezvous; the workers' data
  group meets through MASTER_ADDR/MASTER_PORT (default 127.0.0.1 and a free port).
- torchrun (across machines): torchrun starts one process per rank and sets MASTER_ADDR,
  MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK. RANK 0's process is the driver *and* rank 0's
  worker (it runs its shard in-process); every other rank runs `run_torchrun_worker` (the same
  loop a spawned worker runs). See docs/distributed.md.

Failure: every wait on the control group is bounded and, for spawned workers, checks that every
worker is alive, so a worker that dies (or raises) makes the engine raise ExecutorDiedError (a
RuntimeError) instead of hanging; a step that runs past the engine iteration timeout (a stopped
or deadlocked worker; engine/executor/watchdog.py) does the same. Spawned workers are daemon
processes, exit when their parent dies (a watchdog thread on the parent pid, and the control
group's connection closing), and are stopped by `shutdown()` (a "shutdown" message, then
terminate, then kill), by garbage collection of the executor and at interpreter exit. Under
torchrun the driver's shutdown message ends every rank's loop; torchrun itself stops the other
ranks of a failed run.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import stat
import threading
import time
import traceback
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, engine_iteration_timeout_s
from engine.executor.abstract import Executor, ExecutorDiedError, ForkNotSupportedError
from engine.executor.start_method import worker_start_method
from engine.executor.transport import (
    COLLECTIVE_TIMEOUT_S,
    CONTROL_IDLE_TIMEOUT,
    Comm,
    ControlGroup,
    backend_for,
    check_local_gpus,
    check_torchrun_world,
    env_int,
    join_torchrun_world,
    leave_world,
    torchrun_rank,
    wait_at_most,
)
from engine.executor.watchdog import hung_step_message, resume
from engine.kernels.float32_linear import FLOAT32_LINEAR_ENV, float32_linear_backend
from engine.kernels.linear_precision import resolve_linear_precision
from engine.kernels.quant import storage_key, weight_nbytes
from engine.layers.sharding import (
    ParallelContext,
    check_parallel_sizes,
    head_ranges,
    mlp_range,
    stage_layers,
)
from engine.models.config import LlamaConfig
from engine.scheduler_output import SchedulerOutput
from engine.utils import free_port
from engine.worker.model_runner import ModelRunnerOutput
from engine.worker.worker import Worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # spawn + import torch + load weights, per engine start
POLL_S = 0.05
SHUTDOWN_WAIT_S = 5.0
DEATH_GRACE_S = 3.0  # after a failure, how long the workers' exit codes are awaited


# -- what a rank holds ----------------------------------------------------------------------------


def rank_layout(worker: Worker, full: LlamaConfig) -> dict:
    """What this rank holds (computed from its tensors), and the classes its forward runs (the
    model of engine/models/llama.py, its layers of engine/layers/linear.py). replicated_bytes:
    what other ranks hold too (embedding, lm_head and norms when tp > 1; K/V rows when
    tp > num_kv_heads)."""
    model, stage = worker.model, worker.parallel
    cfg, tp, first = model.cfg, stage.tp, model.layers[0]
    layers = stage_layers(full.num_layers, stage.pp)[stage.pp_rank]
    q, kv = head_ranges(full, tp, stage.tp_rank)
    inter = mlp_range(full, tp, stage.tp_rank)
    return {
        "rank": stage.rank,
        "tp_rank": stage.tp_rank,
        "pp_rank": stage.pp_rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(worker.device),
        "is_output_rank": stage.is_output_rank,
        "layers": [layers.start, layers.stop],
        "q_heads": [q.start, q.stop],
        "kv_heads": [kv.start, kv.stop],
        "mlp_columns": [inter.start, inter.stop],
        "holds_embedding": "embed" in model.w,
        "holds_lm_head": "lm_head" in model.w,
        "weight_bytes": model.weight_bytes(),
        "replicated_bytes": _replicated_bytes(model, full, tp),
        "shapes": {
            name.split(".", 1)[-1]: list(t.shape)
            for name, t in model.w.items()
            if name.startswith("0.") or name in ("embed", "lm_head")
        },
        "num_layers": cfg.num_layers,
        "kv_bytes_per_block": worker.bytes_per_block,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "layer_classes": {
            name: type(part).__name__
            for name, part in (
                ("qkv", first.attention.qkv),
                ("o", first.attention.o),
                ("gate_up", first.mlp.gate_up),
                ("down", first.mlp.down),
            )
        },
    }


def _replicated_bytes(model, full: LlamaConfig, tp: int) -> int:
    """Bytes this rank holds that other ranks of its stage hold too."""
    if tp == 1:
        return 0
    shared = {
        storage_key(t): weight_nbytes(t)
        for name, t in model.w.items()
        if name in ("embed", "lm_head") or "norm" in name
    }
    total = sum(shared.values())
    if tp > full.num_kv_heads:  # this rank's K and V rows are on other ranks too
        cfg = model.cfg
        kv_rows = 2 * cfg.num_kv_heads * cfg.head_dim
        for i in range(cfg.num_layers):
            for name in (f"{i}.qkv", f"{i}.qkv_bias"):
                if name in model.w:
                    t = model.w[name]
                    total += kv_rows * weight_nbytes(t) // t.shape[0]
    return total


def _describe(error: BaseException) -> tuple[str, str, str]:
    return type(error).__name__, str(error), traceback.format_exc()


class RankServer:
    """What one rank does with each message of the driver: "load" (join the data group, load
    the shard), "num_blocks", "init_cache", "step". The same object serves a spawned worker, a
    torchrun process of rank > 0 and, under torchrun, the driver's own shard (rank 0)."""

    def __init__(self, rank: int, tp: int, pp: int, model_dir: str | None = None):
        self.rank, self.tp, self.pp = rank, tp, pp
        self.model_dir = model_dir  # None: the driver's (the "load" message names it)
        self.worker: Worker | None = None
        self.full_cfg: LlamaConfig | None = None
        self.comm: Comm | None = None

    def handle(self, kind: str, payload):
        if kind == "load":
            return self.load(payload)
        if kind == "num_blocks":
            max_model_len, cache_args = payload
            return self.worker.determine_num_blocks(max_model_len, **cache_args)
        if kind == "init_cache":
            self.worker.initialize_cache(*payload)
            layout = rank_layout(self.worker, self.full_cfg)
            return {**layout, "kv_cache_bytes": self.worker.kv_cache_bytes()}
        if kind == "step":
            return self.step(payload)
        raise ValueError(f"unknown control message {kind!r}")

    def load(self, spec: dict) -> None:
        device = spec["device"]
        if device.type == "cuda":
            local_rank = env_int("LOCAL_RANK", self.rank)
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        if not dist.is_initialized():  # a spawned worker; torchrun's processes joined already
            dist.init_process_group(
                backend_for(device),
                init_method="env://",  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        tp, pp = self.tp, self.pp
        tp_group = None
        for stage in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp))) if tp > 1 else None
            if stage == self.rank // tp:
                tp_group = group
        self.comm = Comm(self.rank, tp, pp, tp_group)
        model_dir = self.model_dir or spec["model_dir"]
        self.full_cfg = LlamaConfig.from_model_dir(model_dir)
        self.worker = Worker(
            model_dir,
            device,
            spec["dtype"],
            spec["block_size"],
            spec["kernels"],
            parallel=ParallelContext(tp, pp, self.rank, self.comm),
            linear_precision=spec.get("linear_precision", "float32"),
            kv_cache_dtype=spec.get("kv_cache_dtype"),
        )
        self.worker.load_model()

    def step(self, sched: SchedulerOutput):
        """The output rank answers its ModelRunnerOutput, the others their timings."""
        self.comm.reset()
        start = time.perf_counter()
        output = self.worker.execute_model(sched)
        total = time.perf_counter() - start
        timings = {
            "rank": self.rank,
            "tp_rank": self.rank % self.tp,
            "pp_rank": self.rank // self.tp,
            "step_s": total,
            "compute_s": max(total - self.comm.seconds, 0.0),
            "comm_s": self.comm.seconds,
            "all_reduce_count": self.comm.all_reduce_count,
            "all_reduce_bytes": self.comm.all_reduce_bytes,
            "p2p_bytes": self.comm.p2p_bytes,
        }
        if self.worker.parallel.is_output_rank:
            output.workers = [timings]
            return output
        return timings


def serve_rank(control: ControlGroup, server: RankServer) -> int:
    """A worker's loop: receive the driver's message, handle it, reply; until "shutdown".
    Returns the exit status. A failed step ends the loop at once, without a reply: its peers may
    wait in a collective with this rank, and its leaving makes their collective fail instead of
    hang (the driver then sees the ranks go; the error is in this process's log)."""
    while True:
        (kind, payload), _ = control.broadcast()
        if kind == "shutdown":
            return 0
        try:
            reply = ("ok", server.handle(kind, payload))
        except Exception as error:  # noqa: BLE001 — the driver decides; report anything
            if kind == "step":
                logger.exception("rank %d failed in a step; leaving", server.rank)
                return 1
            reply = ("error", _describe(error))
        control.gather(reply)


def run_torchrun_worker(
    model: str | Path | None, device: str, tensor_parallel_size: int, pipeline_parallel_size: int
) -> int:
    """What a torchrun process of RANK > 0 runs (`python -m engine` dispatches here): check the
    sizes, join the groups, then serve the driver's messages until its shutdown message. Loads
    its own copy of the model directory (`model`, as on every machine) and prints nothing on
    stdout. Returns the exit status."""
    from engine.artifact import resolve_model_path
    from engine.worker.worker import resolve_device

    tp, pp = tensor_parallel_size, pipeline_parallel_size
    rank = check_torchrun_world(tp, pp)
    model_dir = resolve_model_path(model)
    check_parallel_sizes(LlamaConfig.from_model_dir(model_dir), tp, pp)  # as rank 0 does
    dev = resolve_device(device)
    check_local_gpus(dev)
    control = join_torchrun_world(dev)
    try:
        return serve_rank(control, RankServer(rank, tp, pp, str(model_dir)))
    except Exception as error:  # noqa: BLE001 — the driver is gone or the group failed
        logger.error("rank %d: the control group failed: %s", rank, error)
        return 1
    finally:
        leave_world()


def _die_with_parent(interval_s: float = 1.0) -> None:
    """Exit when the engine's process is gone (killed, even by SIGKILL), whatever this worker is
    doing: a daemon thread watches the parent pid. (Linux's PR_SET_PDEATHSIG would fire when the
    *thread* that started the worker ends, e.g. a Streamlit script run, so it is not used.)"""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _worker_main(
    rank: int,
    tp: int,
    pp: int,
    env: dict,
    control_addr: tuple[str, int, int],
    threads: int,
    all_started,
) -> None:
    """A spawned worker: join the driver's control group (as rank + 1; the driver is 0), then
    serve its messages (the first, "load", joins the data group and loads the shard).

    It connects only once every worker is started (`all_started`, an Event): the driver's store
    thread resolves each connecting peer's name, and a worker forked while it held glibc's
    resolver lock inherited that lock held and hung in its own first name lookup (1 start-up in
    about 50 under load, tp 3)."""
    _die_with_parent()
    _close_inherited_tcp_sockets()
    os.environ.update(env)  # torchrun's names: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, ...
    status = 1
    try:
        if not all_started.wait(STARTUP_TIMEOUT_S):
            raise TimeoutError("the engine did not finish starting its workers")
        if threads:
            torch.set_num_threads(threads)
        host, port, size = control_addr
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S)
        )
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank + 1, size, CONTROL_IDLE_TIMEOUT
        )
        status = serve_rank(ControlGroup(group, rank + 1, size), RankServer(rank, tp, pp))
    except Exception:  # noqa: BLE001 — the engine is gone (its connection closed): leave quietly
        pass
    finally:
        leave_world()
    raise SystemExit(status)


# -- the executor --------------------------------------------------------------------------------


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _close_inherited_tcp_sockets() -> None:
    """A forked worker starts with copies of its parent's TCP sockets: a server's listening socket
    and its clients' connections (the app's browsers). Holding them, it would keep a connection the
    parent has closed open, and a browser's next request on it would wait forever (a reload of
    chapter 12 hung so). The worker opens its own sockets after this; pipes are kept."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            fd = int(name)
            if fd <= 2 or not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.close()
        else:
            sock.detach()


@dataclasses.dataclass
class _Ranks:
    """What it takes to stop the ranks, kept apart from the executor (its finalizer must not
    refer to the executor): spawned processes, the control group, whether it still works."""

    processes: list = dataclasses.field(default_factory=list)
    control: ControlGroup | None = None
    store: object = None  # the control group's rendezvous, hosted here (spawned launch)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    healthy: bool = True
    in_world: bool = False  # torchrun: this process joined the data group


def _stop_ranks(ranks: _Ranks) -> None:
    """Send "shutdown" (if the control group still works), then terminate, then kill whatever
    spawned process is left; reap them all; leave the process group."""
    told = False
    if ranks.control is not None and ranks.healthy and ranks.lock.acquire(timeout=SHUTDOWN_WAIT_S):
        try:
            ranks.control.broadcast(("shutdown", None), wait=wait_at_most(SHUTDOWN_WAIT_S))
            told = True
        except Exception:  # noqa: BLE001 — a rank is gone already: terminate below
            pass
        finally:
            ranks.lock.release()
    ranks.healthy = False
    deadline = time.monotonic() + (SHUTDOWN_WAIT_S if told else 0.5)
    for p in ranks.processes:
        p.join(timeout=max(deadline - time.monotonic(), 0.0))
    for p in ranks.processes:
        if p.is_alive():
            p.terminate()
            resume(p.pid)  # a stopped worker acts on SIGTERM only once it runs again
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
    ranks.control = ranks.store = None
    if ranks.in_world:
        leave_world()
        ranks.in_world = False


class MultiprocExecutor(Executor):
    """One worker per rank; the same step to all over the control group; the output rank's
    tokens returned. Spawns the workers, or (under torchrun) is rank 0 among torchrun's."""

    def __init__(
        self,
        model_dir: str | Path,
        model_config: LlamaConfig,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        kernels: str = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        master_addr: str | None = None,
        master_port: int | None = None,
        step_timeout_s: float | None = None,
        linear_precision: str = "float32",
        kv_cache_dtype: torch.dtype | None = None,
    ):
        """Validates everything it can (sizes, devices, the rendezvous port) and starts nothing:
        the processes start (or the torchrun world is joined) in initialize().
        `step_timeout_s`: the engine iteration timeout (None: engine/config.py's default), past
        which a step counts as hung: it fails and every worker is stopped. `linear_precision`
        is resolved here ("auto" timed once in this process) and every rank gets the result,
        as they get the float32 library."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        self.torchrun = torchrun_rank() is not None
        if self.torchrun:  # torchrun started the ranks: WORLD_SIZE must be tp × pp
            check_parallel_sizes(model_config, tp, pp)
            if check_torchrun_world(tp, pp) != 0:
                raise ValueError(
                    "under torchrun only RANK 0 runs the engine core; the other ranks run "
                    "engine.executor.multiproc.run_torchrun_worker (python -m engine does this)"
                )
            check_local_gpus(device)
        else:
            check_parallel_sizes(model_config, tp, pp, device)
            self.start_method = worker_start_method()  # fork, or spawn (refused if unguarded)
        self.tp, self.pp, self.world_size = tp, pp, tp * pp
        self.model_config = model_config
        self.spec = dict(
            model_dir=str(model_dir), device=device, dtype=dtype, block_size=block_size,
            kernels=kernels,
            linear_precision=resolve_linear_precision(linear_precision, device, dtype)["precision"],
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        self.master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or os.environ.get("MASTER_PORT")
        if port is not None and not self.torchrun:  # torchrun's own rendezvous holds its port
            try:
                port = int(port)
            except ValueError:
                raise ValueError(f"MASTER_PORT must be a port number, got {port!r}") from None
            if not 0 < port < 65536:
                raise ValueError(f"MASTER_PORT must be in 1..65535, got {port}")
            if not _port_is_free(self.master_addr, port):
                raise ValueError(
                    f"rendezvous port {self.master_addr}:{port} is in use; choose another "
                    "MASTER_PORT (or unset it: a free port is picked)"
                )
        self.master_port = port
        self.step_timeout_s = engine_iteration_timeout_s(step_timeout_s)
        self.num_blocks = 0
        self.output_rank = tp * (pp - 1)
        self.ranks = _Ranks()
        self.local: RankServer | None = None  # torchrun: rank 0's shard, in this process
        self._layout: list[dict] = []
        self._finalizer = None
        self._dead: str | None = None
        self._deadline, self._what = 0.0, ""

    @property
    def processes(self) -> list:
        return self.ranks.processes

    # -- processes ---------------------------------------------------------------------------

    def _start(self) -> None:
        # Runs on shutdown(), when the executor is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_ranks, self.ranks)
        if self.torchrun:
            self.ranks.in_world = True
            self.ranks.control = join_torchrun_world(self.spec["device"])
            self.local = RankServer(0, self.tp, self.pp)
            return
        ctx = torch.multiprocessing.get_context(self.start_method)
        port = self.master_port or free_port(self.master_addr)
        size = self.world_size + 1  # the control group: this process (0) and every worker
        store = dist.TCPStore(
            self.master_addr, 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )  # fmt: skip
        self.ranks.store = store
        threads, same_library = 0, {}
        if self.spec["device"].type == "cpu":  # share the cores, do not oversubscribe them
            threads = max(1, torch.get_num_threads() // self.world_size)
            if self.spec["dtype"] == torch.float32:  # every rank the same float32 linear library
                same_library = {FLOAT32_LINEAR_ENV: float32_linear_backend()["backend"]}
        all_started = ctx.Event()
        for rank in range(self.world_size):
            env = {
                **same_library,
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world_size),
            }
            p = ctx.Process(
                target=_worker_main,
                args=(
                    rank, self.tp, self.pp, env, (self.master_addr, store.port, size), threads,
                    all_started,
                ),
                name=f"engine-worker-{rank}",
                daemon=True,
            )  # fmt: skip
            p.start()
            self.ranks.processes.append(p)
        all_started.set()
        self.master_port = port
        self.ranks.control = ControlGroup(self._connect(store, size), 0, size)

    def _connect(self, store, size: int):
        """The control group's rank 0. Creating it waits for every worker to connect, so it
        runs in a thread while this one watches the workers and the clock."""
        result: dict = {}

        def connect() -> None:
            try:
                result["group"] = dist.ProcessGroupGloo(
                    dist.PrefixStore("control", store), 0, size, CONTROL_IDLE_TIMEOUT
                )
            except Exception as error:  # noqa: BLE001
                result["error"] = error

        thread = threading.Thread(target=connect, name="engine-control-connect", daemon=True)
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while thread.is_alive():
            thread.join(POLL_S * 2)
            self._check_alive("start-up")
            if time.monotonic() > deadline:
                self._fail(f"workers did not connect within {STARTUP_TIMEOUT_S:.0f} s")
        if "error" in result:
            self._fail(f"the control group could not start: {result['error']}")
        return result["group"]

    def worker_pids(self) -> list[int]:
        """The spawned workers (under torchrun: none; the ranks are torchrun's)."""
        return [p.pid for p in self.processes]

    def _dead_workers(self, failed_only: bool = False) -> list[str]:
        """Spawned workers that are gone (failed_only: with a non-zero exit code), those killed
        by a signal first: when one is killed, its peers fail in their next collective and leave
        with exit code 1 after it, so the killed one is the cause."""
        gone = [
            (rank, p)
            for rank, p in enumerate(self.processes)
            if not p.is_alive() and not (failed_only and p.exitcode == 0)
        ]
        gone.sort(key=lambda item: (item[1].exitcode is None or item[1].exitcode >= 0, item[0]))
        return [
            f"worker rank {rank} (pid {p.pid}) died (exit code {p.exitcode})" for rank, p in gone
        ]

    def _check_alive(self, what: str) -> None:
        if self._dead_workers():
            self._fail(f"a worker left during {what}")

    def _await_exit_codes(self) -> None:
        """After a failure, give the spawned workers up to DEATH_GRACE_S to exit. A worker's
        death resets its connections a moment before its exit code can be read, and its peers
        leave after their collective fails; waiting lets the failure name the worker that
        died instead of the broken connection it left behind."""
        deadline = time.monotonic() + DEATH_GRACE_S
        for p in self.processes:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _fail(self, message: str) -> None:
        """Stop every worker and raise. The dead workers are named first: when one dies, its
        peers fail in their next collective, and the cause is the death, not their error."""
        self._await_exit_codes()
        dead = self._dead_workers(failed_only=True)
        if dead:
            message = "; ".join(dead) + f"; then {message}"
        self._dead = message
        self.ranks.healthy = False  # no shutdown message over a broken group
        self.shutdown()
        raise ExecutorDiedError(message + "; all workers were stopped")

    def _fail_with(self, error_name: str, message: str) -> None:
        """A worker raised: configuration errors (ValueError, e.g. a cache too small) stay
        ValueErrors; anything else is fatal for the executor."""
        if error_name in ("ValueError", "CacheTooSmallError"):
            self._dead = message
            self.shutdown()
            raise ValueError(message)
        self._fail(message)

    def _wait(self, work) -> None:
        """Wait for one collective of the control group, in slices: between them, check the
        spawned workers and the deadline of the current message."""
        while True:
            try:
                work.wait(timedelta(seconds=POLL_S * 10))
                if work.is_completed():
                    return
            except RuntimeError:
                if work.is_completed():  # done after the slice ran out, or failed
                    self._fail_unless_succeeded(work)
                    return
            if self._dead_workers():
                try:  # its last reply may still be on the way
                    work.wait(timedelta(seconds=SHUTDOWN_WAIT_S))
                    if work.is_completed():
                        return
                except RuntimeError:
                    pass
                self._check_alive(self._what)
            if time.monotonic() > self._deadline:
                self._fail(self._timed_out())

    def _fail_unless_succeeded(self, work) -> None:
        """A completed collective whose timed wait raised: it may have completed right after the
        slice ran out (under load this happened about once in 25 start-ups, and the engine was
        stopped for nothing), or failed (a peer's connection closed). An untimed wait on completed
        work returns at once or raises the failure."""
        try:
            work.wait()
        except RuntimeError as error:
            self._fail(f"the control group failed during {self._what}: {error}")

    def _timed_out(self) -> str:
        if self._what.startswith("step"):
            return hung_step_message(self._what, self.step_timeout_s, self.processes)
        return f"the workers did not answer in time during {self._what}"

    def _call(self, kind: str, payload, timeout: float, what: str) -> tuple[list, int]:
        """One message to every rank, one reply from each (by rank), and the message's bytes.
        Raises ExecutorDiedError if a worker dies, fails or stays silent past `timeout` (then
        every worker is stopped); a worker's ValueError comes back as a ValueError."""
        if self._dead is not None:
            raise ExecutorDiedError(f"the executor is stopped: {self._dead}")
        control = self.ranks.control
        if control is None:
            raise ExecutorDiedError("the executor is shut down")
        with self.ranks.lock:
            self._deadline, self._what = time.monotonic() + timeout, what
            try:
                _, nbytes = control.broadcast((kind, payload), wait=self._wait)
                own = None if self.local is None else self._handle_locally(kind, payload)
                replies = control.gather(own, wait=self._wait)
            except ExecutorDiedError:
                raise
            except Exception as error:  # noqa: BLE001 — torch.distributed's errors
                self._fail(f"the control group failed during {what}: {error}")
        if self.local is None:
            replies = replies[1:]  # the driver's own (empty) reply
        for rank, (status, body) in enumerate(replies):
            if status == "error":
                name, text, trace = body
                logger.error("worker rank %d failed:\n%s", rank, trace)
                self._fail_with(name, f"worker rank {rank} failed during {what}: {text}")
        return [body for _, body in replies], nbytes

    def _handle_locally(self, kind: str, payload) -> tuple:
        """Under torchrun, rank 0's part of a message, run here between broadcast and gather."""
        try:
            return ("ok", self.local.handle(kind, payload))
        except Exception as error:  # noqa: BLE001
            if kind == "step":  # the other ranks may wait in a collective with this one
                logger.exception("rank 0 failed during %s", self._what)
                self._fail(f"rank 0 failed during {self._what}: {error}")
            return ("error", _describe(error))

    # -- Executor ------------------------------------------------------------------------------

    def initialize(self, max_model_len: int, num_swap_blocks: int | None = 0, **cache_args) -> int:
        """Start the workers (or join torchrun's); each loads its shard and sizes its own KV
        cache for its heads and layers; the engine uses the smallest block count, so that every
        rank can hold every block the scheduler hands out. On CUDA each worker profiles its own
        GPU (gpu_memory_utilization is per GPU, as in vLLM); on a CPU the workers of one machine
        share its memory, so the byte budget (kv_cache_memory, default
        `default_cpu_kv_cache_bytes`) is split evenly among them."""
        if self.spec["device"].type == "cpu" and cache_args.get("num_kv_blocks") is None:
            budget = cache_args.get("kv_cache_memory") or DEFAULT_CPU_KV_CACHE_BYTES
            per_machine = env_int("LOCAL_WORLD_SIZE", 1) if self.torchrun else self.world_size
            cache_args = {**cache_args, "kv_cache_memory": budget // per_machine}
        self._start()
        self._call("load", self.spec, STARTUP_TIMEOUT_S, "start-up")
        sizes, _ = self._call(
            "num_blocks", (max_model_len, cache_args), STARTUP_TIMEOUT_S, "KV cache sizing"
        )
        self.num_blocks = min(sizes)
        self.num_swap_blocks = self.num_blocks if num_swap_blocks is None else num_swap_blocks
        self._layout, _ = self._call(
            "init_cache", (self.num_blocks, self.num_swap_blocks), STARTUP_TIMEOUT_S,
            "KV cache allocation",
        )  # fmt: skip
        return self.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        replies, control_bytes = self._call(
            "step", scheduler_output, self.step_timeout_s, f"step {scheduler_output.step}"
        )
        output: ModelRunnerOutput = replies[self.output_rank]
        workers = [r.workers[0] if isinstance(r, ModelRunnerOutput) else r for r in replies]
        round_trip = time.perf_counter() - start
        for w in workers:
            w["control_bytes"] = control_bytes  # the message each worker received
            w["round_trip_s"] = round_trip  # engine's view: send, all workers' step, replies
        output.workers = workers
        return output

    def weight_bytes(self) -> int:
        """Bytes of weights over all workers: the model's, plus the replicated parts (see
        layout()'s replicated_bytes) once more per extra copy."""
        return sum(r["weight_bytes"] for r in self._layout)

    def kv_cache_bytes(self) -> int:
        return sum(r["kv_cache_bytes"] for r in self._layout)

    def layout(self) -> list[dict]:
        """Per rank: its layers, query/KV heads, MLP columns, weight and KV-cache bytes, the
        bytes it holds that other ranks hold too, and the shapes of its first layer's
        matrices."""
        return [dict(r) for r in self._layout]

    def fork(self, block_map: dict[int, int], num_blocks: int, num_swap_blocks: int, clock):
        raise ForkNotSupportedError(
            "a tensor / pipeline parallel engine keeps its KV cache in its worker processes, "
            "which a fork would have to start again: fork the same scenario on one worker"
        )

    def shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # idempotent: runs _stop_ranks once
