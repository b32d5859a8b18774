"""Every written lesson (lessons/chNN.md) that a learner can trust.

1. Every control a lesson names exists on its page. Lessons mark controls in one syntax,
   **[라벨]** (bold + brackets); the page, run under Streamlit's AppTest from app.py (so the
   sidebar's settings form is there too), must show a widget with that label. A marked label also
   matches a widget label that continues with a parenthetical ("블록 크기" ↔ "블록 크기 (토큰)").
2. Text checks that keep the review's findings fixed: no copied course sentences or calques, every
   evidence label defined in ch00, a source grade in every 🔬 증거 읽기 section.

The AppTest part runs one page per test with the tiny test model: run one chapter with
`pytest tests/test_lessons.py -k ch03`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"
# Every chapter whose lesson exists (00-16 as they land).
CHAPTERS = sorted(p.stem[2:] for p in LESSONS.glob("ch[0-9][0-9].md"))
MARK = re.compile(r"\*\*\[([^\]\n]+)\]\*\*")
# Widget kinds whose label a learner can read and act on (AppTest accessor names).
WIDGET_KINDS = (
    "button",
    "form_submit_button",
    "slider",
    "select_slider",
    "selectbox",
    "checkbox",
    "number_input",
    "toggle",
    "radio",
    "text_input",
    "text_area",
    "multiselect",
    "segmented_control",
    "pills",
)


def lesson(cid: str) -> str:
    return (LESSONS / f"ch{cid}.md").read_text(encoding="utf-8")


def marked_labels(cid: str) -> list[str]:
    return sorted(set(MARK.findall(lesson(cid))))


def label_matches(marked: str, labels: set[str]) -> bool:
    m = " ".join(marked.split())
    return any(w == m or w.startswith(m + " (") for w in labels)


def widget_labels(at) -> set[str]:
    labels = set()
    for kind in WIDGET_KINDS:
        try:
            widgets = getattr(at, kind)
        except Exception:  # an accessor this Streamlit version lacks
            continue
        for w in widgets:
            label = getattr(w, "label", None)
            if label:
                labels.add(" ".join(str(label).split()))
    return labels


# -- 1. controls named in the text exist on the page --------------------------------------------


def test_marks_parse():
    assert MARK.findall("누르세요: **[다음 스텝]**, 그리고 **[끝까지]**.") == [
        "다음 스텝",
        "끝까지",
    ]
    assert label_matches("블록 크기", {"블록 크기 (토큰)"})
    assert not label_matches("블록", {"블록 크기 (토큰)"})


@pytest.mark.parametrize("cid", CHAPTERS)
def test_lesson_marks_controls(cid):
    # a lab chapter names at least one control in the one syntax
    assert marked_labels(cid), f"ch{cid}.md marks no control as **[라벨]**"


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    at_mod = pytest.importorskip("streamlit.testing.v1")
    from ui.session import SETTINGS_KEY, EngineSettings

    at = at_mod.AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
    at.session_state[SETTINGS_KEY] = EngineSettings(model=str(tiny_model_dir), device="cpu")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.mark.parametrize("cid", CHAPTERS, ids=[f"ch{c}" for c in CHAPTERS])
def test_every_marked_control_exists_on_its_page(app, cid):
    page = sorted((ROOT / "pages").glob(f"ch{cid}_*.py"))
    assert page, f"no page for ch{cid}"
    app.switch_page(str(page[0].relative_to(ROOT)))
    app.run()
    assert not app.exception, [e.value for e in app.exception]
    labels = widget_labels(app)
    missing = [m for m in marked_labels(cid) if not label_matches(m, labels)]
    assert not missing, f"ch{cid}: marked but not on the page: {missing}; page has {sorted(labels)}"


# -- 2. text checks -------------------------------------------------------------------------------

BANNED = {
    "돕니다": "실행됩니다",
    "나눠 지우": "나눠 부담하는",
    "서로 당긴": "맞바꾸는 관계",
    "정직하게 덧붙이면": "(plain statement)",
    "위주": "…이(가) 병목",
    "2코어": "(the app may run on any host)",
    "아티팩트를 살아 움직이게 하는 실행 계층": "(our own sentence)",
    "대규모 병렬 행렬 연산에 특화된 가속기": "(our own sentence)",
}


@pytest.mark.parametrize("cid", CHAPTERS)
def test_no_copied_sentences_or_calques(cid):
    text = lesson(cid)
    found = {k: v for k, v in BANNED.items() if k in text}
    assert not found, f"ch{cid}: replace {found}"


def test_ch00_defines_every_evidence_label():
    text = lesson("00")
    for label in (
        "측정값",
        "계산값",
        "보고값",
        "제조사 문서",
        "vendor-reported",
        "paper-reported",
        "1차",
        "2차",
    ):
        assert label in text, label


@pytest.mark.parametrize("cid", CHAPTERS)
def test_evidence_section_gives_source_grade(cid):
    text = lesson(cid)
    assert "## 🔬 증거 읽기" in text
    section = text.split("## 🔬 증거 읽기", 1)[1].split("\n## ", 1)[0]
    assert "1차" in section or "2차" in section, f"ch{cid}: 증거 읽기 without a source grade"


def test_ch05_asks_for_a_decode_speed_prediction():
    assert "추측하지 마세요" not in lesson("05")
    assert "예측" in lesson("05")
