"""LLM 추론 실험실: the Streamlit entry point.

    streamlit run app.py

Every chapter of the course is a page; a chapter whose page file does not exist yet shows a short
"준비 중" page. The sidebar holds the engine settings and the status of this session's engine;
the URL carries a token (?lab=...) under which a reload finds the session's engines again.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from ui.lab import ACTIVE_KEY, sidebar_status, sidebar_status_slot  # noqa: E402
from ui.lesson import CHAPTERS, PAGES, SECTIONS, coming_soon  # noqa: E402
from ui.session import engine_settings_sidebar, restore_session  # noqa: E402
from ui.share import open_shared_link, projector_toggle  # noqa: E402

# The favicon is a file of this repository, served by this server: a ":material/…" icon would be
# fetched from fonts.gstatic.com by the browser, which fails on a closed classroom network.
FAVICON = ROOT / "ui" / "assets" / "favicon.png"
st.set_page_config(page_title="LLM 추론 실험실", page_icon=str(FAVICON), layout="wide")


def build_pages() -> dict[str, list]:
    sections: dict[str, list] = {name: [] for name in SECTIONS}
    for ch in CHAPTERS:
        path = ch.page_file()
        if path is not None:
            page = st.Page(
                str(path.relative_to(ROOT)),
                title=ch.title,
                icon=ch.icon,
                url_path=ch.url_path,
                default=ch.id == "00",
            )
        else:
            page = st.Page(
                coming_soon(ch),
                title=f"{ch.title} (준비 중)",
                icon=":material/construction:",
                url_path=ch.url_path,
                default=ch.id == "00",
            )
        PAGES[ch.id] = page
        sections[ch.section].append(page)
    return sections


restore_session()  # ?lab=<token>: a reload of the page gets this session's engines and settings
navigation = st.navigation(build_pages(), expanded=True)  # every chapter listed, no "View more"
# a shared link (/ch08?w.ch08_budget=256&step=5): its inputs, settings and step, once per session
open_shared_link(next((cid for cid, page in PAGES.items() if page is navigation), "00"))
st.sidebar.caption("LLM 추론 시스템의 원리 · 실제 엔진을 한 스텝씩")
projector_toggle()  # 프로젝터 보기 (also ?view=projector): large type, the lesson folded
engine_settings_sidebar(show_status=False)
st.session_state[ACTIVE_KEY] = None  # the page's lab names its engine; none → "main"
sidebar_status_slot()  # the page's lab draws 엔진 상태 here after each of its steps
navigation.run()
sidebar_status()  # a page without a lab: the status of "main", after the page ran
