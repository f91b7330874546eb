"""The floors of the house that no tool checks: no module of core/ or plugins/ over 600
lines and no function over 80 (a ceiling, not a target: split by responsibility)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [REPO / "core" / "llamagym", REPO / "plugins" / "llamagym_builtins"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def modules() -> list[Path]:
    found = [
        path for package in PACKAGES for path in package.rglob("*.py")
        if "templates" not in path.relative_to(package).parts  # a new plugin's files
        and not path.is_symlink()
    ]
    assert len(found) > 50  # the packages are where this test thinks they are
    return found


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(REPO)): lines
        for path in modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
