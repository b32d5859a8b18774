"""Shared links and instructor presets (ui/share.py, ui/presets.py): what a link may set, the
link's address, every preset's parameters, and a link opened in a new AppTest session of app.py
that lands on its chapter with its inputs, settings and step."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from _apptest import APP, no_exception

from ui.lesson import CHAPTERS
from ui.presets import PRESETS, preset_params
from ui.share import _APPLIED as APPLIED
from ui.share import PROJECTOR_KEY, link_url, parse_link, widget_prefixes

ROOT = Path(__file__).resolve().parent.parent


def test_parse_link_takes_only_the_chapters_inputs_and_known_settings():
    query = {
        "w.ch08_budget": "64",
        "w.ch08_chunked": "false",
        "w.ch09_blocks": "4",  # another chapter's input
        "w._engine_settings": "1",  # session internals are never a widget of the chapter
        "w.ch08_obj": '{"a": 1}',  # not a scalar
        "w.ch08_word": "swap",  # a bare word typed by hand is a string
        "cfg.max_num_seqs": "4",
        "cfg.no_such_setting": "1",
        "lab": "token",
    }
    widgets, settings, notes = parse_link(query, "08")
    assert widgets == {"ch08_budget": 64, "ch08_chunked": False, "ch08_word": "swap"}
    assert settings == {"max_num_seqs": 4}
    assert len(notes) == 4 and any("ch09_blocks" in n for n in notes)
    assert widget_prefixes("00") == ("ch00_", "main_")


def test_link_url_replaces_the_page_path_and_keeps_a_proxy_prefix():
    params = {"w.ch08_budget": "64", "step": "3"}
    assert link_url("08", params, "http://h:8501/ch03") == (
        "http://h:8501/ch08?w.ch08_budget=64&step=3"
    )
    assert link_url("08", {}, "https://x.org/class/") == "https://x.org/class/ch08"
    assert link_url("10", {}, "https://x.org/class/ch02") == "https://x.org/class/ch10"


def _widget_keys_in_code(chapter_id: str) -> str:
    files = list((ROOT / "pages").glob(f"ch{chapter_id}_*.py"))
    files += list((ROOT / "ui" / "labs").glob(f"ch{chapter_id}.py"))
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


@pytest.mark.parametrize("chapter_id", sorted(PRESETS))
def test_every_preset_parses_whole_and_names_existing_inputs(chapter_id):
    """Each chapter with a lab has at least two presets; each preset's parameters are all taken
    (no note), name inputs that the chapter's code draws, and carry a Korean description."""
    assert len(PRESETS[chapter_id]) >= 2
    code = _widget_keys_in_code(chapter_id)
    for name, (description, params) in PRESETS[chapter_id].items():
        assert re.search("[가-힣]", description), name
        widgets, _settings, notes = parse_link(preset_params(chapter_id, name), chapter_id)
        assert not notes, (name, notes)
        for key in widgets:
            suffix = key.split("_", 1)[1]
            assert f'"{key}"' in code or f'_{suffix}"' in code, (chapter_id, name, key)


def test_every_chapter_with_a_lab_has_presets():
    assert {c.id for c in CHAPTERS} <= set(PRESETS)


def _open_link(tiny_model_dir, page: str, query: dict[str, str]):
    from streamlit.testing.v1 import AppTest

    from ui.session import SETTINGS_KEY, EngineSettings

    at = AppTest.from_file(APP, default_timeout=240)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(tiny_model_dir), device="cpu")
    at.run()  # AppTest switches pages only after app.py's st.navigation ran once
    no_exception(at)
    del at.session_state[APPLIED]  # ... so the link's first load is the next run
    for name, value in query.items():
        at.query_params[name] = value
    at.switch_page(page)
    at.run()
    no_exception(at)
    return at


def test_a_shared_link_opens_its_chapter_with_its_inputs_settings_and_step(tiny_model_dir):
    """A new session on /ch08?preset=예산 32&w.ch08_seqs=2&cfg.max_num_seqs=4&step=3&view=projector:
    the preset's budget, the link's own max_num_seqs slider over it, the sidebar's setting, both
    engines of the comparison fed their workload and at step 3, the projector view; the lab's
    링크 복사 link carries the same values back."""
    from ui.session import SETTINGS_KEY

    query = {
        "preset": "예산 32",
        "w.ch08_seqs": "2",
        "cfg.max_num_seqs": "4",
        "step": "3",
        "view": "projector",
        "fork": json.dumps([{"from": "ch08_off", "at": 1, "changes": {"max_num_seqs": 1}}]),
    }
    at = _open_link(tiny_model_dir, "pages/ch08_continuous_batching.py", query)
    assert at.slider(key="ch08_budget").value == 32
    assert at.slider(key="ch08_seqs").value == 2
    assert at.session_state[SETTINGS_KEY].max_num_seqs == 4
    records = at.session_state["_records"]
    stepped = {key: len(r) for key, r in records.items() if key.startswith("ch08")}
    assert stepped and set(stepped.values()) == {3}, stepped
    assert "ch08_off__fork1" in stepped, "the link's branch, made at step 1, stepped to 3 too"
    (branch,) = at.session_state["_lab_branches"]["ch08"]
    assert (branch.parent, branch.step, branch.changes) == ("ch08_off", 1, {"max_num_seqs": 1})
    assert any("스텝 **3**" in m.value for m in at.markdown), "the lab's counter shows step 3"
    link = next(c.value for c in at.code if "w.ch08_budget=32" in c.value)
    assert "step=3" in link and "cfg.max_num_seqs=4" in link and "/ch08?" in link
    assert "ch08_load" not in link and "ch08_step=" not in link, "buttons are no setting"
    assert "view=projector" in link
    shared = parse_qs(urlsplit(link).query)["fork"][0]
    assert json.loads(shared) == json.loads(query["fork"]), "the branch goes back into the link"
    # the projector view: its toggle on, the lesson folded into expanders, the large type
    assert at.toggle(key=PROJECTOR_KEY).value is True
    assert any("프로젝터 보기에서 접힘" in e.label for e in at.expander)
    assert any("js-plotly-plot text" in h.proto.body for h in at.get("html"))
    at.run()  # a later run of the same session does not apply the link again
    stepped = {key: len(r) for key, r in at.session_state["_records"].items()}
    assert set(v for k, v in stepped.items() if k.startswith("ch08")) == {3}


def _first_load(at, page: str, query: dict[str, str]) -> None:
    """The same AppTest session opens `page` as a new session's first load of a link."""
    for name in list(at.query_params):
        del at.query_params[name]
    for name, value in query.items():
        at.query_params[name] = value
    at.session_state[APPLIED] = False
    at.switch_page(page)
    at.run()
    no_exception(at)


@pytest.mark.slow
def test_every_preset_opens_its_chapter_and_a_refused_value_falls_back(tiny_model_dir):
    """Each chapter's presets applied as a link's first load of its page: no exception, no error
    box, the preset's inputs in the widgets. A slider value out of range opens with the default
    and a note instead of a broken lab. play=1 plays on from the link's step."""
    at = _open_link(tiny_model_dir, "pages/ch00_intro.py", {})
    for chapter_id, presets in sorted(PRESETS.items()):
        page = str(next((ROOT / "pages").glob(f"ch{chapter_id}_*.py")).relative_to(ROOT))
        for name in presets:
            _first_load(at, page, {"preset": name})
            assert not at.error, (chapter_id, name, [e.value for e in at.error])
            widgets, _, _ = parse_link(preset_params(chapter_id, name), chapter_id)
            for key, value in widgets.items():
                assert at.session_state[key] == value, (chapter_id, name, key)
    _first_load(at, "pages/ch08_continuous_batching.py", {"w.ch08_budget": "9999"})
    assert not at.error and at.slider(key="ch08_budget").value == 64
    assert any("기본값으로 열었습니다" in c.value for c in at.caption)
    # play=1: 재생 goes on from the link's step at the link's speed
    _first_load(at, "pages/ch00_intro.py", {"step": "2", "play": "1", "w.main_speed": "0.25"})
    assert at.session_state["_playing_main"] is True
    assert at.select_slider(key="main_speed").value == 0.25
    assert len(at.session_state["_records"]["main"]) >= 2
