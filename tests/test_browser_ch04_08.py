"""Chapters 04–08 in a real browser: `streamlit run app.py` on a free port (the repo's venv python,
the real default model), driven by Playwright with Debian's Chromium. Each chapter's lab is run with
its 실행 button, the plotly plots must render with data, and a screenshot of the lab is saved in
tests/screenshots/. Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "tests" / "screenshots"
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
RUNNING = "[data-testid='stApp'][data-test-script-state='running']"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
STEP_TIMEOUT_MS = 300_000
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

# chapter url → (text that must be on the page, minimum plots after 실행)
CHAPTERS = {
    "ch04": ("지연 시간", 4),
    "ch05": ("메모리 예산 계산기", 3),
    "ch06": ("연속 최대 길이 예약", 4),
    "ch07": ("같은 워크로드, 세 가지 방식", 6),
    "ch08": ("긴 프롬프트가 decode 중인", 4),
}


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(default_model_dir, tmp_path_factory):
    if find_chromium() is None:
        pytest.skip("no Chromium at $CHROMIUM or /usr/bin/chromium: install Debian's chromium to run the browser test")
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit_ch04_08") / "streamlit.log"
    cmd = [python, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.address", "127.0.0.1",
           "--server.port", str(port), "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def page(app_url):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), headless=True, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="ko-KR")
        pg.set_default_timeout(STEP_TIMEOUT_MS)
        pg.goto(app_url)  # warm-up: torch import and the weights
        pg.wait_for_selector(IDLE, timeout=STEP_TIMEOUT_MS)
        yield pg
        browser.close()


def wait_idle(pg) -> None:
    try:
        pg.wait_for_selector(RUNNING, timeout=3000)
    except Exception:  # noqa: BLE001 - the run may already be over
        pass
    pg.wait_for_selector(IDLE, timeout=STEP_TIMEOUT_MS)
    pg.wait_for_timeout(500)


def no_exception(pg) -> None:
    errors = pg.locator("[data-testid='stException']")
    assert errors.count() == 0, errors.first.inner_text()


def plot_traces(pg) -> list[int]:
    return pg.locator(".js-plotly-plot").evaluate_all("els => els.map(e => (e.data || []).length)")


@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_chapter_lab_in_browser(page, app_url, chapter):
    text, min_plots = CHAPTERS[chapter]
    page.goto(f"{app_url}/{chapter}")
    page.wait_for_selector("[data-testid='stApp']")
    wait_idle(page)
    if page.locator("[role=dialog]").count():
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)
    no_exception(page)
    assert text in page.inner_text("body")
    before = len(plot_traces(page))
    button = page.get_by_role("button", name="실행", exact=True).first
    button.scroll_into_view_if_needed()
    button.click()
    wait_idle(page)
    no_exception(page)
    traces = plot_traces(page)
    assert len(traces) >= max(min_plots, before + 1), traces
    # the plots the run added carry data (the step-by-step lab of ch06 may still be empty above them)
    assert all(n > 0 for n in traces[before:]), traces
    page.locator(".js-plotly-plot").nth(before).scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / f"{chapter}_lab.png"))
