"""End to end in a real browser: `streamlit run app.py` on a free port, driven by Playwright with
Debian's Chromium. Opens chapters 01–03, runs labs to completion, checks the plotly plots and the
streamed Korean text, and saves screenshots (tests/screenshots/, one copied to docs/screenshots/lab.png).

Skips only where no Chromium (or Playwright) can be found."""

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
README_SHOT = ROOT / "docs" / "screenshots" / "lab.png"
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"
RUNNING = "[data-testid='stApp'][data-test-script-state='running']"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
STEP_TIMEOUT_MS = 180_000


def url_of(chapter_id: str) -> str:
    from ui.lesson import CHAPTERS

    return next(c.url_path for c in CHAPTERS if c.id == chapter_id)


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(default_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
           "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
           "--server.fileWatcherType", "none"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
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
def browser_page(app_url):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found (looked for $CHROMIUM, /usr/bin/chromium, chromium, chromium-browser): "
                    "install Debian's chromium to run the browser test")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="ko-KR")
        page.set_default_timeout(STEP_TIMEOUT_MS)
        page.goto(app_url)  # warm up on the main page (imports torch, loads the weights)
        page.wait_for_selector(IDLE, timeout=STEP_TIMEOUT_MS)
        yield page
        browser.close()


def wait_idle(page) -> None:
    """Wait for the script run a click started to finish."""
    try:
        page.wait_for_selector(RUNNING, timeout=3000)
    except Exception:  # noqa: BLE001 - the run may have finished before we looked
        pass
    page.wait_for_selector(IDLE, timeout=STEP_TIMEOUT_MS)
    page.wait_for_timeout(300)


def open_page(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("[data-testid='stApp']")
    wait_idle(page)
    dialogs = page.locator("[role=dialog]")
    if dialogs.count() and "Page not found" in dialogs.first.inner_text():
        # Streamlit 1.67 with a pages/ folder: a session's first direct link to a st.Page whose
        # url_path differs from its file name shows this dialog over the right page (see ui/lesson.py).
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)
    assert dialogs.count() == 0, f"unexpected dialog: {dialogs.first.inner_text()}"
    assert "엔진 설정" in page.inner_text("body"), "the page runs inside app.py (sidebar present)"
    assert page.locator("[data-testid='stException']").count() == 0, page.locator(
        "[data-testid='stException']").first.inner_text()


def click(page, name: str) -> None:
    button = page.get_by_role("button", name=name, exact=True).first
    button.scroll_into_view_if_needed()
    button.click()
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0, page.locator(
        "[data-testid='stException']").first.inner_text()


def finish_lab(page) -> None:
    """Press 끝까지 and wait until every request of the lab shows ✅ 완료 and the run is over."""
    click(page, "끝까지")
    page.wait_for_function(
        "() => document.body.innerText.includes('✅ 완료') && !document.body.innerText.includes('▶️ 생성 중')"
        " && !document.body.innerText.includes('⏳ 대기')", timeout=STEP_TIMEOUT_MS)
    wait_idle(page)


def visible_plots(page) -> int:
    return page.locator(".js-plotly-plot .main-svg").evaluate_all(
        "els => els.filter(e => e.getBoundingClientRect().width > 0).length")


def plot_traces(page) -> list[int]:
    """Number of data traces in each rendered plotly plot."""
    return page.locator(".js-plotly-plot").evaluate_all("els => els.map(e => (e.data || []).length)")


def test_chapter01_http_request(browser_page, app_url):
    page = browser_page
    open_page(page, f"{app_url}/{url_of('01')}")
    assert "학습된 모델에서 추론 서버까지" in page.inner_text("body")
    click(page, "HTTP 요청 보내기 (stream=True)")
    body = page.inner_text("body")
    assert "HTTP 200" in body and "chatcmpl-" in body
    assert visible_plots(page) >= 2 and all(n > 0 for n in plot_traces(page))
    page.get_by_text("② 실제 HTTP 요청 하나").first.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "ch01_http.png"))


def test_chapter02_lab_to_the_end(browser_page, app_url):
    page = browser_page
    open_page(page, f"{app_url}/{url_of('02')}")
    assert "글자당 토큰" in page.inner_text("body")
    click(page, "예시 요청 추가")  # the default preset is the Korean self-introduction
    page.get_by_label("직접 쓴 프롬프트").fill("Explain the KV cache in one sentence.")
    click(page, "요청 추가")
    click(page, "다음 스텝")
    click(page, "다음 스텝")
    click(page, "다음 스텝")
    page.get_by_role("button", name="다음 스텝", exact=True).first.scroll_into_view_if_needed()
    page.mouse.wheel(0, 250)
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch02_lab_mid_run.png"))
    README_SHOT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHOTS / "ch02_lab_mid_run.png", README_SHOT)
    finish_lab(page)
    body = page.inner_text("body")
    assert "한국어로 자기소개를 해 주세요." in body  # the streamed panel shows the Korean request
    stream = body[body.index("스트리밍된 글"):]
    generated = stream.split("프롬프트: 한국어로 자기소개를 해 주세요.", 1)[1].strip().splitlines()[0]
    assert generated and generated != "…", "the generated text is shown"
    assert "TTFT, TPOT, E2E" in body  # the metrics of the finished request (측정값)
    assert visible_plots(page) >= 1 and all(n > 0 for n in plot_traces(page))
    page.get_by_role("tab", name="KV 캐시").first.click()
    page.wait_for_timeout(500)
    assert visible_plots(page) >= 1
    page.screenshot(path=str(SHOTS / "ch02_lab_done.png"))


def test_chapter03_cache_grows(browser_page, app_url):
    page = browser_page
    open_page(page, f"{app_url}/{url_of('03')}")
    assert "46,080" in page.inner_text("body")
    click(page, "예시 요청 추가")
    click(page, "다음 스텝")
    page.get_by_role("tab", name="KV 캐시").first.click()
    page.wait_for_timeout(500)
    assert visible_plots(page) >= 1
    page.screenshot(path=str(SHOTS / "ch03_kv_grid.png"))
    # 재생: a fragment with run_every steps the engine on its own (AppTest cannot check this).
    page.get_by_role("button", name="재생", exact=True).first.click()
    page.wait_for_function("() => /마지막 스텝 ([3-9]|\\d\\d)/.test(document.body.innerText)", timeout=STEP_TIMEOUT_MS)
    finish_lab(page)
    assert all(n > 0 for n in plot_traces(page))
