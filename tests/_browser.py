"""Shared harness of the browser tests: a real `streamlit run app.py` on a free localhost port and
a headless Debian Chromium driven by Playwright. Tests skip only where no Chromium can be found."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "tests" / "screenshots"
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
RUNNING = "[data-testid='stApp'][data-test-script-state='running']"
# Without the background-networking flags Chromium keeps dialling out on this closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def find_chromium() -> str | None:
    for candidate in (
        os.environ.get("CHROMIUM"),
        "/usr/bin/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
        shutil.which("google-chrome"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_streamlit(
    log_path: Path,
    app: str = "app.py",
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120,
    extra_args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, str]:
    """`streamlit run app` on 127.0.0.1 and a free port; returns (process, URL) once
    /_stcore/health answers, else stops it and raises RuntimeError with the log's tail. `env`, if
    given, is the whole environment of the server (not added to this process's)."""
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    port = free_port()
    # app.py through ui/serve.py, as run.sh starts it (no "Page not found" on a first deep link)
    launcher = ["-m", "ui.serve"] if app == "app.py" else ["-m", "streamlit", "run", app]
    cmd = [python, *launcher, "--server.port", str(port), *extra_args]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env or None
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"streamlit did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.3)


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


SERVER_FLAGS = (
    "--server.headless",
    "true",
    "--server.address",
    "127.0.0.1",
    "--browser.gatherUsageStats",
    "false",
    "--server.fileWatcherType",
    "none",
)


@contextmanager
def streamlit_server(log_path: Path, start_timeout_s: float = 120):
    """Start the app on 127.0.0.1 and yield its URL once /_stcore/health answers."""
    try:
        proc, url = start_streamlit(
            log_path, start_timeout_s=start_timeout_s, extra_args=SERVER_FLAGS
        )
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield url
    finally:
        stop_process(proc)


class SharedServer:
    """One `streamlit run app.py` (the real default model) for every browser test module that
    asks for it through the `shared_app_url` fixture (tests/conftest.py), instead of a server and
    a model load per module. Started on first use; tests/conftest.py stops it as soon as the next
    test does not need it (and at the end of the session), so it never idles behind other tests.

    Each module still gets its own Chromium page, i.e. its own Streamlit session: session state,
    engine settings and the learner's engines are per session, and the engines of a closed page
    go after LLM_LAB_SESSION_TTL_S, shortened here so that the engines of earlier modules do not
    pile up in the one process (the classroom's own tests keep their own servers and settings)."""

    ENV = {"LLM_LAB_SESSION_TTL_S": "10"}

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.log_path: Path | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, log_dir: Path, start_timeout_s: float = 120) -> str:
        """The running server's URL, starting it first where none runs (or it died)."""
        if self.running:
            return self.url
        self.stop()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "streamlit.log"
        try:
            self.proc, self.url = start_streamlit(
                self.log_path,
                env={**os.environ, **self.ENV},
                start_timeout_s=start_timeout_s,
                extra_args=SERVER_FLAGS,
            )
        except RuntimeError as exc:
            pytest.fail(str(exc))
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = self.url = None


SHARED = SharedServer()


# In the page, before the app's own scripts: the frames its Streamlit websocket delivered (counted
# anew for each socket) and the time of the DOM's last change. Streamlit draws most widgets and
# every chart from code it loads on first use, showing an stSkeleton meanwhile, so a page can go on
# changing after the server's last frame.
WATCH_PAGE = """(() => {
  const Native = window.WebSocket;
  window.__labFrames = 0;
  window.__labChanged = performance.now();
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      if (String(args[0]).includes("/_stcore/stream")) {
        window.__labFrames = 0;
        this.addEventListener("message", () => { window.__labFrames += 1; });
      }
    }
  };
  new MutationObserver(() => { window.__labChanged = performance.now(); }).observe(document, {
    subtree: true, childList: true, attributes: true, characterData: true,
  });
})();"""
# The page has taken in `frames` frames, shows no skeleton and an idle script, and its DOM has not
# changed for `quiet_ms`.
PAGE_SETTLED = f"""([frames, quiet_ms]) => window.__labFrames >= frames
  && !document.querySelector("[data-testid='stSkeleton']")
  && document.querySelector("{IDLE}") !== null
  && performance.now() - window.__labChanged > quiet_ms"""


class ScriptRuns:
    """The script runs of one page, read from its websocket. The page asks for a run with a
    rerun_script message (a click, a page load; a fragment's timer asks too, marked is_auto_rerun;
    a click inside a fragment names it). Every run, full or fragment, starts with a new_session
    message that names the fragments it reruns (none: a full run), and the server sends
    session_status_changed when it goes from idle to running and back. The page's own
    `data-test-script-state` can miss a short run (the frontend may apply "running" and
    "notRunning" in one render), which left the harness guessing with fixed sleeps; the frames say
    when the asked-for run started, when the server went quiet, and how much the page still has to
    take in. A timer's fragment run that starts just after a click does not answer it: the click's
    own run may start later, and a wait that ended on the timer's run let the next click preempt
    it (chapter 14's 연결 끊기 was lost that way in CI)."""

    STREAM = "/_stcore/stream"
    pages: dict[int, ScriptRuns] = {}

    def __init__(self, page) -> None:
        self.page = page
        self.asked = 0  # runs the page asked for, timers' runs left out
        self.answered = True  # a run that answers the last of them has started
        self.wanted: str | None = None  # the fragment the last ask named (None: the whole app)
        self.started = 0  # runs the server started for this page
        self.running = False
        self.socket = None  # the page's current Streamlit websocket
        self.frames = 0  # frames received on it
        self.last_frame = time.monotonic()
        self.seen = (0, 0)  # (asked, started) when a wait last returned
        page.add_init_script(WATCH_PAGE)
        page.on("websocket", self._attach)
        ScriptRuns.pages[id(page)] = self

    @classmethod
    def of(cls, page) -> ScriptRuns:
        runs = cls.pages.get(id(page))
        assert runs is not None and runs.page is page, "open pages with watch_runs(page) first"
        return runs

    def _attach(self, ws) -> None:
        if self.STREAM in ws.url:
            self.socket, self.frames = ws, 0
            ws.on("framesent", lambda payload: self._sent(ws, payload))
            ws.on("framereceived", lambda payload: self._received(ws, payload))

    def _sent(self, ws, payload) -> None:
        from streamlit.proto.BackMsg_pb2 import BackMsg

        if ws is not self.socket or isinstance(payload, str):
            return
        msg = BackMsg.FromString(payload)
        if msg.WhichOneof("type") == "rerun_script" and not msg.rerun_script.is_auto_rerun:
            self.asked += 1
            self.answered = False
            self.wanted = msg.rerun_script.fragment_id or None

    def _received(self, ws, payload) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        if ws is not self.socket:  # a page left behind (goto, reload)
            return
        self.frames += 1
        self.last_frame = time.monotonic()
        if isinstance(payload, str):
            return
        msg = ForwardMsg.FromString(payload)
        kind = msg.WhichOneof("type")
        if kind == "new_session":  # a run starts, possibly preempting one (no status change then)
            self.started += 1
            self.running = True
            fragments = msg.metadata.run.fragment_ids
            if not fragments or self.wanted in fragments:  # a full run reruns every fragment
                self.answered = True
        elif kind == "session_status_changed":
            self.running = msg.session_status_changed.script_is_running

    def _until(self, done, timeout_ms: int) -> bool:
        deadline = time.monotonic() + timeout_ms / 1000
        while not done():
            if time.monotonic() > deadline:
                return False
            self.page.wait_for_timeout(20)
        return True

    def wait_settled(self, timeout_ms: int, start_ms: int = 3000, quiet_ms: int = 100) -> None:
        """Wait for the run the last action asked for (an action that asks for none: for any run,
        up to `start_ms`), for the server to be done and quiet for `quiet_ms` (a run that ends in
        st.rerun starts the next at once), then for the page to have taken in every frame and
        drawn it (PAGE_SETTLED)."""
        asked, started = self.seen
        self._until(lambda: self.asked > asked or self.started > started, start_ms)
        quiet = quiet_ms / 1000
        done = self._until(
            lambda: (
                self.answered and not self.running and time.monotonic() - self.last_frame > quiet
            ),
            timeout_ms,
        )
        if not done:
            pytest.fail(f"the app's script still runs after {timeout_ms} ms")
        self.page.wait_for_function(PAGE_SETTLED, arg=[self.frames, quiet_ms], timeout=timeout_ms)
        self.seen = (self.asked, self.started)

    def wait_asked(self, asked: int, start_ms: int = 3000) -> None:
        """Wait until the page has asked for more than `asked` runs: a click's rerun_script leaves
        the browser a moment after Playwright's click returns, and a wait begun before it would
        settle on whatever ran before."""
        self._until(lambda: self.asked > asked, start_ms)

    def stays_quiet(self, ms: int) -> bool:
        """True if no run starts within `ms`."""
        before = self.started
        self.page.wait_for_timeout(ms)
        return self.started == before


def watch_runs(page) -> None:
    """Follow the page's script runs (ScriptRuns); call before its first goto."""
    ScriptRuns(page)


@contextmanager
def browser_page(app_url: str, timeout_ms: int):
    """A Chromium page warmed up on the app's main page (torch import, weights loaded)."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip(
            "no Chromium found (looked for $CHROMIUM, /usr/bin/chromium, chromium, "
            "chromium-browser): install Debian's chromium to run the browser tests"
        )
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="ko-KR")
        page.set_default_timeout(timeout_ms)
        watch_runs(page)
        page.goto(app_url)
        wait_idle(page, timeout_ms)
        yield page
        browser.close()


def wait_idle(page, timeout_ms: int) -> None:
    """Wait for the script run that a click (or a page load) started to finish, and for the page
    to show its end."""
    ScriptRuns.of(page).wait_settled(timeout_ms)


def stays_idle(page, ms: int = 300) -> bool:
    """True if the page's script does not run again within `ms`. A run's last slice ends with
    st.rerun(scope="app") (ui/lab.py, the fragment's timer stops), so one more run follows."""
    return ScriptRuns.of(page).stays_quiet(ms)


def interact(page, act, timeout_ms: int, run_over: bool = False) -> None:
    """Do `act` (a click, a radio chosen, a box filled and left, a slider's key), which asks for a
    run, then wait for that run: the wait begins once the ask has left the page (ScriptRuns:
    wait_asked), so it cannot settle on a run from before the act or on a timer's. With
    `run_over`, also for the sliced lab run it may start (wait_run_over)."""
    runs = ScriptRuns.of(page)
    asked = runs.asked
    act()
    runs.wait_asked(asked)
    (wait_run_over if run_over else wait_idle)(page, timeout_ms)


def click_button(page, label: str, timeout_ms: int, run_over: bool = True) -> None:
    """Click the first button named `label`, then wait for the run the click asks for and, with
    `run_over`, for the sliced lab run it may start (wait_run_over)."""
    target = page.get_by_role("button", name=label, exact=True).first
    target.scroll_into_view_if_needed()
    interact(page, target.click, timeout_ms, run_over)


def wait_run_over(page, timeout_ms: int) -> None:
    """Wait for a lab's sliced run (끝까지, N 스텝, 실행: ui/lab.py's LabRun) to end. The page goes
    idle between two slices while the run's 정지 button stays, so idle alone is not the end."""
    deadline = time.monotonic() + timeout_ms / 1000
    ran = False  # a run's 정지 button was seen: its end brings a full rerun
    while True:
        wait_idle(page, timeout_ms)
        if page.get_by_role("button", name="정지", exact=True).count() == 0:
            if not ran or stays_idle(page):
                return
        else:
            ran = True
        if time.monotonic() > deadline:
            main = page.locator("[data-testid='stMain']").inner_text()
            pytest.fail(f"the lab's run did not end: {' '.join(main.split())[-1500:]}")


def open_tab(page, label: str, timeout_ms: int, nth: int = 0) -> None:
    """Click the nth tab labelled `label` (a lab draws three tabs per engine: 요청 여정, 스케줄러
    결정, KV 캐시). Only the open tab is drawn (ui/lab.py, views), so the click reruns the lab:
    wait for that run; the tab is then selected."""
    tab = page.get_by_role("tab", name=label, exact=True).nth(nth)
    tab.scroll_into_view_if_needed()
    tab.click()
    wait_idle(page, timeout_ms)
    assert tab.get_attribute("aria-selected") == "true", f"tab {label} did not open"


def plot_types(page) -> list[list[str]]:
    """Per rendered plotly plot: its traces' types ('heatmap' for a KV grid, 'bar', ...)."""
    return page.locator(".js-plotly-plot").evaluate_all(
        "els => els.map(e => (e.data || []).map(t => t.type || 'scatter'))"
    )


def chapter_fixtures(name: str, timeout_ms: int):
    """A chapter test module's two fixtures: `app_url` (the `streamlit run app.py` on the real
    default model that the browser modules share, see SharedServer) and `page` (one Chromium page,
    i.e. one Streamlit session, for the module). `name` (the module's chapters) was the label of
    the module's own server; it is kept so that the modules' calls stay as they are.
    Use as `app_url, page = chapter_fixtures("ch09", TIMEOUT_MS)` at module level."""

    @pytest.fixture(scope="module")
    def app_url(shared_app_url):
        return shared_app_url

    @pytest.fixture(scope="module")
    def page(app_url):
        with browser_page(app_url, timeout_ms) as pg:
            yield pg

    return app_url, page


class LabDriver:
    """What a chapter's browser test does on its page, with one timeout for every script run:
    wait for a run to finish, fail on an exception (and, with error_alerts, on an st.error),
    click a button by its label, open a lab's tab, count the traces of each rendered plot, open a
    chapter. A lab that failed as a whole (its Korean error in place of the lab) fails the test
    too."""

    def __init__(self, timeout_ms: int, error_alerts: bool = False):
        self.timeout_ms = timeout_ms
        self.errors = "[data-testid='stException']" + (
            ", [data-testid='stAlertContentError']" if error_alerts else ""
        )

    def wait_idle(self, pg) -> None:
        """Wait for the click's script run and for the lab run it may have started."""
        wait_run_over(pg, self.timeout_ms)

    def no_exception(self, pg) -> None:
        errors = pg.locator(self.errors)
        assert errors.count() == 0, errors.first.inner_text() + self.engine_words(pg)
        # the lab's own catch-all (ui/lesson.py): the page survived, the lab did not
        failed = pg.get_by_text("실험실을 그리지 못했습니다")
        assert failed.count() == 0, failed.first.inner_text()

    @staticmethod
    def engine_words(pg) -> str:
        """The engine's own message that ui/errors.show_error folds into an expander under the
        Korean one: a failed test should say what the engine said, not only the advice."""
        folded = pg.locator("[data-testid='stExpander']").filter(has_text="엔진이 남긴 원문 메시지")
        words = []
        for expander in folded.all():
            expander.locator("summary").click()  # a closed expander has no content in the DOM
            words.append("\n" + expander.inner_text())
        return "".join(words)

    @staticmethod
    def plot_traces(pg) -> list[int]:
        return pg.locator(".js-plotly-plot").evaluate_all(
            "els => els.map(e => (e.data || []).length)"
        )

    def open_tab(self, pg, label: str, nth: int = 0) -> None:
        open_tab(pg, label, self.timeout_ms, nth)
        self.no_exception(pg)

    def click(self, pg, name: str) -> None:
        click_button(pg, name, self.timeout_ms)
        self.no_exception(pg)

    def interact(self, pg, act) -> None:
        """`act` (a radio, a box, a slider: not a button) and the run it asks for (interact)."""
        interact(pg, act, self.timeout_ms, run_over=True)
        self.no_exception(pg)

    def open_chapter(self, pg, app_url: str, chapter: str) -> None:
        """Go to /chNN and wait for its first run: no dialog ("Page not found" is gone since the
        app runs through ui/serve.py), no exception."""
        pg.goto(f"{app_url}/{chapter}")
        pg.wait_for_selector("[data-testid='stApp']")
        self.wait_idle(pg)
        dialogs = pg.locator("[role=dialog]")
        assert dialogs.count() == 0, dialogs.first.inner_text()
        self.no_exception(pg)
