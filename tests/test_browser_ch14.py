"""Chapter 14 in a real browser: `streamlit run app.py` on a free 127.0.0.1 port (the repo's venv
python, the real default model), driven by Playwright with Debian's Chromium. The prefill-fairness
lab runs with its 실행 button; then the learner's own API server starts on 127.0.0.1, simulated
users load it over HTTP, a long stream is started and disconnected, and the server is stopped.
The plots must render with data; a screenshot of the live server's /metrics plot is saved as
tests/screenshots/ch14_lab.png. Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest

from _browser import SHOTS, browser_page, streamlit_server
from _browser import wait_idle as _wait_idle

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 300_000


@pytest.fixture(scope="module")
def app_url(default_model_dir, tmp_path_factory):
    with streamlit_server(tmp_path_factory.mktemp("streamlit_ch14") / "streamlit.log") as url:
        yield url


@pytest.fixture(scope="module")
def page(app_url):
    with browser_page(app_url, STEP_TIMEOUT_MS) as pg:
        yield pg


def wait_idle(pg) -> None:
    _wait_idle(pg, STEP_TIMEOUT_MS, settle_ms=500)


def no_exception(pg) -> None:
    errors = pg.locator("[data-testid='stException']")
    assert errors.count() == 0, errors.first.inner_text()
    failed = pg.get_by_text("실험실을 그리지 못했습니다")
    assert failed.count() == 0, failed.first.inner_text()


def plot_traces(pg) -> list[int]:
    return pg.locator(".js-plotly-plot").evaluate_all("els => els.map(e => (e.data || []).length)")


def click(pg, name: str) -> None:
    button = pg.get_by_role("button", name=name, exact=True).first
    button.scroll_into_view_if_needed()
    button.click()
    wait_idle(pg)
    no_exception(pg)


def test_ch14_lab_in_browser(page, app_url):
    page.goto(f"{app_url}/ch14")
    page.wait_for_selector("[data-testid='stApp']")
    wait_idle(page)
    if page.locator("[role=dialog]").count():
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)
    no_exception(page)
    body = page.inner_text("body")
    assert "prefill 공정성" in body and "내 서버에 사용자들을 보내기" in body

    # ① prefill fairness: both engines run, the chapter's TTFT plot appears
    before = len(plot_traces(page))
    click(page, "실행")
    traces = plot_traces(page)
    assert len(traces) >= before + 1 and all(n > 0 for n in traces[before:]), traces
    assert "짧은 요청이 처음 들어간 스텝" in page.inner_text("body")

    # ② the live server under load
    click(page, "서버 시작")
    assert "서버 실행 중" in page.inner_text("body")
    before = len(plot_traces(page))
    click(page, "부하 보내기")
    traces = plot_traces(page)
    assert len(traces) >= before + 2 and all(n > 0 for n in traces[before:]), traces
    assert "부하 결과" in page.inner_text("body")
    page.locator(".js-plotly-plot").nth(before).scroll_into_view_if_needed()
    page.wait_for_timeout(800)
    page.screenshot(path=str(SHOTS / "ch14_lab.png"))

    # a long stream, cut by the learner: the server frees it (nothing left running)
    click(page, "긴 스트림 시작")
    click(page, "연결 끊기")
    text = page.inner_text("body")
    assert "끊기 직전 실행 중" in text and "끊은 뒤 실행 중 0" in text, text[-2000:]

    click(page, "서버 멈추기")
    assert "서버가 꺼져 있습니다" in page.inner_text("body")
