"""Classroom bookkeeping without a browser: the caps, the reaper, lazily allocated KV memory and
the learner's "교실이 가득 찼습니다" message under AppTest (ui/registry.py, ui/session.py)."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest

from ui import registry as reg
from ui.registry import MB, ClassroomFull, ClassroomLimits, LazyKVWorker, SessionRegistry

ROOT = Path(__file__).resolve().parent.parent


class FakeWorker:
    def __init__(self):
        self.released = False

    def release_kv(self):
        self.released = True


class FakeExecutor:
    def __init__(self):
        self.worker = FakeWorker()
        self.shut = False

    def shutdown(self):
        self.shut = True


class FakeEngine:
    def __init__(self):
        self.executor = FakeExecutor()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_registry(connected=None, **limits):
    clock = Clock()
    trims = []
    state = {"connected": connected or {}}
    r = SessionRegistry(
        ClassroomLimits(**limits),
        is_connected=lambda sid: state["connected"].get(sid),
        clock=clock,
        trim=lambda: trims.append(1),
    )
    return r, clock, trims, state


def test_engine_cap_refuses_with_figures_and_a_korean_message():
    r, *_ = make_registry(
        max_engines=2, max_kv_bytes=1000 * MB, session_ttl_s=60, reap_interval_s=5
    )
    r.admit("a", "main", FakeEngine(), 47 * MB)
    r.admit("b", "main", FakeEngine(), 47 * MB)
    with pytest.raises(ClassroomFull) as info:
        r.admit("c", "main", FakeEngine(), 47 * MB)
    exc = info.value
    assert (exc.reason, exc.engines, exc.max_engines, exc.kv_bytes) == ("engines", 2, 2, 94 * MB)
    message = exc.message_ko()
    assert "교실이 가득 찼습니다" in message and "2/2" in message and "94/1,000 MB" in message
    assert "65초" in message  # when to retry: the TTL plus one reaper interval
    assert r.usage() == (2, 94 * MB)  # the refused engine left nothing behind


def test_kv_cap_and_an_engine_bigger_than_the_whole_budget():
    r, *_ = make_registry(max_engines=10, max_kv_bytes=100 * MB)
    r.admit("a", "main", FakeEngine(), 60 * MB)
    with pytest.raises(ClassroomFull) as info:
        r.admit("b", "main", FakeEngine(), 60 * MB)
    assert info.value.reason == "kv"
    with pytest.raises(ClassroomFull) as info:
        r.admit("b", "main", FakeEngine(), 101 * MB)
    assert info.value.reason == "too_big" and "KV 블록 수를 줄이고" in info.value.message_ko()
    r.admit("b", "main", FakeEngine(), 40 * MB)  # exactly at the cap is allowed
    assert r.usage() == (2, 100 * MB)


def test_rebuilding_a_key_replaces_and_releases_the_old_engine():
    r, *_ = make_registry(max_engines=1, max_kv_bytes=100 * MB)
    old, new = FakeEngine(), FakeEngine()
    r.admit("a", "main", old, 80 * MB)
    r.admit("a", "main", new, 90 * MB)  # the old one is counted as given back
    assert old.executor.worker.released and old.executor.shut
    assert not new.executor.worker.released
    assert r.usage() == (1, 90 * MB)
    assert r.release("a", "main") and new.executor.worker.released
    assert r.usage() == (0, 0) and not r.release("a", "main")


def test_reaper_releases_a_closed_tab_after_the_ttl_and_empties_its_state():
    r, clock, trims, state = make_registry(max_engines=5, max_kv_bytes=500 * MB, session_ttl_s=60)
    engines, records = {"main": "entry"}, {"main": [1, 2]}
    r.touch("a/1", engines, records, runtime_id="a")
    r.touch("b/1", runtime_id="b")
    ea, eb = FakeEngine(), FakeEngine()
    r.admit("a/1", "main", ea, 47 * MB)
    r.admit("b/1", "main", eb, 47 * MB)
    state["connected"] = {"a": True, "b": True}
    assert r.reap() == []
    state["connected"] = {"a": False, "b": True}  # learner a closed the tab
    clock.now += 5
    assert r.reap() == []  # the reaper notices the closed tab here
    clock.now += 59
    assert r.reap() == []  # not gone for the TTL yet (a reconnect would keep its engine)
    clock.now += 2
    assert r.reap() == ["a/1"]
    assert ea.executor.worker.released and not eb.executor.worker.released
    assert engines == {} and records == {}  # the session's own dicts no longer hold the engine
    assert r.usage() == (1, 47 * MB) and trims  # memory handed back to the OS after the reap
    assert r.session_ids() == ["b/1"]


def test_a_reconnect_within_the_ttl_keeps_the_engine():
    r, clock, _, state = make_registry(session_ttl_s=60)
    r.touch("a/1", runtime_id="a")
    e = FakeEngine()
    r.admit("a/1", "main", e, MB)
    state["connected"] = {"a": True}
    r.reap()
    state["connected"] = {"a": False}
    clock.now += 50
    r.reap()
    state["connected"] = {"a": True}
    r.touch("a/1", runtime_id="a")
    clock.now += 50
    assert r.reap() == [] and not e.executor.worker.released


def test_a_tab_closed_before_the_reapers_first_look_is_still_released():
    r, clock, _, state = make_registry(session_ttl_s=60)
    state["connected"] = {"a": True}
    r.touch("a/1", runtime_id="a")  # the script run itself sees the live websocket
    e = FakeEngine()
    r.admit("a/1", "main", e, MB)
    state["connected"] = {"a": False}  # closed at once, no reaper pass in between
    assert r.reap() == []
    clock.now += 61
    assert r.reap() == ["a/1"] and e.executor.worker.released


def test_unknown_connection_state_falls_back_to_the_idle_ttl():
    # AppTest and scripts have no Streamlit runtime: only a long silence releases the engine.
    r, clock, _, _ = make_registry(session_ttl_s=1, idle_ttl_s=600)
    r.touch("t/1")
    r.admit("t/1", "main", FakeEngine(), MB)
    clock.now += 599
    assert r.reap() == []
    clock.now += 2
    assert r.reap() == ["t/1"]


def test_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLM_LAB_MAX_ENGINES", "7")
    monkeypatch.setenv("LLM_LAB_MAX_KV_MB", "300")
    monkeypatch.setenv("LLM_LAB_SESSION_TTL_S", "4")
    monkeypatch.setenv("LLM_LAB_IDLE_TTL_S", "nonsense")
    limits = ClassroomLimits.from_env()
    assert limits.max_engines == 7 and limits.max_kv_bytes == 300 * MB
    assert limits.session_ttl_s == 4 and limits.reap_interval_s == 2  # at most half the TTL
    assert limits.idle_ttl_s == ClassroomLimits.idle_ttl_s


def test_the_reaper_thread_runs_on_its_own():
    connected = {"a": True}
    r = SessionRegistry(
        ClassroomLimits(session_ttl_s=0.3, reap_interval_s=0.1),
        is_connected=lambda sid: connected.get(sid),
        trim=lambda: None,
    )
    r.touch("a/1", runtime_id="a")
    e = FakeEngine()
    r.admit("a/1", "main", e, MB)
    r.start_reaper()
    try:
        time.sleep(0.3)
        assert not e.executor.worker.released
        connected["a"] = False  # nobody else connects: the thread alone must notice
        deadline = time.monotonic() + 5
        while not e.executor.worker.released and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.executor.worker.released and r.usage() == (0, 0)
    finally:
        r.stop_reaper()


def test_admission_is_atomic_under_concurrent_learners():
    r, *_ = make_registry(max_engines=5, max_kv_bytes=10_000 * MB)
    admitted, refused = [], []

    def learner(i):
        try:
            r.admit(f"s{i}", "main", FakeEngine(), MB)
            admitted.append(i)
        except ClassroomFull:
            refused.append(i)

    threads = [threading.Thread(target=learner, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 5 and len(refused) == 15 and r.usage()[0] == 5


def test_engines_freeze_the_heap_and_the_reaper_thaws_it_to_collect(monkeypatch):
    freezes, trims = [], []
    r = SessionRegistry(
        ClassroomLimits(max_engines=4, max_kv_bytes=100 * MB, session_ttl_s=60),
        is_connected=lambda sid: None,
        trim=lambda: trims.append(1),
        freeze=lambda: freezes.append(gc.get_freeze_count()),
    )
    r.admit("a", "main", FakeEngine(), MB)
    assert len(freezes) == 1  # each admitted engine: what lives now is long-lived
    gc.freeze()  # as a served process would have done
    assert gc.get_freeze_count() > 0
    try:
        r.release_session("a")
        # The reaper thawed everything before collecting (a released engine's cycles may have
        # been frozen with it), then froze again and trimmed.
        assert freezes[-1] == 0 and len(freezes) == 2 and trims == [1]
    finally:
        gc.unfreeze()
    # Outside a `streamlit run` server (pytest, AppTest) the real one freezes nothing...
    assert not reg.is_served() and reg.freeze_heap() is False and gc.get_freeze_count() == 0
    # ...and where it is served it does, unless LLM_LAB_GC_FREEZE=0.
    monkeypatch.setattr(reg, "is_served", lambda: True)
    try:
        assert reg.freeze_heap() is True and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    monkeypatch.setenv("LLM_LAB_GC_FREEZE", "0")
    assert reg.freeze_heap() is False and gc.get_freeze_count() == 0


def test_malloc_trim_is_callable_here():
    assert isinstance(reg.malloc_trim(), bool)
    assert reg.rss_bytes() is None or reg.rss_bytes() > 0


# -- with the real engine -----------------------------------------------------------------------


def _engine(model_dir, num_kv_blocks=8, lazy=True):
    import torch

    from engine.core import EngineConfig, EngineCore
    from engine.executor.uniproc import UniProcExecutor

    config = EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=num_kv_blocks,
        max_model_len=128,
        block_size=16,
    )
    if not lazy:
        return EngineCore(config)
    worker = LazyKVWorker(model_dir, torch.device("cpu"), torch.float32, 16)
    return EngineCore(config, executor=UniProcExecutor(worker))


def _greedy(engine, prompt="The capital of France is", n=6):
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return list(request.output_token_ids)


def test_lazy_kv_worker_allocates_on_first_step_and_gives_it_back(default_model_dir):
    engine = _engine(default_model_dir)
    worker = engine.executor.worker
    planned = reg.planned_kv_bytes(engine)
    cfg = engine.model_config
    assert planned == 8 * 16 * cfg.kv_elements_per_token * 4
    assert not worker.kv_allocated and engine.executor.kv_cache_bytes() == 0
    assert engine.kv_cache_manager.snapshot().num_blocks == 8  # the control plane is complete
    tokens = _greedy(engine)
    assert worker.kv_allocated and engine.executor.kv_cache_bytes() == planned
    assert tokens == _greedy(_engine(default_model_dir, lazy=False))  # same answer as eager KV
    reg.release_engine(engine)
    assert not worker.kv_allocated and engine.executor.kv_cache_bytes() == 0


# -- the learner's page under AppTest ----------------------------------------------------------


@pytest.fixture
def small_registry(monkeypatch):
    """Swap the process's registry for one with tiny caps (restored afterwards)."""

    def install(**limits):
        r = SessionRegistry(ClassroomLimits(**limits), trim=lambda: None)
        monkeypatch.setattr(reg, "_registry", r)
        return r

    return install


def _open_ch00():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.run()
    at.switch_page("pages/ch00_intro.py")
    at.run()
    return at


def test_a_full_classroom_shows_the_message_not_a_traceback(default_model_dir, small_registry):
    r = small_registry(max_engines=1, max_kv_bytes=1000 * MB)
    r.admit("someone-else", "main", FakeEngine(), 47 * MB)
    at = _open_ch00()
    assert not at.exception, [e.value for e in at.exception]
    errors = " ".join(e.value for e in at.error)
    assert "교실이 가득 찼습니다" in errors and "1/1개" in errors, errors
    assert any(b.label == "다시 시도" for b in at.button)
    assert "main" not in at.session_state["_engines"]


def test_a_learner_gets_a_lazy_engine_admitted_and_released_on_reset(
    default_model_dir, small_registry
):
    r = small_registry(max_engines=4, max_kv_bytes=1000 * MB)
    at = _open_ch00()
    assert not at.exception, [e.value for e in at.exception]
    engine = at.session_state["_engines"]["main"]["engine"]
    engines, kv = r.usage()
    assert engines == 1 and kv == reg.planned_kv_bytes(engine) > 0
    assert not engine.executor.worker.kv_allocated  # reading the page allocates no KV tensors
    at.button(key="main_add_preset").click().run()
    at.button(key="main_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert engine.executor.worker.kv_allocated and len(at.session_state["_records"]["main"]) == 1
    at.button(key="main_reset").click().run()
    assert not engine.executor.worker.kv_allocated  # the old engine's KV went back at once
    fresh = at.session_state["_engines"]["main"]["engine"]
    assert fresh is not engine and r.usage()[0] == 1


def test_several_clicking_learners_get_one_thread_per_step(monkeypatch):
    """A lone learner's step uses torch's threads; two learners clicking within the window get one
    each; a learner who stopped clicking no longer counts; a number in the environment wins."""
    monkeypatch.delenv("LLM_LAB_STEP_THREADS", raising=False)
    r, clock, _, _ = make_registry()
    r.touch("a/1")
    assert r.active_sessions() == 1
    assert reg.step_threads(r.active_sessions()) == reg.DEFAULT_THREADS
    r.touch("b/1")
    assert reg.step_threads(r.active_sessions()) == 1
    clock.now += reg.ACTIVE_WINDOW_S + 1
    r.touch("b/1")
    assert r.active_sessions() == 1
    assert reg.step_threads(r.active_sessions()) == reg.DEFAULT_THREADS
    assert reg.step_threads(5, "3") == 3
    assert reg.step_threads(1, "nonsense") == reg.DEFAULT_THREADS
