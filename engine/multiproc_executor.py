"""A multi-process executor on torch.distributed: tensor parallel and pipeline parallel.

    engine core (one scheduler)
        │  the step's SchedulerOutput, pickled once, sent down a pipe to every worker
        ▼
    worker rank 0 … rank N-1   (one process each, spawned; gloo on CPU, NCCL on CUDA)
        │  tensor parallel: all-reduce inside each layer; pipeline parallel: hidden states
        │  sent stage to stage
        ▼
    the output rank (first worker of the last stage) samples and returns the new tokens;
    every rank returns its timings (compute vs communication)

Rank layout, as vLLM numbers it: rank = pp_rank * tp + tp_rank, so the workers of one pipeline
stage are consecutive and form one tensor-parallel group.

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

Rendezvous is torchrun's: the workers get MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK
in their environment and call init_process_group("env://"). MASTER_ADDR/MASTER_PORT are read
from this process's environment (default 127.0.0.1 and a free port). The control channel (the
step's SchedulerOutput down, tokens and timings up) is a local pipe per worker, so all ranks run
on this machine; running ranks on other machines would need that channel over the network too.

Failure: every receive has a timeout and checks that every worker is alive, so a worker that
dies (or raises) makes the engine raise ExecutorDiedError (a RuntimeError) instead of hanging.
Workers are daemon processes, exit when their parent dies (a watchdog thread on the parent pid,
and an EOF on their pipe), and are stopped by `shutdown()`, by garbage collection of the
executor and at interpreter exit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing.connection
import os
import pickle
import socket
import threading
import time
import traceback
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.config import DEFAULT_CPU_KV_CACHE_BYTES
from engine.executor import Executor, ExecutorDiedError
from engine.model_runner import ModelRunner, ModelRunnerOutput
from engine.models.llama import LlamaConfig, LlamaModel, linear, rms_norm
from engine.scheduler_output import SchedulerOutput
from engine.worker import Worker

logger = logging.getLogger(__name__)

# Each worker is a whole Python process with its own copy of the replicated weights; on a CPU more
# than this many is a mistake, not a plan. On CUDA the limit is the number of GPUs.
MAX_CPU_WORLD_SIZE = 16
STARTUP_TIMEOUT_S = 300.0  # spawn + import torch + load weights, per engine start
STEP_TIMEOUT_S = 600.0  # one step (a worker silent this long is treated as hung)
COLLECTIVE_TIMEOUT_S = 600.0  # torch.distributed's own timeout for a collective
POLL_S = 0.05


# -- the plan: which rank holds what -------------------------------------------------------------


def valid_tensor_parallel_sizes(cfg: LlamaConfig) -> list[int]:
    """tp sizes this model can be cut into: tp divides the query heads and the MLP width, and
    either divides the KV heads (split) or is a multiple of them (replicated)."""
    return [
        tp
        for tp in range(1, cfg.num_heads + 1)
        if cfg.num_heads % tp == 0
        and cfg.intermediate_size % tp == 0
        and (cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0)
    ]


def check_parallel_sizes(
    cfg: LlamaConfig, tp: int, pp: int, device: torch.device | None = None
) -> None:
    """Refuse sizes that cannot work, before any process starts (ValueError, with what works)."""
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    valid = valid_tensor_parallel_sizes(cfg)
    if tp not in valid:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide this model ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}); "
            f"sizes that work: {', '.join(map(str, valid))}"
        )
    if pp > cfg.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is more stages than the model's {cfg.num_layers} layers; "
            f"sizes that work: 1 to {cfg.num_layers}"
        )
    world = tp * pp
    if device is not None and device.type == "cuda":
        count = torch.cuda.device_count()
        if world > count:
            raise ValueError(
                f"tensor_parallel_size × pipeline_parallel_size = {world} workers, but only "
                f"{count} CUDA device(s): one worker per GPU"
            )
    elif world > MAX_CPU_WORLD_SIZE:
        raise ValueError(
            f"tensor_parallel_size × pipeline_parallel_size = {world} CPU worker processes; at "
            f"most {MAX_CPU_WORLD_SIZE} (each one is a process with its own weights)"
        )


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Consecutive layers per stage, as even as possible; earlier stages take the remainder
    (the last stage also runs lm_head)."""
    base, extra = divmod(num_layers, pp)
    stages, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def head_ranges(cfg: LlamaConfig, tp: int, tp_rank: int) -> tuple[range, range]:
    """The query heads and the KV heads tp rank `tp_rank` holds. Query head j reads KV head
    j // (num_heads / num_kv_heads), so a rank's query heads read exactly its KV heads."""
    q_per_rank = cfg.num_heads // tp
    q = range(tp_rank * q_per_rank, (tp_rank + 1) * q_per_rank)
    if cfg.num_kv_heads >= tp:
        kv_per_rank = cfg.num_kv_heads // tp
        kv = range(tp_rank * kv_per_rank, (tp_rank + 1) * kv_per_rank)
    else:  # more ranks than KV heads: each KV head lives on tp / num_kv_heads ranks
        head = tp_rank // (tp // cfg.num_kv_heads)
        kv = range(head, head + 1)
    return q, kv


def mlp_range(cfg: LlamaConfig, tp: int, tp_rank: int) -> range:
    width = cfg.intermediate_size // tp
    return range(tp_rank * width, (tp_rank + 1) * width)


def shard_weights(
    cfg: LlamaConfig, weights: dict[str, torch.Tensor], tp: int, tp_rank: int, pp: int, pp_rank: int
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """This rank's slice of the weight dict (LlamaModel's names, layers renumbered from 0) and the
    config that describes it (its layers, heads and MLP width)."""
    d = cfg.head_dim
    layers = stage_layers(cfg.num_layers, pp)[pp_rank]
    q_heads, kv_heads = head_ranges(cfg, tp, tp_rank)
    inter = mlp_range(cfg, tp, tp_rank)
    qs, kvs, ms = (
        slice(q_heads.start * d, q_heads.stop * d),
        slice(kv_heads.start * d, kv_heads.stop * d),
        slice(inter.start, inter.stop),
    )
    split = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]

    def heads_of(fused: torch.Tensor) -> torch.Tensor:  # rows of q, k, v for this rank's heads
        q, k, v = fused.split(split)
        return torch.cat([q[qs], k[kvs], v[kvs]]).contiguous()

    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embed"] = weights["embed"]  # replicated over the stage's tp ranks
    for local, i in enumerate(layers):
        out[f"{local}.input_norm"] = weights[f"{i}.input_norm"]
        out[f"{local}.qkv"] = heads_of(weights[f"{i}.qkv"])  # column-parallel
        if f"{i}.qkv_bias" in weights:
            out[f"{local}.qkv_bias"] = heads_of(weights[f"{i}.qkv_bias"])
        out[f"{local}.o"] = weights[f"{i}.o"][:, qs].contiguous()  # row-parallel
        out[f"{local}.post_norm"] = weights[f"{i}.post_norm"]
        gate, up = weights[f"{i}.gate_up"].chunk(2)
        out[f"{local}.gate_up"] = torch.cat([gate[ms], up[ms]]).contiguous()  # column-parallel
        out[f"{local}.down"] = weights[f"{i}.down"][:, ms].contiguous()  # row-parallel
    if pp_rank == pp - 1:
        out["final_norm"] = weights["final_norm"]
        out["lm_head"] = weights["lm_head"]  # replicated (tied: the same tensor as embed)
    local_cfg = dataclasses.replace(
        cfg,
        num_layers=len(layers),
        num_heads=len(q_heads),
        num_kv_heads=len(kv_heads),
        intermediate_size=len(inter),
    )
    return local_cfg, out


# -- communication, counted ----------------------------------------------------------------------


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


# -- the sharded model, runner and worker --------------------------------------------------------


class ShardedLlamaModel(LlamaModel):
    """LlamaModel on one rank's slice: the attention and MLP outputs are partial sums, made whole
    by one all-reduce each; the first stage embeds, the others receive hidden states, the last
    computes the logits (only on the output rank: lm_head is replicated, one copy suffices)."""

    comm: Comm
    is_first_stage: bool
    is_last_stage: bool
    computes_logits: bool
    hidden_size: int

    def attention(self, i, x, cos, sin, kv_cache, attn_meta) -> torch.Tensor:
        return self.comm.all_reduce(super().attention(i, x, cos, sin, kv_cache, attn_meta))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(super().mlp(i, x))

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_caches, attn_meta, logits_indices):
        """LlamaModel.forward over this stage's layers; None where this rank has no logits."""
        cfg, w = self.cfg, self.w
        cos, sin = self.rope_cos_sin(positions)
        if self.is_first_stage:
            h = F.embedding(input_ids, w["embed"])
        else:
            h = self.comm.recv((input_ids.shape[0], self.hidden_size), self.dtype, self.device)
        for i in range(cfg.num_layers):
            h = h + self.attention(
                i, rms_norm(h, w[f"{i}.input_norm"], cfg.rms_norm_eps), cos, sin, kv_caches[i],
                attn_meta,
            )  # fmt: skip
            h = h + self.mlp(i, rms_norm(h, w[f"{i}.post_norm"], cfg.rms_norm_eps))
        if not self.is_last_stage:
            self.comm.send(h)
            return None
        if not self.computes_logits:
            return None
        h = rms_norm(h[logits_indices], w["final_norm"], cfg.rms_norm_eps)
        return linear(h, w["lm_head"]).float()


class ParallelModelRunner(ModelRunner):
    """Every rank runs the step's forward; only the output rank samples (and keeps the samplers'
    per-request state, e.g. seeded generators)."""

    is_output_rank: bool = False

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.is_output_rank:
            return super().execute_model(sched)
        swap_seconds = self.swap_blocks(sched)
        if sched.is_empty:
            return ModelRunnerOutput({}, {"swap": swap_seconds})
        t0 = time.perf_counter()
        inputs = self.prepare_inputs(sched)
        t1 = time.perf_counter()
        self.model.forward(
            inputs.input_ids,
            inputs.positions,
            self.kv_caches,
            inputs.attn_meta,
            inputs.logits_indices,
        )
        self._sync()
        t2 = time.perf_counter()
        timings = {"prepare_inputs": t1 - t0, "forward": t2 - t1, "sample": 0.0}
        return ModelRunnerOutput({}, {**timings, "swap": swap_seconds})


class ParallelWorker(Worker):
    """A Worker whose model is this rank's shard."""

    def __init__(self, *args, rank: int, tp: int, pp: int, comm: Comm, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank, self.tp, self.pp, self.comm = rank, tp, pp, comm
        self.tp_rank, self.pp_rank = rank % tp, rank // tp
        self.is_output_rank = rank == tp * (pp - 1)  # first worker of the last stage (vLLM's)

    def load_model(self) -> None:
        full = LlamaModel.from_pretrained(self.model_dir, device=self.device, dtype=self.dtype)
        self.full_cfg = full.cfg
        local_cfg, weights = shard_weights(
            full.cfg, full.w, self.tp, self.tp_rank, self.pp, self.pp_rank
        )
        del full
        model = ShardedLlamaModel(local_cfg, weights, self.device, self.dtype)
        model.comm = self.comm
        model.is_first_stage = self.pp_rank == 0
        model.is_last_stage = self.pp_rank == self.pp - 1
        model.computes_logits = self.is_output_rank
        model.hidden_size = self.full_cfg.hidden_size
        self.model = model.with_kernels(self.kernels)

    def initialize_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        super().initialize_cache(num_blocks, num_swap_blocks)
        runner = self.runner
        self.runner = ParallelModelRunner(
            runner.model, runner.kv_caches, runner.block_size, runner.swap_caches
        )
        self.runner.is_output_rank = self.is_output_rank

    def layout(self) -> dict:
        """What this rank holds (computed from its tensors). replicated_bytes: what other ranks
        hold too (embedding, lm_head and norms when tp > 1; K/V rows when tp > num_kv_heads)."""
        cfg, full = self.model.cfg, self.full_cfg
        layers = stage_layers(full.num_layers, self.pp)[self.pp_rank]
        q, kv = head_ranges(full, self.tp, self.tp_rank)
        inter = mlp_range(full, self.tp, self.tp_rank)
        replicated = [
            t
            for name, t in self.model.w.items()
            if self.tp > 1 and (name in ("embed", "lm_head", "final_norm") or "norm" in name)
        ]
        seen, replicated_bytes = set(), 0
        for t in replicated:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                replicated_bytes += t.numel() * t.element_size()
        if self.tp > full.num_kv_heads:  # this rank's K and V rows are on other ranks too
            kv_rows = 2 * cfg.num_kv_heads * cfg.head_dim
            for i in range(cfg.num_layers):
                for name in (f"{i}.qkv", f"{i}.qkv_bias"):
                    if name in self.model.w:
                        t = self.model.w[name]
                        replicated_bytes += kv_rows * (t.numel() // t.shape[0]) * t.element_size()
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "is_output_rank": self.is_output_rank,
            "layers": [layers.start, layers.stop],
            "q_heads": [q.start, q.stop],
            "kv_heads": [kv.start, kv.stop],
            "mlp_columns": [inter.start, inter.stop],
            "holds_embedding": "embed" in self.model.w,
            "holds_lm_head": "lm_head" in self.model.w,
            "weight_bytes": self.model.weight_bytes(),
            "replicated_bytes": replicated_bytes,
            "shapes": {
                name.split(".", 1)[-1]: list(t.shape)
                for name, t in self.model.w.items()
                if name.startswith("0.") or name in ("embed", "lm_head")
            },
            "num_layers": cfg.num_layers,
            "kv_bytes_per_block": self.bytes_per_block,
        }


# -- the worker process --------------------------------------------------------------------------


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


def _worker_main(rank: int, tp: int, pp: int, env: dict, spec: dict, conn, threads: int) -> None:
    """One rank: join the process group, load the shard, then serve the engine's requests."""
    _die_with_parent()
    os.environ.update(env)  # torchrun's names: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, ...
    try:
        if threads:
            torch.set_num_threads(threads)
        device = spec["device"]
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method="env://",
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        tp_group = None
        for stage in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp))) if tp > 1 else None
            if stage == rank // tp:
                tp_group = group
        comm = Comm(rank, tp, pp, tp_group)
        worker = ParallelWorker(
            spec["model_dir"],
            device,
            spec["dtype"],
            spec["block_size"],
            spec["kernels"],
            rank=rank,
            tp=tp,
            pp=pp,
            comm=comm,
        )
        worker.load_model()
        conn.send(("ok", None))
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # the engine is gone
                break
            if kind == "shutdown":
                break
            if kind == "num_blocks":
                max_model_len, cache_args = payload
                conn.send(("ok", worker.determine_num_blocks(max_model_len, **cache_args)))
            elif kind == "init_cache":
                worker.initialize_cache(*payload)
                conn.send(("ok", {**worker.layout(), "kv_cache_bytes": worker.kv_cache_bytes()}))
            elif kind == "step":
                sched = pickle.loads(payload)
                comm.reset()
                start = time.perf_counter()
                output = worker.execute_model(sched)
                total = time.perf_counter() - start
                output.workers = [
                    {
                        "rank": rank,
                        "tp_rank": rank % tp,
                        "pp_rank": rank // tp,
                        "step_s": total,
                        "compute_s": max(total - comm.seconds, 0.0),
                        "comm_s": comm.seconds,
                        "all_reduce_count": comm.all_reduce_count,
                        "all_reduce_bytes": comm.all_reduce_bytes,
                        "p2p_bytes": comm.p2p_bytes,
                    }
                ]
                conn.send(("ok", output if worker.is_output_rank else output.workers[0]))
    except BaseException as error:  # noqa: BLE001 — report anything to the engine, then exit
        try:
            conn.send(("error", (type(error).__name__, str(error), traceback.format_exc())))
        except (OSError, ValueError):
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


# -- the executor --------------------------------------------------------------------------------


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop_workers(processes: list, conns: list) -> None:
    """Ask each worker to leave, then terminate, then kill whatever is left; reap them all."""
    for conn in conns:
        try:
            conn.send(("shutdown", None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for p in processes:
        p.join(timeout=max(deadline - time.monotonic(), 0.0))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass


class MultiprocExecutor(Executor):
    """One worker process per rank; the same step to all; the output rank's tokens returned."""

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
    ):
        """Validates everything it can (sizes, devices, the rendezvous port) and starts nothing:
        the processes start in initialize()."""
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        check_parallel_sizes(model_config, tp, pp, device)
        self.tp, self.pp, self.world_size = tp, pp, tp * pp
        self.model_config = model_config
        self.spec = dict(
            model_dir=str(model_dir), device=device, dtype=dtype, block_size=block_size,
            kernels=kernels,
        )  # fmt: skip
        self.master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or os.environ.get("MASTER_PORT")
        if port is not None:
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
        self.num_blocks = 0
        self.output_rank = tp * (pp - 1)
        self.processes: list = []
        self.conns: list = []
        self._layout: list[dict] = []
        self._finalizer = None
        self._dead: str | None = None

    # -- processes ---------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        port = self.master_port or _free_port(self.master_addr)
        threads = 0
        if self.spec["device"].type == "cpu":  # share the cores, do not oversubscribe them
            threads = max(1, torch.get_num_threads() // self.world_size)
        for rank in range(self.world_size):
            env = {
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world_size),
            }
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.tp, self.pp, env, self.spec, child, threads),
                name=f"engine-worker-{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.processes.append(p)
            self.conns.append(parent)
        self.master_port = port
        # Runs on shutdown(), when the executor is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.conns)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _fail(self, message: str) -> None:
        """Stop every worker and raise. A dead worker is named first: when one dies, its peers
        fail in their next collective, and the cause is the death, not their error."""
        dead = [
            f"worker rank {rank} (pid {p.pid}) died (exit code {p.exitcode})"
            for rank, p in enumerate(self.processes)
            if not p.is_alive() and p.exitcode != 0
        ]
        if dead and "died" not in message:
            message = "; ".join(dead) + f"; then {message}"
        self._dead = message
        self.shutdown()
        raise ExecutorDiedError(message + "; all workers were stopped")

    def _gather(self, timeout: float, what: str) -> list:
        """One reply from every worker. Raises ExecutorDiedError if a worker dies, reports an
        error, or stays silent past `timeout` (then every worker is stopped)."""
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in replies]
            ready = multiprocessing.connection.wait(
                [self.conns[r] for r in pending] + [self.processes[r].sentinel for r in pending],
                timeout=POLL_S * 10,
            )
            for rank in pending:
                conn, process = self.conns[rank], self.processes[rank]
                if conn in ready or conn.poll():
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        status, payload = "died", None
                    if status == "ok":
                        replies[rank] = payload
                        continue
                    if status == "error":
                        name, text, _ = payload
                        logger.error("worker rank %d failed:\n%s", rank, payload[2])
                        self._fail_with(name, f"worker rank {rank} failed during {what}: {text}")
                if not process.is_alive():
                    self._fail(
                        f"worker rank {rank} (pid {process.pid}) died during {what} "
                        f"(exit code {process.exitcode})"
                    )
            if time.monotonic() > deadline:
                self._fail(f"workers {pending} did not answer within {timeout:.0f} s during {what}")
        return [replies[r] for r in range(self.world_size)]

    def _fail_with(self, error_name: str, message: str) -> None:
        """A worker raised: configuration errors (ValueError, e.g. a cache too small) stay
        ValueErrors; anything else is fatal for the executor."""
        if error_name in ("ValueError", "CacheTooSmallError"):
            self._dead = message
            self.shutdown()
            raise ValueError(message)
        self._fail(message)

    def _broadcast(self, kind: str, payload) -> None:
        if self._dead is not None:
            raise ExecutorDiedError(f"the executor is stopped: {self._dead}")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((kind, payload))
            except (OSError, ValueError):
                self._fail(f"worker rank {rank} is gone (its pipe is closed)")

    # -- Executor ------------------------------------------------------------------------------

    def initialize(self, max_model_len: int, num_swap_blocks: int | None = 0, **cache_args) -> int:
        """Start the workers; each sizes its own KV cache for its heads and layers; the engine
        uses the smallest block count, so that every rank can hold every block the scheduler
        hands out. On CUDA each worker profiles its own GPU (gpu_memory_utilization is per GPU,
        as in vLLM); on a CPU the workers share one memory, so the byte budget (kv_cache_memory,
        default DEFAULT_CPU_KV_CACHE_BYTES) is split evenly among them."""
        if self.spec["device"].type == "cpu" and cache_args.get("num_kv_blocks") is None:
            budget = cache_args.get("kv_cache_memory") or DEFAULT_CPU_KV_CACHE_BYTES
            cache_args = {**cache_args, "kv_cache_memory": budget // self.world_size}
        self._start()
        self._gather(STARTUP_TIMEOUT_S, "start-up")
        self._broadcast("num_blocks", (max_model_len, cache_args))
        self.num_blocks = min(self._gather(STARTUP_TIMEOUT_S, "KV cache sizing"))
        self.num_swap_blocks = self.num_blocks if num_swap_blocks is None else num_swap_blocks
        self._broadcast("init_cache", (self.num_blocks, self.num_swap_blocks))
        self._layout = self._gather(STARTUP_TIMEOUT_S, "KV cache allocation")
        return self.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast("step", payload)
        replies = self._gather(STEP_TIMEOUT_S, f"step {scheduler_output.step}")
        output: ModelRunnerOutput = replies[self.output_rank]
        workers = [r.workers[0] if isinstance(r, ModelRunnerOutput) else r for r in replies]
        round_trip = time.perf_counter() - start
        for w in workers:
            w["control_bytes"] = len(payload)  # the SchedulerOutput each worker received
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

    def shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # idempotent: runs _stop_workers once


def describe_layout(layout: list[dict]) -> str:
    """A few lines for the CLI: which rank holds what."""
    lines = []
    for r in layout:
        lines.append(
            f"rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}): layers "
            f"{r['layers'][0]}-{r['layers'][1] - 1}, query heads {r['q_heads'][0]}-"
            f"{r['q_heads'][1] - 1}, KV heads {r['kv_heads'][0]}-{r['kv_heads'][1] - 1}, "
            f"weights {r['weight_bytes'] / 2**20:.1f} MiB "
            f"({r['replicated_bytes'] / 2**20:.1f} MiB replicated), "
            f"KV cache {r['kv_cache_bytes'] / 2**20:.1f} MiB"
        )
    return "\n".join(lines)


def all_reduces_per_step(model_config: LlamaConfig, tp: int, pp: int) -> int:
    """Derived: 2 all-reduces per layer on every rank (after o, after down) when tp > 1; each
    rank runs its stage's layers."""
    if tp == 1:
        return 0
    return 2 * math.ceil(model_config.num_layers / pp)
