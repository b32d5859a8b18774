"""One lab state, every view, across clicks and reloads (ui/lab.py, ui/session.py, app.py).

- the sidebar's 엔진 상태 shows the step and the KV blocks the lab's counters show, after 다음 스텝,
  N 스텝, 끝까지 and 리셋 (the lab draws it into the sidebar from its fragment);
- 끝까지 advances in slices, and 정지 or 리셋 ends it before any further step;
- a reload (a new session with the URL's ?lab= token) gets the run and the settings back; a token
  is never shared with another live tab, and the reaper releases what it kept;
- every number input shows the value used: out-of-range values are brought into range with a note;
- the lab's text never shows U+FFFD: token bytes that are no character are shown as bytes, and
  the workloads' prompts are cut on character boundaries;
- compared engines' journeys share one x range; the favicon is a local file.

AppTest runs on the tiny model (tests/_apptest.py)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from _apptest import APP, TIMEOUT, no_exception  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CH00 = "pages/ch00_intro.py"


def _open(model_dir, token: str | None = None):
    from streamlit.testing.v1 import AppTest

    from ui.session import SETTINGS_KEY, TOKEN_PARAM, EngineSettings

    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    if token is not None:
        at.query_params[TOKEN_PARAM] = token
    else:
        at.session_state[SETTINGS_KEY] = EngineSettings(model=str(model_dir), device="cpu")
    at.run()
    no_exception(at)
    at.switch_page(CH00)
    at.run()
    no_exception(at)
    return at


@pytest.fixture
def app(tiny_model_dir):
    return _open(tiny_model_dir)


def _records(at, key: str = "main") -> list:
    return at.session_state["_records"][key]


def _lab_counter(at) -> tuple[int, str]:
    """(step, "used/total") from the lab's own counter line."""
    line = next(m.value for m in at.main.markdown if m.value.startswith("스텝 **"))
    match = re.search(r"스텝 \*\*(\d+)\*\* · KV 블록 \*\*(\d+/\d+)\*\*", line)
    return int(match.group(1)), match.group(2)


def _sidebar_status(at) -> tuple[int, str]:
    """(step, "used/total") from the sidebar's 엔진 상태."""
    text = "\n".join(m.value for m in at.sidebar.markdown)
    match = re.search(r"스텝 \*\*(\d+)\*\* · KV 블록 \*\*(\d+/\d+)\*\*", text)
    assert match, text
    return int(match.group(1)), match.group(2)


def _add_request(at, max_tokens: int) -> None:
    at.number_input(key="main_max_tokens").set_value(max_tokens).run()
    at.button(key="main_add_preset").click().run()
    no_exception(at)


def test_the_sidebar_status_follows_every_click_of_the_lab(app):
    at = app
    _add_request(at, 12)
    assert _sidebar_status(at) == _lab_counter(at) == (0, "0/64")
    at.button(key="main_step").click().run()
    at.button(key="main_step").click().run()
    at.button(key="main_step").click().run()
    step, kv = _lab_counter(at)
    assert step == 3 == len(_records(at)) and kv != "0/64"
    assert _sidebar_status(at) == (step, kv)
    assert not any("첫 스텝에서 할당" in m.value for m in at.sidebar.markdown)
    at.number_input(key="main_step_count").set_value(2).run()
    at.button(key="main_nsteps").click().run()
    assert _sidebar_status(at) == _lab_counter(at) == (5, _lab_counter(at)[1])
    at.button(key="main_to_end").click().run()
    assert _sidebar_status(at) == _lab_counter(at)
    assert _lab_counter(at)[1] == "0/64"  # the request finished: its blocks went back
    at.button(key="main_reset").click().run()
    assert _sidebar_status(at) == _lab_counter(at) == (0, "0/64")
    assert sum(m.value.startswith("- 장치") for m in at.sidebar.markdown) == 1  # drawn once


def test_a_run_to_the_end_stops_at_the_next_step_on_stop_or_reset(app, monkeypatch):
    """With one step per slice (a slow machine's slice), 끝까지 takes a step per script run; 정지
    (its on_click runs before the lab) ends it with no further step, 리셋 too."""
    import ui.lab as lab

    monkeypatch.setattr(lab, "slice_budget", lambda: 0.0)
    monkeypatch.setattr(lab, "MAX_SLICE_S", 0.0)
    at = app
    _add_request(at, 30)
    at.button(key="main_to_end").click().run()
    no_exception(at)
    run = at.session_state["_lab_run_main"]
    assert run is not None and 1 <= run.done == len(_records(at)) < 30
    assert any(b.label == "정지" for b in at.button)  # shown while the run goes on
    at.run()  # the timer's next tick: one more slice
    assert len(_records(at)) == run.done >= 2
    done = len(_records(at))
    at.button(key="main_stop").click().run()
    no_exception(at)
    assert len(_records(at)) == done  # stopped before any further step
    assert at.session_state.get("_lab_run_main") is None
    at.run()
    assert len(_records(at)) == done
    assert not any(b.label == "정지" for b in at.button)
    # 리셋 during a run: no step, a fresh engine
    at.button(key="main_to_end").click().run()  # a slice, then the full run that starts the timer
    assert done < len(_records(at)) <= done + 2 and at.session_state["_lab_run_main"]
    at.button(key="main_reset").click().run()
    assert len(_records(at)) == 0 and at.session_state.get("_lab_run_main") is None


def test_a_slice_ends_after_the_step_in_progress_when_a_click_waits(tiny_model_dir):
    """advance_run checks for a waiting click after every step (click_pending in the served app)."""
    from streamlit.testing.v1 import AppTest

    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import streamlit as st
from ui.lab import LabContext, advance_run, start_run, add_prompt
from ui.session import SETTINGS_KEY, EngineSettings, get_engine, get_records

st.session_state[SETTINGS_KEY] = EngineSettings(model={str(tiny_model_dir)!r}, device="cpu")
engine = get_engine("main")
ctx = LabContext("main", [__import__("ui.lab").lab.Side("main")], {{"main": engine}}, {{}})
add_prompt(ctx, "hello", max_tokens=20)
start_run(ctx, None)
calls = []
def stop():
    calls.append(1)
    return len(calls) >= 3  # a click arrives during the third step
st.session_state["stepped"] = advance_run(ctx, None, stop)
st.session_state["records"] = len(get_records("main"))
"""
    at = AppTest.from_string(script, default_timeout=TIMEOUT)
    at.run()
    no_exception(at)
    assert at.session_state["stepped"] == 3 == at.session_state["records"]
    assert at.session_state["_lab_run_main"] is not None  # the run goes on at the next tick


def test_a_reload_gets_the_run_and_the_settings_back(tiny_model_dir):
    from ui.session import SETTINGS_KEY, TOKEN_PARAM

    first = _open(tiny_model_dir)
    first.number_input(key="cfg_num_kv_blocks").set_value(48)
    first.button(key="cfg_apply").click().run()
    _add_request(first, 10)
    for _ in range(3):
        first.button(key="main_step").click().run()
    token = first.query_params[TOKEN_PARAM]
    engine = first.session_state["_engines"]["main"]["engine"]
    text = dict(first.session_state["_texts"]["main"])

    again = _open(tiny_model_dir, token=token)  # a new session, the same URL
    assert again.query_params[TOKEN_PARAM] == token
    assert again.session_state[SETTINGS_KEY].num_kv_blocks == 48
    assert again.session_state[SETTINGS_KEY].model == str(tiny_model_dir)
    assert again.session_state["_engines"]["main"]["engine"] is engine
    assert len(_records(again)) == 3 and again.session_state["_texts"]["main"] == text
    assert _lab_counter(again) == _sidebar_status(again) == (3, _lab_counter(first)[1])
    assert again.number_input(key="cfg_num_kv_blocks").value == 48  # the form shows it too
    again.button(key="main_step").click().run()
    assert len(_records(again)) == 4

    fresh = _open(tiny_model_dir, token="not-a-token-of-this-server-0000")
    assert fresh.query_params[TOKEN_PARAM] != token
    assert not _records(fresh)


def test_the_registry_hands_saved_state_to_a_reload_only(monkeypatch):
    """claim: a gone tab's state goes to the reload; a live tab keeps its own; release empties it;
    two tokens never share."""
    from ui.registry import ClassroomLimits, SessionRegistry

    connected = {"tab-1": True}
    registry = SessionRegistry(
        ClassroomLimits(session_ttl_s=60, reap_interval_s=5),
        is_connected=lambda sid: connected.get(sid, False),
        trim=lambda: None,
    )
    engines = {"main": "engine-a"}
    registry.touch("lab:A", engines, runtime_id="tab-1", saved={"_engines": engines, "x": 1})
    registry.touch("lab:B", {}, runtime_id="tab-9", saved={"x": 2})
    assert registry.claim("lab:A", "tab-2", wait_s=0) is None  # tab-1 is still open
    connected["tab-1"] = False  # tab-1 reloads: its old connection closed
    saved = registry.claim("lab:A", "tab-2", wait_s=0)
    assert saved == {"_engines": engines, "x": 1} and saved["_engines"] is engines
    assert registry.claim("lab:B", "tab-2", wait_s=0) == {"x": 2}  # B's own, not A's
    assert registry.claim("lab:nobody", "tab-2", wait_s=0) is None
    registry.release_session("lab:A")
    assert engines == {} and registry.claim("lab:A", "tab-3", wait_s=0) is None


def test_max_tokens_out_of_range_is_brought_into_range_and_shown(app):
    at = app
    at.number_input(key="main_max_tokens").set_value(99999).run()
    no_exception(at)
    shown = at.number_input(key="main_max_tokens").value
    assert shown == 1023  # the tiny model's max_model_len 1024 leaves 1023 for the output
    assert any("99,999" in c.value and "1,023" in c.value for c in at.caption)
    at.number_input(key="main_max_tokens").set_value(5).run()
    assert not any("99,999" in c.value for c in at.caption)  # the note goes with the fix
    at.button(key="main_add_preset").click().run()
    request = at.session_state["_engines"]["main"]["engine"].all_requests()[-1]
    assert request.sampling_params.max_tokens == at.number_input(key="main_max_tokens").value == 5
    at.number_input(key="main_step_count").set_value(0).run()
    assert at.number_input(key="main_step_count").value == 1


def test_sidebar_fields_show_the_settings_in_use(app):
    """One KV block of 16 tokens: max_model_len is lowered to 16 in the field too; a value out
    of range is brought into range; a refused change puts the fields back to what is in use."""
    at = app
    at.number_input(key="cfg_num_kv_blocks").set_value(1)
    at.button(key="cfg_apply").click().run()
    no_exception(at)
    settings = at.session_state["_engine_settings"]
    assert settings.max_model_len == 16 == at.number_input(key="cfg_max_len").value
    assert any("16토큰으로 낮춰" in w.value for w in at.sidebar.warning)
    at.number_input(key="cfg_num_kv_blocks").set_value(64)
    at.number_input(key="cfg_max_len").set_value(99999)
    at.button(key="cfg_apply").click().run()
    settings = at.session_state["_engine_settings"]
    assert settings.max_model_len == 1024 == at.number_input(key="cfg_max_len").value
    assert any("32,768" in w.value and "99,999" in w.value for w in at.sidebar.warning)
    at.number_input(key="cfg_block_size").set_value(8)
    at.number_input(key="cfg_num_kv_blocks").set_value(1)
    at.button(key="cfg_apply").click().run()  # 8 tokens: refused
    assert any("설정은 바꾸지 않았습니다" in e.value for e in at.sidebar.error)
    assert at.number_input(key="cfg_block_size").value == 16  # back to the settings in use
    assert at.number_input(key="cfg_num_kv_blocks").value == 64


# -- text without U+FFFD ------------------------------------------------------------------------


def test_readable_shows_bytes_of_a_split_hangul_syllable_never_fffd():
    from ui.tokens import readable

    data = "서울에서 가 볼 만한 곳".encode()
    assert readable(data) == ("서울에서 가 볼 만한 곳", False)
    cut = data[: len("서울에서 가 볼 만한 ".encode()) + 2]  # 곳 is EA B3 B3: two of its bytes
    assert readable(cut) == ("서울에서 가 볼 만한 ⟨EA B3⟩", True)
    assert readable(cut, final=False) == ("서울에서 가 볼 만한 ", False)  # may still complete
    assert readable(data[4:]) == ("⟨9A B8⟩에서 가 볼 만한 곳", True)  # starts inside 울
    assert readable(b"ab\x80\xffcd") == ("ab⟨80 FF⟩cd", True)
    for i in range(len(data) + 1):
        for final in (True, False):
            assert "\ufffd" not in readable(data[:i], final)[0]
            assert "\ufffd" not in readable(data[i:], final)[0]


def test_token_text_over_real_hangul_token_splits(default_model_dir):
    """SmolLM2's byte-level BPE splits Hangul syllables over tokens; growing a text token by
    token never shows U+FFFD, and only the last incomplete syllable shows as bytes at the end."""
    from engine.tokenizer import Tokenizer
    from ui.tokens import token_text

    tokenizer = Tokenizer(default_model_dir)
    text = "서울에서 가 볼 만한 곳 세 군데를 추천해 주세요."
    ids = tokenizer.encode_plain(text)
    partial = [i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i])]
    assert partial, "the real tokenizer splits some syllable (else this test shows nothing)"
    for i in range(1, len(ids) + 1):
        growing, shown = token_text(tokenizer, ids[:i], final=False)
        assert "\ufffd" not in growing and not shown and text.startswith(growing)
        ended, shown = token_text(tokenizer, ids[:i], final=True)
        assert "\ufffd" not in ended and shown == (i in partial)
    assert token_text(tokenizer, ids) == (text, False)


@pytest.mark.parametrize("model", ["default", "tiny"])
def test_workload_prompts_are_real_text(model, default_model_dir, tiny_model_dir):
    """prompt_ids cuts on character boundaries: every prompt decodes without U+FFFD, keeps its
    exact length, and variants still differ."""
    import types

    from engine.tokenizer import Tokenizer
    from ui.experiments.common import prompt_ids
    from ui.tokens import token_text

    tokenizer = Tokenizer(default_model_dir if model == "default" else tiny_model_dir)
    engine = types.SimpleNamespace(tokenizer=tokenizer)
    for variant in range(24):
        for length in (1, 7, 16, 33, 64, 100, 250, 512, 700):
            ids = prompt_ids(engine, length, variant)
            assert len(ids) == length
            assert "\ufffd" not in tokenizer.decode(ids), (variant, length)
            assert not token_text(tokenizer, ids)[1], (variant, length)
    assert prompt_ids(engine, 64, 0) != prompt_ids(engine, 64, 1)


def test_the_stream_panel_text_of_a_request_cut_inside_a_syllable(default_model_dir):
    """request_text: a finished request whose last token ends inside a syllable shows its bytes;
    while it generates, they are held back; a stop string's cut keeps the engine's text."""
    import types

    from engine.tokenizer import Tokenizer
    from ui.lab import request_text

    tokenizer = Tokenizer(default_model_dir)
    engine = types.SimpleNamespace(tokenizer=tokenizer)
    ids = tokenizer.encode_plain("서울")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))

    def request(tokens, finished, stop=()):
        params = types.SimpleNamespace(stop=list(stop))
        return types.SimpleNamespace(
            sampling_params=params, output_token_ids=tokens, is_finished=finished
        )

    data = b"".join(tokenizer.token_bytes(t) for t in ids[:cut])
    whole = data.decode("utf-8", "ignore")
    text, shown = request_text(engine, request(ids[:cut], True), "")
    assert shown and "\ufffd" not in text and text.startswith(whole) and "⟨" in text
    assert request_text(engine, request(ids[:cut], False), "") == (whole, False)
    assert request_text(engine, request(ids, True), "") == ("서울", False)
    assert request_text(engine, request(ids, True, ["울"]), "서") == ("서", False)


# -- comparisons and the page -------------------------------------------------------------------


def test_compared_journeys_share_one_x_range():
    from ui.lab import journey_end_ms, share_x_range

    short = {
        "data": [{"type": "bar", "base": [0, 10], "x": [5, 20]}, {"type": "scatter", "x": [31]}],
        "layout": {"xaxis": {"title": {"text": "ms"}}},
    }
    long = {"data": [{"type": "bar", "base": [0, 200], "x": [50, 100]}], "layout": {}}
    assert journey_end_ms(short) == 31 and journey_end_ms(long) == 300
    share_x_range([short, long])
    assert short["layout"]["xaxis"]["range"] == long["layout"]["xaxis"]["range"] == [0, 309]
    assert short["layout"]["xaxis"]["title"] == {"text": "ms"}  # the rest of the axis is kept


def test_the_favicon_is_a_local_png():
    """app.py's page icon is a PNG of this repository (a ":material/" icon is fetched from
    fonts.gstatic.com by the browser)."""
    data = (ROOT / "ui" / "assets" / "favicon.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width == height >= 32
    source = (ROOT / "app.py").read_text()
    assert 'FAVICON = ROOT / "ui" / "assets" / "favicon.png"' in source
    assert "page_icon=str(FAVICON)" in source


def test_a_negative_prediction_is_set_to_zero_in_the_box(app):
    at = app
    at.number_input(key="predict_ch00_steps").set_value(-3.0).run()
    no_exception(at)
    assert at.number_input(key="predict_ch00_steps").value == 0.0
    assert at.session_state["_predictions"]["ch00_steps"]["value"] == 0.0
    assert any("-3" in c.value and "0으로" in c.value for c in at.caption)
    at.number_input(key="predict_ch00_steps").set_value(4.0).run()
    assert at.session_state["_predictions"]["ch00_steps"]["value"] == 4.0


def test_a_comparison_draws_both_journeys_on_one_x_range(tiny_model_dir):
    """Two engines of one lab, one with a single running slot: its requests take turns (by the
    steps each journey names), and both journey charts carry one x range, the later end."""
    from _apptest import charts
    from streamlit.testing.v1 import AppTest

    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import streamlit as st
from ui.experiments.common import Workload
from ui.lab import Side, lab
from ui.session import SETTINGS_KEY, EngineSettings

st.session_state[SETTINGS_KEY] = EngineSettings(model={str(tiny_model_dir)!r}, device="cpu")
sides = [Side("cmp_one", "한 슬롯", {{"max_num_seqs": 1}}), Side("cmp_many", "여러 슬롯", {{}})]
lab("cmp", sides, presets=None, workload=Workload.uniform(3, 8, 6), show_code_panel=False)
"""
    at = AppTest.from_string(script, default_timeout=TIMEOUT)
    at.run()
    at.button(key="cmp_load").click().run()
    at.button(key="cmp_to_end").click().run()
    no_exception(at)
    specs = charts(at)
    one = next(s for i, s in specs.items() if "cmp_one_journey" in i)
    many = next(s for i, s in specs.items() if "cmp_many_journey" in i)
    from ui.lab import journey_end_ms

    one_steps, many_steps = _steps_by_lane(one), _steps_by_lane(many)
    turns = sorted(one_steps.values(), key=min)
    assert len(turns) == 3 and all(max(a) < min(b) for a, b in zip(turns, turns[1:]))
    assert max(map(max, one_steps.values())) > max(map(max, many_steps.values()))
    assert set.intersection(*many_steps.values())  # many slots: the requests share steps
    end = max(journey_end_ms(one), journey_end_ms(many))
    assert end > 0
    assert one["layout"]["xaxis"]["range"] == many["layout"]["xaxis"]["range"]
    assert one["layout"]["xaxis"]["range"] == pytest.approx([0, end * 1.03])


def _steps_by_lane(spec: dict) -> dict[str, set[int]]:
    """The engine steps each request's bars name (customdata[2]), by swimlane: the engine's own
    record of who ran when, where wall-clock ends would only compare noise."""
    steps: dict[str, set[int]] = {}
    for trace in spec["data"]:
        if trace.get("type") != "bar":
            continue
        for lane, row in zip(trace["y"], trace["customdata"]):
            if isinstance(row[2], int):
                steps.setdefault(lane, set()).add(row[2])
    return steps


def test_a_slice_is_twice_the_redraw_between_slices_within_bounds(monkeypatch):
    """LabRun.budget: the first slice takes the floor; later ones twice the gap since the last
    slice ended (the redraw), never below the floor nor above MAX_SLICE_S; no floor, no limit."""
    import ui.lab as lab

    now = [100.0]
    monkeypatch.setattr(lab.time, "perf_counter", lambda: now[0])
    run = lab.LabRun(limit=50, total=50)
    assert run.budget(0.3) == 0.3 and run.budget(None) is None
    run.slice_end = 100.0
    now[0] = 100.1  # a quick redraw
    assert run.budget(0.3) == 0.3
    now[0] = 100.5  # a redraw of 0.5 s
    assert run.budget(0.3) == pytest.approx(1.0)
    now[0] = 105.0
    assert run.budget(0.3) == lab.MAX_SLICE_S
    assert run.budget(None) is None


def test_a_busy_cpu_gets_one_thread_per_step(monkeypatch):
    """A lone learner's step uses torch's threads on a quiet machine, one where the load fills
    every core (two torch threads then wait on each other: ui/registry.py, step_threads)."""
    from ui import registry as reg

    monkeypatch.delenv("LLM_LAB_STEP_THREADS", raising=False)
    assert reg.step_threads(1, busy=False) == reg.DEFAULT_THREADS
    assert reg.step_threads(1, busy=True) == 1
    assert reg.step_threads(1, "3", busy=True) == 3  # a number in the environment wins
    monkeypatch.setattr(reg.os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    assert reg.cpu_busy()
    monkeypatch.setattr(reg.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert not reg.cpu_busy()
