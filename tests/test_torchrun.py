"""The engine under torchrun (engine/__main__.py's dispatch, engine/executor/multiproc.py's
control group; docs/distributed.md): RANK 0 runs the engine core and its shard, the other ranks
serve its steps, and the text equals tp 1's. "Two machines" are two torchrun invocations with
--nnodes 2 against the same 127.0.0.1 master. A WORLD_SIZE that is not tp × pp is refused with
a clear error, and nothing is left running.

Each launch starts torchrun and one Python process per rank (each imports torch), so the tests
are few; every launch has a timeout, so a hang fails instead of blocking the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from _tiny import run_engine

from engine import SamplingParams
from engine.utils import free_port

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The same engine runs on two machines"
MAX_TOKENS = 12
LAUNCH_TIMEOUT_S = 300
MARK = "ENGINE_TORCHRUN_TEST_MARK"  # set in every launched process's environment


@pytest.fixture(scope="module")
def reference_text(make_engine) -> str:
    """tp 1, in this process (the in-process executor): what the CLI prints for PROMPT."""
    engine = make_engine(kernels="torch")
    engine.add_request(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), request_id="ref"
    )
    _, final, streamed = run_engine(engine)
    assert final["ref"].token_ids  # the model said something
    return streamed["ref"]


def start(torchrun_args: list[str], engine_args: list[str], model_dir: Path, mark: str):
    """`python -m torch.distributed.run ... -m engine generate PROMPT ...` in the repository."""
    command = [
        sys.executable, "-m", "torch.distributed.run", *torchrun_args,
        "-m", "engine", "generate", PROMPT, "--raw", "--model", str(model_dir),
        "--device", "cpu", "--kernels", "torch", "--max-tokens", str(MAX_TOKENS), *engine_args,
    ]  # fmt: skip
    env = {**os.environ, MARK: mark, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(processes: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each launch; past the timeout, kill their trees and
    fail."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    results = []
    try:
        for p in processes:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in processes:
            for child in psutil.Process(p.pid).children(recursive=True) + [psutil.Process(p.pid)]:
                try:
                    child.kill()
                except psutil.Error:
                    pass
            p.communicate()
        pytest.fail(f"torchrun did not finish within {LAUNCH_TIMEOUT_S} s")
    return results


def left_running(mark: str) -> list[int]:
    """Processes started by a launch (they carry its mark) that are still alive."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def assert_nothing_left(mark: str) -> None:
    deadline = time.monotonic() + 15
    while left_running(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_running(mark) == []


def test_torchrun_one_machine_tp2_prints_tp1s_text(tiny_model_dir, reference_text):
    mark = uuid.uuid4().hex
    torchrun_args = ["--nnodes", "1", "--nproc-per-node", "2"]
    torchrun_args += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    [(status, out, err)] = finish([start(torchrun_args, ["-tp", "2"], tiny_model_dir, mark)])
    assert status == 0, err
    assert out == reference_text  # printed once: rank 1 prints nothing of the output
    # rank 0's layout report names both ranks, each holding half the heads
    assert "rank 0 (tp 0, pp 0): layers 0-1, query heads 0-1" in err
    assert "rank 1 (tp 1, pp 0): layers 0-1, query heads 2-3" in err
    assert_nothing_left(mark)


@pytest.mark.slow  # two torchrun launches, a rendezvous between them: the slowest here
def test_torchrun_two_nodes_pp2_prints_tp1s_text(tiny_model_dir, reference_text):
    """Two "machines" on 127.0.0.1: node 0 runs the engine core and stage 0, node 1 stage 1;
    the step goes over the control group, the hidden states over the data group."""
    mark = uuid.uuid4().hex
    common = ["--nnodes", "2", "--nproc-per-node", "1"]
    common += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes = [
        start(common + ["--node-rank", str(node)], ["-pp", "2"], tiny_model_dir, mark)
        for node in (1, 0)  # the second machine may come up first: it waits for the master
    ]
    (status1, out1, err1), (status0, out0, err0) = finish(nodes)
    assert status0 == 0, err0
    assert status1 == 0, err1
    assert out0 == reference_text
    assert out1 == ""  # the worker machine prints nothing of the output
    assert "rank 1 (tp 0, pp 1): layers 1-1" in err0  # stage 1 lives on the other node
    assert_nothing_left(mark)


def test_torchrun_world_size_not_tp_times_pp_is_refused(tiny_model_dir):
    mark = uuid.uuid4().hex
    torchrun_args = ["--nnodes", "1", "--nproc-per-node", "2"]
    torchrun_args += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    [(status, out, err)] = finish([start(torchrun_args, ["-tp", "1"], tiny_model_dir, mark)])
    assert status != 0
    assert out == ""
    assert "WORLD_SIZE=2" in err and "1 × 1 = 1" in err
    assert "--nnodes × --nproc-per-node must equal tp × pp" in err
    assert_nothing_left(mark)
