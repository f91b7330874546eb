"""What ``llamagym check`` says of a plugin's imports of modules that moved: each one, by
file and line, with its new place and the release the old name goes in.

The plugin's package is read as text and parsed, never run again: at most
:data:`MAX_FILES` Python files of at most :data:`MAX_FILE_BYTES` bytes each, so a large
or odd package costs a bounded read.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

from llamagym import goes_in, gone, moved_away

MAX_FILES = 2_000
MAX_FILE_BYTES = 1 << 20


#: LlamaGym's own packages, which import no moved name (tests/plugins/test_compat.py).
OWN_PACKAGES = ("llamagym", "llamagym_builtins")


def package_files(module: str) -> list[tuple[Path, Path]]:
    """``(root, file)`` for each Python file of the top-level package ``module`` belongs
    to; none for LlamaGym's own, a module outside a package, or one not found."""
    top = module.split(".")[0]
    try:
        spec = None if top in OWN_PACKAGES else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    files: list[tuple[Path, Path]] = []
    for root in map(Path, roots):
        for path in sorted(root.rglob("*.py")):
            if len(files) >= MAX_FILES:
                return files
            if path.is_file() and not path.is_symlink():
                files.append((root, path))
    return files


def _imported(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every module an import statement of ``tree`` names, with its line:
    ``import a.b``, ``from a.b import c`` (``a.b`` and ``a.b.c``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def moved_imports(module: str) -> list[str]:
    """One line per import, in the package of ``module``, of a module that moved:
    ``pkg/plugin.py:6: llamagym.specs moved to ... in LlamaGym 0.5 and the old name goes
    in 0.6``."""
    lines = []
    for root, path in package_files(module):
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            continue  # a file that cannot be read is no import to report
        for name, line in _imported(tree):
            moved = moved_away(name)
            if moved is None:
                continue
            new, release = moved
            when = (f"and is gone since {goes_in(release)}" if gone(release)
                    else f"and the old name goes in {goes_in(release)}")
            where = f"{root.name}/{path.relative_to(root)}:{line}"
            lines.append(f"{where}: {name} moved to {new} in LlamaGym {release} {when}")
    return lines


__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "OWN_PACKAGES", "moved_imports", "package_files"]
