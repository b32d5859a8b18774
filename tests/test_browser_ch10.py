"""Chapter 10 in a real browser: `streamlit run app.py` (the real default model), Playwright with
Debian's Chromium. The lab's 실행 runs the shared-system-prompt workload with prefix caching on and
off, the hash-chain and LRU experiments run below it, their plots render with data, and screenshots
are saved as tests/screenshots/ch10_lab.png (the lab) and ch10_experiments.png. Skips only where no
Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 400_000


app_url, page = chapter_fixtures("ch10", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS, error_alerts=True)


def test_ch10_lab_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch10")
    body = page.inner_text("body")
    assert "같은 앞부분을 가진 요청들" in body and "해시 사슬" in body
    before = len(lab.plot_traces(page))
    lab.click(page, "실행")
    body = page.inner_text("body")
    assert "요청별 비교" in body and "측정값" in body
    assert "decode 스텝은 켬·끔 모두" in body  # the output is still computed
    traces = lab.plot_traces(page)
    # the on/off lab views, the per-step hits, the shared-block grid and the TTFT bars
    assert len(traces) >= before + 3, traces
    assert all(n > 0 for n in traces[before:]), traces
    lab_plots = len(traces)
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
    hits = page.locator(".js-plotly-plot").nth(before)
    hits.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch10_lab.png"))
