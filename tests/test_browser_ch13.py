"""Chapter 13 in a real browser: `streamlit run app.py` on a free port (the repo's venv python,
the real default model), driven by Playwright with Debian's Chromium: 속도 재기 measures batch 1
and batch 8 (8 output tokens each) and draws the two bars (tests/screenshots/ch13_speed.png). The
lab's default run (drafts on and off, equal greedy outputs, drafts accepted) is walked by
tests/test_browser_walk.py; its draft grid is checked by tests/test_app_ch13.py. Skips only where
no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 600_000


app_url, page = chapter_fixtures("ch13", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS)


def plot_traces(pg) -> list[list[dict]]:
    """Per rendered plot: its traces' type, name and texttemplate."""
    return pg.locator(".js-plotly-plot").evaluate_all(
        "els => els.map(e => (e.data || []).map(t => "
        "({type: t.type || '', name: t.name || '', texttemplate: t.texttemplate || ''})))"
    )


def find_plot(pg, test) -> int | None:
    return next((i for i, traces in enumerate(plot_traces(pg)) if test(traces)), None)


def test_ch13_speed_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch13")
    assert "같은 요청, 추측 디코딩 켬·끔" in page.inner_text("body")

    # the speed comparison, kept short: 8 output tokens per request
    slider = page.get_by_role("slider", name="출력 토큰 수 (요청마다)")
    slider.scroll_into_view_if_needed()
    slider.focus()
    lab.interact(page, lambda: page.keyboard.press("Home"))
    assert slider.get_attribute("aria-valuetext") == "8"
    lab.click(page, "속도 재기")
    body = page.inner_text("body")
    assert "속도 향상" in body and "배치 8" in body
    bars = find_plot(
        page, lambda ts: [t["name"] for t in ts] == ["추측 디코딩 끔", "추측 디코딩 켬"]
    )
    assert bars is not None, plot_traces(page)
    page.screenshot(path=str(SHOTS / "ch13_speed.png"), full_page=False)
