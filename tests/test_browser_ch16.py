"""Chapter 16 in a real browser: `streamlit run app.py` on a free port (the repo's venv python,
the real default model), driven by Playwright with Debian's Chromium: the lab's 실행 runs the
person schema on both engines (one request under the grammar, the same request free) to the end;
the per-step view shows the mask's facts with their evidence labels, the schema's position marker
and the prediction compared with the first step's allowed count
(tests/screenshots/ch16_lab.png). Skips only where no Chromium (or Playwright) can be found."""

from __future__ import annotations

import re

import pytest
from _browser import SHOTS, LabDriver, chapter_fixtures

pytestmark = pytest.mark.browser

STEP_TIMEOUT_MS = 600_000

app_url, page = chapter_fixtures("ch16", STEP_TIMEOUT_MS)
lab = LabDriver(STEP_TIMEOUT_MS, error_alerts=True)


def test_ch16_lab_in_browser(page, app_url):
    lab.open_chapter(page, app_url, "ch16")
    body = page.inner_text("body")
    assert "같은 요청, 문법 제약 있음·없음" in body
    assert "name: string (최대 20자)" in body and "age: integer (0 … 120)" in body

    lab.click(page, "실행")
    body = page.inner_text("body")
    assert "스텝마다 마스크가 한 일" in body
    for label in (
        "허용 토큰 수 (최소 … 최대)",
        "마스크가 지운 확률 (최대)",
        "마스크 시간 (평균 ms)",
    ):
        assert label in body, label
    assert "측정값" in body and "계산값" in body and "예측 ↔ 측정" in body
    assert "6,144바이트" in body  # 4 × ⌈49,152 / 32⌉
    removed = re.search(r"마스크가 지운 확률 \(최대\)\s*([0-9.]+)", body)
    assert removed and float(removed.group(1)) > 0.0, body[:2000]
    # the constrained side's output parses: the person object, no code fence
    assert '"name"' in body and '"age"' in body
    assert page.locator("[data-testid='stDataFrame']").count() >= 2
    heading = page.get_by_text("스텝마다 마스크가 한 일").first
    heading.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "ch16_lab.png"), full_page=False)
