"""Classroom bookkeeping: which browser session holds which engines, and giving memory back.

One process serves a whole classroom, so every learner's engine lives in this process. This module
keeps a process-wide registry of sessions (last seen, connected or not, their engines and the KV
bytes each engine holds), refuses a new engine once a cap is reached (ClassroomFull, shown by
ui/session.py as "교실이 가득 찼습니다"), and runs a reaper thread that releases the engines of
sessions whose browser tab has gone, then hands the freed memory back to the operating system.

No Streamlit import here except the runtime look-up in `streamlit_is_connected`, so the logic is
unit-tested without a browser (tests/test_classroom.py).

Settings (environment variables, read when the registry is created):
  LLM_LAB_MAX_ENGINES     most learner engines at once in this process      (default 64)
  LLM_LAB_MAX_KV_MB       most KV-cache memory of all those engines, in MB  (default: a quarter
                          of this machine's memory, at most 4096). A learner holds one engine per
                          lab key it has opened (main, ch03, ...); each counts its full KV cache
                          (64 blocks of the default model in float32 ≈ 47 MB) from the moment it
                          is built, though the tensors are allocated only on its first step.
  LLM_LAB_SESSION_TTL_S   seconds after a tab closes before its engines go  (default 60)
  LLM_LAB_IDLE_TTL_S      where connection state is unknown (no Streamlit runtime, e.g. AppTest):
                          seconds without a script run before engines go    (default 3600)
  LLM_LAB_REAP_INTERVAL_S how often the reaper looks                        (default 10, ≤ TTL/2)
  LLM_LAB_STATUS_FILE     if set, the reaper writes the registry's figures there as JSON after
                          each pass (engines, KV bytes, sessions, reaped, RSS): for load scripts
  LLM_LAB_GC_FREEZE       0 keeps Python's cyclic collector looking at every object (default 1:
                          see freeze_heap)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.worker.worker import Worker


def _logger() -> logging.Logger:
    """Streamlit's logger set-up where Streamlit is there, so the reaper's lines reach the
    console of `streamlit run`; a plain logger elsewhere."""
    try:
        from streamlit.logger import get_logger

        return get_logger("llm_lab.registry")
    except ImportError:
        return logging.getLogger("llm_lab.registry")


_LOG = _logger()

MB = 1 << 20
ACTIVE_WINDOW_S = 20.0  # a session that ran a script this recently is clicking now


def _env_number(name: str, default: float, cast=float):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        _LOG.warning("ignoring %s=%r (not a number)", name, raw)
        return default
    return value if value > 0 else default


def _default_max_kv_bytes() -> int:
    """A quarter of this machine's memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8192 * MB
    return int(min(4096 * MB, total // 4))


@dataclass(frozen=True)
class ClassroomLimits:
    max_engines: int = 64
    max_kv_bytes: int = field(default_factory=_default_max_kv_bytes)
    session_ttl_s: float = 60.0
    idle_ttl_s: float = 3600.0
    reap_interval_s: float = 10.0

    @classmethod
    def from_env(cls) -> "ClassroomLimits":
        ttl = _env_number("LLM_LAB_SESSION_TTL_S", cls.session_ttl_s)
        return cls(
            max_engines=_env_number("LLM_LAB_MAX_ENGINES", cls.max_engines, int),
            max_kv_bytes=int(_env_number("LLM_LAB_MAX_KV_MB", _default_max_kv_bytes() / MB) * MB),
            session_ttl_s=ttl,
            idle_ttl_s=_env_number("LLM_LAB_IDLE_TTL_S", cls.idle_ttl_s),
            reap_interval_s=min(
                _env_number("LLM_LAB_REAP_INTERVAL_S", cls.reap_interval_s), max(ttl / 2, 0.2)
            ),
        )


class ClassroomFull(RuntimeError):
    """A new engine would pass a cap. Carries the figures for the learner's message."""

    def __init__(
        self,
        reason: str,
        engines: int,
        max_engines: int,
        kv_bytes: int,
        max_kv_bytes: int,
        need_bytes: int,
        retry_s: float,
    ):
        self.reason = reason  # "engines" | "kv" | "too_big"
        self.engines, self.max_engines = engines, max_engines
        self.kv_bytes, self.max_kv_bytes, self.need_bytes = kv_bytes, max_kv_bytes, need_bytes
        self.retry_s = retry_s
        super().__init__(
            f"classroom full ({reason}): {engines}/{max_engines} engines, "
            f"{kv_bytes / MB:.0f}/{max_kv_bytes / MB:.0f} MB KV, "
            f"this engine needs {need_bytes / MB:.0f} MB"
        )

    def message_ko(self) -> str:
        used = (
            f"학습자 엔진 **{self.engines}/{self.max_engines}개**, KV 캐시 "
            f"**{self.kv_bytes / MB:,.0f}/{self.max_kv_bytes / MB:,.0f} MB**"
        )
        if self.reason == "too_big":
            return (
                f"🏫 이 설정의 KV 캐시({self.need_bytes / MB:,.0f} MB)는 이 서버의 KV 한도"
                f"({self.max_kv_bytes / MB:,.0f} MB)보다 큽니다. 사이드바에서 KV 블록 수를 줄이고 "
                "‘설정 적용’을 누르세요."
            )
        return (
            f"🏫 교실이 가득 찼습니다. 지금 이 서버에서 {used}를 쓰고 있어, 엔진 하나"
            f"(KV {self.need_bytes / MB:,.0f} MB)를 더 만들 수 없습니다. 다른 학습자가 탭을 닫으면 "
            f"약 {self.retry_s:.0f}초 안에 자리가 납니다. 잠시 뒤 ‘다시 시도’를 눌러 주세요. "
            "(강사: 한도는 LLM_LAB_MAX_ENGINES / LLM_LAB_MAX_KV_MB 환경 변수로 정합니다.)"
        )


# -- an engine whose KV tensors exist only once something uses them -------------------------------


class LazyKVWorker(Worker):
    """A Worker that sizes its KV cache at start-up but allocates the tensors on first use.

    The engine's control plane (block count, block pool, scheduler) is complete from the start; only
    the K/V tensors wait until the first step (or anything else that reads `worker.runner`). So a
    learner who only reads a page holds no KV memory, and `release_kv()` gives it back."""

    def __init__(self, *args, **kwargs):
        self._runner = None
        self._allocate_on_use = False
        self.num_swap_blocks = 0
        super().__init__(*args, **kwargs)

    @property
    def runner(self):
        if self._runner is None and self._allocate_on_use:
            # sets self.runner through the setter below
            super().initialize_cache(self.num_blocks, self.num_swap_blocks)
        return self._runner

    @runner.setter
    def runner(self, value) -> None:
        self._runner = value

    @property
    def kv_allocated(self) -> bool:
        return self._runner is not None

    def initialize_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self._allocate_on_use = True

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV tensors allocated now (0 before first use and after release)."""
        return super().kv_cache_bytes() if self._runner is not None else 0

    def planned_kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def release_kv(self) -> None:
        """Drop the K/V tensors (and the requests' cached blocks with them). Should anything still
        step this engine, fresh tensors are allocated then, so a late step never crashes."""
        self._runner = None


def lazy_worker_of(engine) -> LazyKVWorker | None:
    worker = getattr(getattr(engine, "executor", None), "worker", None)
    return worker if isinstance(worker, LazyKVWorker) else None


def planned_kv_bytes(engine) -> int:
    """KV bytes this engine holds or will hold once used (blocks × bytes per block)."""
    worker = lazy_worker_of(engine)
    if worker is not None:
        return worker.planned_kv_bytes()
    try:
        return int(engine.executor.kv_cache_bytes())
    except Exception:  # noqa: BLE001 - an executor without byte counts
        return 0


def release_engine(engine) -> None:
    """Give back what an engine holds: its KV tensors and its executor."""
    worker = getattr(getattr(engine, "executor", None), "worker", None)
    if hasattr(worker, "release_kv"):
        worker.release_kv()
    try:
        engine.executor.shutdown()
    except Exception:  # noqa: BLE001 - releasing must never raise into the reaper
        _LOG.exception("executor shutdown failed")


def malloc_trim() -> bool:
    """Give freed memory back: glibc's free heap pages to the OS, and on a GPU the CUDA caching
    allocator's unused blocks to the driver. False where there is no glibc."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - giving memory back is best effort
        _LOG.exception("torch.cuda.empty_cache failed")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the registry ---------------------------------------------------------------------------------


@dataclass
class _Slot:
    engine: Any
    kv_bytes: int


@dataclass
class _Session:
    session_id: str
    last_seen: float
    engines: dict[str, _Slot] = field(default_factory=dict)
    state: list[dict] = field(default_factory=list)  # the session's own dicts, emptied when reaped
    runtime_id: str = ""  # the Streamlit session id, asked about the connection ("" = session_id)
    seen_connected: bool = False
    disconnected_since: float | None = None
    saved: dict = field(default_factory=dict)  # what a reload of its page gets back (claim)


def is_served() -> bool:
    """True inside a real `streamlit run` server (not AppTest, not a plain script)."""
    try:
        from streamlit.runtime import Runtime

        return Runtime.exists() and type(Runtime.instance()) is Runtime  # AppTest mocks it
    except Exception:  # noqa: BLE001
        return False


def freeze_heap() -> bool:
    """In a served process, move every object alive now into the collector's permanent
    generation (gc.freeze). Once the weights, the modules and an engine are in memory, each
    full collection otherwise walks ~300 k long-lived objects: measured here, one per click and
    ~0.14 CPU-s, more than the engine step. Called when an engine is admitted; the reaper thaws
    and collects everything when it releases engines (a released engine's cycles may be frozen),
    then freezes again. Garbage that is not cyclic is freed by reference counting as ever.
    Returns whether it froze (not under AppTest or pytest; LLM_LAB_GC_FREEZE=0 turns it off)."""
    if os.environ.get("LLM_LAB_GC_FREEZE", "1").strip() == "0" or not is_served():
        return False
    gc.collect()  # cheap after the first time: the frozen objects are not walked
    gc.freeze()
    return True


def streamlit_is_connected(session_id: str) -> bool | None:
    """Whether this session's browser is connected (a live websocket); None where unknown."""
    try:
        from streamlit.runtime import Runtime

        if not Runtime.exists():
            return None
        connected = Runtime.instance().is_active_session(session_id)  # documented thread-safe
        return connected if isinstance(connected, bool) else None  # AppTest mocks the Runtime
    except Exception:  # noqa: BLE001 - any runtime trouble means "unknown", never a crash
        return None


class SessionRegistry:
    """Process-wide: sessions, their engines, the caps, and the reaper."""

    def __init__(
        self,
        limits: ClassroomLimits | None = None,
        is_connected: Callable[[str], bool | None] = streamlit_is_connected,
        clock: Callable[[], float] = time.monotonic,
        trim: Callable[[], Any] = malloc_trim,
        freeze: Callable[[], Any] = freeze_heap,
    ):
        self.limits = limits or ClassroomLimits.from_env()
        self._is_connected = is_connected
        self._clock = clock
        self._trim = trim
        self._freeze = freeze
        self._lock = threading.RLock()
        self._sessions: dict[str, _Session] = {}
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self.reaped_sessions = 0
        self.released_engines = 0

    # -- what sessions report ------------------------------------------------------------------
    def touch(
        self, session_id: str, *state: dict, runtime_id: str = "", saved: dict | None = None
    ) -> None:
        """A script run of this session: it is alive now. `state` are its dicts to empty on reap;
        `runtime_id` is the id to ask the Streamlit runtime about (default: session_id); `saved`
        what a reload of its page gets back (claim), kept until the session is released."""
        with self._lock:
            entry = self._sessions.get(session_id)
            if entry is None:
                entry = self._sessions[session_id] = _Session(session_id, self._clock())
            entry.runtime_id = runtime_id or entry.runtime_id
            if saved:
                entry.saved.update(saved)
            entry.last_seen = self._clock()
            entry.disconnected_since = None
            if not entry.seen_connected:  # so a tab closed before the reaper's first look counts
                entry.seen_connected = bool(self._is_connected(entry.runtime_id or session_id))
            for d in state:
                if not any(d is known for known in entry.state):
                    entry.state.append(d)

    def claim(self, session_id: str, runtime_id: str, wait_s: float = 1.0) -> dict | None:
        """A new browser session (a reload) takes over what `session_id` saved: returns a copy of
        it, or None where there is none or where another connected tab still holds it (after
        waiting up to `wait_s` for a reloading tab's old connection to close). The session then
        answers to `runtime_id`, so the reaper watches the new tab."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                entry = self._sessions.get(session_id)
                if entry is None:
                    return None
                owner = entry.runtime_id or entry.session_id
            if owner == runtime_id or not self._is_connected(owner):
                break  # gone (a reload closed it), or unknown (no Streamlit runtime)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
        with self._lock:
            entry.runtime_id = runtime_id
            entry.last_seen = self._clock()
            entry.disconnected_since = None
            return dict(entry.saved)

    def usage(self) -> tuple[int, int]:
        """(engines, KV bytes) over all sessions."""
        with self._lock:
            slots = [s for e in self._sessions.values() for s in e.engines.values()]
            return len(slots), sum(s.kv_bytes for s in slots)

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def check_room(self, session_id: str, key: str, need_bytes: int) -> None:
        """Raise ClassroomFull if an engine of `need_bytes` under (session, key) would pass a cap.
        An engine this session already holds under `key` is counted as given back."""
        lim = self.limits
        with self._lock:
            engines, kv = self.usage()
            old = self._sessions.get(session_id)
            old_slot = old.engines.get(key) if old else None
            if old_slot is not None:
                engines, kv = engines - 1, kv - old_slot.kv_bytes
            figures = dict(
                engines=engines,
                max_engines=lim.max_engines,
                kv_bytes=kv,
                max_kv_bytes=lim.max_kv_bytes,
                need_bytes=need_bytes,
                retry_s=lim.session_ttl_s + lim.reap_interval_s,
            )
            if need_bytes > lim.max_kv_bytes:
                raise ClassroomFull("too_big", **figures)
            if engines + 1 > lim.max_engines:
                raise ClassroomFull("engines", **figures)
            if kv + need_bytes > lim.max_kv_bytes:
                raise ClassroomFull("kv", **figures)

    def admit(self, session_id: str, key: str, engine, kv_bytes: int | None = None) -> None:
        """Register `engine` as this session's engine under `key` (replacing and releasing an older
        one), or raise ClassroomFull and leave everything as it was."""
        need = planned_kv_bytes(engine) if kv_bytes is None else kv_bytes
        with self._lock:
            self.check_room(session_id, key, need)
            entry = self._sessions.get(session_id)
            if entry is None:
                entry = self._sessions[session_id] = _Session(session_id, self._clock())
            entry.last_seen = self._clock()
            old = entry.engines.pop(key, None)
            entry.engines[key] = _Slot(engine, need)
        if old is not None and old.engine is not engine:
            self._release_slot(old)
        self._freeze()  # the new engine and everything before it: long-lived from now on

    def release(self, session_id: str, key: str) -> bool:
        """Release one engine of a session (its reset button). True if there was one."""
        with self._lock:
            entry = self._sessions.get(session_id)
            slot = entry.engines.pop(key, None) if entry else None
        if slot is None:
            return False
        self._release_slot(slot)
        return True

    def release_session(self, session_id: str, trim: bool = True) -> int:
        """Release every engine of a session and empty its registered dicts.
        Returns how many engines were released."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
        if entry is None:
            return 0
        for slot in entry.engines.values():
            self._release_slot(slot)
        for d in entry.state:
            d.clear()
        entry.saved.clear()
        n = len(entry.engines)
        entry.engines.clear()
        if trim:
            self._give_back_memory()
        return n

    def _release_slot(self, slot: _Slot) -> None:
        release_engine(slot.engine)
        self.released_engines += 1

    def _give_back_memory(self) -> None:
        gc.unfreeze()  # a released engine's cycles may have been frozen with it (freeze_heap)
        gc.collect()
        self._freeze()
        self._trim()

    # -- the reaper -----------------------------------------------------------------------------
    def stale_sessions(self) -> list[str]:
        """Sessions whose tab has been gone for session_ttl_s (or, where the connection state is
        unknown, which have not run a script for idle_ttl_s)."""
        now = self._clock()
        stale = []
        with self._lock:
            entries = list(self._sessions.values())
        for entry in entries:
            connected = self._is_connected(entry.runtime_id or entry.session_id)
            with self._lock:
                if connected:
                    entry.seen_connected = True
                    entry.disconnected_since = None
                elif connected is False and entry.seen_connected:
                    if entry.disconnected_since is None:
                        entry.disconnected_since = now
                    if now - entry.disconnected_since >= self.limits.session_ttl_s:
                        stale.append(entry.session_id)
                elif now - entry.last_seen >= self.limits.idle_ttl_s:
                    stale.append(entry.session_id)
        return stale

    def reap(self) -> list[str]:
        """Release the engines of stale sessions, then give the memory back to the OS once."""
        stale = self.stale_sessions()
        released = 0
        for session_id in stale:
            released += self.release_session(session_id, trim=False)
        if stale:
            self.reaped_sessions += len(stale)
            before = rss_bytes()
            self._give_back_memory()
            after = rss_bytes()
            engines, kv = self.usage()
            _LOG.info(
                "released %d engines of %d closed tabs; RSS %s → %s MB; now %d engines, %.0f MB KV",
                released,
                len(stale),
                before and before // MB,
                after and after // MB,
                engines,
                kv / MB,
            )
        return stale

    def start_reaper(self) -> None:
        with self._lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._stop.clear()
            self._reaper = threading.Thread(
                target=self._reap_forever, name="llm-lab-reaper", daemon=True
            )
            self._reaper.start()

    def stop_reaper(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout)

    def status(self) -> dict:
        """What an instructor's load script reads (also written to $LLM_LAB_STATUS_FILE)."""
        engines, kv = self.usage()
        with self._lock:
            sessions = len(self._sessions)
        return {
            "engines": engines,
            "kv_bytes": kv,
            "sessions": sessions,
            "reaped_sessions": self.reaped_sessions,
            "released_engines": self.released_engines,
            "rss_bytes": rss_bytes(),
            "time": time.time(),
        }

    def active_sessions(self, window_s: float = ACTIVE_WINDOW_S) -> int:
        """Sessions that ran a script (a click, a play tick) within the last `window_s`."""
        now = self._clock()
        with self._lock:
            return sum(1 for e in self._sessions.values() if now - e.last_seen <= window_s)

    def write_status(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.status(), f)
        os.replace(tmp, path)

    def _reap_forever(self) -> None:
        status_file = os.environ.get("LLM_LAB_STATUS_FILE", "").strip()
        while not self._stop.wait(self.limits.reap_interval_s):
            try:
                self.reap()
                if status_file:
                    self.write_status(status_file)
            except Exception:  # noqa: BLE001 - the reaper must outlive any one bad session
                _LOG.exception("reaper pass failed")


# -- threads per engine step ---------------------------------------------------------------------

DEFAULT_THREADS = (
    torch.get_num_threads()
)  # torch's own choice at start (the cores, or OMP_NUM_THREADS)


def step_threads(active_sessions: int, setting: str | None = None, busy: bool = False) -> int:
    """Intra-op threads for one engine step. A lone learner gets every core torch would use. With
    several learners clicking, or a CPU already busy with other work (`busy`), each step gets one:
    steps then run side by side on different cores instead of each splitting every matmul over
    cores something else needs, where torch's threads wait on each other. Measured on the 2-vCPU
    box under load: a decode step took 1,464 ms wall and 574 CPU-ms with 2 threads, 206 ms and
    84 CPU-ms with 1; chapter 07's default run (115 steps of three engines) took 214 s with 2
    threads and 18 s with 1 while other processes kept the load above 2 (14 s with 2 threads on
    a quiet moment). LLM_LAB_STEP_THREADS: "auto" (this rule, the default) or a number."""
    setting = (setting or os.environ.get("LLM_LAB_STEP_THREADS", "auto")).strip().lower()
    if setting != "auto":
        try:
            return max(1, int(setting))
        except ValueError:
            _LOG.warning("ignoring LLM_LAB_STEP_THREADS=%r (not 'auto' or a number)", setting)
    return 1 if active_sessions > 1 or busy else DEFAULT_THREADS


def cpu_busy() -> bool:
    """Whether the machine's run queue (1-minute load average) fills every core: more torch
    threads would then only queue behind other work."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:
        return False


def apply_step_threads() -> int:
    """Set this thread's torch threads for the step it is about to run (served app only: under
    AppTest and pytest, threads stay as they are). Returns the count in force."""
    if not is_served():
        return torch.get_num_threads()
    threads = step_threads(get_registry().active_sessions(), busy=cpu_busy())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


_registry: SessionRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> SessionRegistry:
    """The process's registry (created from the environment on first use, reaper started)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = SessionRegistry()
            _registry.start_reaper()
        return _registry
