"""End to end in a real browser: `streamlit run app.py` on a free port (the one the browser modules
share), driven by Playwright with Debian's Chromium. Opens chapters 01–03, runs labs to completion,
checks the plotly plots and the streamed Korean text, and saves screenshots (tests/screenshots/,
one copied to docs/screenshots/lab.png).

Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import os
import shutil

import pytest
from _browser import ROOT, SHOTS, click_button, plot_types
from _browser import browser_page as open_browser_page
from _browser import open_tab as _open_tab
from _browser import wait_idle as _wait_idle

pytestmark = pytest.mark.browser

# Copied over the README's picture only when asked (UPDATE_README_SHOT=1), so a test run leaves
# the tracked files alone.
README_SHOT = ROOT / "docs" / "screenshots" / "lab.png"
STEP_TIMEOUT_MS = 180_000


def url_of(chapter_id: str) -> str:
    from ui.lesson import CHAPTERS

    return next(c.address for c in CHAPTERS if c.id == chapter_id)


@pytest.fixture(scope="module")
def app_url(shared_app_url):
    """The browser modules' shared `streamlit run app.py` (tests/_browser.py, SharedServer)."""
    return shared_app_url


@pytest.fixture(scope="module")
def browser_page(app_url):
    with open_browser_page(app_url, STEP_TIMEOUT_MS) as page:
        yield page


def wait_idle(page) -> None:
    _wait_idle(page, STEP_TIMEOUT_MS)


def open_tab(page, label: str) -> None:
    _open_tab(page, label, STEP_TIMEOUT_MS)


def assert_kv_tab_drawn(page) -> None:
    """With the lab's KV 캐시 tab open: its block grid (a heatmap; the chapter's own plots have
    none) is drawn, after the rerun that opening the tab started (only the open tab is drawn)."""
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')]"
        ".some(e => (e.data || []).some(t => t.type === 'heatmap'))",
        timeout=STEP_TIMEOUT_MS,
    )
    types = plot_types(page)
    assert any("heatmap" in t for t in types), types
    assert visible_plots(page) >= 2  # the grid and the occupancy over the steps


def open_page(page, url: str) -> None:
    page.goto(url)
    page.wait_for_selector("[data-testid='stApp']")
    wait_idle(page)
    dialogs = page.locator("[role=dialog]")  # no "Page not found" (the app runs via ui/serve.py)
    assert dialogs.count() == 0, f"unexpected dialog: {dialogs.first.inner_text()}"
    assert "엔진 설정" in page.inner_text("body"), "the page runs inside app.py (sidebar present)"
    assert page.locator("[data-testid='stException']").count() == 0, page.locator(
        "[data-testid='stException']"
    ).first.inner_text()


def click(page, name: str) -> None:
    click_button(page, name, STEP_TIMEOUT_MS, run_over=False)
    assert page.locator("[data-testid='stException']").count() == 0, page.locator(
        "[data-testid='stException']"
    ).first.inner_text()


def finish_lab(page) -> None:
    """Press 끝까지 and wait until every request of the lab shows 상태: 완료 and the run is over."""
    click(page, "끝까지")
    page.wait_for_function(
        "() => document.body.innerText.includes('상태: 완료') && "
        "!document.body.innerText.includes('상태: 생성 중') && "
        "!document.body.innerText.includes('상태: 대기 중')",
        timeout=STEP_TIMEOUT_MS,
    )
    wait_idle(page)


def visible_plots(page) -> int:
    return page.locator(".js-plotly-plot .main-svg").evaluate_all(
        "els => els.filter(e => e.getBoundingClientRect().width > 0).length"
    )


def plot_traces(page) -> list[int]:
    """Number of data traces in each rendered plotly plot."""
    return page.locator(".js-plotly-plot").evaluate_all(
        "els => els.map(e => (e.data || []).length)"
    )


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
    click(page, "예시 요청 추가")  # the default preset: "What is the capital of France?"
    page.get_by_label("직접 쓴 프롬프트").fill("Explain the KV cache in one sentence.")
    click(page, "요청 추가")
    click(page, "다음 스텝")
    click(page, "다음 스텝")
    click(page, "다음 스텝")
    page.get_by_role("button", name="다음 스텝", exact=True).first.scroll_into_view_if_needed()
    page.mouse.wheel(0, 250)
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch02_lab_mid_run.png"))
    if os.environ.get("UPDATE_README_SHOT") == "1":
        README_SHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHOTS / "ch02_lab_mid_run.png", README_SHOT)
    finish_lab(page)
    body = page.inner_text("body")
    assert "What is the capital of France?" in body  # the streamed panel shows the request
    stream = body[body.index("스트리밍된 글") :]
    generated = (
        stream.split("프롬프트: What is the capital of France?", 1)[1].strip().splitlines()[0]
    )
    assert generated and generated != "…", "the generated text is shown"
    assert "TTFT, TPOT, E2E" in body  # the metrics of the finished request (측정값)
    assert visible_plots(page) >= 1 and all(n > 0 for n in plot_traces(page))
    open_tab(page, "KV 캐시")
    assert_kv_tab_drawn(page)
    page.screenshot(path=str(SHOTS / "ch02_lab_done.png"))


def test_small_kv_cache_setting_shows_no_traceback(browser_page, app_url):
    """KV 블록 수 = 10 in the sidebar: the form lowers max_model_len to what the blocks hold and
    says so in Korean; the lab still steps; no traceback anywhere. The settings are restored after.
    """
    page = browser_page
    open_page(page, f"{app_url}/{url_of('00')}")
    sidebar = page.locator("[data-testid='stSidebar']")
    blocks = sidebar.get_by_label("KV 블록 수")
    blocks.fill("10")
    blocks.press("Tab")
    click(page, "설정 적용 (엔진 재시작)")
    body = page.inner_text("body")
    assert "160토큰으로 낮춰 적용했습니다" in body, body[:2000]
    assert "Traceback" not in body and "CacheTooSmallError" not in body
    click(page, "예시 요청 추가")
    click(page, "다음 스텝")
    body = page.inner_text("body")
    assert "Traceback" not in body and "KV 블록 **" not in body
    assert "마지막 스텝 1" in body
    assert "/10" in sidebar.inner_text()  # the sidebar status shows the 10-block engine
    page.screenshot(path=str(SHOTS / "small_kv_cache.png"))
    blocks.fill("64")
    blocks.press("Tab")
    sidebar.get_by_label("최대 길이 (max_model_len)").fill("1024")
    click(page, "설정 적용 (엔진 재시작)")


def test_chapter03_cache_grows(browser_page, app_url):
    page = browser_page
    open_page(page, f"{app_url}/{url_of('03')}")
    assert "46,080" in page.inner_text("body")
    click(page, "예시 요청 추가")
    click(page, "다음 스텝")
    open_tab(page, "KV 캐시")
    assert_kv_tab_drawn(page)
    page.screenshot(path=str(SHOTS / "ch03_kv_grid.png"))
    # 재생: a fragment with run_every steps the engine on its own (AppTest cannot check this).
    page.get_by_role("button", name="재생", exact=True).first.click()
    page.wait_for_function(
        "() => /마지막 스텝 ([3-9]|\\d\\d)/.test(document.body.innerText)", timeout=STEP_TIMEOUT_MS
    )
    finish_lab(page)
    assert all(n > 0 for n in plot_traces(page))
