"""Chapter layout and the chapter list.

render_chapter("03", lab): lessons/ch03.md up to `<!-- LAB -->` → lab() → the rest of the lesson
→ 확인 문제 (the quiz) → 다음 장 with a link to the next chapter's page.

The quiz (lessons/chNN_quiz.json) is a list of questions of three kinds. Two are graded by the
code, because a right answer to them can be verified (자동 채점); the third, an open "explain why"
question, is graded by the learner against a model answer (스스로 채점), because no keyword list can
tell a right explanation from a wrong one that uses the same words ("기아는 아니다").

    {"kind": "choice", "question": str, "options": [str, ...], "answer": int,
     "hint": str (optional), "explanation": str}
    {"kind": "short", "question": str, "check": CHECK, "accept": [str, ...],
     "hint": str (optional), "explanation": str}
    {"kind": "self", "question": str, "model_answer": str, "explanation": str}

CHECK says what a right short answer is:
    {"type": "number", "value": float, "rel_tol": float (default 0.005)}
        the answer states exactly one number and no negation (a comma before exactly three digits
        is a thousands separator; "1,5" is ambiguous and read as no number), within the tolerance;
    {"type": "exact", "answers": [str, ...]}
        the whole answer, normalised, is one of these.
"accept" holds example right answers (each must pass CHECK); one is shown once the answer is
revealed. A number answer that does not state exactly one number is not graded: the learner is
asked to write one number. Choice options are shuffled per session (seeded); a first wrong answer
gets a hint and a second try, and only a second wrong answer reveals the key and the explanation.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import streamlit as st

from ui.share import link_values_taken, projector_on, undo_link_values

ROOT = Path(__file__).resolve().parent.parent
LESSONS_DIR = ROOT / "lessons"
PAGES_DIR = ROOT / "pages"
LAB_MARK = "<!-- LAB -->"
NEXT_HEADING = "## 다음 장"


@dataclass(frozen=True)
class Chapter:
    id: str  # "00" … "16"
    title: str  # Korean title shown in the navigation
    section: str
    icon: str  # a Material icon (bundled with Streamlit, so it renders without emoji fonts)

    @property
    def url_path(self) -> str:
        """ "chNN" for every chapter, ready or not (a stable ASCII address: /ch03).

        Note (Streamlit 1.67): because pages/ exists, the first session of a fresh server that
        opens a direct chapter link gets a "Page not found" dialog over the right page under a
        plain `streamlit run app.py`; `python -m ui.serve` starts the same app without it
        (ui/serve.py says why; tests/test_browser_share.py checks it)."""
        return f"ch{self.id}"

    @property
    def address(self) -> str:
        """The path a link uses: "" for chapter 00, the default page, which Streamlit serves at
        the root only (its url_path is ignored: /ch00 would answer "Page not found"); else
        url_path."""
        return "" if self.id == "00" else self.url_path

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
    Chapter("15", "15 · prefill/decode 분리와 KV 캐시 계층", "서빙", ":material/call_split:"),
    Chapter("16", "16 · 구조화된 출력", "서빙", ":material/data_object:"),
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


_NUMBER_TOKEN = re.compile(r"[0-9][0-9,]*(?:\.[0-9]+)?")
_GROUPED = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")


def numbers_in(text: str) -> list[float] | None:
    """The numbers written in text; None when one of them is ambiguous.

    A comma followed by exactly three digits is a thousands separator ("23,040" → 23040.0); any
    other comma inside a number ("1,5": a decimal comma? a list?) makes the answer ambiguous, so it
    is not read at all rather than read as 15. A comma that ends a number is punctuation."""
    out = []
    for raw in _NUMBER_TOKEN.findall(str(text)):
        raw = raw.rstrip(",")
        if "," in raw and not _GROUPED.fullmatch(raw):
            return None
        out.append(float(raw.replace(",", "")))
    return out


NUMBER_PROBLEM = (
    "숫자 하나만 써 주세요. 숫자가 여럿이거나 부정하는 말이 섞인 답은 채점하지 않습니다. "
    "천 단위 쉼표는 23,040처럼 세 자리마다 찍습니다."
)
_NEGATION = re.compile(r"아니|아님|아냐|않|없|못|틀|\b(?:not|no|isn't|wrong)\b", re.IGNORECASE)


def answer_number(answer: str) -> float | None:
    """The one number an answer states, or None when it cannot be read as exactly one: no number,
    several ("3블록 × 5 = 15"), an ambiguous comma ("1,5"), or a negation ("12가 아니다")."""
    found = numbers_in(answer)
    if found is None or len(found) != 1 or _NEGATION.search(str(answer)):
        return None
    return found[0]


def answer_problem(answer: str, check: dict) -> str | None:
    """Why a short answer cannot be graded as written (None when it can). A number question is
    sent back rather than graded wrong when its answer does not state exactly one number."""
    if check.get("type") != "number" or not normalize(answer):
        return None
    return None if answer_number(answer) is not None else NUMBER_PROBLEM


def check_answer(answer: str, check: dict) -> bool:
    """Whether a short answer is right under the question's CHECK (see the module docstring)."""
    given = normalize(answer)
    if not given:
        return False
    kind = check.get("type")
    if kind == "number":
        found = answer_number(answer)
        if found is None:
            return False
        value = float(check["value"])
        tol = float(check.get("rel_tol", 0.005)) * abs(value) or 1e-9
        return abs(found - value) <= tol
    if kind == "exact":
        return given in {normalize(a) for a in check["answers"]}
    raise ValueError(f"unknown check type: {kind!r}")


def choice_is_right(q: dict, choice: str) -> bool:
    """A chosen option is right only when it is the key itself, never by sharing its words."""
    return choice == q["options"][q["answer"]]


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


KIND_LABELS = {"choice": "자동 채점", "short": "자동 채점", "self": "스스로 채점"}
SELF_MARKS = ["맞았어요", "틀렸어요"]
KIND_LEGEND = (
    "자동 채점: 고른 답, 숫자, 용어처럼 코드가 확인할 수 있는 답입니다. "
    "스스로 채점: 설명을 먼저 써 보고, 모범 답안과 견주어 직접 표시합니다."
)


def _choice(key: str, q: dict, order: list[int]) -> None:
    shown = [q["options"][j] for j in order]
    choice = st.radio("답 고르기", shown, index=None, key=key, label_visibility="collapsed")
    if choice is not None:
        _feedback(key, choice, choice_is_right(q, choice), q, q["options"][q["answer"]])


def _short(key: str, q: dict) -> None:
    answer = st.text_input(
        "답 쓰기", key=key, label_visibility="collapsed", placeholder="답을 쓰고 Enter"
    )
    if not answer.strip():
        return
    problem = answer_problem(answer, q["check"])
    if problem:
        st.warning(problem)
        return
    right = check_answer(answer, q["check"])
    _feedback(key, answer.strip(), right, q, "예시 답: " + (q.get("accept") or ["—"])[0])


def _self_assessed(key: str, q: dict) -> None:
    """Write first, then reveal the model answer and mark yourself; the code never grades it."""
    written = st.text_area(
        "내 답 쓰기", key=key, label_visibility="collapsed", placeholder="내 생각을 먼저 써 보세요"
    )
    shown = st.checkbox(
        "모범 답안 보기",
        key=f"{key}_reveal",
        disabled=not written.strip(),
        help="먼저 답을 쓰면 열 수 있습니다.",
    )
    if not (shown and written.strip()):
        return
    st.info("모범 답안: " + q["model_answer"] + "\n\n" + q["explanation"])
    mark = st.radio(
        "내 답을 모범 답안과 견주어 스스로 채점해 보세요",
        SELF_MARKS,
        index=None,
        key=f"{key}_mark",
        horizontal=True,
    )
    if mark == SELF_MARKS[1]:
        st.caption("어느 부분이 달랐는지 본문의 해당 절에서 다시 확인해 보세요.")


def quiz(chapter_id: str) -> None:
    """The chapter's questions, each labelled with who grades it: the code (choice, number,
    exact term) or the learner against a model answer (open explanations)."""
    questions = load_quiz(chapter_id)
    if not questions:
        st.caption("이 장의 확인 문제는 준비 중입니다.")
        return
    cid = f"ch{chapter(chapter_id).id}"
    seed = _session_seed()
    st.caption(KIND_LEGEND)
    for i, q in enumerate(questions, 1):
        key = f"quiz_{cid}_{i}"
        with st.container(border=True):
            label = KIND_LABELS[q["kind"]]
            st.markdown(f"**문제 {i}.** :gray-badge[{label}] {q['question']}")
            if q["kind"] == "choice":
                _choice(key, q, shuffled_order(len(q["options"]), seed, cid, i))
            elif q["kind"] == "short":
                _short(key, q)
            else:
                _self_assessed(key, q)


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
    folded = projector_on()  # the projector view: the lesson folds away, the lab fills the page
    st.markdown(f"[:material/arrow_downward: 실험으로 가기](#{LAB_ANCHOR})")
    with st.expander("본문 (프로젝터 보기에서 접힘)") if folded else st.container():
        lesson_markdown(before)
    st.divider()
    st.header("실험실", anchor=LAB_ANCHOR)
    if claim:
        lab_claim(claim)
    try:
        lab()
        link_values_taken()
    except Exception as exc:  # noqa: BLE001 - a learner sees a Korean message, never a traceback
        from ui.errors import show_error

        if undo_link_values():  # a shared link's value the lab refused: open with its defaults
            st.rerun()
        show_error(exc, "실험실을 그리지 못했습니다")
    st.divider()
    with st.expander("본문 이어서 (프로젝터 보기에서 접힘)") if folded else st.container():
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
