"""Chapter 15 in a real browser: `streamlit run app.py` (the real default model), Playwright with
Debian's Chromium. The lab's default run (one colocated engine against a DisaggregatedPair's
prefill and decode engines, in lockstep) goes to the end: each request's crossing and the ITL
comparison render with data, then the host tier's three cases run (tests/screenshots/
ch15_lab.png, ch15_itl.png, ch15_tier.png). Skips only where no Chromium (or Playwright) can be
found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 400_000


app_url, page = chapter_fixtures("ch15", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS, error_alerts=True)


def test_ch15_lab_and_tier_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch15")
    body = page.inner_text("body")
    assert "함께 배치 vs 분리" in body and "호스트 계층" in body and "P:D 훑기" in body
    lab_plots = len(lab.plot_traces(page))
    lab.click(page, "실행")
    body = page.inner_text("body")
    assert "요청마다 건너간 길" in body and "짧은 요청들의 토큰 간격" in body
    assert "예측 ↔ 측정" in body and "측정값" in body
    traces = lab.plot_traces(page)
    assert len(traces) >= lab_plots + 2 and all(n > 0 for n in traces)
    # the lab's own captions (the lesson above names the same figures in other words)
    page.get_by_text("요청마다 건너간 길", exact=False).last.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch15_lab.png"))
    page.get_by_text("짧은 요청들의 토큰 간격 (ITL)", exact=False).last.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch15_itl.png"))
    lab.click(page, "계층 실험 실행")
    body = page.inner_text("body")
    assert "계층의 숫자" in body and "세 경우 모두 A2의 출력 토큰이 같습니다" in body
    page.get_by_text("계층 실험 실행", exact=True).last.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / "ch15_tier.png"))
