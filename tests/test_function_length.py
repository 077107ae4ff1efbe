"""No function body in mdc/ or pipelines/ is longer than 60 lines: a longer one does several things (issue 25).
The body is counted from its first statement after the docstring: the formatter lays a signature
out one parameter per line (a typer command's options), which is declaration, not logic."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(node.body) > 1
    start = node.body[1] if has_docstring else first
    return node.end_lineno - start.lineno + 1


def long_functions(source: str, name: str) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name} ({body_lines(node)} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > LIMIT
    ]


def test_no_function_in_mdc_or_pipelines_is_over_60_lines():
    found = [
        hit
        for package in ("mdc", "pipelines")
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in long_functions(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_a_long_function_is_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT + 1))
    assert long_functions(f"def f():\n{body}\n", "m.py") == ["m.py:1 f (61 lines)"]
