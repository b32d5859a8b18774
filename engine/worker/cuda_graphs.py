"""CUDA graphs for decode-only steps: launch the whole forward with one call.

A 135M-parameter model on a big GPU is not limited by FLOPs or memory bandwidth but by Python:
a decode step launches a few hundred small kernels (30 layers × norms, matmuls, rope, attention),
and each launch costs microseconds of CPU time while the GPU waits. A CUDA graph records those
launches once and replays them with a single call (vLLM does the same for decode steps).

A graph replays the *same* kernels on the *same* memory, so everything that changes from step to
step must live in fixed device buffers that are overwritten before each replay:

- the batch size is fixed per graph: graphs are captured for a few sizes (1, 2, 4, ... 32) and a
  batch is padded up to the nearest one. Padding rows copy row 0 (same token, position, slot and
  block table): they write the very same K/V values into row 0's slot, so the cache is unchanged,
  and their logits are ignored. (vLLM points padding rows at a reserved null block instead; our
  KV manager reserves none, so `pad_slot` can name one if it ever does.)
- attention's shapes depend on the context length, so each graph also has a fixed number of
  blocks per request (a power of two): all requests gather that many blocks and a mask hides the
  keys past each request's end. A longer context simply uses the next bucket's graph.
- prefill and mixed steps (variable token counts per request) run eagerly, as before.

Graphs are captured lazily, the first time a (batch size, blocks) bucket is met. `capture_fn` is
injectable so that the CPU tests can check all of this bookkeeping with an eager stand-in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.layers.attention import AttentionMetadata, DecodeGroup
from engine.scheduler_output import Phase, SchedulerOutput
from engine.utils import cdiv

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)

# capture_fn(forward) -> (replay, output): `replay()` reruns the recorded forward on the current
# contents of the static buffers and leaves its result in `output` (the same tensor every time).
CaptureFn = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def next_bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `n` rows (None: larger than any)."""
    return next((s for s in sorted(sizes) if s >= n), None)


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class GraphEntry:
    """One captured graph and the fixed buffers it reads and writes."""

    batch_size: int
    blocks_per_seq: int
    # [4 * batch + batch * blocks]: ids, positions, slots, context lengths, then block tables
    packed: torch.Tensor
    mask: torch.Tensor  # [batch, 1, 1, blocks * block_size] True = attend
    key_positions: torch.Tensor  # [blocks * block_size] 0, 1, 2, ... (to build the mask on device)
    logits_indices: torch.Tensor  # [batch] 0..batch-1: every row (padding rows are ignored later)
    meta: AttentionMetadata
    replay: Callable[[], None] | None = None
    output: torch.Tensor | None = None  # [batch, vocab] logits, rewritten by each replay

    def view(self, index: int) -> torch.Tensor:
        """Slice `index` of the packed buffer: 0 ids, 1 positions, 2 slots, 3 context lengths."""
        b = self.batch_size
        return self.packed[index * b : (index + 1) * b]

    @property
    def block_ids(self) -> torch.Tensor:
        return self.packed[4 * self.batch_size :]


@dataclass
class GraphStats:
    """How often each path ran: the selfcheck and the tests read these."""

    graph_steps: int = 0
    eager_steps: int = 0
    # (batch, blocks) in capture order
    captures: list[tuple[int, int]] = field(default_factory=list)
    padded_rows: int = 0


def cuda_capture(
    forward: Callable[[], torch.Tensor], pool=None, stream=None
) -> tuple[Callable[[], None], torch.Tensor]:
    """Record `forward` into a CUDA graph. It runs twice first on a side stream (warm-up: lazy
    initialisation and allocator state must not happen during capture), then once under capture,
    which records the kernels without running them. One side stream serves every capture of a
    runner (each new stream that runs a matmul gets a cuBLAS workspace of its own)."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph.replay, output


def eager_capture(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for CPU tests: 'replay' runs the forward eagerly into the same output tensor,
    so the static-buffer bookkeeping is exercised exactly as with a real graph."""
    output = forward().clone()

    def replay() -> None:
        output.copy_(forward())

    return replay, output


class CudaGraphRunner:
    """Decode steps through captured graphs; `prepare()` returns None for steps that run eagerly."""

    def __init__(
        self,
        model,
        kv_caches: list,
        block_size: int,
        max_model_len: int | None = None,
        capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES,
        capture_fn: CaptureFn | None = None,
        pad_slot: int | None = None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self.capture_sizes = tuple(sorted(capture_sizes))
        num_blocks = kv_caches[0][0].shape[0] if kv_caches else 0
        max_len = max_model_len or num_blocks * block_size
        self.max_blocks_per_seq = next_power_of_two(max(cdiv(max_len, block_size), 1))
        self.pad_slot = pad_slot
        if capture_fn is None:
            pool = torch.cuda.graph_pool_handle()  # all graphs share one memory pool
            stream = torch.cuda.Stream()  # and one warm-up stream
            capture_fn = lambda forward: cuda_capture(forward, pool, stream)  # noqa: E731
        self.capture_fn = capture_fn
        self.graphs: dict[tuple[int, int], GraphEntry] = {}
        self.stats = GraphStats()

    # -- which steps take the graph path ---------------------------------------------------------

    def bucket(self, sched: SchedulerOutput) -> tuple[int, int] | None:
        """(batch size, blocks per request) of the graph for this step, or None for eager:
        only steps in which every request decodes exactly one token."""
        reqs = sched.scheduled
        if not reqs or any(
            s.phase != Phase.DECODE or s.num_tokens != 1 or s.num_computed_tokens == 0 for s in reqs
        ):
            return None
        batch = next_bucket(len(reqs), self.capture_sizes)
        longest = max(s.num_computed_tokens + 1 for s in reqs)
        blocks = next_power_of_two(cdiv(longest, self.block_size))
        if batch is None or blocks > self.max_blocks_per_seq:
            return None
        return batch, blocks

    # -- static buffers ------------------------------------------------------------------------

    def host_inputs(self, sched: SchedulerOutput, batch: int, blocks: int) -> list[int]:
        """The packed buffer's contents for this step (scheduler's order), padded to `batch`."""
        bs = self.block_size
        ids, pos, slots, ctx, tables = [], [], [], [], []
        for s in sched.scheduled:
            p = s.num_computed_tokens
            ids.append(s.token_ids[0])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            used = s.block_ids[: cdiv(p + 1, bs)]
            tables.append(used + [0] * (blocks - len(used)))
        pad = batch - len(ids)
        self.stats.padded_rows += pad
        if self.pad_slot is None:  # mirror row 0: identical K/V written to the same slot
            ids, pos, slots, ctx = (x + [x[0]] * pad for x in (ids, pos, slots, ctx))
            tables += [tables[0]] * pad
        else:  # a reserved slot: position 0, context of one token, in the slot's own block
            ids, pos, ctx = ids + [0] * pad, pos + [0] * pad, ctx + [1] * pad
            slots = slots + [self.pad_slot] * pad
            tables += [[self.pad_slot // bs] + [0] * (blocks - 1)] * pad
        return ids + pos + slots + ctx + [b for row in tables for b in row]

    def new_entry(self, batch: int, blocks: int) -> GraphEntry:
        dev, keys = self.device, blocks * self.block_size
        packed = torch.zeros(4 * batch + batch * blocks, dtype=torch.long, device=dev)
        mask = torch.zeros(batch, 1, 1, keys, dtype=torch.bool, device=dev)
        entry = GraphEntry(
            batch,
            blocks,
            packed,
            mask,
            torch.arange(keys, device=dev),
            torch.arange(batch, device=dev),
            meta=None,
        )  # type: ignore[arg-type]
        # One decode group over all rows with fixed shapes: gather `blocks` blocks per request,
        # keep all `keys` keys, and let the mask hide those past each request's end.
        group = DecodeGroup(
            rows=slice(0, batch),
            num_seqs=batch,
            block_ids=entry.block_ids,
            padded_len=keys,
            context_len=keys,
            mask=mask,
        )
        entry.meta = AttentionMetadata(
            slot_mapping=entry.view(2),
            block_size=self.block_size,
            decode_groups=[group],
            prefills=[],
        )
        return entry

    def forward(self, entry: GraphEntry) -> torch.Tensor:
        """What the graph records: the mask from the context lengths, then the model forward."""
        torch.lt(
            entry.key_positions.unsqueeze(0),
            entry.view(3).unsqueeze(1),
            out=entry.mask.view(entry.batch_size, -1),
        )
        return self.model.forward(
            entry.view(0), entry.view(1), self.kv_caches, entry.meta, entry.logits_indices
        )

    # -- one step ------------------------------------------------------------------------------

    def prepare(self, sched: SchedulerOutput) -> GraphEntry | None:
        """Fill the static buffers for a graph step (capturing its graph the first time)."""
        key = self.bucket(sched)
        if key is None:
            self.stats.eager_steps += 1
            return None
        entry = self.graphs.get(key)
        fresh = entry is None
        if fresh:
            entry = self.new_entry(*key)
        host = torch.tensor(self.host_inputs(sched, *key), dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        entry.packed.copy_(host, non_blocking=True)
        if fresh:  # capture with this step's inputs in place: the warm-up writes the right K/V
            entry.replay, entry.output = self.capture_fn(lambda: self.forward(entry))
            self.graphs[key] = entry
            self.stats.captures.append(key)
        self.stats.graph_steps += 1
        return entry

    def run(self, entry: GraphEntry, num_rows: int) -> torch.Tensor:
        """Replay; the logits of the real rows (a copy: the next replay overwrites the output)."""
        entry.replay()
        return entry.output[:num_rows].clone()


def configure_engine(engine, enforce_eager: bool | None = None, **graph_args) -> str:
    """Turn graphs on for an EngineCore's runner when the device is CUDA and eager mode is not
    forced (default: the engine's `config.enforce_eager`). Returns what was decided, in words."""
    if enforce_eager is None:
        enforce_eager = engine.config.enforce_eager
    runner = engine.executor.worker.runner
    if enforce_eager:
        runner.enable_cuda_graphs(False)
        return "off (enforce_eager)"
    if engine.device.type != "cuda" and "capture_fn" not in graph_args:
        return f"off (CUDA graphs need CUDA; device is {engine.device.type})"
    runner.enable_cuda_graphs(True, max_model_len=engine.max_model_len, **graph_args)
    sizes = runner.cuda_graphs.capture_sizes
    return f"on for decode steps, batch sizes {', '.join(map(str, sizes))} (captured on first use)"
