"""Take a run home from a lab: download buttons for its Perfetto trace and its tables
(engine/tools/trace_export.py builds them; docs/traces.md documents them). Several engines (a
comparison) go into one trace file, each its own process named by its label."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import streamlit as st

from engine.core import EngineCore
from engine.tools import trace_export
from engine.trace import StepRecord

LabRun = tuple[str, EngineCore, list[StepRecord]]

CAPTION = (
    "트레이스는 ui.perfetto.dev의 'Open trace file' 또는 chrome://tracing의 'Load'로 엽니다 "
    "(엔진 시계, 파일은 브라우저 안에서만 읽힘). CSV는 pandas.read_csv로 읽고, 열의 뜻은 "
    "docs/traces.md에 있습니다."
)


@dataclass
class ExportFile:
    label: str  # the button's text
    file_name: str
    mime: str
    make: Callable[[], str]  # the file's text, built when the button is clicked


def trace_runs(runs: list[LabRun]) -> list[trace_export.Run]:
    """The lab's runs as trace_export runs: each engine's records and its requests as of now
    (a snapshot of the lists, so a later step does not change a download in progress)."""
    return [(label, list(records), engine.all_requests()) for label, engine, records in runs]


def export_files(key: str, runs: list[LabRun]) -> list[ExportFile]:
    """The files a lab offers: the trace, the three tables as CSV, everything as JSON."""
    exported = trace_runs(runs)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", key).strip("-") or "run"

    def table(name: str) -> Callable[[], str]:
        columns = trace_export.TABLES[name]
        return lambda: trace_export.to_csv(trace_export.trace_tables(exported)[name], columns)

    return [
        ExportFile(
            "Perfetto 트레이스 (JSON)",
            f"{stem}-trace.json",
            "application/json",
            lambda: trace_export.trace_json(exported),
        ),
        ExportFile("스텝 기록 (CSV)", f"{stem}-steps.csv", "text/csv", table("steps")),
        ExportFile("요청 여정 (CSV)", f"{stem}-journeys.csv", "text/csv", table("journeys")),
        ExportFile("요청 지표 (CSV)", f"{stem}-requests.csv", "text/csv", table("requests")),
        ExportFile(
            "전체 (JSON)",
            f"{stem}-tables.json",
            "application/json",
            lambda: trace_export.tables_json(exported),
        ),
    ]


def export_buttons(key: str, runs: list[LabRun]) -> None:
    """One row of download buttons (keys f"{key}_export_{i}") and a one-line caption. The files
    are built only when a button is clicked, and a click does not rerun the lab."""
    files = export_files(key, runs)
    for i, (column, f) in enumerate(zip(st.columns(len(files)), files)):
        with column:
            st.download_button(
                f.label,
                f.make,
                file_name=f.file_name,
                mime=f.mime,
                key=f"{key}_export_{i}",
                on_click="ignore",
            )
    st.caption(CAPTION)
