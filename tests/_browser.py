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
        page.goto(app_url)
        page.wait_for_selector(IDLE, timeout=timeout_ms)
        yield page
        browser.close()


def wait_idle(page, timeout_ms: int, settle_ms: int = 300) -> None:
    """Wait for the script run that a click started to finish."""
    try:
        page.wait_for_selector(RUNNING, timeout=3000)
    except Exception:  # noqa: BLE001 - the run may have finished before we looked
        pass
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    page.wait_for_timeout(settle_ms)


def stays_idle(page, ms: int = 700) -> bool:
    """True if the page's script is still not running `ms` later. A run's last slice ends with
    st.rerun(scope="app") (ui/lab.py, the fragment's timer stops): the page can read idle between
    that fragment run and the full run it asks for, whose sidebar (엔진 상태) is drawn last."""
    page.wait_for_timeout(ms)
    return page.locator(IDLE).count() == 1


def wait_run_over(page, timeout_ms: int) -> None:
    """Wait for a lab's sliced run (끝까지, N 스텝, 실행: ui/lab.py's LabRun) to end. The page goes
    idle between two slices while the run's 정지 button stays, so idle alone is not the end."""
    deadline = time.monotonic() + timeout_ms / 1000
    ran = False  # a run's 정지 button was seen: its end brings a full rerun
    while True:
        wait_idle(page, timeout_ms, settle_ms=300)
        if page.get_by_role("button", name="정지", exact=True).count() == 0:
            if not ran or stays_idle(page):
                return
        else:
            ran = True
        if time.monotonic() > deadline:
            main = page.locator("[data-testid='stMain']").inner_text()
            pytest.fail(f"the lab's run did not end: {' '.join(main.split())[-1500:]}")
        page.wait_for_timeout(500)


def open_tab(page, label: str, timeout_ms: int, nth: int = 0) -> None:
    """Click the nth tab labelled `label` (a lab draws three tabs per engine: 요청 여정, 스케줄러
    결정, KV 캐시). Only the open tab is drawn (ui/lab.py, views), so the click reruns the lab:
    wait for that run; the tab is then selected."""
    tab = page.get_by_role("tab", name=label, exact=True).nth(nth)
    tab.scroll_into_view_if_needed()
    tab.click()
    wait_idle(page, timeout_ms, settle_ms=500)
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
        pg.wait_for_timeout(200)

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
        button = pg.get_by_role("button", name=name, exact=True).first
        button.scroll_into_view_if_needed()
        button.click()
        self.wait_idle(pg)
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
