"""A lab's whole setup as a link: an instructor's "링크 복사", a learner's first load of it.

    /ch08?w.ch08_budget=256&cfg.num_kv_blocks=32&step=5&steplab=ch08

Query parameters of a shared link (the page path is the chapter):
- `w.<widget key>=<JSON value>`: the chapter's lab inputs, every simple-valued widget whose key
  starts with the chapter's prefix ("ch08_", and "main_" for chapter 00's lab), e.g. the token
  budget slider, the seed box, the open view tab;
- `cfg.<EngineSettings field>=<JSON value>`: the sidebar's engine settings that differ from the
  defaults (ui/session.py);
- `step=N` (with `steplab=<lab key>`): the lab's workload attached and N lockstep steps taken, the
  steps 다음 스텝 takes (ui/lab.py, open_shared_step);
- `play=1`: 재생 on from there, at the lab's speed (its `w.<lab key>_speed` widget);
- `view=projector`: the projector view (large type, the lesson folded);
- `poll=<code>`: a class poll this session votes in (ui/poll.py);
- `preset=<name>`: an instructor preset of the chapter (ui/presets.py), applied under the link's
  own parameters;
- `fork=<JSON>`: the lab's branches, [{"from": side key, "at": step, "changes": {...}}]
  (ui/fork.py: each made at its step with EngineCore.fork's changes).

A link is applied once, on the first run of a browser session that did not restore a saved one
(restore_session): a reload keeps what the learner changed since. Only keys with the chapter's
prefix and JSON scalars (or short lists of them) are taken, so a link can set a lab's inputs and
nothing else of the session.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from urllib.parse import urlencode, urlsplit

import streamlit as st

from ui import fork
from ui.session import (
    SETTINGS_KEY,
    EngineSettings,
    current_settings,
    persist_key,
    validate_settings,
)

WIDGET = "w."
SETTING = "cfg."
STEP, STEP_LAB, PRESET, FORK, VIEW, POLL = "step", "steplab", "preset", "fork", "view", "poll"
PLAY = "play"  # play=1: 재생 from the link's step at the link's speed (w.<lab>_speed)
PROJECTOR = "projector"  # ?view=projector
PROJECTOR_KEY = "share_projector"  # the sidebar's 프로젝터 보기 toggle
MAX_PARAMS = 80
MAX_VALUE_CHARS = 2000
MAX_SHARED_STEPS = 500  # the lab's N 스텝 limit (ui/lab.py MAX_N)
_APPLIED = "_share_applied"  # the session took its link (or had none) on its first run
_PENDING_STEP = "_share_pending_step"  # (lab key or None, steps) until the lab takes it
_CHAPTER = "_share_chapter"  # the chapter id of the page this run draws
_FORK = "_share_fork"  # the link's fork parameter (ui/fork.py reads it through fork_param)
_NOTES = "_share_notes"  # Korean notes on what a link asked for and did not get
_LINK_KEYS = "_share_link_keys"  # the widget keys the link set, until the lab drew them once
persist_key(_APPLIED)  # a reload (restore_session) does not apply its link over the learner's work
persist_key(_FORK)
_POLL = "_share_poll"  # the class poll code a link named (ui/poll.py reads it: poll_code)
persist_key(_POLL)


def widget_prefixes(chapter_id: str) -> tuple[str, ...]:
    """The widget key prefixes a chapter's link may carry: its own, and chapter 00's lab key."""
    return (f"ch{chapter_id}_", "main_") if chapter_id == "00" else (f"ch{chapter_id}_",)


def _simple(value) -> bool:
    if isinstance(value, (bool, int, float, str)):
        return not isinstance(value, str) or len(value) <= MAX_VALUE_CHARS
    if isinstance(value, (list, tuple)):
        return len(value) <= 16 and all(isinstance(v, (bool, int, float, str)) for v in value)
    return False


def _is_trigger(key: str) -> bool:
    """Whether `key` belongs to a button (its value is a click, never a setting to share)."""
    from streamlit.runtime.state import get_session_state

    try:
        state = get_session_state()._state  # streamlit's SessionState (1.67)
        widget_id = state._key_id_mapper.get_id_from_key(key, None)
        meta = state._new_widget_state.widget_metadata.get(widget_id) if widget_id else None
        return meta is not None and meta.value_type.endswith("trigger_value")
    except AttributeError:  # internals moved: keep the key (setting a button's is refused later)
        return False


def widget_values(chapter_id: str) -> dict:
    """The chapter's simple-valued widget values now in st.session_state (buttons left out)."""
    prefixes = widget_prefixes(chapter_id)
    found = {}
    for key in sorted(str(k) for k in st.session_state.keys()):
        if not key.startswith(prefixes) or _is_trigger(key):
            continue
        value = st.session_state[key]
        if _simple(value):
            found[key] = list(value) if isinstance(value, tuple) else value
    return found


def settings_changes(settings: EngineSettings) -> dict:
    """The engine settings that differ from the defaults."""
    default = asdict(EngineSettings())
    return {k: v for k, v in asdict(settings).items() if default[k] != v}


def link_params(chapter_id: str, lab_key: str | None = None, step: int = 0) -> dict[str, str]:
    """The query parameters of a link to this session's setup of the chapter's lab."""
    params = {
        f"{WIDGET}{k}": json.dumps(v, ensure_ascii=False)
        for k, v in widget_values(chapter_id).items()
    }
    for name, value in settings_changes(current_settings()).items():
        params[f"{SETTING}{name}"] = json.dumps(value, ensure_ascii=False)
    if step:
        params[STEP] = str(int(step))
        if lab_key:
            params[STEP_LAB] = lab_key
    forks = fork.branches_param(lab_key) if lab_key else ""
    if forks:
        params[FORK] = forks
    if projector_on():
        params[VIEW] = PROJECTOR
    return params


def chapter_path(chapter_id: str) -> str:
    """The chapter's address in a link ("" for chapter 00, served at the root: ui/lesson.py)."""
    return "" if chapter_id == "00" else f"ch{chapter_id}"


def link_url(chapter_id: str, params: dict[str, str], base: str | None = None) -> str:
    """The whole link: the app's address (st.context.url, its page path replaced) + the query."""
    base = base if base is not None else (st.context.url or "")
    parts = urlsplit(base)
    path = parts.path.rstrip("/")
    last = path.rsplit("/", 1)[-1]
    if last.startswith("ch") and last[2:].isdigit():
        path = path[: -len(last)].rstrip("/")
    origin = f"{parts.scheme}://{parts.netloc}" if parts.netloc else ""
    query = urlencode(params)
    return f"{origin}{path}/{chapter_path(chapter_id)}" + (f"?{query}" if query else "")


# -- reading a link ------------------------------------------------------------------------------


def _decode(text: str):
    """A parameter's JSON value; a bare word (typed by hand: ?w.ch09_exp=swap) is a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_link(query: dict[str, str], chapter_id: str) -> tuple[dict, dict, list[str]]:
    """(widget values, settings changes, notes) from a link's query parameters. A parameter the
    link may not set (another chapter's key, an unknown setting, a value that is no scalar) is
    left out with a Korean note naming it."""
    prefixes = widget_prefixes(chapter_id)
    names = {f.name: f.type for f in fields(EngineSettings)}
    widgets, settings, notes = {}, {}, []
    for name, text in list(query.items())[:MAX_PARAMS]:
        if name.startswith(WIDGET):
            key, value = name[len(WIDGET) :], _decode(text)
            if key.startswith(prefixes) and _simple(value):
                widgets[key] = value
            else:
                notes.append(f"링크의 '{name}'은(는) 이 장의 입력이 아니라 쓰지 않았습니다.")
        elif name.startswith(SETTING):
            field, value = name[len(SETTING) :], _decode(text)
            if field in names and isinstance(value, (bool, int, float, str)):
                settings[field] = value
            else:
                notes.append(f"링크의 엔진 설정 '{field}'은(는) 알 수 없어 쓰지 않았습니다.")
    return widgets, settings, notes


def _settings_from(changes: dict) -> tuple[EngineSettings | None, str]:
    """This session's settings (the defaults, on a first load) with a link's changes, validated
    as the sidebar form validates."""
    try:
        asked = replace(current_settings(), **changes)
    except TypeError as exc:
        return None, f"링크의 엔진 설정을 읽지 못했습니다 ({exc})."
    new, note, ok = validate_settings(asked)
    return (new if ok else None), note


def _parse_steps(query: dict[str, str]) -> int | None:
    text = query.get(STEP)
    if text is None:
        return None
    try:
        return min(max(int(text), 0), MAX_SHARED_STEPS)
    except ValueError:
        return None


def open_shared_link(chapter_id: str) -> None:
    """On a session's first run (app.py, before the sidebar and the page draw): apply the link's
    preset, widget values, engine settings and step. A reload that took over its saved state
    (restore_session) has _APPLIED among it: its own values win, the link is not applied again."""
    st.session_state[_CHAPTER] = chapter_id
    if st.session_state.get(_APPLIED):
        return
    st.session_state[_APPLIED] = True
    query = {k: st.query_params.get(k) for k in st.query_params.keys()}
    if FORK in query:
        st.session_state[_FORK] = str(query[FORK])[:MAX_VALUE_CHARS]
    if query.get(POLL):
        st.session_state[_POLL] = str(query[POLL]).strip().upper()[:16]
    if query.get(VIEW) == PROJECTOR:
        st.session_state[PROJECTOR_KEY] = True
    from ui.presets import preset_params

    preset = preset_params(chapter_id, query.get(PRESET)) if query.get(PRESET) else {}
    merged = {**preset, **query}
    widgets, changes, notes = parse_link(merged, chapter_id)
    if query.get(PRESET) and not preset:
        notes.append(f"이 장에는 '{query[PRESET]}' 프리셋이 없습니다.")
    if changes:
        settings, note = _settings_from(changes)
        if settings is not None:
            st.session_state[SETTINGS_KEY] = settings
        if note:
            notes.append(note)
    st.session_state.update(widgets)
    st.session_state[_LINK_KEYS] = list(widgets)
    steps, play = _parse_steps(merged), str(merged.get(PLAY, "")) in ("1", "true")
    if steps is not None or play:
        st.session_state[_PENDING_STEP] = (merged.get(STEP_LAB), steps or 0, play)
    st.session_state[_NOTES] = notes


def undo_link_values() -> bool:
    """After the lab failed on its first run with a link's values (a number outside a slider's
    range): drop them, so the page reruns with the lab's defaults, and say so. False when the
    link set nothing (the failure is the lab's own)."""
    keys = st.session_state.pop(_LINK_KEYS, None)
    if not keys:
        return False
    for key in keys:
        st.session_state.pop(key, None)
    st.session_state.pop(_PENDING_STEP, None)
    notes = st.session_state.setdefault(_NOTES, [])
    notes.append("링크의 입력값 중 이 실험실이 받지 못하는 값이 있어 기본값으로 열었습니다.")
    return True


def link_values_taken() -> None:
    """The chapter's lab drew with the link's values: they are the learner's from now on."""
    st.session_state.pop(_LINK_KEYS, None)


def take_pending_step(lab_key: str) -> tuple[int, bool] | None:
    """(the steps a link asked this lab to open at, whether to play on from there), once; None:
    no link step for this lab."""
    pending = st.session_state.get(_PENDING_STEP)
    if pending is None or (pending[0] and pending[0] != lab_key):
        return None
    st.session_state.pop(_PENDING_STEP, None)
    return int(pending[1]), bool(pending[2])


def fork_param() -> str:
    """A shared link's `fork` parameter as written ("" when none): the lab opens the branches it
    describes (ui/fork.py, open_shared_branches); links this session shares carry its live
    branches (fork.branches_param)."""
    return str(st.session_state.get(_FORK) or "")


def poll_code() -> str:
    """The class poll code of this session's link ("" when none; ui/poll.py)."""
    return str(st.session_state.get(_POLL) or "")


def current_chapter() -> str | None:
    return st.session_state.get(_CHAPTER)


def link_notes() -> None:
    """What the link asked for and did not get, once, small and orange."""
    for note in st.session_state.pop(_NOTES, None) or []:
        st.caption(f":orange[{note}]")


def share_panel(lab_key: str, step: int) -> None:
    """링크 복사: this lab's setup (the chapter's inputs, the engine settings, the step) as a link,
    in a popover with a copy button, and the chapter's instructor presets."""
    chapter_id = current_chapter() or lab_key[2:4]
    link_notes()
    with st.popover("링크 복사", icon=":material/link:"):
        st.caption(
            "이 실험의 입력값, 엔진 설정, 지금 스텝을 담은 링크입니다. 새 브라우저에서 열면 같은 "
            "장이 같은 입력으로 열리고, 워크로드를 넣은 뒤 같은 스텝까지 진행합니다."
        )
        st.code(link_url(chapter_id, link_params(chapter_id, lab_key, step)), language=None)
        from ui.presets import preset_links

        preset_links(chapter_id, lambda params: link_url(chapter_id, params))


# -- the projector view ---------------------------------------------------------------------------

# Large type for a room: the page's text, the widgets' labels, the plotly charts' text (their
# inline font sizes give way to !important), and the lab's buttons.
PROJECTOR_CSS = """<style>
.stMainBlockContainer { max-width: 100%; padding-left: 2rem; padding-right: 2rem; }
.stMainBlockContainer p, .stMainBlockContainer li, .stMainBlockContainer label,
.stMainBlockContainer button, .stMainBlockContainer td, .stMainBlockContainer th
{ font-size: 1.45rem !important; line-height: 1.45; }
.stMainBlockContainer h1 { font-size: 3rem !important; }
.stMainBlockContainer h2, .stMainBlockContainer h3 { font-size: 2.2rem !important; }
.js-plotly-plot text { font-size: 18px !important; }
</style>"""


def projector_on() -> bool:
    """Whether this session shows the projector view (the toggle, or ?view=projector)."""
    return bool(st.session_state.get(PROJECTOR_KEY))


def projector_toggle() -> None:
    """The sidebar's 프로젝터 보기 toggle, and the projector's large type while it is on (the
    lesson text folds away in render_chapter, so the lab fills the page)."""
    st.sidebar.toggle(
        "프로젝터 보기",
        key=PROJECTOR_KEY,
        help="강의실 화면용: 큰 글씨, 본문은 접고 실험실을 화면 가득 (링크에 ?view=projector)",
    )
    if projector_on():
        st.html(PROJECTOR_CSS)
