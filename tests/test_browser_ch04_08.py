"""Chapters 04 and 06 in a real browser: `streamlit run app.py` on a free port (the repo's venv
python, the real default model), driven by Playwright with Debian's Chromium. ch04: 실행 runs the
default workload to its end and the journey shows the queued requests in the 대기열 colour. ch06:
the reservation experiment beside the lab (its own 실행) draws its comparison. (The labs' default
runs of chapters 05–08, with their texts and plots, are checked by tests/test_browser_walk.py.)
Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 300_000

app_url, page = chapter_fixtures("ch04_08", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS)


def test_ch04_lab_in_browser(page, app_url):
    """The default run to its end on the real model: its claim above the lab, the journey with
    r4 and r5 in the 대기열 colour, the per-request and distribution charts, the request table."""
    from ui import figures
    from ui.experiments import ch04

    lab.open_chapter(page, app_url, "ch04")
    body = page.inner_text("body")
    assert "지연 시간" in body and ch04.CLAIM[:30] in body
    lab.click(page, "실행")
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


def test_ch06_reservation_experiment_in_browser(page, app_url):
    """The contiguous-reservation experiment (not the lab): 실행 runs the paged engine and draws
    the used / paged / contiguous slots side by side."""
    lab.open_chapter(page, app_url, "ch06")
    assert "연속 최대 길이 예약" in page.inner_text("body")
    before = len(lab.plot_traces(page))
    lab.click(page, "실행")
    traces = lab.plot_traces(page)
    assert len(traces) >= max(3, before + 1) and all(n > 0 for n in traces[before:]), traces
    page.locator(".js-plotly-plot").nth(before).scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch06_lab.png"))
