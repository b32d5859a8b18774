"""The engine's import graph, read from the code: which module imports which (imports inside
functions included), the layer each module belongs to, the rules between layers, and the picture
of docs/architecture.md.

    python -m engine.tools.import_graph            # the layer diagram (mermaid), as in the docs
    python -m engine.tools.import_graph --check    # exit 1 on an import circle or a broken rule

The layers, lowest first. A module may import its own layer and the layers below it; the
instruments (tools) are imported only by the command line."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parents[1]

# (layer, what it holds). The order is the rule: imports go down, never up.
LAYERS: list[tuple[str, str]] = [
    ("ground", "plain data and the control path: config, request, scheduler, KV-cache manager"),
    ("data path", "worker, model runner, models, layers, kernels, sampling, spec decode"),
    ("executor", "in-process and multi-process executors behind one interface"),
    ("engine", "EngineCore: the loop that joins the ground to an executor"),
    ("entry points", "LLM / AsyncLLM, the OpenAI-compatible server, the command line"),
    ("tools", "the instruments: bench, calibration, cost model, simulator, quality, selfcheck"),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
DATA_PATH_PACKAGES = ("models", "layers", "kernels", "sample", "spec_decode", "worker")
# The command line dispatches to the instruments; nothing else in the engine may import them.
TOOL_USERS = ("engine.__main__", "engine.entrypoints.cli")


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int


def module_name(path: Path, root: Path = ENGINE_DIR) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def engine_modules(root: Path = ENGINE_DIR) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(target: str, known: dict[str, Path]) -> str | None:
    """The engine module an import names: `engine.worker.worker` itself, or the package of a name
    imported from it (`from engine.worker import worker` names the module engine.worker.worker)."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative import
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_edges(root: Path = ENGINE_DIR) -> list[Edge]:
    """Every import of an engine module by an engine module, wherever it sits in the file."""
    known = engine_modules(root)
    edges = set()
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported_names(node, package):
                resolved = _resolve(target, known) if target.startswith("engine") else None
                if resolved and resolved != name and not _is_parent(resolved, name):
                    edges.add(Edge(name, resolved, node.lineno))
    return sorted(edges, key=lambda e: (e.importer, e.imported, e.line))


def _is_parent(package: str, module: str) -> bool:
    """Importing a submodule runs its packages' __init__ first; that is no dependency of note."""
    return module.startswith(package + ".")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module == "engine.models.config":
        return "ground"  # the architecture numbers: plain data the ground and the tools size with
    if len(parts) == 1 or module == "engine.__main__" or parts[1] == "entrypoints":
        return "entry points"
    if parts[1] == "tools":
        return "tools"
    if parts[1] == "executor":
        return "executor"
    if module == "engine.core":
        return "engine"
    if parts[1] in DATA_PATH_PACKAGES:
        return "data path"
    return "ground"


def broken_rules(edges: list[Edge]) -> list[str]:
    """Imports that go up a layer, or into the instruments from outside the command line."""
    found = []
    for e in edges:
        low, high = layer_of(e.importer), layer_of(e.imported)
        if high == "tools" and low != "tools" and e.importer not in TOOL_USERS:
            found.append(f"{e.importer}:{e.line} imports the instrument {e.imported}")
        elif high != "tools" and RANK[high] > RANK[low]:
            found.append(f"{e.importer}:{e.line} ({low}) imports {e.imported} ({high})")
    return found


def find_cycle(edges: list[Edge]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, []).append(e.imported)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def group_of(module: str) -> str:
    """The box a module is drawn in: its folder (worker/, tools/, ...) or, on the ground, itself."""
    parts = module.split(".")
    if module in ("engine", "engine.__main__"):
        return "engine (CLI, public names)"
    if module == "engine.models.config":
        return "models/config"
    if (ENGINE_DIR / parts[1]).is_dir():
        return f"{parts[1]}/"
    return parts[1]


def mermaid(edges: list[Edge]) -> str:
    """The layer diagram: one subgraph per layer, one box per folder (or ground module). Arrows
    inside the ground go module to module; an arrow from above into the ground goes to the ground
    as a whole, so that the picture stays readable."""
    modules = sorted({m for e in edges for m in (e.importer, e.imported)} | set(engine_modules()))
    boxes: dict[str, set[str]] = {}
    for m in modules:
        boxes.setdefault(layer_of(m), set()).add(group_of(m))
    lines = ["flowchart BT"]
    for i, (layer, what) in enumerate(LAYERS):
        lines.append(f'  subgraph L{i}["{layer}: {what}"]')
        lines += [f'    {_node_id(b)}["{b}"]' for b in sorted(boxes.get(layer, ()))]
        lines.append("  end")
    arrows = set()
    for e in edges:
        src, dst = group_of(e.importer), group_of(e.imported)
        from_above = layer_of(e.importer) != "ground" and layer_of(e.imported) == "ground"
        target = "L0" if from_above else _node_id(dst)
        if src != dst:
            arrows.add((_node_id(src), target))
    lines += [f"  {a} --> {b}" for a, b in sorted(arrows)]
    return "\n".join(lines) + "\n"


def _node_id(box: str) -> str:
    return "n_" + "".join(c if c.isalnum() else "_" for c in box)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    edges = import_edges()
    if "--check" not in args:
        print(mermaid(edges), end="")
        return 0
    problems = broken_rules(edges)
    cycle = find_cycle(edges)
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
    print("\n".join(problems) or f"{len(edges)} imports, no circle, every rule kept")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
