"""Shared harness of the page tests under streamlit.testing.v1.AppTest (tests/test_app_ch*.py):
one AppTest session of app.py on the tiny test model, and the plotly-chart look-ups.

The session's engine settings point at the tiny model (the same path the sidebar's model field
takes), so a chapter's lab runs real engines in seconds; the real model is exercised by the
browser tests. Use as `app = app_fixture(PAGE)` at module level: one session per module, every
test of the module drives it in turn (a test that changes a shared setting puts it back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
TIMEOUT = 240  # torch start-up and real engine runs on a (possibly busy) 2-core CPU


def no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


def open_app(model_dir: Path | str, page: str | None = None, timeout: float = TIMEOUT):
    """app.py under AppTest with the engine settings on `model_dir` (CPU), run once, then switched
    to `page` (a path under pages/) and run again; no exception on either run."""
    from streamlit.testing.v1 import AppTest

    from ui.session import SETTINGS_KEY, EngineSettings

    at = AppTest.from_file(APP, default_timeout=timeout)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(model_dir), device="cpu")
    at.run()
    no_exception(at)
    if page is not None:
        at.switch_page(page)
        at.run()
        no_exception(at)
    return at


def app_fixture(
    page: str | None = None,
    timeout: float = TIMEOUT,
    teardown: Callable[[object], None] | None = None,
):
    """A module-scoped `app` fixture: `open_app(tiny_model_dir, page, timeout)`, and
    `teardown(at)` once the module's tests are done (e.g. to stop a server the page started)."""

    @pytest.fixture(scope="module")
    def app(tiny_model_dir):
        pytest.importorskip("streamlit")
        at = open_app(tiny_model_dir, page, timeout)
        yield at
        if teardown is not None:
            teardown(at)

    return app


# A lab engine's four charts (ui/lab.py, views) sit in three tabs, and only the open tab is drawn.
LAB_VIEW_TABS = {
    "_journey": "요청 여정",
    "_schedule": "스케줄러 결정",
    "_kvgrid": "KV 캐시",
    "_kvusage": "KV 캐시",
}


def open_tab(at, engine_key: str, label: str):
    """Open one of a lab engine's view tabs, as a click on its label does: the tabs keep the open
    label in st.session_state[f"{engine_key}_tabs"], so set it and run again. Nothing runs when
    that tab is already open, or when no such state exists (tabs that track no state, like
    chapter 01's own, draw every tab)."""
    tabs_key = f"{engine_key}_tabs"
    if tabs_key not in at.session_state or at.session_state[tabs_key] == label:
        return at
    at.session_state[tabs_key] = label
    at.run()
    no_exception(at)
    return at


def open_tab_of(at, key: str):
    """If `key` names a lab view's chart (f"{engine_key}_kvgrid", ...), open the tab it is in."""
    for suffix, label in LAB_VIEW_TABS.items():
        if key.endswith(suffix):
            return open_tab(at, key.removesuffix(suffix), label)
    return at


def charts(at) -> dict[str, dict]:
    """Every rendered plotly chart: element id (it carries the chart's key) → its figure spec."""
    return {c.proto.id: json.loads(c.proto.spec) for c in at.get("plotly_chart")}


def chart(at, key: str) -> dict:
    """The first chart whose element id contains `key` (a lab view's tab opened first); fails when
    there is none."""
    open_tab_of(at, key)
    specs = charts(at)
    match = [spec for element_id, spec in specs.items() if key in element_id]
    assert match, f"plot {key} missing; ids: {list(specs)}"
    return match[0]


def assert_charts(at, keys: list[str], axes: tuple[str, ...] = ("x", "y", "z")) -> None:
    """Each key names a rendered chart with at least one trace carrying data on one of `axes`
    (a heatmap has only z; pass ("x", "y") where the chapter's plots are all x/y plots). A lab
    view's chart is looked for with its tab open (open_tab_of)."""
    for key in keys:
        open_tab_of(at, key)
        specs = charts(at)
        match = [spec for element_id, spec in specs.items() if key in element_id]
        assert match, f"plot {key} missing; ids: {list(specs)}"
        data = match[0]["data"]
        assert data and any(any(t.get(a) for a in axes) for t in data), f"plot {key} has no data"
