"""A class poll on a predict box: the instructor opens it (projector view), learners who open the
poll's link add their prediction as an anonymous vote, the projector shows the class's answers
as a histogram before the run reveals the engine's, and closing the poll forgets it.

    /ch08?poll=K7PX2M&...   (the lab's shared link, ui/share.py, with the poll's code)

The votes live in this process only (like ui/registry.py's sessions), behind a lock, bounded:
at most MAX_POLLS open polls and MAX_VOTES votes a poll, one vote per browser session a poll
(a second prediction replaces the first). No accounts, no names: a vote is a value.
PollStore has no Streamlit in it (tests/test_poll.py tests it alone); the widgets follow it.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import streamlit as st

MAX_POLLS = 32
MAX_VOTES = 500
POLL_TTL_S = 4 * 3600.0  # a poll nobody closed is forgotten after this long
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I/L: read aloud from a projector
CODE_LEN = 6
POLL_PARAM = "poll"
LEARNER_DROPS = ("step", "steplab", "view")  # link parameters a poll's link leaves out


class PollError(ValueError):
    """A poll refused: unknown or closed code, too many polls, full, a value it cannot take."""


@dataclass
class Poll:
    code: str
    pid: str  # the predict box the poll is about
    question: str
    options: list[str] | None  # a choice question's options; None: a number
    unit: str = ""
    opened: float = field(default_factory=time.monotonic)
    votes: dict[str, object] = field(default_factory=dict)  # voter → value


class PollStore:
    """The process's open polls (thread-safe; bounded in polls, votes and age)."""

    def __init__(self, max_polls: int = MAX_POLLS, max_votes: int = MAX_VOTES) -> None:
        self.max_polls = max_polls
        self.max_votes = max_votes
        self._lock = threading.Lock()
        self._polls: dict[str, Poll] = {}

    def _expire(self) -> None:
        now = time.monotonic()
        for code in [c for c, p in self._polls.items() if now - p.opened > POLL_TTL_S]:
            del self._polls[code]

    def open(self, pid: str, question: str, options: list[str] | None, unit: str = "") -> str:
        """A new poll's code; PollError when MAX_POLLS are open."""
        with self._lock:
            self._expire()
            if len(self._polls) >= self.max_polls:
                raise PollError(f"열린 투표가 이미 {self.max_polls}개라 더 열 수 없습니다.")
            code = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LEN))
            while code in self._polls:
                code = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LEN))
            opts = list(options) if options is not None else None
            self._polls[code] = Poll(code, pid, question, opts, unit)
            return code

    def get(self, code: str) -> Poll | None:
        """A copy of the poll (None: unknown or closed)."""
        with self._lock:
            self._expire()
            poll = self._polls.get(str(code).upper())
            if poll is None:
                return None
            return replace(poll, votes=dict(poll.votes))

    def vote(self, code: str, voter: str, value) -> None:
        """Record `voter`'s answer (replacing their earlier one); PollError when refused."""
        with self._lock:
            poll = self._polls.get(str(code).upper())
            if poll is None:
                raise PollError("이 투표는 닫혔거나 없습니다.")
            value = _valid_value(poll, value)
            if voter not in poll.votes and len(poll.votes) >= self.max_votes:
                raise PollError(f"이 투표는 {self.max_votes}표가 다 찼습니다.")
            poll.votes[voter] = value

    def close(self, code: str) -> None:
        with self._lock:
            self._polls.pop(str(code).upper(), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._polls)


def _valid_value(poll: Poll, value):
    if poll.options is not None:
        if value not in poll.options:
            raise PollError(f"'{value}'은(는) 이 투표의 보기가 아닙니다.")
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PollError("숫자 예측만 받습니다.") from None
    if not math.isfinite(number) or number < 0:
        raise PollError("0 이상의 유한한 숫자만 받습니다.")
    return number


def histogram(poll: Poll, bins: int = 8) -> tuple[list[str], list[int]]:
    """(labels, counts): a choice poll's count per option in its order; a number poll's votes in
    up to `bins` equal-width bins between the smallest and the largest vote."""
    values = list(poll.votes.values())
    if poll.options is not None:
        counts = Counter(values)
        return list(poll.options), [counts.get(o, 0) for o in poll.options]
    if not values:
        return [], []
    low, high = min(values), max(values)
    if high == low:
        return [f"{low:g}"], [len(values)]
    n = min(bins, len(set(values)))
    width = (high - low) / n
    counts = [0] * n
    for v in values:
        counts[min(int((v - low) / width), n - 1)] += 1
    labels = [f"{low + i * width:.3g}–{low + (i + 1) * width:.3g}" for i in range(n)]
    return labels, counts


_STORE = PollStore()


def get_store() -> PollStore:
    return _STORE


# -- the widgets -----------------------------------------------------------------------------------

_OWNED = "_poll_owned"  # pid → the code of the poll this session (the instructor) opened


def voter_id() -> str:
    """This browser session's anonymous voter id: its reload token (ui/session.py), so a reload
    replaces its vote rather than adding one."""
    from ui.session import session_id, session_token

    return session_token() or session_id()


def class_poll(pid: str, question: str, options: list[str] | None, unit: str, value) -> None:
    """Under a predict box (ui/predict.py): a learner whose link names this box's poll sends the
    prediction made before the run; the projector view has the instructor's poll controls."""
    from ui.share import poll_code, projector_on

    code = poll_code()
    poll = get_store().get(code) if code else None
    if poll is not None and poll.pid == pid:
        _send_vote(code, value)
    if projector_on():
        instructor_poll(pid, question, options, unit)


def _send_vote(code: str, value) -> None:
    if value is None:
        st.caption(f"반 투표 {code}: 예측을 적으면 익명으로 반 전체 결과에 들어갑니다.")
        return
    try:
        get_store().vote(code, voter_id(), value)
    except PollError as exc:
        st.caption(f":orange[{exc}]")
        return
    st.caption(f"반 투표 {code}에 내 예측을 익명으로 보냈습니다 (바꾸면 바뀐 값으로 셉니다).")


def _open_poll(pid: str, question: str, options: list[str] | None, unit: str) -> None:
    try:
        code = get_store().open(pid, question, options, unit)
    except PollError as exc:
        st.session_state[f"_poll_note_{pid}"] = str(exc)
        return
    st.session_state.setdefault(_OWNED, {})[pid] = code


def _close_poll(pid: str) -> None:
    code = st.session_state.setdefault(_OWNED, {}).pop(pid, None)
    if code:
        get_store().close(code)


def instructor_poll(pid: str, question: str, options: list[str] | None, unit: str) -> None:
    """반 투표 열기 → the poll's code and link, the class's answers as a histogram (새로 고침 or
    any rerun redraws it), 투표 닫기 (the votes are forgotten)."""
    code = st.session_state.get(_OWNED, {}).get(pid)
    poll = get_store().get(code) if code else None
    if poll is None:
        st.session_state.get(_OWNED, {}).pop(pid, None)
        st.button(
            "반 투표 열기",
            key=f"poll_open_{pid}",
            icon=":material/how_to_vote:",
            on_click=_open_poll,
            args=(pid, question, options, unit),
            help="학생들이 이 예측 상자에 적은 답을 익명으로 모아 히스토그램으로 보여 줍니다",
        )
        note = st.session_state.pop(f"_poll_note_{pid}", None)
        if note:
            st.caption(f":orange[{note}]")
        return
    _poll_results(pid, poll)


def _poll_results(pid: str, poll: Poll) -> None:
    from ui.share import current_chapter, link_params, link_url

    chapter_id = current_chapter() or pid[2:4]
    # the learners' link: the same inputs, before the run (a step would lock their predict box)
    # and in the ordinary view
    params = {k: v for k, v in link_params(chapter_id).items() if k not in LEARNER_DROPS}
    link = link_url(chapter_id, {**params, POLL_PARAM: poll.code})
    st.markdown(f"**반 투표 {poll.code}** · {len(poll.votes)}표 (익명, 이 서버의 메모리에만)")
    st.code(link, language=None)
    labels, counts = histogram(poll)
    if sum(counts):
        spec = {
            "data": [{"type": "bar", "x": labels, "y": counts, "text": counts}],
            "layout": {
                "title": {"text": f"반의 예측 ({poll.unit or '보기'}별 표 수)"},
                "yaxis": {"title": {"text": "표"}, "dtick": 1},
                "height": 320,
                "margin": {"t": 50, "b": 40, "l": 50, "r": 10},
            },
        }
        st.plotly_chart(spec, width="stretch", key=f"poll_hist_{pid}")
    else:
        st.caption("아직 표가 없습니다. 학생들이 위 링크를 열고 예측을 적으면 여기에 쌓입니다.")
    c1, c2 = st.columns(2)
    c1.button("결과 새로 고침", key=f"poll_refresh_{pid}", icon=":material/refresh:")
    c2.button("투표 닫기", key=f"poll_close_{pid}", on_click=_close_poll, args=(pid,))
