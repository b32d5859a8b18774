"""How the multi-process executor (engine/executor/multiproc.py) starts its workers: fork where
it is safe, spawn where it must.

vLLM forks its workers on Linux (VLLM_WORKER_MULTIPROC_METHOD, default "fork") and switches to
spawn when CUDA is already initialised in the parent, since a forked child cannot use the
parent's CUDA context. Forking also spares a script the `if __name__ == "__main__":` guard: a
forked worker starts from this process's memory, while a spawned one re-runs the main script's
top level, which in an unguarded script builds the engine again inside the worker (multiprocessing
refuses, and the worker dies). Where spawning is unavoidable such a script is refused at once,
with the fix, instead of a dead worker.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

WORKER_MULTIPROC_METHOD_ENV = "LLM_WORKER_MULTIPROC_METHOD"  # vLLM: VLLM_WORKER_MULTIPROC_METHOD
START_METHODS = ("fork", "spawn")


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def why_spawn() -> str | None:
    """Why the workers must be spawned here, or None: they can fork."""
    requested = os.environ.get(WORKER_MULTIPROC_METHOD_ENV) or "fork"
    if requested not in START_METHODS:
        raise ValueError(
            f"{WORKER_MULTIPROC_METHOD_ENV} must be one of {', '.join(START_METHODS)}, "
            f"got {requested!r}"
        )
    if requested == "spawn":
        return f"{WORKER_MULTIPROC_METHOD_ENV}=spawn"
    if not sys.platform.startswith("linux"):
        return f"forking is not safe on {sys.platform}"
    if _cuda_initialized():
        return "CUDA is initialised in this process, and a forked worker could not use it"
    return None


def _is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = {ast.dump(side) for side in (test.left, test.comparators[0])}
    guard = {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}
    return isinstance(test.ops[0], ast.Eq) and sides == guard


def unguarded_main_line() -> tuple[str, int] | None:
    """(script, line) when the main script's top level, outside an `if __name__ == "__main__":`
    block, is what is starting the workers now; None otherwise (a guarded call, an interactive
    session, `python -c`, a notebook: nothing a spawned worker would re-run)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)
    ):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        body = ast.parse(Path(path).read_text(encoding="utf-8")).body
    except (OSError, SyntaxError, ValueError):
        return None
    for node in body:
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            if node.lineno <= line <= node.end_lineno:
                return None
    return path, line


def worker_start_method() -> str:
    """ "fork" or "spawn" (see the module docstring); raises RuntimeError, naming the fix, when
    the workers must be spawned from an unguarded script's top level."""
    reason = why_spawn()
    if reason is None:
        return "fork"
    unguarded = unguarded_main_line()
    if unguarded is not None:
        script, line = unguarded
        raise RuntimeError(
            f"{script}, line {line}, starts the engine's worker processes outside an "
            f'`if __name__ == "__main__":` block, and here they must be spawned ({reason}): '
            "each spawned worker re-runs the script's top level and would start the engine "
            'again. Put the code that builds the engine under `if __name__ == "__main__":` '
            "(or let the workers fork: Linux, CUDA not initialised before the engine is built, "
            f"{WORKER_MULTIPROC_METHOD_ENV} unset)"
        )
    return "spawn"
