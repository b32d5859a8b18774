"""Predict → run → compare: the learner commits to a guess before the run, then sees it beside
the measurement with one sentence on the gap. Predictions are kept per browser session (and
across a reload of its page)."""

from __future__ import annotations

import streamlit as st

from ui.poll import class_poll
from ui.session import persist_key

_STORE = "_predictions"  # pid → {"value": ..., "unit": ..., "question": ...}
persist_key(_STORE)  # a reload of the page keeps them (ui/session.py, restore_session)


def prediction(pid: str):
    """The stored prediction of `pid` (None if the learner has not made one)."""
    entry = st.session_state.get(_STORE, {}).get(pid)
    return None if entry is None else entry["value"]


def _not_negative(key: str) -> None:
    """A negative guess is set to 0 in the box itself (a browser would keep it with a red mark
    and send nothing), with a note."""
    value = st.session_state.get(key)
    note = f"_{key}_note"
    if value is not None and value < 0:
        st.session_state[key] = 0.0
        st.session_state[note] = f"예측 {value:g}은(는) 음수라 0으로 맞췄습니다."
    else:
        st.session_state.pop(note, None)


def predict(
    pid: str,
    question: str,
    unit: str = "",
    options: list[str] | None = None,
    default: float | None = None,
    locked: bool = False,
    step: float | None = None,
):
    """Ask for a prediction: a number with its unit, or one of `options`. Returns the value.

    `locked` (the run has started) freezes it, so the comparison is with a guess made before."""
    store = st.session_state.setdefault(_STORE, {})
    with st.container(border=True):
        st.markdown(f"**예측** — {question}")
        key = f"predict_{pid}"
        if options is not None:
            current = store.get(pid, {}).get("value")
            index = options.index(current) if current in options else None
            value = st.radio(
                "내 예측",
                options,
                index=index,
                key=key,
                horizontal=True,
                disabled=locked,
                label_visibility="collapsed",
            )
        else:
            current = store.get(pid, {}).get("value")
            c1, c2 = st.columns([2, 3], vertical_alignment="center")
            value = c1.number_input(
                f"내 예측 ({unit})" if unit else "내 예측",
                value=current,
                step=step,
                key=key,
                disabled=locked,
                placeholder="숫자를 쓰세요",
                on_change=_not_negative,
                args=(key,),
            )
            c2.caption(
                "실행 전에 적어 두세요. 실행하면 잠기고, 측정값과 나란히 보여 줍니다."
                if not locked
                else "실행 중에는 예측이 잠깁니다 (리셋하면 다시 쓸 수 있음)."
            )
            if st.session_state.get(f"_{key}_note"):
                st.caption(f":orange[{st.session_state[f'_{key}_note']}]")
        if value is not None and not locked:
            store[pid] = {"value": value, "unit": unit, "question": question}
        class_poll(pid, question, options, unit, prediction(pid))  # a class poll (ui/poll.py)
    return prediction(pid)


def gap_sentence(predicted, measured, unit: str = "") -> str:
    """One Korean sentence on the gap between a number predicted and measured."""
    if isinstance(predicted, str) or isinstance(measured, str):
        return (
            "예측이 맞았습니다."
            if predicted == measured
            else f"예측({predicted})과 달리 실제로는 '{measured}'였습니다. 왜 그랬는지 그림에서 "
            "찾아 보세요."
        )
    if measured == 0:
        return "측정값이 0이라 비율로 비교할 수 없습니다."
    ratio = predicted / measured
    if 0.8 <= ratio <= 1.25:
        return f"예측이 측정값의 {ratio:.2f}배로, 20% 안에 들었습니다."
    if ratio > 1:
        return (
            f"예측이 측정값보다 {ratio:.1f}배 컸습니다: "
            f"생각보다 {'빨랐' if unit == 'ms' else '작았'}습니다."
        )
    return f"예측이 측정값의 {ratio:.2f}배였습니다: 실제는 예측의 {1 / ratio:.1f}배입니다."


def compare(pid: str, measured, unit: str = "", fmt: str = "{:,.1f}") -> None:
    """Prediction and measurement side by side, with one sentence on the gap."""
    predicted = prediction(pid)
    with st.container(border=True):
        st.markdown("**예측 ↔ 측정**")
        c1, c2 = st.columns(2)
        show = (lambda v: v) if isinstance(measured, str) else (lambda v: fmt.format(v))
        c1.metric("내 예측", "—" if predicted is None else f"{show(predicted)} {unit}".strip())
        c2.metric("측정값", f"{show(measured)} {unit}".strip())
        if predicted is None:
            st.caption("예측을 적지 않았습니다. 리셋하고 예측을 먼저 적은 뒤 다시 실행해 보세요.")
        else:
            st.markdown(gap_sentence(predicted, measured, unit))
