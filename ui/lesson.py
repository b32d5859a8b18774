"""Chapter layout and the chapter list.

render_chapter("03", lab): lessons/ch03.md up to `<!-- LAB -->` → lab() → the rest of the lesson
→ 확인 문제 (the quiz) → 다음 장 with a link to the next chapter's page.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import streamlit as st

from ui.widgets import quiz

ROOT = Path(__file__).resolve().parent.parent
LESSONS_DIR = ROOT / "lessons"
PAGES_DIR = ROOT / "pages"
LAB_MARK = "<!-- LAB -->"
NEXT_HEADING = "## 다음 장"


@dataclass(frozen=True)
class Chapter:
    id: str  # "00" … "14"
    title: str  # Korean title shown in the navigation
    section: str
    icon: str  # a Material icon (bundled with Streamlit, so it renders without emoji fonts)

    @property
    def url_path(self) -> str:
        """"chNN" for every chapter, ready or not (a stable ASCII address: /ch03).

        Note (Streamlit 1.67): because pages/ exists, a session's *first* load of a direct chapter
        link shows a "Page not found" dialog over the right page. Using the file stem as url_path
        avoids the dialog but makes Streamlit run the page file alone (no app.py: no sidebar, no
        navigation), which is worse. Renaming pages/ (e.g. chapters/) would avoid both."""
        return f"ch{self.id}"

    def page_file(self) -> Path | None:
        """pages/chNN_*.py if it exists (the chapter is ready), else None (a 준비 중 page)."""
        found = sorted(PAGES_DIR.glob(f"ch{self.id}_*.py"))
        return found[0] if found else None


CHAPTERS = [
    Chapter("00", "00 · 코스 안내", "기초", ":material/explore:"),
    Chapter("01", "01 · 학습된 모델에서 추론 서버까지", "기초", ":material/inventory_2:"),
    Chapter("02", "02 · 토큰화, prefill, decode", "기초", ":material/text_fields:"),
    Chapter("03", "03 · KV 캐시", "기초", ":material/memory:"),
    Chapter("04", "04 · 지연 시간과 처리량", "기초", ":material/timer:"),
    Chapter("05", "05 · 메모리 예산과 dtype", "메모리", ":material/sd_storage:"),
    Chapter("06", "06 · 블록 단위 KV 관리 (PagedAttention)", "메모리", ":material/grid_view:"),
    Chapter("07", "07 · 배칭 기초", "배칭과 스케줄링", ":material/stacks:"),
    Chapter("08", "08 · continuous batching과 토큰 단위 스케줄링", "배칭과 스케줄링", ":material/autorenew:"),
    Chapter("09", "09 · 선점과 스케줄링 정책", "배칭과 스케줄링", ":material/pan_tool:"),
    Chapter("10", "10 · prefix caching", "배칭과 스케줄링", ":material/recycling:"),
    Chapter("11", "11 · 양자화와 dtype", "최적화", ":material/compress:"),
    Chapter("12", "12 · 실행자와 워커: 분산 실행", "최적화", ":material/lan:"),
    Chapter("13", "13 · speculative decoding", "최적화", ":material/bolt:"),
    Chapter("14", "14 · API 서버와 스트리밍", "서빙", ":material/public:"),
]
SECTIONS = ["기초", "메모리", "배칭과 스케줄링", "최적화", "서빙"]

# app.py registers its st.Page objects here (chapter id → page), so that links work for every page.
PAGES: dict = {}


def chapter(chapter_id: str) -> Chapter:
    cid = f"{int(str(chapter_id).lower().removeprefix('ch')):02d}"
    return next(c for c in CHAPTERS if c.id == cid)


def next_chapter(chapter_id: str) -> Chapter | None:
    ids = [c.id for c in CHAPTERS]
    i = ids.index(chapter(chapter_id).id)
    return CHAPTERS[i + 1] if i + 1 < len(CHAPTERS) else None


def lesson_parts(chapter_id: str) -> tuple[str, str, str]:
    """(before the lab, after the lab up to 다음 장, the 다음 장 section)."""
    path = LESSONS_DIR / f"ch{chapter(chapter_id).id}.md"
    text = path.read_text(encoding="utf-8") if path.is_file() else f"# {chapter(chapter_id).title}\n\n(본문 준비 중)"
    before, _, after = text.partition(LAB_MARK)
    rest, mark, next_part = after.partition(NEXT_HEADING)
    return before, rest, (mark + next_part) if mark else ""


def page_link(chapter_id: str, label: str | None = None) -> None:
    ch = chapter(chapter_id)
    target = PAGES.get(ch.id)
    if target is None:
        target = ch.page_file()
        target = str(target.relative_to(ROOT)) if target else None
    try:
        if target is None:
            raise LookupError
        st.page_link(target, label=label or f"다음 장: {ch.title} →", icon=":material/arrow_forward:")
    except Exception:  # page not registered (e.g. a page run on its own): plain text instead
        st.caption(f"다음 장: {ch.title} (왼쪽 메뉴에서 여세요)")


def render_chapter(chapter_id: str, lab: Callable[[], None]) -> None:
    before, rest, next_part = lesson_parts(chapter_id)
    st.markdown(before)
    st.divider()
    st.header("실험실")
    try:
        lab()
    except Exception as exc:  # noqa: BLE001 - a learner sees a Korean message, never a traceback
        from ui.errors import show_error

        show_error(exc, "실험실을 그리지 못했습니다")
    st.divider()
    st.markdown(rest)
    st.markdown("## 확인 문제")
    quiz(chapter_id)
    if next_part:
        st.markdown(next_part)
    nxt = next_chapter(chapter_id)
    if nxt is not None:
        page_link(nxt.id)


def coming_soon(ch: Chapter) -> Callable[[], None]:
    """The page of a chapter whose lab is not written yet: title, what it will show, a link back."""

    def page() -> None:
        st.title(ch.title)
        st.info("준비 중인 장입니다. 본문과 실험실이 곧 추가됩니다.", icon=":material/construction:")
        path = LESSONS_DIR / f"ch{ch.id}.md"
        if path.is_file():
            st.caption("아래는 미리 써 둔 본문입니다 (실험실 없이).")
            before, rest, next_part = lesson_parts(ch.id)
            st.markdown(before + rest + next_part)
        st.page_link(PAGES.get("00", "pages/ch00_intro.py"), label="00 · 코스 안내로 돌아가기", icon=":material/explore:")

    page.__name__ = f"coming_soon_ch{ch.id}"
    return page
