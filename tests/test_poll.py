"""The class poll (ui/poll.py): the bounded process-wide store on its own, then two AppTest
sessions of a predict box: the instructor's projector view opens a poll, a learner whose link
names it predicts, and the instructor's histogram counts the vote; closing forgets it."""

from __future__ import annotations

import threading

import pytest

from ui.poll import Poll, PollError, PollStore, histogram


def test_store_bounds_one_vote_per_voter_and_forgets_a_closed_poll():
    store = PollStore(max_polls=2, max_votes=2)
    code = store.open("ch08_itl", "질문", ["작아진다", "같다"])
    assert len(code) == 6 and store.get(code.lower()).pid == "ch08_itl"
    store.vote(code, "a", "작아진다")
    store.vote(code, "a", "같다")  # a second prediction replaces the first
    assert store.get(code).votes == {"a": "같다"}
    store.vote(code, "b", "같다")
    with pytest.raises(PollError):
        store.vote(code, "c", "같다")  # full
    with pytest.raises(PollError):
        store.vote(code, "a", "모른다")  # not an option
    number = store.open("ch00_steps", "스텝 수", None, "스텝")
    with pytest.raises(PollError):
        store.open("ch03", "q", None)  # MAX_POLLS open
    for bad in (-1, float("nan"), "열"):
        with pytest.raises(PollError):
            store.vote(number, "a", bad)
    store.close(code)
    assert store.get(code) is None and len(store) == 1
    with pytest.raises(PollError):
        store.vote(code, "d", "같다")


def test_store_takes_concurrent_votes_without_losing_one():
    store = PollStore(max_votes=1000)
    code = store.open("p", "q", None)
    threads = [
        threading.Thread(target=lambda i=i: [store.vote(code, f"{i}-{j}", j) for j in range(50)])
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.get(code).votes) == 400


def test_histogram_of_choices_and_numbers():
    choice = Poll("C", "p", "q", ["a", "b", "c"], votes={"x": "a", "y": "c", "z": "a"})
    assert histogram(choice) == (["a", "b", "c"], [2, 0, 1])
    numbers = Poll("N", "p", "q", None, votes={str(i): float(v) for i, v in enumerate([1, 2, 9])})
    labels, counts = histogram(numbers, bins=4)
    assert sum(counts) == 3 and counts[0] == 2 and counts[-1] == 1 and len(labels) == 3
    assert histogram(Poll("E", "p", "q", None)) == ([], [])


def _predict_box():
    from ui.predict import predict  # the test process's sys.path: AppTest runs in it

    predict("ch08_itl", "ITL 최대는?", options=["작아진다", "같다", "커진다"])


def _session(**state):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_predict_box, args=(), default_timeout=60)
    at.session_state["_session_token"] = state.pop("token")
    for key, value in state.items():
        at.session_state[key] = value
    return at


def test_a_learners_prediction_reaches_the_instructors_histogram():
    from ui.poll import get_store
    from ui.share import PROJECTOR_KEY

    teacher = _session(token="teacher-token-000000", **{PROJECTOR_KEY: True})
    teacher.run()
    assert not teacher.exception
    teacher.button(key="poll_open_ch08_itl").click().run()
    code = teacher.session_state["_poll_owned"]["ch08_itl"]
    link = next(c.value for c in teacher.code if "poll=" + code in c.value)
    assert "view=" not in link and "step=" not in link  # learners predict before the run
    assert any("아직 표가 없습니다" in c.value for c in teacher.caption)

    learner = _session(token="learner-token-000000", _share_poll=code)
    learner.run()
    learner.radio(key="predict_ch08_itl").set_value("같다").run()
    assert not learner.exception
    assert get_store().get(code).votes == {"learner-token-000000": "같다"}

    teacher.button(key="poll_refresh_ch08_itl").click().run()
    chart = teacher.get("plotly_chart")[0]
    assert '"y":[0,1,0]' in chart.proto.spec.replace(" ", "")
    assert any("1표" in m.value for m in teacher.markdown)
    teacher.button(key="poll_close_ch08_itl").click().run()
    assert get_store().get(code) is None
    assert teacher.button(key="poll_open_ch08_itl")  # the poll can be opened again
