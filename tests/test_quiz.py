"""The chapter quizzes (lessons/chNN_quiz.json) test understanding, not the shape of the options:
keys spread over positions, the key is seldom the longest option, short answers are checked by
meaning (numbers within tolerance, exact choices, required and rejected keywords), options are
shuffled per session, and a wrong answer earns a hint and a second try before the key is shown."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ui.lesson import LESSONS_DIR, check_answer, load_quiz, shuffled_order

QUIZ_FILES = sorted(LESSONS_DIR.glob("ch*_quiz.json"))
CHAPTER_IDS = [p.name[2:4] for p in QUIZ_FILES]
CHECK_TYPES = {"number", "exact", "keywords"}


def all_questions():
    return [(cid, i, q) for cid in CHAPTER_IDS for i, q in enumerate(load_quiz(cid), 1)]


def choices():
    return [q for _, _, q in all_questions() if q["kind"] == "choice"]


def test_quiz_files_exist_for_chapters_00_to_08():
    assert {f"{i:02d}" for i in range(9)} <= set(CHAPTER_IDS)


@pytest.mark.parametrize("cid", CHAPTER_IDS)
def test_schema(cid):
    qs = json.loads((LESSONS_DIR / f"ch{cid}_quiz.json").read_text(encoding="utf-8"))
    assert len(qs) >= 3
    for q in qs:
        assert q["kind"] in ("choice", "short") and q["question"] and q["explanation"]
        if q["kind"] == "choice":
            assert len(q["options"]) >= 3
            assert len(set(q["options"])) == len(q["options"]), "options must be distinct"
            assert 0 <= q["answer"] < len(q["options"])
        else:
            assert q["check"]["type"] in CHECK_TYPES
            assert q["accept"], "at least one example answer"


@pytest.mark.parametrize("cid", CHAPTER_IDS)
def test_no_position_holds_more_than_40_percent_of_keys(cid):
    keys = [q["answer"] for q in load_quiz(cid) if q["kind"] == "choice"]
    assert len(keys) >= 3, "a chapter needs at least three choice questions to spread its keys"
    top = Counter(keys).most_common(1)[0][1]
    assert top / len(keys) <= 0.4, (cid, keys)


def test_key_is_seldom_the_longest_option():
    qs = choices()
    strictly_longest = 0
    for q in qs:
        lengths = [len(o) for o in q["options"]]
        k = q["answer"]
        if all(lengths[k] > n for j, n in enumerate(lengths) if j != k):
            strictly_longest += 1
    assert strictly_longest / len(qs) <= 0.4, (strictly_longest, len(qs))


@pytest.mark.parametrize(
    "cid,i,q",
    [t for t in all_questions() if t[2]["kind"] == "short"],
    ids=lambda v: v if isinstance(v, (str, int)) else "",
)
def test_short_answer_examples_pass_and_empty_fails(cid, i, q):
    for example in q["accept"]:
        assert check_answer(example, q["check"]), (cid, i, example)
    assert not check_answer("", q["check"])
    assert not check_answer("모르겠어요", q["check"])


def short(cid: str, needle: str) -> dict:
    return next(q for q in load_quiz(cid) if q["kind"] == "short" and needle in q["question"])


def test_cheat_capacity_does_not_pass_the_paging_question():
    q = short("06", "공짜")
    assert not check_answer("용량", q["check"])
    assert not check_answer("메모리 용량", q["check"])
    assert check_answer("용량은 그대로이고 단편화 낭비가 줄어든다", q["check"])


def test_cheat_echoing_the_question_does_not_pass_ttft():
    q = short("02", "첫 출력")
    assert not check_answer("첫 토큰", q["check"])
    assert not check_answer("첫 토큰까지의 시간", q["check"])
    assert check_answer("TTFT", q["check"]) and check_answer("ttft", q["check"])
    assert check_answer("Time to first token", q["check"])


def test_cheat_wrong_magnitude_does_not_pass_the_kv_bytes():
    q = short("03", "bf16")
    assert not check_answer("230400", q["check"])
    assert not check_answer("2304", q["check"])
    assert not check_answer("46080", q["check"])
    for right in ("23040", "23,040", "23040 B", "2 × 30 × 3 × 64 × 2 = 23040"):
        assert check_answer(right, q["check"]), right


def test_number_check_uses_tolerance():
    check = {"type": "number", "value": 76294, "rel_tol": 0.02}
    assert check_answer("약 76,000 토큰", check) and check_answer("76293.9", check)
    assert not check_answer("7.6만", check) and not check_answer("762939", check)


def test_keywords_need_every_group_and_no_rejected_word():
    check = {"type": "keywords", "all": [["토큰"], ["요청", "동시"]], "none": ["모름"]}
    assert check_answer("토큰 수와 동시 요청 수", check)
    assert not check_answer("토큰", check)
    assert not check_answer("토큰과 요청, 모름", check)
    assert check_answer("HOL", {"type": "keywords", "all": [["=hol", "headofline"]]})
    assert not check_answer("whole", {"type": "keywords", "all": [["=hol", "headofline"]]})


def test_evidence_labels_need_all_three():
    q = short("00", "증거 라벨")
    assert not check_answer("측정값", q["check"])
    assert check_answer("측정값, 계산값, 보고값", q["check"])


def test_shuffle_is_a_seeded_permutation_that_varies():
    orders = {tuple(shuffled_order(4, seed, "ch03", 1)) for seed in range(40)}
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert len(orders) > 5
    assert shuffled_order(4, 7, "ch03", 1) == shuffled_order(4, 7, "ch03", 1)


QUIZ_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from ui.lesson import quiz
quiz("03")
"""


@pytest.fixture
def quiz_app():
    at_mod = pytest.importorskip("streamlit.testing.v1")
    root = str(Path(__file__).resolve().parent.parent)
    at = at_mod.AppTest.from_string(QUIZ_SCRIPT.format(root=root), default_timeout=30)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_choice_gets_a_second_try_before_the_key(quiz_app):
    at = quiz_app
    q = load_quiz("03")[0]
    key_text = q["options"][q["answer"]]
    wrong = [o for o in q["options"] if o != key_text]
    radio = at.radio(key="quiz_ch03_1")
    assert sorted(radio.options) == sorted(q["options"])
    radio.set_value(wrong[0]).run()
    errors = [e.value for e in at.error]
    assert errors and errors[0].startswith("다시 생각해 보세요")
    assert key_text not in errors[0] and q["explanation"] not in errors[0]
    at.radio(key="quiz_ch03_1").set_value(wrong[1]).run()
    assert key_text in at.error[0].value and q["explanation"] in at.error[0].value
    at.radio(key="quiz_ch03_1").set_value(key_text).run()
    assert at.success[0].value.startswith("정답입니다")


def test_short_answer_second_try(quiz_app):
    at = quiz_app
    q = load_quiz("03")[1]
    at.text_input(key="quiz_ch03_2").input("230400").run()
    assert (
        at.error[0].value.startswith("다시 생각해 보세요")
        and q["explanation"] not in at.error[0].value
    )
    at.text_input(key="quiz_ch03_2").input("46080").run()
    assert q["explanation"] in at.error[0].value
    at.text_input(key="quiz_ch03_2").input("23,040").run()
    assert at.success[0].value.startswith("정답입니다")


def test_options_are_shuffled_per_session():
    at_mod = pytest.importorskip("streamlit.testing.v1")
    root = str(Path(__file__).resolve().parent.parent)
    seen = set()
    for seed in (1, 2, 3, 4, 5, 6):
        at = at_mod.AppTest.from_string(QUIZ_SCRIPT.format(root=root), default_timeout=30)
        at.session_state["_quiz_seed"] = seed
        at.run()
        seen.add(tuple(at.radio(key="quiz_ch03_1").options))
    assert len(seen) > 1
