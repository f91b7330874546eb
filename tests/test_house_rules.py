"""The floors of the house that no tool checks: no module of core/ or plugins/ over 600
lines and no function over 80 (a ceiling, not a target: split by responsibility), and a
top level of the package that a newcomer can read: at most 12 modules, each a floor of
its own that says in its docstring why it lives there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from llamagym.config.files import tomllib  # tomli before Python 3.11

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [REPO / "core" / "llamagym", REPO / "plugins" / "llamagym_builtins"]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_TOP_LEVEL_MODULES = 12


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


def top_level_modules() -> list[Path]:
    return sorted((REPO / "core" / "llamagym").glob("*.py"))


def test_the_top_level_holds_at_most_12_modules() -> None:
    names = [path.name for path in top_level_modules()]
    assert "__init__.py" in names and "agent.py" in names  # the folder this test thinks
    assert len(names) <= MAX_TOP_LEVEL_MODULES, names


def test_each_top_level_module_says_why_it_lives_there_and_is_a_floor_of_its_own() -> None:
    """A paragraph of the docstring starts ``Top level:``; and but for ``__init__`` the
    module is a floor (or a part of one) of the layers contract, not a room of one."""
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (layers,) = [c["layers"] for c in contracts["tool"]["importlinter"]["contracts"]
                 if c.get("containers") == ["llamagym"]]
    floors = {name.strip() for layer in layers for name in re.split(r"[:|]", layer)}
    unexplained, not_floors = [], []
    for path in top_level_modules():
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if not any(part.startswith("Top level: ") for part in docstring.split("\n\n")):
            unexplained.append(path.name)
        if path.stem != "__init__" and path.stem not in floors:
            not_floors.append(path.name)
    assert unexplained == []
    assert not_floors == []
