"""`python -m ui.serve [streamlit flags]`: `streamlit run app.py` without the "Page not found"
dialog on the first deep link a fresh server answers (/ch08?..., a shared link: ui/share.py).

Why (Streamlit 1.67): a class-wide flag, PagesManager.uses_pages_directory, is set on the first
browser session of the process because pages/ exists next to app.py, and it stays set until the
first st.navigation call clears it. That session's first script run therefore goes through MPA
v1 (script_runner._mpa_v1): its pages are pages/*.py under their file names, so /ch08 is not one
of them and the server sends page_not_found before it runs app.py, whose st.navigation then draws
the right chapter under the dialog (streamlit issues 9624, 9992, 8860). Every later session is
fine. Clearing the flag before the server starts tells Streamlit what app.py's st.navigation
would tell it anyway (this app has no v1 pages), so the first session is like every other and
pages/ stays where it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app.py"


def use_navigation_only() -> None:
    """Tell Streamlit, before any session, that pages/ holds st.navigation's page files, not MPA
    v1 pages (what st.navigation itself does on its first call)."""
    from streamlit.runtime.pages_manager import PagesManager

    PagesManager.uses_pages_directory = False


def main(argv: list[str] | None = None) -> None:
    """`streamlit run app.py ARGV` in this process, after use_navigation_only()."""
    from streamlit.web import cli

    use_navigation_only()
    args = ["run", str(APP), *(sys.argv[1:] if argv is None else argv)]
    cli.main(args=args, prog_name="streamlit")


if __name__ == "__main__":
    main()
