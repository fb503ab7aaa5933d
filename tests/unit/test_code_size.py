"""Units a reader can hold in their head (issue #49): no module of
distore_ucx/ or native/ over 450 lines, no Python function over 100.

The units that are over today are listed with their size: they may only
shrink, and one that fits leaves the list (so the list is what is left to
split). A new unit over the limit fails at once."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 100

# What is left to split, at its size when listed: it may not grow.
OVER_MODULES: dict[str, int] = {}
OVER_FUNCTIONS: dict[str, int] = {}


def modules() -> dict[str, int]:
    """Lines of every source module, by path from the repository root."""
    files = [*ROOT.glob("distore_ucx/**/*.py"), *ROOT.glob("native/**/*.cc"),
             *ROOT.glob("native/**/*.h")]
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}


def functions() -> dict[str, int]:
    """Lines of every Python function and method, as path:Class.name."""
    out = {}
    for path in ROOT.glob("distore_ucx/**/*.py"):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        item.owner = node.name  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = getattr(node, "owner", None)
                name = f"{owner}.{node.name}" if owner else node.name
                out[f"{rel}:{name}"] = max(out.get(f"{rel}:{name}", 0),
                                           node.end_lineno - node.lineno + 1)
    return out


def check(sizes: dict[str, int], limit: int, listed: dict[str, int], what: str) -> list[str]:
    """What breaks the rule: a unit over `limit` not listed, a listed one
    grown past its size, or one listed that fits now (or is gone)."""
    problems = [f"{name}: {n} lines, over {limit}: split it" for name, n in sorted(sizes.items())
                if n > limit and name not in listed]
    for name, size in listed.items():
        n = sizes.get(name)
        if n is None or n <= limit:
            problems.append(f"{name} fits now ({n} lines): take it off the list of {what}")
        elif n > size:
            problems.append(f"{name} grew to {n} lines (listed at {size}): split it, not grow it")
    return problems


def test_no_module_grows_past_450_lines():
    assert check(modules(), MAX_MODULE_LINES, OVER_MODULES, "OVER_MODULES") == []


def test_no_function_grows_past_100_lines():
    assert check(functions(), MAX_FUNCTION_LINES, OVER_FUNCTIONS, "OVER_FUNCTIONS") == []


def test_the_check_sees_what_breaks_the_rule():
    listed = {"a.py": 500, "b.py": 480}
    sizes = {"a.py": 510, "b.py": 300, "c.py": 451, "d.py": 450}
    assert check(sizes, 450, listed, "X") == [
        "c.py: 451 lines, over 450: split it",
        "a.py grew to 510 lines (listed at 500): split it, not grow it",
        "b.py fits now (300 lines): take it off the list of X",
    ]
