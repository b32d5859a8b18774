"""The house in layers, checked from the code (engine/tools/import_graph.py reads every import,
the ones inside functions too): no import circle, no layer importing a higher one, the
instruments imported only by the command line, the ground free of torch and pandas, functions a
reader can hold in their head, and docs/architecture.md's picture drawn from the code as it is."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from engine.tools import import_graph

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_ENGINE_MODULE_LINES = 800
DIAGRAM_START, DIAGRAM_END = "```mermaid\n", "```\n"


@pytest.fixture(scope="module")
def edges():
    return import_graph.import_edges()


def test_the_graph_reader_finds_imports_inside_functions(tmp_path):
    pkg = tmp_path / "engine"
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scheduler.py").write_text("def f():\n    from engine import core\n")
    (pkg / "core.py").write_text("from engine.scheduler import f\n")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "bench.py").write_text("import engine.core\n")
    found = import_graph.import_edges(pkg)
    pairs = {(e.importer, e.imported) for e in found}
    assert ("engine.scheduler", "engine.core") in pairs  # the import inside a function
    assert import_graph.find_cycle(found) == ["engine.core", "engine.scheduler", "engine.core"]
    assert import_graph.broken_rules(found) == [
        "engine.scheduler:2 (ground) imports engine.core (engine)"
    ]


def test_no_import_circle_in_the_engine(edges):
    assert import_graph.find_cycle(edges) is None


def test_every_import_goes_down_a_layer_and_the_tools_stay_apart(edges):
    assert import_graph.broken_rules(edges) == []


def test_the_ground_and_the_engine_core_load_no_heavy_library():
    ground = [m for m in import_graph.engine_modules() if import_graph.layer_of(m) == "ground"]
    probe = (
        "import importlib, sys\n"
        f"for m in {ground!r}: importlib.import_module(m)\n"
        "heavy = [x for x in ('torch', 'pandas', 'streamlit') if x in sys.modules]\n"
        "import engine.core\n"
        "late = [x for x in ('pandas', 'streamlit') if x in sys.modules]\n"
        "print(heavy, late)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[] []", f"ground loads {out}"


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _python_files() -> list[Path]:
    files = [ROOT / "app.py"]
    for folder in ("engine", "ui", "pages"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def test_no_function_over_80_lines():
    long = [
        f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} {fn.end_lineno - fn.lineno + 1}"
        for p in _python_files()
        for fn in _functions(p)
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_no_engine_module_over_800_lines():
    long = [
        f"{p.relative_to(ROOT)} {n}"
        for p in sorted((ROOT / "engine").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_ENGINE_MODULE_LINES
    ]
    assert long == []


def _length(path: Path, cls: str, method: str) -> int:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            fn = next(f for f in node.body if getattr(f, "name", None) == method)
            return fn.end_lineno - fn.lineno + 1
    raise AssertionError(f"{cls}.{method} not found in {path}")


def test_the_core_loop_stays_short():
    assert _length(ROOT / "engine/core.py", "EngineCore", "step") <= 25
    assert _length(ROOT / "engine/scheduler.py", "Scheduler", "schedule") <= 40


def test_docs_picture_is_the_graph_of_the_code(edges):
    doc = (ROOT / "docs/architecture.md").read_text()
    start = doc.index(DIAGRAM_START) + len(DIAGRAM_START)
    drawn = doc[start : doc.index(DIAGRAM_END, start)]
    assert drawn == import_graph.mermaid(edges), (
        "docs/architecture.md is out of date: replace its mermaid block with the output of "
        "`python -m engine.tools.import_graph`"
    )
