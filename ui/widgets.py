"""Widgets every chapter reuses: the decision table, evidence labels and the "방금 실행된 코드"
panel. The lab itself (requests, stepping, the three views) is ui/lab.py; the quiz is in
ui/lesson.py."""

from __future__ import annotations

import datetime as _dt
import inspect
from pathlib import Path

import pandas as pd
import streamlit as st

from engine.trace import StepRecord
from ui.experiments.common import display_frame
from ui.figures import REASON_KO

FINISH_KO = {"stop": "정지 토큰", "length": "길이 한도", "abort": "중단", "error": "오류"}
PHASE_KO = {"prefill": "prefill", "chunked_prefill": "chunked prefill (조각)", "decode": "decode"}

EVIDENCE_KINDS = {
    "측정값": ("blue", "measured"),
    "계산값": ("green", "derived"),
    "보고값": ("orange", "reported"),
    "제조사 문서": ("violet", "vendor-documented"),
}


# -- tables --------------------------------------------------------------------------------------


def show_frame(df: pd.DataFrame, container=None, **kwargs) -> None:
    """st.dataframe of display_frame(df) (hide_index=True unless given), in `container` if
    given (a column or another container). A frame may carry its own column widths in
    df.attrs["column_config"] (decision_table does): used unless column_config is given."""
    kwargs.setdefault("hide_index", True)
    config = df.attrs.get("column_config")
    if config and "column_config" not in kwargs:
        kwargs["column_config"] = {k: v for k, v in config.items() if k in df.columns}
    (container or st).dataframe(display_frame(df), **kwargs)


# -- the plots -----------------------------------------------------------------------------------

# The decision table is read in a narrow column (two or three engines side by side): the request,
# what it got and why come first; the token counts after them, under short headers.
DECISION_COLUMNS = ["요청", "결정", "이유", "토큰", "국면", "계산됨", "prefix 히트"]


def _decision_column_config() -> dict:
    column = st.column_config.Column  # no type: display_frame may turn a column with gaps to text
    return {
        "요청": column(width="small", pinned=True),
        "결정": column(width="small"),
        "이유": column(width="medium", help="배정받지 못한 요청이 이번 스텝에 빠진 까닭"),
        "토큰": column(width="small", help="이번 스텝에 배정된 토큰 수"),
        "국면": column(width="small"),
        "계산됨": column(width="small", help="이 스텝 전에 이미 KV가 계산된 토큰 수"),
        "prefix 히트": column(width="small", help="prefix 캐시에서 찾아 계산을 건너뛴 토큰 수"),
    }


def decision_table(record: StepRecord | None) -> pd.DataFrame:
    """The scheduler's decision of one step: who got how many tokens, and why the others did not.
    Columns: DECISION_COLUMNS (the reason third, so a narrow column shows it without scrolling);
    show_frame applies the column widths it carries."""
    rows = []
    if record is not None:
        for s in record.scheduled:
            rows.append(
                {
                    "요청": s.request_id,
                    "결정": "배정",
                    "이유": "",
                    "토큰": s.num_tokens,
                    "국면": PHASE_KO.get(s.phase, s.phase),
                    "계산됨": s.num_computed_tokens,
                    "prefix 히트": s.num_prefix_hit_tokens,
                }
            )
        for rid, reason in record.unscheduled.items():
            rows.append(
                {
                    "요청": rid,
                    "결정": "선점" if reason == "preempted" else "대기",
                    "이유": REASON_KO.get(reason, reason),
                    "토큰": 0,
                    "국면": "",
                    "계산됨": None,
                    "prefix 히트": None,
                }
            )
        for rid in record.finished:
            for row in rows:
                if row["요청"] == rid:
                    reason = FINISH_KO.get(record.finished[rid], record.finished[rid])
                    row["결정"] += f" → 완료({reason})"
    table = pd.DataFrame(rows, columns=DECISION_COLUMNS)
    table.attrs["column_config"] = _decision_column_config()
    return table


# -- evidence, code ----------------------------------------------------------------------------


def evidence(kind: str, text: str, **conditions) -> None:
    """A number with its evidence label, one of the four chapter 00 defines: 측정값 (conditions),
    계산값 (formula=...), 보고값 and 제조사 문서 (source=...)."""
    if kind not in EVIDENCE_KINDS:
        raise ValueError(f"evidence kind must be one of {list(EVIDENCE_KINDS)}, got {kind!r}")
    color, english = EVIDENCE_KINDS[kind]
    if kind == "측정값":
        conditions.setdefault("날짜", _dt.date.today().isoformat())
    extra = ""
    if kind == "계산값" and "formula" in conditions:
        extra = f" · 공식: `{conditions.pop('formula')}`"
    if kind in ("보고값", "제조사 문서") and "source" in conditions:
        extra = f" · 출처: {conditions.pop('source')}"
    cond = " · ".join(f"{k}={v}" for k, v in conditions.items())
    st.markdown(
        f":{color}-badge[{kind} ({english})] {text}{extra}"
        + (f"  \n:gray[조건: {cond}]" if cond else "")
    )


def show_code(obj, title: str = "방금 실행된 코드") -> None:
    """The real source of the engine function just exercised (inspect.getsource)."""
    try:
        source = inspect.getsource(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
        line = inspect.getsourcelines(obj)[1]
        try:
            where = str(path.relative_to(Path(__file__).resolve().parent.parent))
        except ValueError:
            where = str(path)
    except (OSError, TypeError) as exc:
        st.caption(f"소스를 찾을 수 없습니다: {exc}")
        return
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", str(obj)))
    with st.expander(f"{title}: `{name}` ({where}:{line})", icon=":material/code:"):
        st.code(source, language="python", line_numbers=True)
