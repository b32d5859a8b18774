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
    /_stcore/health answers, else stops it and raises RuntimeError with the log's tail."""
    python = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
    port = free_port()
    cmd = [python, "-m", "streamlit", "run", app, "--server.port", str(port), *extra_args]
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


@contextmanager
def streamlit_server(log_path: Path, start_timeout_s: float = 120):
    """Start the app on 127.0.0.1 and yield its URL once /_stcore/health answers."""
    flags = (
        "--server.headless",
        "true",
        "--server.address",
        "127.0.0.1",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
    )
    try:
        proc, url = start_streamlit(log_path, start_timeout_s=start_timeout_s, extra_args=flags)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield url
    finally:
        stop_process(proc)


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
