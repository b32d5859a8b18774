"""The architecture's rules, checked: the control path is free of tensors and dataframes, the
engine never imports the app, and the app uses only the engine's public names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def python_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["engine.scheduler", "engine.kv_cache"])
def test_control_path_imports_neither_torch_nor_pandas(module):
    """Imported in a fresh interpreter, so what their imports import counts too."""
    code = (
        f"import sys, {module}; "
        "bad = sorted(m for m in ('torch', 'pandas', 'numpy') if m in sys.modules); "
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} pulls in {result.stdout.strip()}"


def test_engine_never_imports_streamlit_or_the_app():
    offenders = {
        str(path.relative_to(REPO)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] in ("streamlit", "ui", "pages")
        )
        for path in python_files("engine")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("folder", ["pages", "ui"])
def test_app_uses_only_public_engine_names(folder):
    """No `from engine.x import _private`, and pages reach no `_private` attribute of anything."""
    problems = []
    for path in python_files(folder) + ([REPO / "app.py"] if folder == "pages" else []):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                problems += [
                    f"{path.name}: imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
            if folder == "pages" and isinstance(node, ast.Attribute):
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    problems.append(f"{path.name}:{node.lineno}: reaches .{node.attr}")
    assert problems == []
