"""A shared link opened in a new browser (ui/share.py): a fresh `python -m ui.serve` server (pages/
in place) and a fresh Chromium context, whose first load is /ch08?preset=예산 32&w.ch08_seqs=2&
step=3&fork=[a branch at step 1]. The page is chapter 08 with no "Page not found" dialog
(ui/serve.py says why a fresh server showed one), the sliders hold the link's values, the lab, its
branch and the sidebar's 엔진 상태 are at step 3, and the lab's 링크 복사 gives a link with the
same setup back. The real default model."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from _browser import CHROMIUM_ARGS, IDLE, SHOTS, find_chromium, streamlit_server

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TIMEOUT_MS = 180_000
FORK = '[{"from":"ch08_off","at":1,"changes":{"max_num_seqs":1}}]'  # a branch made at step 1
LINK = "/ch08?preset=" + quote("예산 32") + "&w.ch08_seqs=2&step=3&fork=" + quote(FORK)


def slider_value(page, label: str) -> str | None:
    return page.get_by_role("slider", name=label).first.get_attribute("aria-valuetext")


def test_a_shared_link_opens_at_its_step_in_a_new_browser(tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found ($CHROMIUM, /usr/bin/chromium, chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    # a fresh server (its first session is where the dialog showed), started as run.sh starts it:
    # python -m ui.serve
    with streamlit_server(tmp_path / "streamlit.log") as url:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport={"width": 1400, "height": 1000}, locale="ko-KR")
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url + LINK)  # the server's first session: where the dialog used to show
            page.wait_for_selector(IDLE, timeout=TIMEOUT_MS)
            page.wait_for_function(
                "() => (document.body.innerText.match(/스텝 3 · KV/g) || []).length >= 3",
                timeout=TIMEOUT_MS,
            )
            _check_the_scenario(page)
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "share_link.png"))
            browser.close()


def _check_the_scenario(page) -> None:
    assert page.locator("[role=dialog]").count() == 0, page.locator(
        "[role=dialog]"
    ).first.inner_text()
    assert page.locator("[data-testid='stException']").count() == 0
    body = page.inner_text("body")
    assert "continuous batching과 토큰 단위 스케줄링" in body and "엔진 설정" in body
    assert slider_value(page, "토큰 예산 (max_num_batched_tokens)") == "32"  # the preset's
    assert slider_value(page, "최대 동시 요청 수 (max_num_seqs)") == "2"  # the link's own
    assert "갈래 1 · 스텝 3" in " ".join(body.split()), "the link's branch, stepped with the others"
    sidebar = page.locator("[data-testid='stSidebar']").inner_text()
    assert "스텝 3" in sidebar, sidebar[-600:]
    page.get_by_role("button", name="링크 복사").first.click()
    code = page.locator("[data-testid='stCode']", has_text="/ch08?").first
    code.wait_for(timeout=30_000)
    link = code.inner_text()
    assert "/ch08?" in link and "w.ch08_budget=32" in link and "w.ch08_seqs=2" in link
    assert "step=3" in link and "fork=" in link
