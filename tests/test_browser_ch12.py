"""Chapter 12 in a real browser: `streamlit run app.py` (the real default model, 9 query / 3 KV
heads, so tp 3), Playwright with Debian's Chromium. The page opens without starting a worker and
shows what each of the three workers will hold (computed from the shapes); 실행 starts the engines
(a status box says so) and runs the same requests on tp 1 and tp 3 (three worker processes), and
the per-step compute vs all-reduce figure and the step times render with data. Screenshot:
tests/screenshots/ch12_lab.png. The 시뮬레이션 switch draws the same views for a simulated
Llama-3.1-70B on 8 H100s against 4 (tests/screenshots/ch12_simulation.png). Skips only where no
Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 400_000


app_url, page = chapter_fixtures("ch12", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS, error_alerts=True)


def test_ch12_lab_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch12")
    body = page.inner_text("body")
    assert "같은 요청을 워커 1개와 워커 여러 개로" in body
    assert "워커가 가질 것" in body and "아직 띄우지 않음" in body
    # plotly draws after the script run ends; on a loaded machine that can be after "idle"
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')]"
        ".some(e => (e.data || []).length >= 12)",
        timeout=STEP_TIMEOUT_MS,
    )
    before = lab.plot_traces(page)
    assert any(n >= 12 for n in before), before  # the shard figure: 4 matrices × 3 ranks
    lab.click(page, "실행")
    # 실행 starts the engines, then reruns the page to run the workload: wait past that rerun
    page.get_by_text("전체 비교", exact=False).first.wait_for(timeout=STEP_TIMEOUT_MS)
    lab.wait_idle(page)
    lab.no_exception(page)
    body = page.inner_text("body")
    assert "tp 3 × pp 1" in body and "워커가 가진 것" in body
    assert "전체 비교" in body and "측정값" in body and "보고값" in body
    assert "all-reduce 60번" in body  # derived: 2 × 30 layers
    traces = lab.plot_traces(page)
    assert len(traces) >= len(before) + 2, (before, traces)  # the comm figure, the step times
    assert all(n > 0 for n in traces), traces
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.get_by_text("전체 비교", exact=False).first.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch12_lab.png"), full_page=False)


def test_ch12_simulation_in_browser(page, app_url):
    """실행 대상 → 시뮬레이션: the same views draw Llama-3.1-70B on 8 H100s against 4 (computed),
    with the scale table; 실행 runs the simulated engines (no worker process)."""
    lab.open_chapter(page, app_url, "ch12")
    target = page.locator("[data-testid='stRadio']").filter(has_text="실행 대상")
    target.get_by_text("시뮬레이션", exact=True).click()
    lab.wait_idle(page)
    lab.no_exception(page)
    body = page.inner_text("body")
    assert "tp 4 × pp 1" in body and "tp 8 × pp 1" in body and "GPU를 늘리면" in body
    assert "all-reduce 160번" in body  # derived: 2 × 80 layers
    lab.click(page, "실행")
    body = page.inner_text("body")
    assert "전체 비교" in body and "계산값" in body and "보고값" in body
    traces = lab.plot_traces(page)
    assert len(traces) >= 4 and all(n > 0 for n in traces), traces
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.get_by_text("전체 비교", exact=False).first.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch12_simulation.png"), full_page=False)
