"""Docs that stay true: every hook has a test, and its exact signature is documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from llamagym import hookspecs
from llamagym.devtools.conformance import CHECK_NAMES
from llamagym.hookspecs import all_hook_names

ROOT = Path(__file__).resolve().parents[1]
HOOKS_DOC = ROOT / "docs" / "plugin-hooks.md"
GUIDE = ROOT / "docs" / "writing-a-plugin.md"


def _annotation(annotation: object) -> str:
    # hookspecs.py postpones annotations (PEP 563), so they are the source text as
    # written; should that change, render the objects the way inspect does.
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def hook_signature(name: str) -> str:
    """``def name(arg: Annotation, ...) -> Return``, annotations exactly as written."""
    signature = inspect.signature(getattr(hookspecs, name))
    parameters = []
    for parameter in signature.parameters.values():
        text = f"{parameter.name}: {_annotation(parameter.annotation)}"
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
        parameters.append(text)
    return f"def {name}({', '.join(parameters)}) -> {_annotation(signature.return_annotation)}"


def test_every_hook_has_a_test() -> None:
    sources = "\n".join(
        path.read_text(encoding="utf-8")
        for path in (ROOT / "tests").rglob("test_*.py")
        if path.resolve() != Path(__file__).resolve()
    )
    untested = [name for name in all_hook_names() if not re.search(rf"\b{name}\b", sources)]
    assert untested == [], f"hooks no test mentions: {untested}"


def test_every_hook_signature_is_in_the_docs() -> None:
    text = HOOKS_DOC.read_text(encoding="utf-8")
    missing = [hook_signature(n) for n in all_hook_names() if hook_signature(n) not in text]
    assert missing == [], "docs/plugin-hooks.md lacks these exact signatures:\n" + "\n".join(
        missing
    )


def test_the_hooks_doc_has_one_section_per_hook_and_no_stale_ones() -> None:
    sections = re.findall(r"^## (\S+)$", HOOKS_DOC.read_text(encoding="utf-8"), re.MULTILINE)
    assert sections == all_hook_names()  # same hooks, in the order of hookspecs.py


def test_the_guide_names_every_conformance_check() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    assert [name for name in CHECK_NAMES if f"`{name}`" not in text] == []
