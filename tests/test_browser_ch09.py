"""Chapter 09 in a real browser: `streamlit run app.py` (the real default model), Playwright with
Debian's Chromium. The burst lab is driven like a learner would: predict the victim, put the
workload in, step ten times to the first preemption (two victims leave the block grid: 6/8 blocks
used, three waiting), then run to the end and read the recompute-cost plots. A screenshot of the
lab is saved as tests/screenshots/ch09_lab.png. Skips only where no Chromium can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 300_000


app_url, page = chapter_fixtures("ch09", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS)


def plot_titles(pg) -> list[str]:
    return pg.locator(".js-plotly-plot").evaluate_all(
        "els => els.map(e => (e.querySelector('.gtitle') || {}).textContent || '')"
    )


def test_burst_lab_preempts_and_measures_the_cost(page, app_url):
    lab.open_chapter(page, app_url, "ch09")
    assert "KV 캐시가 모자랄 때, 누가 양보하나" in page.inner_text("body")

    # predict the victim (the radio group whose options end with 'nobody')
    victim = page.get_by_role("radiogroup").filter(has_text="아무도 선점되지 않는다")
    lab.interact(page, victim.get_by_text("D", exact=True).click)
    lab.click(page, "워크로드 넣기")
    steps = page.get_by_label("N", exact=True)
    steps.fill("10")
    lab.interact(page, lambda: steps.press("Enter"))
    lab.click(page, "N 스텝")
    body = page.inner_text("body")
    assert "스텝 10 · KV 블록 6/8 · 실행 2 · 대기 3" in " ".join(body.split()), body[:2000]

    lab.click(page, "끝까지")
    body = page.inner_text("body")
    assert "예측 ↔ 측정" in body and "측정값" in body and "계산값" in body
    traces = lab.plot_traces(page)
    titles = plot_titles(page)
    found = {
        key: [i for i, t in enumerate(titles) if t.startswith(key)]
        for key in ("계산한 토큰", "KV 블록이 줄면")
    }
    assert all(found.values()), (titles, traces)
    cost, thrash = found["계산한 토큰"][0], found["KV 블록이 줄면"][0]
    assert traces[cost] == 2 and traces[thrash] >= 1, (titles, traces)
    page.locator(".js-plotly-plot").nth(cost).scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch09_lab.png"))
