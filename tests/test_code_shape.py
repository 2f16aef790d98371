"""The runtime packages stay readable: no function over 60 lines, no class over 400, the verifier's loop under 500.

Issue 42 split the functions and classes that had grown past these bounds (``VerifierServer`` was 603 lines,
``create_app`` 200, ``measure_curves`` 99); this test keeps them from growing back. A function's length is from its
``def`` (decorators excluded) to its last line, docstring included, as ``ast`` reports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_PACKAGES = ("shared", "verifier_node", "drafter_node", "runtime", "http_server")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 400
MAX_SERVER_LINES = 500


def oversized(root: Path) -> list[str]:
    """Every function over :data:`MAX_FUNCTION_LINES` and class over :data:`MAX_CLASS_LINES` under ``root``'s
    runtime packages, as ``path:line name (N lines)``."""
    found = []
    for package in RUNTIME_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
                if limit is None:
                    continue
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_or_class_is_over_its_bound():
    assert oversized(ROOT) == []


def test_the_verifier_loop_is_under_500_lines():
    lines = len((ROOT / "verifier_node" / "server.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_SERVER_LINES, lines


def test_the_check_finds_an_oversized_function(tmp_path):
    package = tmp_path / "shared"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "long.py").write_text(f"def long():\n{body}\n", encoding="utf-8")
    for name in RUNTIME_PACKAGES[1:]:
        (tmp_path / name).mkdir()
    assert oversized(tmp_path) == [f"shared/long.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]
