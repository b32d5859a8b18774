"""Chapter 00's lab alone, on the shared lab component (ui/lab.py, which runs in st.fragment).

    .venv/bin/python -m streamlit run tests/classroom_fragment_app.py

The classroom browser test uses it to check that the session/engine lifecycle needs no page rerun
(a click reruns the fragment only, the page counter stays at 1), and `tests/load_classroom.py
--app tests/classroom_fragment_app.py` measures what such a click costs the server."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from ui.lab import LabContext  # noqa: E402
from ui.lab import lab as engine_lab  # noqa: E402
from ui.registry import lazy_worker_of  # noqa: E402
from ui.session import get_records  # noqa: E402

st.set_page_config(page_title="조각 실험실", layout="wide")
runs = st.session_state["_page_runs"] = st.session_state.get("_page_runs", 0) + 1
st.caption(f"페이지 실행 {runs}회")


def fragment_marker(ctx: LabContext) -> None:
    """Drawn inside the lab's fragment: what the fragment alone saw."""
    worker = lazy_worker_of(ctx.engines["main"])
    allocated = "예" if worker is None or worker.kv_allocated else "아니오"
    st.caption(f"조각 안: 스텝 {len(get_records('main'))}개 · KV 텐서 할당 {allocated}")


engine_lab("main", default_max_tokens=24, chapter_view=fragment_marker, show_code_panel=False)
