"""No function in pipelines/ is longer than 60 lines: a longer one does several things (issue 25)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60


def long_functions(source: str, name: str) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LIMIT
    ]


def test_no_function_in_pipelines_is_over_60_lines():
    found = [
        hit
        for path in sorted((ROOT / "pipelines").rglob("*.py"))
        for hit in long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_a_long_function_is_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    assert long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f (61 lines)"]
