"""The chapter quizzes (lessons/chNN_quiz.json) must never mark a wrong answer right.

Only answers the code can verify are graded by it (a choice, one number, an exact term); an open
"explain why" question is self-assessed against a model answer, and the page says which kind each
question is. Each auto-graded question is fed wrong answers of its own (negations, the misconception
its chapter rebuts, a number beside the right one) and must reject every one. Also: keys spread over
positions and are seldom the longest option, one polite register, options shuffled per session, and
a wrong answer earns a hint and a second try before the key is shown."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from test_lesson_terms import quiz_text

from ui.lesson import (
    LESSONS_DIR,
    NUMBER_PROBLEM,
    answer_number,
    answer_problem,
    check_answer,
    choice_is_right,
    load_quiz,
    numbers_in,
    shuffled_order,
)

QUIZ_FILES = sorted(LESSONS_DIR.glob("ch*_quiz.json"))
CHAPTER_IDS = [p.name[2:4] for p in QUIZ_FILES]
SEEDS = sorted(Path("/work/shared/seeds").glob("000_*.txt"))


def all_questions():
    return [(cid, i, q) for cid in CHAPTER_IDS for i, q in enumerate(load_quiz(cid), 1)]


def of_kind(kind: str):
    return [t for t in all_questions() if t[2]["kind"] == kind]


def ids(v):
    return v if isinstance(v, (str, int)) else ""


def test_quiz_files_exist_for_chapters_00_to_16():
    assert {f"{i:02d}" for i in range(17)} <= set(CHAPTER_IDS)


@pytest.mark.parametrize("cid", CHAPTER_IDS)
def test_schema(cid):
    qs = json.loads((LESSONS_DIR / f"ch{cid}_quiz.json").read_text(encoding="utf-8"))
    assert len(qs) >= 3
    for q in qs:
        assert q["kind"] in ("choice", "short", "self") and q["question"] and q["explanation"]
        if q["kind"] == "choice":
            assert len(q["options"]) >= 3
            assert len(set(q["options"])) == len(q["options"]), "options must be distinct"
            assert 0 <= q["answer"] < len(q["options"])
        elif q["kind"] == "short":
            assert q["check"]["type"] in ("number", "exact"), "keyword grading is gone"
            assert q["accept"], "at least one example answer"
        else:
            assert q["model_answer"]
            assert not {"check", "accept", "options", "answer"} & set(q), "never auto-graded"


@pytest.mark.parametrize("cid", CHAPTER_IDS)
def test_no_position_holds_more_than_40_percent_of_keys(cid):
    keys = [q["answer"] for q in load_quiz(cid) if q["kind"] == "choice"]
    assert len(keys) >= 3, "a chapter needs at least three choice questions to spread its keys"
    top = Counter(keys).most_common(1)[0][1]
    assert top / len(keys) <= 0.4, (cid, keys)


def varied_choices():
    """Choice questions whose options differ in length by more than 3 characters (short numeric
    options such as "약 8 GB" cannot be varied), each with the key's length rank (how many of
    its options are strictly shorter than the key) and whether no option is longer than the key."""
    out = []
    for cid, i, q in of_kind("choice"):
        lengths = [len(o) for o in q["options"]]
        if max(lengths) - min(lengths) > 3:
            key_len = lengths[q["answer"]]
            out.append((cid, i, sum(n < key_len for n in lengths), key_len >= max(lengths)))
    return out


def test_key_is_seldom_the_longest_option():
    """The key is at least as long as every other option in at most 20% of the questions (it was
    17 of 48, ties counted)."""
    varied = varied_choices()
    assert len(varied) >= 30
    longest = [(cid, i) for cid, i, _, at_least_as_long in varied if at_least_as_long]
    assert len(longest) / len(varied) <= 0.2, (len(longest), len(varied), longest)


def test_key_length_rank_is_spread():
    """Nor is the key systematically the second longest or the shortest: no length rank holds
    more than a third of the questions, so an option's length tells nothing."""
    varied = varied_choices()
    ranks = Counter(rank for _, _, rank, _ in varied)
    assert max(ranks.values()) / len(varied) <= 1 / 3, ranks


# -- every auto-graded question rejects wrong answers of its own --------------------------------

# (chapter, question number) → wrong answers a learner could write: the misconception the chapter
# rebuts, the worked example's answer where the question uses new numbers, neighbours, negations.
WRONG = {
    ("01", 2): ["56623104", "49152", "576", "134515008", "28311553", "28,311,551"],
    ("02", 2): ["TPOT", "ITL", "E2E", "첫 토큰", "첫 토큰까지의 시간", "TTFT가 아니다", "not TTFT"],
    ("03", 2): ["46080", "230400", "2304", "11520", "23041", "23,039", "23040이 아니다"],
    ("04", 4): ["throughput", "처리량", "SLO", "goodput이 아니다", "not goodput", "badput"],
    ("05", 2): ["7.6만", "762939", "7629", "38147", "152588", "80000", "76294가 아니다"],
    ("07", 3): ["starvation", "tail latency", "선점", "whole", "HOL이 아니다", "not HOL"],
    ("09", 3): ["16", "15", "11", "13", "3", "48", "12가 아니다", "⌈47 / 16⌉ × 5 = 15"],
    ("09", 5): ["기아는 아니다", "기아가 아니다", "not starvation", "선점", "교착", "HOL"],
    ("10", 1): ["90", "96", "48", "64", "79", "81", "80이 아니다"],
    ("10", 5): [
        "cache_salt가 아니다",
        "not salt",
        "seed",
        "request_id",
        "prefix_caching_hash_algo",
    ],
    ("12", 1): ["32", "128", "256", "60", "63", "65", "64가 아니다"],
    ("13", 1): ["3.4", "4", "2.4", "2.44", "3", "2.952가 아니다"],
    ("13", 5): ["1", "1.875", "2.5", "3", "무한대", "2를 넘을 수 있다, 아니다"],
    ("14", 5): ["6", "2.4", "0.42", "8.5", "14", "16", "15가 아니다"],
    ("15", 3): ["24576", "1228800", "4915200", "2457.6", "245760", "2,457,600이 아니다"],
    ("16", 3): ["6144", "131072", "4096", "32768", "524288", "16,384가 아니다"],
}


def short_questions():
    return of_kind("short")


def test_every_short_question_has_its_own_wrong_answers():
    assert {(cid, i) for cid, i, _ in short_questions()} == set(WRONG)


def _generated_wrong(q: dict) -> list[str]:
    """Negations of each right example, and for numbers the values just outside the tolerance
    and a factor of ten either way."""
    out = []
    for right in q["accept"]:
        out += [f"{right}가 아니다", f"{right} 아님", f"not {right}", f"{right}는 틀렸다"]
    check = q["check"]
    if check["type"] == "number":
        value = float(check["value"])
        step = max(3 * float(check.get("rel_tol", 0.005)) * abs(value), 1.0 if value >= 10 else 0.1)
        out += [f"{value + step:g}", f"{value - step:g}", f"{value * 10:g}", f"{value / 10:g}"]
    return out


@pytest.mark.parametrize("cid,i,q", short_questions(), ids=ids)
def test_short_answer_rejects_its_wrong_answers(cid, i, q):
    for wrong in WRONG[(cid, i)] + _generated_wrong(q):
        assert not check_answer(wrong, q["check"]), (cid, i, wrong)


@pytest.mark.parametrize("cid,i,q", short_questions(), ids=ids)
def test_short_answer_examples_pass_and_empty_fails(cid, i, q):
    for example in q["accept"]:
        assert check_answer(example, q["check"]), (cid, i, example)
        assert answer_problem(example, q["check"]) is None
    assert not check_answer("", q["check"])
    assert not check_answer("모르겠어요", q["check"])


@pytest.mark.parametrize("cid,i,q", of_kind("choice"), ids=ids)
def test_choice_accepts_only_its_key(cid, i, q):
    key_text = q["options"][q["answer"]]
    assert choice_is_right(q, key_text)
    for option in q["options"]:
        if option != key_text:
            assert not choice_is_right(q, option), (cid, i, option)
    assert not choice_is_right(q, key_text + " 아니다")


def test_rebutted_misconceptions_are_wrong_options():
    """The two cases the review found: ch11's "int4 is lossless" and ch09's "not starvation"."""
    q = next(q for _, _, q in of_kind("choice") if "float32와 거의 같은" in q["question"])
    lossless = next(o for o in q["options"] if "손실이 없는" in o)
    assert not choice_is_right(q, lossless)
    starvation = next(q for cid, _, q in short_questions() if cid == "09" and "기아" in q["accept"])
    assert not check_answer("기아는 아니다", starvation["check"])
    assert check_answer("기아", starvation["check"])


def test_self_assessed_questions_exist_and_carry_no_grading():
    selfs = of_kind("self")
    assert len(selfs) >= 5
    for _, _, q in selfs:
        assert "check" not in q and "accept" not in q


# -- number reading ------------------------------------------------------------------------------


def test_numbers_in_reads_thousands_separators_only_in_threes():
    assert numbers_in("23,040 B") == [23040.0]
    assert numbers_in("28,311,552") == [28311552.0]
    assert numbers_in("약 76,000 토큰, 그리고 2.5") == [76000.0, 2.5]
    assert numbers_in("15, 그러니까") == [15.0]
    for ambiguous in ("1,5", "1,5000", "12,34", "1,234,56"):
        assert numbers_in(ambiguous) is None, ambiguous


def test_a_number_answer_needs_exactly_one_number():
    check = {"type": "number", "value": 15, "rel_tol": 0.0}
    assert check_answer("15", check) and check_answer("15개", check)
    assert check_answer("15,", check)
    assert not check_answer("1,5", check), "1,5 is not 15"
    assert not check_answer("3블록 × 5 = 15", check), "several numbers are not read"
    assert not check_answer("15가 아니다", check)
    assert answer_number("15 또는 16") is None
    assert answer_problem("1,5", check) == NUMBER_PROBLEM
    assert answer_problem("3 × 5 = 15", check) == NUMBER_PROBLEM
    assert answer_problem("14", check) is None  # one number: graded (wrong), not sent back


def test_number_check_uses_tolerance():
    check = {"type": "number", "value": 76294, "rel_tol": 0.02}
    assert check_answer("약 76,000 토큰", check) and check_answer("76293.9", check)
    assert not check_answer("7.6만", check) and not check_answer("762939", check)


def test_exact_check_is_the_whole_answer():
    check = {"type": "exact", "answers": ["TTFT", "time to first token"]}
    assert check_answer("ttft", check) and check_answer("Time-to-first token", check)
    assert not check_answer("TTFT가 아니다", check) and not check_answer("TTFT 아님", check)


# -- one register; no text from the course's original chapter ------------------------------------

_PLAIN_END = re.compile(r"(?<!니)다[.)]?$|[^요]\?$|라\.?$")


@pytest.mark.parametrize("cid", CHAPTER_IDS)
def test_questions_and_explanations_speak_politely(cid):
    """해요체/하십시오체 for every question, hint, explanation and model answer (options may be
    the plain statements an exam option is)."""
    for i, q in enumerate(load_quiz(cid), 1):
        for field in ("question", "hint", "explanation", "model_answer"):
            for sentence in re.split(r"(?<=[.?!])\s+", q.get(field, "")):
                sentence = sentence.strip().rstrip(")")
                assert not _PLAIN_END.search(sentence), (cid, i, field, sentence)


@pytest.mark.skipif(not SEEDS, reason="the course's original chapter is not on this machine")
@pytest.mark.parametrize("path", QUIZ_FILES, ids=lambda p: p.name)
def test_no_20_character_run_shared_with_the_original_chapter(path):
    """Every string of the quiz, joined and with whitespace collapsed (so a run across two
    options counts too), shares no run of 20 characters with the original chapter."""
    seed = " ".join(SEEDS[0].read_text(encoding="utf-8").split())
    runs = {seed[j : j + 20] for j in range(len(seed) - 19)}
    text = " ".join(quiz_text(path).split())
    shared = [text[j : j + 20] for j in range(len(text) - 19) if text[j : j + 20] in runs]
    assert not shared, (path.name, shared[:3])


def test_shuffle_is_a_seeded_permutation_that_varies():
    orders = {tuple(shuffled_order(4, seed, "ch03", 1)) for seed in range(40)}
    assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert len(orders) > 5
    assert shuffled_order(4, 7, "ch03", 1) == shuffled_order(4, 7, "ch03", 1)


# -- the widget ----------------------------------------------------------------------------------

QUIZ_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from ui.lesson import quiz
quiz({cid!r})
"""


def quiz_app_for(cid: str):
    at_mod = pytest.importorskip("streamlit.testing.v1")
    root = str(Path(__file__).resolve().parent.parent)
    at = at_mod.AppTest.from_string(QUIZ_SCRIPT.format(root=root, cid=cid), default_timeout=30)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.fixture
def quiz_app():
    return quiz_app_for("03")


def test_each_question_says_who_grades_it():
    at = quiz_app_for("06")
    headers = [m.value for m in at.markdown if m.value.startswith("**문제 ")]
    kinds = [q["kind"] for q in load_quiz("06")]
    assert len(headers) == len(kinds)
    for header, kind in zip(headers, kinds):
        assert ("스스로 채점" in header) == (kind == "self"), header
        assert ("자동 채점" in header) == (kind != "self"), header


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


def test_an_unreadable_number_is_sent_back_without_costing_a_try(quiz_app):
    at = quiz_app
    for unreadable in ("2,30", "2 × 30 × 3 × 64 × 2 = 23040"):
        at.text_input(key="quiz_ch03_2").input(unreadable).run()
        assert at.warning and at.warning[0].value == NUMBER_PROBLEM
        assert not at.error and not at.success
    at.text_input(key="quiz_ch03_2").input("230400").run()
    assert "한 번 더 답할 수 있습니다" in at.error[0].value, "the first graded try"


def test_self_assessed_question_reveals_the_model_answer_and_never_grades():
    at = quiz_app_for("06")
    i, q = next((i, q) for i, q in enumerate(load_quiz("06"), 1) if q["kind"] == "self")
    key = f"quiz_ch06_{i}"
    assert at.checkbox(key=f"{key}_reveal").disabled, "write first, then reveal"
    at.text_area(key=key).input("페이징은 메모리를 늘린다").run()
    assert not at.success and not at.error, "the code does not judge an explanation"
    at.checkbox(key=f"{key}_reveal").check().run()
    shown = " ".join(m.value for m in at.info)
    assert q["model_answer"] in shown and q["explanation"] in shown
    assert not at.success and not at.error
    at.radio(key=f"{key}_mark").set_value("틀렸어요").run()
    assert not at.exception and not at.success and not at.error


def test_options_are_shuffled_per_session():
    at_mod = pytest.importorskip("streamlit.testing.v1")
    root = str(Path(__file__).resolve().parent.parent)
    seen = set()
    for seed in (1, 2, 3, 4, 5, 6):
        at = at_mod.AppTest.from_string(QUIZ_SCRIPT.format(root=root, cid="03"), default_timeout=30)
        at.session_state["_quiz_seed"] = seed
        at.run()
        seen.add(tuple(at.radio(key="quiz_ch03_1").options))
    assert len(seen) > 1
