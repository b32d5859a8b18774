"""The lab's state in a real browser (tests/test_lab_state.py checks the same under AppTest, where
fragments run inline and no timer fires): chapter 00 on the real default model.

- nothing is fetched from outside the machine, the favicon included;
- 실험으로 가기 scrolls to the lab;
- the sidebar's 엔진 상태 follows fragment reruns (다음 스텝 and 재생 ticks, no page rerun);
- 끝까지 is stopped by 정지 within one step;
- a reload keeps the run and the sidebar settings;
- a max_tokens of 99999 is shown as the value used, with a note;
- at 1280×720 and 150 % zoom every control button shows its whole label."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
from _browser import (
    CHROMIUM_ARGS,
    SHOTS,
    click_button,
    find_chromium,
    interact,
    wait_run_over,
    watch_runs,
)
from _browser import wait_idle as _wait_idle

pytestmark = pytest.mark.browser

TIMEOUT_MS = 240_000
# The request's tokens: 끝까지 must still run when the test clicks 정지, however fast the engine
# steps (60 tokens were done within a second once the float32 kernel read one row as one stream).
RUN_TOKENS = 600
LAB_COUNTER = re.compile(r"스텝 (\d+) · KV 블록 (\d+/\d+)")
CONTROLS = ["다음 스텝", "N 스텝", "재생", "끝까지", "리셋"]


@pytest.fixture(scope="module")
def browser(shared_app_url):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found: install Debian's chromium to run the browser tests")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        yield instance
        instance.close()


def wait_idle(pg) -> None:
    _wait_idle(pg, TIMEOUT_MS)


def no_exception(pg) -> None:
    errors = pg.locator("[data-testid='stException']")
    assert errors.count() == 0, errors.first.inner_text()


def click(pg, label: str) -> None:
    click_button(pg, label, TIMEOUT_MS, run_over=False)
    no_exception(pg)


def lab_state(pg) -> tuple[int, str]:
    found = LAB_COUNTER.search(pg.locator("[data-testid='stMain']").inner_text())
    assert found, "no lab counter on the page"
    return int(found.group(1)), found.group(2)


def sidebar_state(pg) -> tuple[int, str]:
    text = pg.locator("[data-testid='stSidebar']").inner_text()
    found = LAB_COUNTER.search(text)
    assert found, f"the sidebar shows no engine state: {text[-600:]}"
    return int(found.group(1)), found.group(2)


def number_box(scope, label: str):
    return scope.locator(f"input[aria-label='{label}']").first


def set_number(pg, label: str, value: int, sidebar: bool = False) -> None:
    scope = pg.locator("[data-testid='stSidebar']") if sidebar else pg
    box = number_box(scope, label)
    box.scroll_into_view_if_needed()
    box.fill(str(value))
    if sidebar:  # a sidebar field waits for 설정 적용 (a form): leaving it asks for no run
        box.press("Tab")
    else:
        interact(pg, lambda: box.press("Tab"), TIMEOUT_MS)


def open_app(browser, url: str, **context):
    ctx = browser.new_context(locale="ko-KR", **context)
    pg = ctx.new_page()
    watch_runs(pg)
    pg.set_default_timeout(TIMEOUT_MS)
    outside: list[str] = []
    host = urlparse(url).netloc

    def record(request) -> None:
        parsed = urlparse(request.url)
        if parsed.scheme not in ("data", "blob") and parsed.netloc != host:
            outside.append(request.url)

    pg.on("request", record)
    pg.goto(url)
    wait_idle(pg)
    return ctx, pg, outside


def test_one_state_in_every_view_across_clicks_ticks_and_a_reload(browser, shared_app_url):
    ctx, pg, outside = open_app(browser, shared_app_url, viewport={"width": 1400, "height": 1000})
    try:
        assert "lab=" in pg.url  # the session token a reload finds the state by
        icon = pg.evaluate("() => document.querySelector(\"link[rel='shortcut icon']\").href")
        assert urlparse(icon).netloc == urlparse(shared_app_url).netloc and "/media/" in icon

        pg.get_by_role("link", name=re.compile("실험으로 가기")).first.click()
        pg.wait_for_timeout(800)
        top = pg.evaluate("() => document.getElementById('lab').getBoundingClientRect().top")
        assert 0 <= top < 400, f"the lab header is at {top}px after 실험으로 가기"

        set_number(pg, "KV 블록 수", 48, sidebar=True)
        click(pg, "설정 적용 (엔진 재시작)")
        set_number(pg, "max_tokens", 99999)
        sidebar = pg.locator("[data-testid='stSidebar']")
        max_len = number_box(sidebar, "최대 길이 (max_model_len)").input_value()
        assert max_len == "768"  # 48 blocks × 16 tokens: lowered in the field too
        box = number_box(pg, "max_tokens")
        assert box.input_value() == "767"  # what the request will use: max_model_len - 1
        assert "99,999" in pg.locator("[data-testid='stMain']").inner_text()
        set_number(pg, "max_tokens", RUN_TOKENS)
        pg.get_by_label("직접 쓴 프롬프트").fill(
            "Write a Python function that returns the n-th Fibonacci number, with comments."
        )
        click(pg, "요청 추가")
        for _ in range(3):
            click(pg, "다음 스텝")
        assert lab_state(pg)[0] == 3 and sidebar_state(pg) == lab_state(pg)
        assert lab_state(pg)[1].endswith("/48")

        pg.get_by_role("button", name="재생", exact=True).first.click()
        pg.wait_for_function(
            '() => /스텝 ([6-9]|\\d\\d) · KV/.test(document.querySelector("[data-testid='
            "'stSidebar']\").innerText)",
            timeout=TIMEOUT_MS,
        )
        click(pg, "일시정지")
        assert sidebar_state(pg) == lab_state(pg)

        pg.get_by_role("button", name="끝까지", exact=True).first.click()
        pg.get_by_role("button", name="정지", exact=True).first.wait_for(timeout=TIMEOUT_MS)
        click(pg, "정지")
        stopped = lab_state(pg)[0]
        pg.wait_for_timeout(2000)
        wait_idle(pg)
        assert lab_state(pg)[0] <= stopped + 1, "정지 did not stop 끝까지 within one step"
        assert lab_state(pg)[0] < RUN_TOKENS, "the run reached its end before 정지"
        assert sidebar_state(pg) == lab_state(pg)
        before = lab_state(pg)

        pg.reload()
        wait_idle(pg)
        no_exception(pg)
        assert lab_state(pg) == before == sidebar_state(pg), "a reload lost the run"
        kv_field = number_box(pg.locator("[data-testid='stSidebar']"), "KV 블록 수")
        assert kv_field.input_value() == "48", "a reload lost the sidebar settings"
        body = pg.locator("[data-testid='stMain']").inner_text()
        assert "\ufffd" not in body
        pg.screenshot(path=str(SHOTS / "lab_state_after_reload.png"))
        set_number(pg, "KV 블록 수", 64, sidebar=True)  # the shared server's next module
        click(pg, "설정 적용 (엔진 재시작)")
    finally:
        ctx.close()
    assert not outside, f"fetched from outside the machine: {outside}"


def test_controls_keep_their_labels_at_150_percent_zoom(browser, shared_app_url):
    """A 1280×720 window at 150 % zoom is a 853×480 CSS-pixel viewport at device scale 1.5."""
    viewport = {"width": 853, "height": 480}
    ctx, pg, _ = open_app(browser, shared_app_url, viewport=viewport, device_scale_factor=1.5)
    try:
        for label in CONTROLS:
            button = pg.get_by_role("button", name=label, exact=True).first
            button.scroll_into_view_if_needed()
            clipped = button.evaluate(
                "b => [...b.querySelectorAll('p, span, div')]"
                ".some(e => e.scrollWidth > e.clientWidth + 1)"
            )
            assert not clipped, f"the button {label} does not show its whole label"
            assert button.inner_text().strip() == label
        pg.get_by_role("button", name="다음 스텝", exact=True).first.scroll_into_view_if_needed()
        pg.screenshot(path=str(SHOTS / "lab_controls_150pct.png"))
    finally:
        ctx.close()


def test_a_fork_opens_beside_the_original_and_shows_the_diff(browser, shared_app_url):
    """여기서 갈라 보기 at step 2 with a small token budget: the branch's counter sits beside the
    original's, the same buttons step both, and the diff view shows the deltas, the steps whose
    decisions differ and both KV curves on one chart."""
    ctx, pg, _ = open_app(browser, shared_app_url, viewport={"width": 1400, "height": 1000})
    try:
        set_number(pg, "max_tokens", 12)
        pg.get_by_label("예시 프롬프트").first.click()
        interact(pg, pg.get_by_role("option", name="옛날 옛적에 (긴 프롬프트)").click, TIMEOUT_MS)
        click(pg, "예시 요청 추가")
        click(pg, "다음 스텝")
        expander = pg.locator("[data-testid='stExpander']").filter(has_text="여기서 갈라 보기")
        expander.locator("summary").first.click()
        box = number_box(expander, "토큰 예산 (max_num_batched_tokens)")
        box.fill("8")
        box.press("Tab")
        click(pg, "갈라 보기")
        main = pg.locator("[data-testid='stMain']")
        assert "갈래 1 · 스텝 1" in " ".join(main.inner_text().split())
        click(pg, "끝까지")
        wait_run_over(pg, TIMEOUT_MS)
        text = " ".join(main.inner_text().split())
        assert "갈래 1: 토큰 예산 128 → 8" in text and "결정이 달라진 스텝" in text
        assert "갈래 1 · 스텝" in text
        traces = pg.locator(".js-plotly-plot").evaluate_all(
            "els => els.filter(e => (e.layout.title.text || '').includes('원래 엔진과 갈래'))"
            ".map(e => e.data.map(t => t.name))"
        )
        assert traces == [["원래 엔진", "갈래 1"]], traces
        pg.get_by_text("결정이 달라진 스텝").first.scroll_into_view_if_needed()
        pg.wait_for_timeout(500)
        pg.screenshot(path=str(SHOTS / "lab_fork.png"))
    finally:
        ctx.close()
