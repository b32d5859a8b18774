"""Chapter 12's simulation in a real browser: `streamlit run app.py`, Playwright with Debian's
Chromium. The 시뮬레이션 switch draws the lab's views for a simulated Llama-3.1-70B on 8 H100s
against 4 (tests/screenshots/ch12_simulation.png), and 실행 runs the simulated engines to the end.
(The real tp 1 vs tp 3 lab, worker processes included, is walked by tests/test_browser_walk.py.)
Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 400_000


app_url, page = chapter_fixtures("ch12", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS, error_alerts=True)


def test_ch12_simulation_in_browser(page, app_url):
    """실행 대상 → 시뮬레이션: the same views draw Llama-3.1-70B on 8 H100s against 4 (computed),
    with the scale table; 실행 runs the simulated engines (no worker process)."""
    lab.open_chapter(page, app_url, "ch12")
    target = page.locator("[data-testid='stRadio']").filter(has_text="실행 대상")
    lab.interact(page, target.get_by_text("시뮬레이션", exact=True).click)
    body = page.inner_text("body")
    assert "tp 4 × pp 1" in body and "tp 8 × pp 1" in body and "GPU를 늘리면" in body
    assert "all-reduce 160번" in body  # derived: 2 × 80 layers
    lab.click(page, "실행")
    body = page.inner_text("body")
    assert "전체 비교" in body and "계산값" in body and "제조사 문서" in body
    traces = lab.plot_traces(page)
    assert len(traces) >= 4 and all(n > 0 for n in traces), traces
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.get_by_text("전체 비교", exact=False).first.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch12_simulation.png"), full_page=False)
