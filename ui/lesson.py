"""Chapter layout and the chapter list.

render_chapter("03", lab): lessons/ch03.md up to `<!-- LAB -->` → lab() → the rest of the lesson
→ 확인 문제 (the quiz) → 다음 장 with a link to the next chapter's page.

The quiz (lessons/chNN_quiz.json) is a list of questions of two kinds:

    {"kind": "choice", "question": str, "options": [str, ...], "answer": int,
     "hint": str (optional), "explanation": str}
    {"kind": "short", "question": str, "check": CHECK, "accept": [str, ...],
     "hint": str (optional), "explanation": str}

CHECK says what a right short answer is, in a form the code can verify:
    {"type": "number", "value": float, "rel_tol": float (default 0.005)}
        the last number written (thousands separators allowed) lies within the tolerance;
    {"type": "exact", "answers": [str, ...]}
        the whole answer, normalised, is one of these;
    {"type": "keywords", "all": [[str, ...], ...], "none": [str, ...] (optional)}
        every group in "all" has a synonym in the answer and no word of "none" appears
        ("=word" matches only an answer that is exactly that word).
"accept" holds example right answers (each must pass CHECK); one is shown once the answer is
revealed. Choice options are shuffled per session (seeded); a first wrong answer gets a hint and a
second try, and only a second wrong answer reveals the key and the explanation.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import streamlit as st

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
        """ "chNN" for every chapter, ready or not (a stable ASCII address: /ch03).

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
    Chapter(
        "08",
        "08 · continuous batching과 토큰 단위 스케줄링",
        "배칭과 스케줄링",
        ":material/autorenew:",
    ),
    Chapter("09", "09 · 선점과 스케줄링 정책", "배칭과 스케줄링", ":material/pan_tool:"),
    Chapter("10", "10 · prefix caching", "배칭과 스케줄링", ":material/recycling:"),
    Chapter("11", "11 · 양자화와 dtype", "최적화", ":material/compress:"),
    Chapter("12", "12 · 실행자와 워커: 분산 실행", "최적화", ":material/lan:"),
    Chapter("13", "13 · speculative decoding", "최적화", ":material/bolt:"),
    Chapter("14", "14 · API 서버와 스트리밍", "서빙", ":material/public:"),
]
SECTIONS = ["기초", "메모리", "배칭과 스케줄링", "최적화", "서빙"]

# -- the quiz ------------------------------------------------------------------------------------

QUIZ_SEED_KEY = "_quiz_seed"
MAX_TRIES = 2  # wrong answers before the key and the explanation are shown
DEFAULT_HINT = "본문의 해당 절을 다시 떠올려 보고 한 번 더 답해 보세요."


def load_quiz(chapter_id: str) -> list[dict]:
    path = LESSONS_DIR / f"ch{chapter(chapter_id).id}_quiz.json"
    if not path.is_file():
        return []
    return json.loads(path.read_text(encoding="utf-8"))


def normalize(text: str) -> str:
    """Lower case without spaces, hyphens, underscores, quotes and middle dots."""
    return re.sub(r"[\s\-_·'\"`‘’“”]+", "", str(text)).lower()


_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def numbers_in(text: str) -> list[float]:
    """The numbers written in text, thousands separators allowed ("23,040" → 23040.0)."""
    out = []
    for raw in _NUMBER.findall(str(text)):
        try:
            out.append(float(raw.replace(",", "")))
        except ValueError:
            continue
    return out


def _keyword_in(word: str, given: str) -> bool:
    """A synonym appears in the normalised answer ("=word": the whole answer must be the word)."""
    if word.startswith("="):
        return given == normalize(word[1:])
    return normalize(word) in given


def check_answer(answer: str, check: dict) -> bool:
    """Whether a short answer is right under the question's CHECK (see the module docstring)."""
    given = normalize(answer)
    if not given:
        return False
    kind = check.get("type")
    if kind == "number":
        found = numbers_in(answer)
        if not found:
            return False
        value = float(check["value"])
        tol = float(check.get("rel_tol", 0.005)) * abs(value) or 1e-9
        return abs(found[-1] - value) <= tol
    if kind == "exact":
        return given in {normalize(a) for a in check["answers"]}
    if kind == "keywords":
        if any(normalize(w) in given for w in check.get("none", [])):
            return False
        return all(any(_keyword_in(w, given) for w in group) for group in check["all"])
    raise ValueError(f"unknown check type: {kind!r}")


def shuffled_order(n: int, seed: int, chapter_id: str, index: int) -> list[int]:
    """A permutation of range(n), fixed for one session, chapter and question."""
    order = list(range(n))
    random.Random(f"{seed}:{chapter_id}:{index}").shuffle(order)
    return order


def _session_seed() -> int:
    if QUIZ_SEED_KEY not in st.session_state:
        st.session_state[QUIZ_SEED_KEY] = random.SystemRandom().randrange(2**31)
    return int(st.session_state[QUIZ_SEED_KEY])


def _count_wrong(key: str, answer: str) -> int:
    """Remember a distinct wrong answer of this question; return how many there were so far."""
    tried = st.session_state.setdefault(f"{key}_wrong", [])
    if answer not in tried:
        tried.append(answer)
    return len(tried)


def _feedback(key: str, answer: str, right: bool, q: dict, key_text: str) -> None:
    if right:
        st.success("정답입니다. " + q.get("explanation", ""))
        return
    if _count_wrong(key, answer) < MAX_TRIES:
        st.error(
            "다시 생각해 보세요. 한 번 더 답할 수 있습니다. 힌트: " + q.get("hint", DEFAULT_HINT)
        )
    else:
        st.error("다시 생각해 보세요. 정답: " + key_text + " — " + q.get("explanation", ""))


def quiz(chapter_id: str) -> None:
    """The chapter's questions with feedback: shuffled options, a hint and a second try."""
    questions = load_quiz(chapter_id)
    if not questions:
        st.caption("이 장의 확인 문제는 준비 중입니다.")
        return
    cid = f"ch{chapter(chapter_id).id}"
    seed = _session_seed()
    for i, q in enumerate(questions, 1):
        key = f"quiz_{cid}_{i}"
        with st.container(border=True):
            st.markdown(f"**문제 {i}.** {q['question']}")
            if q.get("kind") == "choice":
                order = shuffled_order(len(q["options"]), seed, cid, i)
                shown = [q["options"][j] for j in order]
                choice = st.radio(
                    "답 고르기", shown, index=None, key=key, label_visibility="collapsed"
                )
                if choice is not None:
                    key_text = q["options"][q["answer"]]
                    _feedback(key, choice, choice == key_text, q, key_text)
            else:
                answer = st.text_input(
                    "답 쓰기", key=key, label_visibility="collapsed", placeholder="답을 쓰고 Enter"
                )
                if answer.strip():
                    example = (q.get("accept") or ["—"])[0]
                    _feedback(
                        key,
                        answer.strip(),
                        check_answer(answer, q["check"]),
                        q,
                        "예시 답: " + example,
                    )


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
    missing = f"# {chapter(chapter_id).title}\n\n(본문 준비 중)"
    text = path.read_text(encoding="utf-8") if path.is_file() else missing
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
        st.page_link(
            target, label=label or f"다음 장: {ch.title} →", icon=":material/arrow_forward:"
        )
    except Exception:  # page not registered (e.g. a page run on its own): plain text instead
        st.caption(f"다음 장: {ch.title} (왼쪽 메뉴에서 여세요)")


# A control named in a lesson, **[라벨]**. Markdown cannot close bold right after "]" when a Korean
# particle follows ("**[실행]**을" shows its asterisks: CommonMark's flanking rule), so lessons
# are rendered with the control as an HTML <strong>; the lesson files keep the markdown form
# (tests/test_lessons.py reads it).
CONTROL_MARK = re.compile(r"\*\*\[([^\]\n]+)\]\*\*")


def lesson_markdown(text: str) -> None:
    st.markdown(CONTROL_MARK.sub(r"<strong>[\1]</strong>", text), unsafe_allow_html=True)


LAB_ANCHOR = "lab"


def lab_claim(claim: str) -> None:
    """The effect this chapter's default lab shows (its claim: a test runs the default workload
    on the real engine and asserts it), stated above the lab so a learner knows what to watch."""
    st.info(f"**이 실험이 보여 줄 것** — {claim}", icon=":material/science:")


def render_chapter(chapter_id: str, lab: Callable[[], None], claim: str | None = None) -> None:
    """The chapter page. `claim`: the effect the default lab must show (shown above the lab)."""
    before, rest, next_part = lesson_parts(chapter_id)
    title, newline, body = before.partition("\n")
    if title.startswith("# "):
        lesson_markdown(title)
        before = body
    st.markdown(f"[:material/arrow_downward: 실험으로 가기](#{LAB_ANCHOR})")
    lesson_markdown(before)
    st.divider()
    st.header("실험실", anchor=LAB_ANCHOR)
    if claim:
        lab_claim(claim)
    try:
        lab()
    except Exception as exc:  # noqa: BLE001 - a learner sees a Korean message, never a traceback
        from ui.errors import show_error

        show_error(exc, "실험실을 그리지 못했습니다")
    st.divider()
    lesson_markdown(rest)
    st.markdown("## 확인 문제")
    quiz(chapter_id)
    if next_part:
        lesson_markdown(next_part)
    nxt = next_chapter(chapter_id)
    if nxt is not None:
        page_link(nxt.id)


def coming_soon(ch: Chapter) -> Callable[[], None]:
    """The page of a chapter whose lab is not written yet: title, what it will show, a link back."""

    def page() -> None:
        st.title(ch.title)
        st.info(
            "준비 중인 장입니다. 본문과 실험실이 곧 추가됩니다.", icon=":material/construction:"
        )
        path = LESSONS_DIR / f"ch{ch.id}.md"
        if path.is_file():
            st.caption("아래는 미리 써 둔 본문입니다 (실험실 없이).")
            before, rest, next_part = lesson_parts(ch.id)
            lesson_markdown(before + rest + next_part)
        st.page_link(
            PAGES.get("00", "pages/ch00_intro.py"),
            label="00 · 코스 안내로 돌아가기",
            icon=":material/explore:",
        )

    page.__name__ = f"coming_soon_ch{ch.id}"
    return page
