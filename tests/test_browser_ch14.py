"""Chapter 14 in a real browser: `streamlit run app.py` on a free 127.0.0.1 port (the repo's venv
python, the real default model), driven by Playwright with Debian's Chromium. The prefill-fairness
lab runs with its 실행 button; then the learner's own API server starts on 127.0.0.1, simulated
users load it over HTTP, a long stream is started and disconnected, and the server is stopped.
The plots must render with data; a screenshot of the live server's /metrics plot is saved as
tests/screenshots/ch14_lab.png. Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 300_000


app_url, page = chapter_fixtures("ch14", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS)


def test_ch14_lab_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch14")
    body = page.inner_text("body")
    assert "prefill 공정성" in body and "내 서버에 사용자들을 보내기" in body

    # ① prefill fairness: both engines run, the chapter's TTFT plot appears
    before = len(lab.plot_traces(page))
    lab.click(page, "실행")
    traces = lab.plot_traces(page)
    assert len(traces) >= before + 1 and all(n > 0 for n in traces[before:]), traces
    body = page.inner_text("body")
    assert "짧은 요청이 처음 들어간 스텝" in body and "이 실험이 보여 줄 것" in body

    # ② the live server under load
    lab.click(page, "서버 시작")
    assert "서버 실행 중" in page.inner_text("body")
    before = len(lab.plot_traces(page))
    lab.click(page, "부하 보내기")
    traces = lab.plot_traces(page)
    assert len(traces) >= before + 2 and all(n > 0 for n in traces[before:]), traces
    assert "부하 결과" in page.inner_text("body")
    page.locator(".js-plotly-plot").nth(before).scroll_into_view_if_needed()
    page.wait_for_timeout(800)
    page.screenshot(path=str(SHOTS / "ch14_lab.png"))

    # a long stream, cut by the learner: the server frees it (nothing left running)
    lab.click(page, "긴 스트림 시작")
    lab.click(page, "연결 끊기")
    text = page.inner_text("body")
    assert "끊기 직전 실행 중" in text and "끊은 뒤 실행 중 0" in text, text[-2000:]

    lab.click(page, "서버 멈추기")
    assert "서버가 꺼져 있습니다" in page.inner_text("body")
