"""The engine-iteration watchdog (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S; here
LLM_ENGINE_ITERATION_TIMEOUT_S, engine/config.py): a step that does not finish in time fails
its requests with an error that names the hung worker, /health answers 503 while the engine makes
no progress, and no process outlives the engine, whatever state a worker was left in.

Bounded: a watchdog of a few seconds, tp 2 on the tiny model, every wait with a deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from engine import SamplingParams
from engine.config import ENGINE_ITERATION_TIMEOUT_ENV, EngineConfig
from engine.entrypoints.llm import AsyncLLM

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SMALL = dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=24, kernels="torch")


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def children() -> set[int]:
    """This process's live descendants, but multiprocessing's resource_tracker (a spawn start
    leaves one per process; it ends with this process, once no worker holds its pipe)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.status() != "zombie" and "resource_tracker" not in " ".join(p.cmdline())
    }


def wait_until(condition, timeout_s: float, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    return condition()


def test_the_timeout_comes_from_the_config_or_the_environment(monkeypatch):
    assert EngineConfig().engine_iteration_timeout_s == 60.0  # vLLM's default
    monkeypatch.setenv(ENGINE_ITERATION_TIMEOUT_ENV, "2.5")
    assert EngineConfig().engine_iteration_timeout_s == 2.5
    assert EngineConfig(engine_iteration_timeout_s=7).engine_iteration_timeout_s == 7.0
    monkeypatch.setenv(ENGINE_ITERATION_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=ENGINE_ITERATION_TIMEOUT_ENV):
        EngineConfig()
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(engine_iteration_timeout_s=0)


def _consume(llm: AsyncLLM, prompt_token_ids: list[int]) -> dict:
    """Stream one request to its end in a thread of its own; the result says how it ended."""
    result: dict = {}

    async def stream() -> None:
        async for output in llm.generate(None, GREEDY, prompt_token_ids=prompt_token_ids):
            result["finished"] = output.finished

    def run() -> None:
        try:
            asyncio.run(stream())
        except Exception as error:  # noqa: BLE001 — what the test checks
            result["error"] = error

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def test_a_hung_step_makes_health_503_until_the_engine_moves_again(make_engine):
    """Any executor: a step past the timeout is reported by /health; when it ends, 200 again."""
    from engine.entrypoints.server.app import start_server_in_thread

    engine = make_engine(engine_iteration_timeout_s=0.5, kernels="torch")
    release = threading.Event()
    execute = engine.executor.execute_model

    def hung_once(scheduler_output):
        release.wait(timeout=30)
        return execute(scheduler_output)

    engine.executor.execute_model = hung_once
    llm = AsyncLLM(engine)
    with start_server_in_thread(llm) as server:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        request = _consume(llm, [5, 6, 7])
        stalled = wait_until(
            lambda: (r := httpx.get(f"{server.url}/health", timeout=5)).status_code == 503 and r,
            timeout_s=15,
        )
        assert stalled, "a step hung past the engine iteration timeout, /health still says 200"
        error = stalled.json()["error"]
        assert error["code"] == "engine_not_progressing"
        assert "engine iteration timeout" in error["message"]
        release.set()
        request["thread"].join(timeout=20)
        assert request.get("finished") is True and "error" not in request
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    llm.shutdown()


def test_a_stopped_worker_fails_the_step_and_leaves_no_process(make_engine):
    before = children()
    engine = make_engine(**SMALL, tensor_parallel_size=2, engine_iteration_timeout_s=3.0)
    pids = engine.executor.worker_pids()
    llm = AsyncLLM(engine)
    try:
        first = _consume(llm, [5, 6, 7])
        first["thread"].join(timeout=30)
        assert first.get("finished") is True, first

        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        second = _consume(llm, [8, 9, 10])
        reported = wait_until(lambda: llm.health(), timeout_s=30)
        assert "engine iteration timeout" in reported  # first the stall, then the death
        second["thread"].join(timeout=30)
        assert time.monotonic() - start < 30  # the collective's own timeout is 600 s
        message = str(second.get("error"))
        assert "did not finish within the engine iteration timeout (3 s" in message
        assert f"worker rank 1 (pid {pids[1]}) is stopped" in message
        assert llm.health().startswith("the engine loop died")
    finally:
        llm.shutdown()
        engine.shutdown()
    assert wait_until(lambda: not alive(pids), timeout_s=10), alive(pids)
    assert wait_until(lambda: children() <= before, timeout_s=10), children() - before


def _start_serve(model_dir, timeout_s: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--device", "cpu",
        "--kernels", "torch", "--num-kv-blocks", "16", "--max-model-len", "128", "-tp", "2",
        "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning",
        "--engine-iteration-timeout-s", str(timeout_s),
    ]  # fmt: skip
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return server.poll() is not None  # gone: stop waiting

    assert wait_until(up, timeout_s=120, poll_s=0.3) and server.poll() is None
    return server, url


def _descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _stream_in_background(url: str) -> threading.Thread:
    def run() -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 64, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
                for _ in reply.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # two server processes with tp 2, each for seconds
def test_serve_with_a_stopped_worker_reports_it_exits_and_leaves_no_process(tiny_model_dir):
    """The issue's run: SIGSTOP on one rank of `serve -tp 2`; /health answers 503 within the
    watchdog time, the server exits with status 1, and nothing it started is left."""
    server, url = _start_serve(tiny_model_dir, timeout_s=3)
    try:
        started = _descendants(server.pid)
        workers = [p for p in started if "resource_tracker" not in psutil.Process(p).cmdline()]
        os.kill(workers[-1], signal.SIGSTOP)
        stream = _stream_in_background(url)

        def unhealthy():
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                return False

        assert wait_until(unhealthy, timeout_s=30), "/health kept answering 200"
        assert server.wait(timeout=60) == 1
        stream.join(timeout=30)
        assert wait_until(lambda: not alive(started), timeout_s=15), alive(started)
    finally:
        server.kill()


@pytest.mark.slow
def test_sigterm_while_a_worker_is_stopped_leaves_no_process(tiny_model_dir):
    """SIGTERM before the watchdog fires (uvicorn re-raises it after its shutdown, which used to
    end the process before the workers were stopped): the stopped worker is killed too."""
    server, url = _start_serve(tiny_model_dir, timeout_s=60)
    try:
        started = _descendants(server.pid)
        os.kill(started[-1], signal.SIGSTOP)
        stream = _stream_in_background(url)
        time.sleep(1.0)  # the step is now blocked on the stopped rank
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        stream.join(timeout=30)
        assert wait_until(lambda: not alive(started), timeout_s=15), alive(started)
    finally:
        server.kill()


class _LateWork:
    """A collective that completes right after a timed wait ran out: the wait raises "Operation
    timed out!", yet is_completed() is True by the time the caller checks, and it succeeded."""

    def __init__(self, error: str | None = None):
        self.error, self.timed_waits = error, 0

    def wait(self, timeout=None):
        if timeout is not None and self.timed_waits == 0:
            self.timed_waits += 1
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.timed_waits > 0


def test_a_collective_completed_just_after_its_wait_slice_is_a_success_not_a_failure():
    """Under load, about one tp start-up in 25 stopped every worker with "the control group failed
    during start-up: Operation timed out!" although nothing had failed."""
    from engine.executor.abstract import ExecutorDiedError
    from engine.executor.multiproc import MultiprocExecutor

    failures: list[str] = []
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor._what, executor._deadline = "start-up", time.monotonic() + 60
    executor._dead_workers = lambda failed_only=False: []

    def fail(message: str) -> None:
        failures.append(message)
        raise ExecutorDiedError(message)

    executor._fail = fail
    executor._wait(_LateWork())
    assert failures == []
    with pytest.raises(ExecutorDiedError, match="Connection reset by peer"):
        executor._wait(_LateWork(error="Connection reset by peer"))


def test_workers_connect_only_after_every_worker_is_started(monkeypatch):
    """The driver's store thread resolves each connecting worker's name; a worker forked while it
    held glibc's resolver lock hung in its own first lookup (tp 3, 1 start-up in about 50 under
    load). So no worker may connect before the last one is started: each waits on an Event that
    the driver sets after the last start."""
    import threading as _threading

    import torch

    from engine.executor import multiproc

    seen: list[bool] = []

    class FakeProcess:
        def __init__(self, target, args, name, daemon):
            self.all_started = args[-1]

        def start(self):
            seen.append(self.all_started.is_set())

    class FakeContext:
        Process = FakeProcess
        Event = _threading.Event

    class Connected(Exception):
        pass

    def connect(self, store, size):
        seen.append(self.ranks.processes[-1].all_started.is_set())
        raise Connected

    monkeypatch.setattr(torch.multiprocessing, "get_context", lambda method: FakeContext)
    monkeypatch.setattr(multiproc.MultiprocExecutor, "_connect", connect)
    monkeypatch.setattr(multiproc, "_stop_ranks", lambda ranks: None)
    executor = multiproc.MultiprocExecutor.__new__(multiproc.MultiprocExecutor)
    executor.torchrun, executor.start_method = False, "fork"
    executor.master_addr, executor.master_port = "127.0.0.1", None
    executor.tp, executor.pp, executor.world_size = 3, 1, 3
    executor.spec = {"device": torch.device("cpu"), "dtype": torch.bfloat16}
    executor.ranks = multiproc._Ranks()
    with pytest.raises(Connected):
        executor._start()
    assert seen == [False, False, False, True]
