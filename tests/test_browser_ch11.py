"""Chapter 11 in a real browser: `streamlit run app.py` on a free port (the real default model),
driven by Playwright. The lab's 실행 runs float32, int8 and int4 engines side by side; the decode
plot must render with data, and a screenshot of the lab is saved in tests/screenshots/. Skips only
where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, chapter_fixtures
from _browser import wait_idle as _wait_idle

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 480_000  # three engines load (two of them quantize at load) and run


app_url, page = chapter_fixtures("ch11", STEP_TIMEOUT_MS)


def no_exception(pg) -> None:
    errors = pg.locator("[data-testid='stException']")
    assert errors.count() == 0, errors.first.inner_text()


def plot_traces(pg) -> list[int]:
    return pg.locator(".js-plotly-plot").evaluate_all("els => els.map(e => (e.data || []).length)")


def test_ch11_lab_in_browser(page, app_url):
    page.goto(f"{app_url}/ch11")
    page.wait_for_selector("[data-testid='stApp']")
    _wait_idle(page, STEP_TIMEOUT_MS, settle_ms=500)
    if page.locator("[role=dialog]").count():
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)
    no_exception(page)
    body = page.inner_text("body")
    assert "같은 요청, 다른 숫자" in body and "decode 스텝 하나가 읽는 가중치" in body
    before = len(plot_traces(page))
    button = page.get_by_role("button", name="실행", exact=True).first
    button.scroll_into_view_if_needed()
    button.click()
    # three engines load and run (minutes on a busy CPU): wait for the run's own summary, then
    # for the explanation computed after it in the same run (the grid check reads 106 M weights
    # once per process), then for the run to end
    page.get_by_text("decode만 한 스텝의 중앙값").first.wait_for(timeout=STEP_TIMEOUT_MS)
    page.get_by_text("왜 이런 일치율인가").first.wait_for(timeout=STEP_TIMEOUT_MS)
    _wait_idle(page, STEP_TIMEOUT_MS, settle_ms=500)
    no_exception(page)
    traces = plot_traces(page)
    assert len(traces) >= before + 1 and all(n > 0 for n in traces[before:]), traces
    # the agreement table is explained beside it, with its evidence labels
    body = page.inner_text("body")
    agreement = body[body.find("생성된 토큰이") :][:1500]
    assert "측정 요약" in body and "이 실험이 보여 줄 것" in body
    assert "최대 절대 오차 0" in body, agreement
    assert "계산값" in body and "측정값" in body
    page.get_by_text("측정 요약").last.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch11_lab.png"))
