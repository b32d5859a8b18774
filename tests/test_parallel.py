"""The multi-process executor (engine/executor/multiproc.py) on the tiny model: tensor and
pipeline parallel give tp 1's greedy tokens under prefix caching, chunked prefill and
preemption; per-rank weights add up; bad sizes are refused before any process starts; a dead
worker makes the engine raise; no worker outlives the engine.

Each engine here spawns worker processes (each imports torch), so the tests are few."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import threading
import time

import pandas as pd
import psutil
import pytest
import torch
from _tiny import TINY_VOCAB_SIZE, run_engine

from engine import SamplingParams
from engine.executor.abstract import ExecutorDiedError
from engine.layers.sharding import check_parallel_sizes, head_ranges, valid_tensor_parallel_sizes
from engine.models.config import LlamaConfig
from engine.models.llama import LlamaModel, shard_weights

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
# A cache of 8 blocks of 16 tokens and a 24-token budget: chunked prefill and preemption happen.
SMALL = dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24, kernels="torch")


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    out = {
        k: torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=g).tolist()
        for k, n in {"a": 5, "b": 17, "c": 40, "d": 1, "e": 33, "f": 90}.items()
    }
    out["g"] = out["c"][:32] + [5, 6, 7]  # shares two full blocks with "c": a prefix-cache hit
    return out


def generate(engine):
    for rid, prompt in prompts().items():
        engine.add_request(prompt_token_ids=prompt, sampling_params=GREEDY, request_id=rid)
    records, final, _ = run_engine(engine)
    return records, {rid: out.token_ids for rid, out in final.items()}


def logprobs_of(engine) -> dict[str, list[float]]:
    """Each request's chosen-token logprobs and its top-3 logprobs, flattened."""
    return {
        rid: [
            value
            for entry in engine.get_request(rid).output_logprobs
            for value in (entry["logprob"], *sorted(entry["top_logprobs"].values()))
        ]
        for rid in prompts()
    }


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


@pytest.fixture(scope="module")
def reference(make_engine):
    """tp 1 (the in-process executor) on the same schedule."""
    engine = make_engine(**SMALL)
    records, tokens = generate(engine)
    assert engine.scheduler.num_preemptions > 0
    assert any(s.phase == "chunked_prefill" for r in records for s in r.scheduled)
    assert sum(r.prefix_cache_hits for r in records) > 0
    assert all(not r.workers for r in records)
    return tokens, engine.weight_bytes(), engine.model_config, logprobs_of(engine)


def replicated_bytes(cfg: LlamaConfig, tp: int, pp: int) -> int:
    """What the layout states is held more than once, from the config alone (float32): with
    tp > 1 every rank of a stage holds its embedding / lm_head and norms whole; with pp > 1 the
    tied embedding is on the first stage and again (as lm_head) on the last; with tp > KV heads
    each KV head's K and V rows are on several ranks."""
    h = cfg.hidden_size
    embed = cfg.vocab_size * h * 4
    norms = (2 * cfg.num_layers + 1) * h * 4
    extra = (tp - 1) * (embed * pp + norms)  # each stage's extra copies of its replicated parts
    if pp > 1:
        extra += embed  # the tied matrix on two stages
    if tp > cfg.num_kv_heads:  # K and V rows of each KV head on tp / num_kv_heads ranks
        kv_rows = 2 * cfg.num_kv_heads * cfg.head_dim
        extra += (tp // cfg.num_kv_heads - 1) * kv_rows * h * 4 * cfg.num_layers
    return extra


@pytest.mark.parametrize(
    "tp, pp", [(2, 1), (1, 2), (4, 1)], ids=["tp2", "pp2", "tp4_kv_replicated"]
)
def test_parallel_greedy_equals_tp1_and_layout_adds_up(make_engine, reference, tp, pp):
    ref_tokens, ref_bytes, cfg, ref_logprobs = reference
    engine = make_engine(**SMALL, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    pids = engine.executor.worker_pids()
    assert len(alive(pids)) == tp * pp
    records, tokens = generate(engine)
    assert tokens == ref_tokens
    # the logits agree within float tolerance (the all-reduce sums in another order)
    for rid, values in logprobs_of(engine).items():
        assert len(values) == 12 * 4  # 12 tokens × (chosen + top 3)
        assert values == pytest.approx(ref_logprobs[rid], abs=1e-4), rid
    assert engine.scheduler.num_preemptions > 0

    # every rank reports every step; 2 all-reduces per layer it runs when tp > 1
    layers_per_stage = cfg.num_layers // pp
    for record in records:
        if not record.scheduled:
            continue
        assert [w["rank"] for w in record.workers] == list(range(tp * pp))
        for w in record.workers:
            assert w["all_reduce_count"] == (2 * layers_per_stage if tp > 1 else 0)
            hidden_bytes = record.total_tokens * cfg.hidden_size * 4
            assert w["all_reduce_bytes"] == w["all_reduce_count"] * hidden_bytes
            assert w["p2p_bytes"] == (hidden_bytes if pp > 1 else 0)
            assert w["compute_s"] >= 0 and w["comm_s"] >= 0

    layout = engine.executor.layout()
    assert sum(r["weight_bytes"] for r in layout) == ref_bytes + replicated_bytes(cfg, tp, pp)
    assert engine.weight_bytes() == sum(r["weight_bytes"] for r in layout)
    # each KV head's cache lives on every rank that holds it: tp 4 replicates the 2 KV heads
    kv_copies = max(tp // cfg.num_kv_heads, 1)
    assert engine.kv_cache_bytes() == kv_copies * 2 * cfg.num_layers * 8 * 16 * 2 * 16 * 4
    layers = sorted({tuple(r["layers"]) for r in layout})
    assert layers == sorted({(s * layers_per_stage, (s + 1) * layers_per_stage) for s in range(pp)})
    for r in layout:  # shard shapes: qkv rows = (local q + 2 × local kv heads) × head_dim
        q = (r["q_heads"][1] - r["q_heads"][0]) * cfg.head_dim
        kv = (r["kv_heads"][1] - r["kv_heads"][0]) * cfg.head_dim
        assert r["shapes"]["qkv"] == [q + 2 * kv, cfg.hidden_size]
        assert r["shapes"]["o"] == [cfg.hidden_size, q]
        assert r["shapes"]["down"] == [cfg.hidden_size, cfg.intermediate_size // tp]
        # every worker process runs the one model class, built from the parallel layers
        assert r["model_class"] == "engine.models.llama.LlamaModel"
        assert r["layer_classes"] == {
            "qkv": "QKVParallelLinear",
            "o": "RowParallelLinear",
            "gate_up": "MergedColumnParallelLinear",
            "down": "RowParallelLinear",
        }

    if pp == 2:  # garbage collection stops the workers too
        del engine, records
        gc.collect()
    else:
        engine.shutdown()
    deadline = time.monotonic() + 15
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(pids) == []


class ThreadGroup:
    """In one process, what a worker's Comm does: all_reduce sums the tensor-parallel ranks'
    tensors (each rank a thread, in rank order), send/recv hand hidden states to the next
    pipeline stage."""

    def __init__(self, tp: int, pipe: dict):
        self.tp, self.parts, self.pipe = tp, [None] * tp, pipe  # pipe: shared by the stages
        self.barrier = threading.Barrier(tp)

    def rank(self, tp_rank: int):
        group = self

        class RankComm:
            def all_reduce(self, t):
                group.parts[tp_rank] = t
                group.barrier.wait()
                total = sum(group.parts[1:], group.parts[0].clone())
                group.barrier.wait()
                return total

            def send(self, t):
                group.pipe["hidden"] = t

            def recv(self, shape, dtype, device):
                assert group.pipe["hidden"].shape == shape
                return group.pipe["hidden"]

        return RankComm()


def forward_on_ranks(models: list[LlamaModel], tp: int, steps) -> list[torch.Tensor]:
    """Each step's logits from the output rank; the ranks of a stage run as threads, the
    stages one after the other, each rank on its own KV cache."""
    caches = [m.allocate_kv_cache(4, 16) for m in models]
    out = []
    for ids, positions, meta in steps:
        results = [None] * len(models)
        for stage in range(len(models) // tp):
            ranks = range(stage * tp, (stage + 1) * tp)

            def run(r):
                results[r] = models[r].forward(
                    ids, positions, caches[r], meta, torch.tensor([len(ids) - 1])
                )

            threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        out.append(results[tp * (len(models) // tp - 1)])
    return out


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (4, 1)])
def test_the_workers_model_is_the_one_llama_model(tiny_model_dir, tp, pp):
    """Ranks built as a worker process builds its model (LlamaModel.from_pretrained with its
    ParallelContext), run in this process (threads for the all-reduce): the same class, the
    parallel linear layers, and tensor parallel 1's logits through the same forward."""
    from engine.layers.attention import build_attention_metadata
    from engine.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from engine.layers.sharding import ParallelContext

    prompt = torch.arange(3, 23)
    steps = [
        (prompt, torch.arange(20), build_attention_metadata([20], [0], [[0, 1]], 16)),
        (torch.tensor([9]), torch.tensor([20]), build_attention_metadata([1], [20], [[0, 1]], 16)),
    ]
    whole = LlamaModel.from_pretrained(tiny_model_dir)
    expected = forward_on_ranks([whole], 1, steps)
    pipe: dict = {}
    groups = [ThreadGroup(tp, pipe) for _ in range(pp)]
    models = [
        LlamaModel.from_pretrained(
            tiny_model_dir, parallel=ParallelContext(tp, pp, r, groups[r // tp].rank(r % tp))
        )
        for r in range(tp * pp)
    ]
    for model in models:
        assert type(model) is LlamaModel and model.parallel.tp == tp
        layer = model.layers[0]
        assert isinstance(layer.attention.qkv, QKVParallelLinear)
        assert isinstance(layer.mlp.gate_up, MergedColumnParallelLinear)
        assert isinstance(layer.attention.o, RowParallelLinear)
        assert isinstance(layer.mlp.down, RowParallelLinear)
        assert (layer.attention.o.all_reduce is not None) == (tp > 1)
    got = forward_on_ranks(models, tp, steps)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert a.argmax() == b.argmax()


def test_heads_and_sizes_follow_the_model(reference):
    cfg = reference[2]  # 4 query heads, 2 KV heads, 2 layers
    assert valid_tensor_parallel_sizes(cfg) == [1, 2, 4]
    assert [head_ranges(cfg, 4, r)[1] for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    # the default model's shape: 9 query heads, 3 KV heads, MLP width 1536 → tp 3
    default_like = LlamaConfig(**{**cfg.__dict__, "num_heads": 9, "num_kv_heads": 3})
    default_like.intermediate_size = 1536  # 1536 / 9 is not whole: tp 9 cannot cut the MLP
    assert valid_tensor_parallel_sizes(default_like) == [1, 3]
    # shards put back together give the original matrices
    weights = {
        name: torch.randn(shape)
        for name, shape in {
            "embed": (8, 64),
            "0.input_norm": (64,),
            "0.qkv": ((4 + 2 + 2) * 16, 64),
            "0.o": (64, 64),
            "0.post_norm": (64,),
            "0.gate_up": (2 * 128, 64),
            "0.down": (64, 128),
            "final_norm": (64,),
            "lm_head": (8, 64),
        }.items()
    }
    small = LlamaConfig(**{**cfg.__dict__, "num_layers": 1})
    parts = [shard_weights(small, weights, 2, r, 1, 0)[1] for r in range(2)]
    assert torch.equal(torch.cat([p["0.o"] for p in parts], dim=1), weights["0.o"])
    assert torch.equal(torch.cat([p["0.down"] for p in parts], dim=1), weights["0.down"])
    q, k, v = weights["0.qkv"].split([64, 32, 32])
    assert torch.equal(parts[1]["0.qkv"], torch.cat([q[32:], k[16:], v[16:]]))
    gate, up = weights["0.gate_up"].chunk(2)
    assert torch.equal(parts[0]["0.gate_up"], torch.cat([gate[:64], up[:64]]))


def test_bad_sizes_are_refused_before_any_process_starts(make_engine, reference, monkeypatch):
    cfg = reference[2]
    before = set(psutil.Process().children(recursive=True))
    for kwargs, message in [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
        (dict(pipeline_parallel_size=-1), "pipeline_parallel_size must be an integer >= 1"),
        (dict(tensor_parallel_size=3), "sizes that work: 1, 2, 4"),
        (dict(tensor_parallel_size=8), "sizes that work: 1, 2, 4"),
        (dict(pipeline_parallel_size=3), "more stages than the model's 2 layers"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_engine(**SMALL, **kwargs)
    with pytest.raises(ValueError, match="at most 16"):
        check_parallel_sizes(LlamaConfig(**{**cfg.__dict__, "num_layers": 32}), 4, 8)
    with socket.socket() as busy:  # a rendezvous port in use
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        with pytest.raises(ValueError, match="is in use"):
            make_engine(**SMALL, tensor_parallel_size=2)
    monkeypatch.delenv("MASTER_PORT")
    assert multiprocessing.active_children() == []
    assert set(psutil.Process().children(recursive=True)) == before


def test_a_dead_worker_makes_the_engine_raise_not_hang(make_engine):
    # a cache error inside the workers comes back as the same ValueError, workers stopped
    with pytest.raises(ValueError, match="cannot hold one request"):
        make_engine(**{**SMALL, "num_kv_blocks": 2}, tensor_parallel_size=2)
    assert multiprocessing.active_children() == []

    engine = make_engine(**SMALL, tensor_parallel_size=2)
    pids = engine.executor.worker_pids()
    engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=GREEDY, request_id="x")
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExecutorDiedError, match="worker rank 1 .* died"):
        engine.step()
    assert time.monotonic() - start < 60  # the step timeout is far longer: liveness noticed it
    assert alive(pids) == []
    with pytest.raises(ExecutorDiedError, match="stopped"):
        engine.step()


class LateExit:
    """A worker process as the driver sees it: gone after `after_s`, with `code`."""

    def __init__(self, pid: int, code: int, after_s: float):
        self.pid, self.code, self.gone_at = pid, code, time.monotonic() + after_s

    def is_alive(self) -> bool:
        return time.monotonic() < self.gone_at

    def join(self, timeout: float) -> None:
        time.sleep(max(min(self.gone_at - time.monotonic(), timeout), 0.0))

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else self.code


def test_a_failed_collective_is_blamed_on_the_killed_worker():
    """Rank 1 is killed; its connection resets at once, but its exit code shows a moment later,
    after rank 0 (whose all-reduce failed) has left with exit code 1. The driver waits for the
    exit codes and names the killed rank first, not the broken connection nor rank 0."""
    from engine.executor.multiproc import MultiprocExecutor, _Ranks

    executor = object.__new__(MultiprocExecutor)
    executor.ranks = _Ranks(processes=[LateExit(10, 1, 0.0), LateExit(11, -9, 0.3)])
    executor._finalizer, executor._dead = None, None
    with pytest.raises(ExecutorDiedError) as failure:
        executor._fail("the control group failed during step 2: Connection reset by peer")
    assert str(failure.value).startswith(
        "worker rank 1 (pid 11) died (exit code -9); worker rank 0 (pid 10) died (exit code 1); "
        "then the control group failed during step 2"
    )


@pytest.mark.slow  # spawns workers for seconds: the full suite runs it, the fast tier not
def test_bench_section_runs_both_sizes_on_the_same_requests(tiny_model_dir):
    from engine.entrypoints.llm import LLM
    from engine.tools.bench.config import BenchConfig
    from engine.tools.bench.parallel import run_parallel
    from engine.tools.bench.report import format_parallel

    config = BenchConfig.quick_config(
        model=str(tiny_model_dir), device="cpu", num_requests=4, prompt_len=(8, 40),
        output_len=(4, 8), probe_prompt_len=8, probe_output_len=4, kernels="torch",
        tensor_parallel_size=2,
    )  # fmt: skip
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32, max_model_len=128)
    result = run_parallel(llm, config, log=lambda _: None)
    assert result["identical_outputs"]
    base, par = result["rows"]["tp1"], result["rows"]["tp2_pp1"]
    assert base["comm_share"] is None and 0 < par["comm_share"] < 1
    assert par["all_reduces_per_step"] == result["derived_all_reduces_per_step"] == 4
    assert par["offline_steps"] == base["offline_steps"]
    assert len(result["layout"]) == 2
    text = "\n".join(format_parallel(result))
    assert "9. Parallel: tp 2 × pp 1" in text and "tp2_pp1" in text and "threads: tp 1" in text
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(default_model_dir):
    """The real model: 9 query heads and 3 KV heads, so tp 3 gives each rank 3 and 1."""
    from engine.core import EngineConfig, EngineCore

    config = EngineConfig(
        model=str(default_model_dir), device="cpu", num_kv_blocks=24, max_model_len=256,
        max_num_batched_tokens=48, kernels="torch",
    )  # fmt: skip
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
    outputs = []
    for tp in (1, 3):
        engine = EngineCore(config, tensor_parallel_size=tp)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for i, text in enumerate(texts * 2):  # the repeats hit the prefix cache
            engine.add_request(text, params, request_id=str(i))
        _, final, _ = run_engine(engine)
        outputs.append({rid: out.token_ids for rid, out in final.items()})
        if tp == 3:
            assert [r["kv_heads"] for r in engine.executor.layout()] == [[0, 1], [1, 2], [2, 3]]
        engine.shutdown()
    assert outputs[0] == outputs[1]


@pytest.mark.slow  # spawns workers for seconds: the full suite runs it, the fast tier not
def test_chapter12_experiment_tables(tiny_model_dir):
    """ui/experiments/ch12.py: the same workload on tp 1, tp 2 and pp 2, tables for the page."""
    from ui.experiments.ch12 import communication_table, compare_layouts, shard_table
    from ui.experiments.common import Workload

    config = dict(
        model=str(tiny_model_dir), device="cpu", num_kv_blocks=32, max_model_len=128,
        kernels="torch",
    )  # fmt: skip
    result = compare_layouts(config, Workload.uniform(3, 20, 6), sizes=((1, 1), (2, 1), (1, 2)))
    summary = result.summary.set_index("실행")
    assert list(summary.index) == ["tp 1 × pp 1", "tp 2 × pp 1", "tp 1 × pp 2"]
    assert summary["tp 1과 같은 출력"].all()
    assert list(summary["스텝당 all-reduce (측정)"]) == [0, 4, 0]
    assert pd.isna(summary.loc["tp 1 × pp 1", "통신 비율 (%)"])  # no communication at all
    assert 0 < summary.loc["tp 2 × pp 1", "통신 비율 (%)"] < 100
    tp2 = result.runs["tp 2 × pp 1"]
    shards = shard_table(tp2.layout)
    assert list(shards["qkv"]) == ["64 × 64", "64 × 64"]  # (2 q + 2 × 1 kv heads) × 16 rows
    assert list(shards["down"]) == ["64 × 64", "64 × 64"]  # MLP width 128 cut in 2
    comm = communication_table(tp2.result.records)
    assert set(comm["rank"]) == {0, 1} and (comm["all_reduce_count"] == 4).all()
    assert multiprocessing.active_children() == []


@pytest.mark.slow  # spawns workers for seconds: the full suite runs it, the fast tier not
def test_workers_exit_when_the_engine_process_is_killed(tiny_model_dir):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from engine.core import EngineCore\n"
        "if __name__ == '__main__':\n"
        f"    engine = EngineCore(model={str(tiny_model_dir)!r}, device='cpu', num_kv_blocks=16,\n"
        "                        max_model_len=128, kernels='torch', tensor_parallel_size=2)\n"
        "    print(*engine.executor.worker_pids(), flush=True)\n"
        "    sys.stdin.read()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(alive(pids)) == 2
        parent.send_signal(signal.SIGKILL)  # no atexit, no finalizer: only the watchdog is left
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(pids) == []
    finally:
        parent.kill()
