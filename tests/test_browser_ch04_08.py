"""Chapters 04–08 in a real browser: `streamlit run app.py` on a free port (the repo's venv python,
the real default model), driven by Playwright with Debian's Chromium. Each chapter's lab is run with
its 실행 button, the plotly plots must render with data, and a screenshot of the lab is saved in
tests/screenshots/. Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 300_000

# chapter url → (text that must be on the page, minimum plots after 실행). A lab engine's views
# draw only their open tab (ui/lab.py, views): its journey, one plot per engine.
CHAPTERS = {
    "ch05": ("메모리 예산 계산기", 3),
    "ch06": ("연속 최대 길이 예약", 3),
    "ch07": ("같은 워크로드, 세 가지 방식", 6),
    "ch08": ("긴 프롬프트가 decode 중인", 4),
}


app_url, page = chapter_fixtures("ch04_08", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS)


@pytest.mark.parametrize("chapter", list(CHAPTERS))
def test_chapter_lab_in_browser(page, app_url, chapter):
    text, min_plots = CHAPTERS[chapter]
    lab.open_chapter(page, app_url, chapter)
    assert text in page.inner_text("body")
    before = len(lab.plot_traces(page))
    button = page.get_by_role("button", name="실행", exact=True).first
    button.scroll_into_view_if_needed()
    button.click()
    lab.wait_idle(page)  # until the sliced run's 정지 button is gone (_browser.wait_run_over)
    lab.no_exception(page)
    traces = lab.plot_traces(page)
    assert len(traces) >= max(min_plots, before + 1), traces
    # the plots the run added carry data (the step-by-step lab of ch06 may still be empty above
    # them)
    assert all(n > 0 for n in traces[before:]), traces
    page.locator(".js-plotly-plot").nth(before).scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / f"{chapter}_lab.png"))


def test_ch04_lab_in_browser(page, app_url):
    """The default run to its end on the real model: its claim above the lab, the journey with
    r4 and r5 in the 대기열 colour, the per-request and distribution charts, the request table."""
    from ui import figures
    from ui.experiments import ch04

    lab.open_chapter(page, app_url, "ch04")
    body = page.inner_text("body")
    assert "지연 시간" in body and ch04.CLAIM[:30] in body
    button = page.get_by_role("button", name="실행", exact=True).first
    button.scroll_into_view_if_needed()
    button.click()
    lab.wait_idle(page)
    lab.no_exception(page)
    traces = lab.plot_traces(page)
    assert len(traces) >= 3 and all(n > 0 for n in traces), traces
    queue = page.locator(".js-plotly-plot").first.evaluate(
        "e => (e.data || []).filter(t => t.name === '대기열').map(t => [t.marker.color, t.y])"
    )
    assert queue and queue[0][0] == figures.SEGMENT_COLORS["대기열"]
    assert {"r4", "r5"} <= set(queue[0][1])
    assert "요청별 측정값" in page.inner_text("body")
    page.locator(".js-plotly-plot").nth(1).scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch04_lab.png"))
