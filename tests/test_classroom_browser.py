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
    stepped and its state drawn by fragment reruns alone; the page script ran once per learner."""
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
