"""A small classroom in real browsers: 4 headless Chromium learners on one `streamlit run app.py`
(127.0.0.1, a free port), a few steps each on chapter 00, all clicking at once.

Checks: no exception on any page, each learner sees only its own request, and once the tabs close
the reaper releases every engine (nobody else connects) and RSS comes back to within 150 MB of
the one-learner level. Server CPU per click and the click latencies are printed (run with -s),
never asserted: this machine is shared. The engines' TTL is shortened with LLM_LAB_SESSION_TTL_S.

Skips only where no Chromium (or Playwright) can be found. The same code is the instructor's load
script: .venv/bin/python tests/load_classroom.py --learners N."""

from __future__ import annotations

import asyncio

import pytest
from load_classroom import Server, classroom, find_chromium, report

pytestmark = pytest.mark.browser

LEARNERS, STEPS, TTL_S = 4, 3, 5


def test_four_learners_isolated_and_reaped(default_model_dir, tmp_path):
    if find_chromium() is None:
        pytest.skip("no Chromium found: install Debian's chromium to run the browser tests")
    pytest.importorskip("playwright.async_api", reason="playwright is not installed")
    server = Server(
        tmp_path / "streamlit.log",
        {"LLM_LAB_SESSION_TTL_S": str(TTL_S), "LLM_LAB_REAP_INTERVAL_S": "1"},
    )
    try:
        r = asyncio.run(
            classroom(
                server.url,
                server.pid,
                LEARNERS,
                STEPS,
                timeout_ms=300_000,
                reap_wait_s=TTL_S + 90,
                status=server.status,
            )
        )
    finally:
        server.stop()
    print("\n" + report(r))
    log = server.log_path.read_text()
    assert not r["errors"], (r["errors"], log[-3000:])
    assert r["clicks"] == LEARNERS * STEPS
    for i, body in r["learner_bodies"].items():
        assert r["markers"][i] in body, f"learner {i} does not see its own request"
        others = [m for j, m in r["markers"].items() if j != i and m in body]
        assert not others, f"learner {i} sees other learners' requests: {others}"
    assert "Traceback" not in log, log[-3000:]
    # Nobody else connected after the tabs closed: the reaper alone released every engine.
    assert r["engines_released_after_s"] is not None, r["status_after"]
    status = r["status_after"]
    assert status["engines"] == 0 and status["kv_bytes"] == 0
    assert status["released_engines"] >= LEARNERS + 1  # the wave and the warm-up learner
    assert r["rss_after_mb"] <= r["rss_one_learner_mb"] + 150, report(r)
    assert "closed tabs; RSS" in server.log_path.read_text()  # the reaper's line on the console


def test_the_lab_in_a_fragment_needs_no_page_rerun(default_model_dir, tmp_path):
    """Chapter 00's lab inside st.fragment (as issue 11 runs it): the engine is built, admitted,
    stepped and its state drawn by fragment reruns alone; the page script ran once per learner.
    Then one more learner on the same server: a lab tab opens by a fragment rerun and stays open
    (check_the_open_tab_stays_open)."""
    if find_chromium() is None:
        pytest.skip("no Chromium found: install Debian's chromium to run the browser tests")
    pytest.importorskip("playwright.async_api", reason="playwright is not installed")
    server = Server(
        tmp_path / "streamlit.log",
        {"LLM_LAB_SESSION_TTL_S": str(TTL_S), "LLM_LAB_REAP_INTERVAL_S": "1"},
        app="tests/classroom_fragment_app.py",
    )
    try:
        r = asyncio.run(
            classroom(
                server.url,
                server.pid,
                2,
                STEPS,
                timeout_ms=300_000,
                reap_wait_s=TTL_S + 90,
                status=server.status,
            )
        )
        check_the_open_tab_stays_open(server.url)  # one more learner, on the same server
    finally:
        server.stop()
    print("\n" + report(r))
    assert not r["errors"], (r["errors"], server.log_path.read_text()[-3000:])
    for i, body in r["learner_bodies"].items():
        assert "페이지 실행 1회" in body, f"learner {i}: a click reran the whole page"
        assert f"조각 안: 스텝 {STEPS}개 · KV 텐서 할당 예" in body, body[-1500:]
        assert r["markers"][i] in body and r["isolation_ok"]
    assert r["engines_released_after_s"] is not None, r["status_after"]
    assert r["status_after"]["engines"] == 0


def check_the_open_tab_stays_open(url: str) -> None:
    """Only the open tab of the lab's views is drawn (issue 12; ui/lab.py, views): after a step
    the page holds the journey alone; clicking KV 캐시 reruns the lab's fragment (the page script
    still ran once) and draws the KV grid and the occupancy instead; the next 다음 스텝 keeps
    that tab open and redraws it with the new step."""
    from _browser import browser_page, click_button, open_tab, plot_types

    timeout_ms = 300_000

    def click(page, name: str) -> None:
        click_button(page, name, timeout_ms, run_over=False)
        assert page.locator("[data-testid='stException']").count() == 0

    def usage_points(page) -> int:
        """The occupancy plot's points (one per step): the KV tab's plot that is not the grid."""
        return page.locator(".js-plotly-plot").evaluate_all(
            "els => els.filter(e => (e.data || []).every(t => t.type !== 'heatmap'))"
            ".map(e => e.data[0].x.length)"
        )[0]

    with browser_page(url, timeout_ms) as page:
        click(page, "예시 요청 추가")
        click(page, "다음 스텝")
        types = plot_types(page)
        assert len(types) == 1 and "heatmap" not in types[0], types  # the journey alone
        open_tab(page, "KV 캐시", timeout_ms)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.js-plotly-plot')]"
            ".some(e => (e.data || []).some(t => t.type === 'heatmap'))",
            timeout=timeout_ms,
        )
        types = plot_types(page)
        # the grid (a heatmap, with its legend's traces) and the occupancy, nothing else
        assert len(types) == 2 and sum("heatmap" in t for t in types) == 1, types
        assert usage_points(page) == 1
        click(page, "다음 스텝")
        kv_tab = page.get_by_role("tab", name="KV 캐시", exact=True).first
        assert kv_tab.get_attribute("aria-selected") == "true"
        page.wait_for_function(
            "() => [...document.querySelectorAll('.js-plotly-plot')]"
            ".some(e => (e.data || []).length && e.data[0].type !== 'heatmap'"
            " && e.data[0].x.length === 2)",
            timeout=timeout_ms,
        )
        assert len(plot_types(page)) == 2
        assert "페이지 실행 1회" in page.inner_text("body")  # tab and steps: fragment runs
