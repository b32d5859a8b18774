"""CUDA graphs for decode steps (engine/worker/cuda_graphs.py).

On a CPU the capture is replaced by an eager stand-in that records what would be captured, so
the bookkeeping is tested for real: which steps take the graph path, the batch-size and
context buckets, padding, the static buffers, and that greedy outputs do not change. The same
test on CUDA captures real graphs; it skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import SamplingParams as SP
from engine.scheduler_output import Phase, ScheduledRequest, SchedulerOutput
from engine.worker.cuda_graphs import (
    CudaGraphRunner,
    configure_engine,
    eager_capture,
    next_bucket,
    next_power_of_two,
)

BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "The KV cache keeps",
    "블록 테이블은",
    "def step(self):",
    "Hello there, how are",
    "1, 2, 3,",
]


def decode(rid: str, computed: int, blocks: list[int], token: int = 7) -> ScheduledRequest:
    return ScheduledRequest(rid, Phase.DECODE, 1, computed, [token], blocks, SP(), True)


def step(*reqs: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(
        step=0, scheduled=list(reqs), unscheduled={}, preempted=[], token_budget=64
    )


class FakeModel:
    """Records the forward's inputs; returns logits whose row i is the row's input id."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls = []

    def forward(self, ids, positions, kv_caches, meta, logits_indices):
        self.calls.append((ids.clone(), positions.clone(), meta.slot_mapping.clone()))
        return ids[logits_indices].float().unsqueeze(1).repeat(1, 3)


class RecordingCapture:
    def __init__(self):
        self.captured = 0

    def __call__(self, forward):
        self.captured += 1
        return eager_capture(forward)


@pytest.fixture
def graph_runner():
    caches = [(torch.zeros(16, BLOCK, 1, 1), torch.zeros(16, BLOCK, 1, 1))]
    capture = RecordingCapture()
    runner = CudaGraphRunner(
        FakeModel(), caches, BLOCK, max_model_len=64, capture_sizes=(1, 2, 4, 8), capture_fn=capture
    )
    return runner, capture


def test_buckets():
    sizes = (1, 2, 4, 8, 16, 32)
    assert [next_bucket(n, sizes) for n in (1, 2, 3, 5, 9, 32, 33)] == [1, 2, 4, 8, 16, 32, None]
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]


def test_only_decode_only_steps_take_the_graph_path(graph_runner):
    runner, _ = graph_runner
    assert runner.bucket(step(decode("a", 5, [3, 4]))) == (1, 2)  # 6 tokens: 2 blocks of 4
    assert runner.bucket(step(decode("a", 5, [3, 4]), decode("b", 1, [9]))) == (2, 2)
    assert runner.bucket(step(*[decode(str(i), 2, [i]) for i in range(3)])) == (4, 1)
    prefill = ScheduledRequest("p", Phase.PREFILL, 3, 0, [1, 2, 3], [5], SP(), True)
    assert runner.bucket(step(decode("a", 5, [3, 4]), prefill)) is None  # mixed step: eager
    assert runner.bucket(step(prefill)) is None
    assert runner.bucket(step()) is None
    assert runner.bucket(step(*[decode(str(i), 2, [i]) for i in range(9)])) is None  # > 8 rows
    assert runner.bucket(step(decode("long", 63, list(range(16))))) == (1, 16)
    assert runner.max_blocks_per_seq == 16


def test_padding_mirrors_row_zero_and_fills_the_static_buffers(graph_runner):
    runner, capture = graph_runner
    sched = step(
        decode("a", 5, [3, 4], token=11),
        decode("b", 1, [9], token=22),
        decode("c", 2, [6], token=33),
    )
    entry = runner.prepare(sched)
    assert (entry.batch_size, entry.blocks_per_seq) == (4, 2) and capture.captured == 1
    assert entry.view(0).tolist() == [11, 22, 33, 11]  # ids; the padding row copies row 0
    assert entry.view(1).tolist() == [5, 1, 2, 5]  # positions
    assert entry.view(2).tolist() == [4 * 4 + 1, 9 * 4 + 1, 6 * 4 + 2, 4 * 4 + 1]  # slots
    assert entry.view(3).tolist() == [6, 2, 3, 6]  # context lengths
    assert entry.block_ids.view(4, 2).tolist() == [[3, 4], [9, 0], [6, 0], [3, 4]]
    assert entry.mask.view(4, -1).tolist()[1] == [True, True] + [False] * 6
    assert entry.mask.view(4, -1).sum(1).tolist() == [6, 2, 3, 6]
    logits = runner.run(entry, num_rows=3)
    assert logits[:, 0].tolist() == [11, 22, 33]  # padding rows dropped, scheduler order kept
    assert runner.stats.padded_rows == 1 and runner.stats.graph_steps == 1


def test_a_bucket_is_captured_once_and_replays_the_new_inputs(graph_runner):
    runner, capture = graph_runner
    first = runner.prepare(step(decode("a", 5, [3, 4], token=11)))
    runner.run(first, 1)
    again = runner.prepare(step(decode("a", 6, [3, 4], token=12)))
    assert again is first and capture.captured == 1
    assert runner.run(again, 1)[0, 0].item() == 12 and again.view(1).tolist() == [6]
    assert runner.prepare(step(decode("a", 8, [3, 4, 5], token=13))).blocks_per_seq == 4
    assert capture.captured == 2 and runner.stats.captures == [(1, 2), (1, 4)]
    assert (
        runner.prepare(step(ScheduledRequest("p", Phase.PREFILL, 2, 0, [1, 2], [5], SP(), True)))
        is None
    )
    assert runner.stats.eager_steps == 1 and runner.stats.graph_steps == 3


def test_a_reserved_pad_slot_is_used_when_given():
    caches = [(torch.zeros(16, BLOCK, 1, 1), torch.zeros(16, BLOCK, 1, 1))]
    runner = CudaGraphRunner(
        FakeModel(),
        caches,
        BLOCK,
        64,
        capture_sizes=(4,),
        capture_fn=eager_capture,
        pad_slot=15 * BLOCK,
    )
    entry = runner.prepare(step(decode("a", 5, [3, 4], token=11)))
    assert entry.view(2).tolist() == [17] + [60] * 3 and entry.view(3).tolist() == [6, 1, 1, 1]
    assert entry.block_ids.view(4, 2).tolist()[1:] == [[15, 0]] * 3


def test_graphs_need_cuda_unless_a_capture_is_injected(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), device="cpu", num_kv_blocks=32, max_model_len=128)
    assert "need CUDA" in configure_engine(llm.engine)
    assert configure_engine(llm.engine, enforce_eager=True) == "off (enforce_eager)"
    with pytest.raises(ValueError, match="CUDA"):
        llm.engine.executor.worker.runner.enable_cuda_graphs(True)
    assert llm.engine.executor.worker.runner.cuda_graphs is None


def run_engine(model_dir, device: str, capture_fn=None, enforce_eager: bool = False):
    llm = LLM(
        model=str(model_dir),
        device=device,
        dtype="float32",
        num_kv_blocks=40,
        max_model_len=160,
        max_num_batched_tokens=32,
    )
    if capture_fn is not None or device == "cuda":
        args = {"capture_fn": capture_fn} if capture_fn else {}
        configure_engine(llm.engine, enforce_eager=enforce_eager, **args)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], llm.engine.executor.worker.runner.cuda_graphs


def test_greedy_outputs_are_unchanged_by_the_graph_path_on_cpu(tiny_model_dir):
    eager, _ = run_engine(tiny_model_dir, "cpu")
    capture = RecordingCapture()
    graphed, graphs = run_engine(tiny_model_dir, "cpu", capture_fn=capture)
    assert graphed == eager
    # 5 prompts: batches of 5 pad to 8, later fewer; prefill chunks (budget 32) stay eager
    assert (
        graphs.stats.graph_steps > 0
        and graphs.stats.eager_steps > 0
        and graphs.stats.padded_rows > 0
    )
    assert capture.captured == len(graphs.graphs) == len(set(graphs.stats.captures))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: real graph capture and replay"
)
def test_real_cuda_graphs_keep_greedy_outputs(tiny_model_dir):
    eager, _ = run_engine(tiny_model_dir, "cuda", enforce_eager=True)
    graphed, graphs = run_engine(tiny_model_dir, "cuda")
    assert graphs is not None and graphs.stats.graph_steps > 0
    assert graphed == eager
