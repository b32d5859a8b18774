"""Chapter 10 in a real browser: `streamlit run app.py` (the real default model), Playwright with
Debian's Chromium. The hash-chain and LRU experiments below the lab run and their plots render with
data (tests/screenshots/ch10_experiments.png). The lab's own default run (prefix caching on and
off) is walked by tests/test_browser_walk.py. Skips only where no Chromium (or Playwright) can be
found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 400_000


app_url, page = chapter_fixtures("ch10", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS, error_alerts=True)


def test_ch10_experiments_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch10")
    body = page.inner_text("body")
    assert "같은 앞부분을 가진 요청들" in body and "해시 사슬" in body
    lab_plots = len(lab.plot_traces(page))
    lab.click(page, "해시 사슬 실행")
    body = page.inner_text("body")
    assert "같은 프롬프트 다시" in body
    assert len(lab.plot_traces(page)) >= lab_plots + 1
    lab.click(page, "LRU 실험 실행")
    assert "A를 다시 보냈을 때 히트" in page.inner_text("body")  # (tables are canvases)
    assert len(lab.plot_traces(page)) >= lab_plots + 4  # the chain and three LRU grids
    page.get_by_text("LRU 축출: 작은 캐시에서는", exact=False).first.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch10_experiments.png"))
