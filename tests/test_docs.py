"""Docs that stay true: every hook has a test, and its exact signature is documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from llamagym.devtools.agent_checks import CHECK_NAMES
from llamagym.plugin_runtime import hookspecs
from llamagym.plugin_runtime.hookspecs import all_hook_names

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


# -- the README is a front door, and no link in the docs leads nowhere -----------------

README = ROOT / "README.md"
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).+?\1")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(CODE_SPAN.sub("", line))
    return lines


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives ``path``'s headings: lowercase, punctuation dropped, spaces
    to hyphens, and ``-1``, ``-2``, ... after a repeated one."""
    anchors: set[str] = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").lower()).replace(" ", "-")
        anchor, number = slug, 0
        while anchor in anchors:
            number += 1
            anchor = f"{slug}-{number}"
        anchors.add(anchor)
    return anchors


def broken_links(paths: list[Path]) -> list[str]:
    """Every relative link in ``paths`` whose file does not exist, or whose ``#anchor``
    names no heading of the Markdown file it points into, as ``file: target (why)``."""
    problems = []
    for path in paths:
        text = "\n".join(_prose_lines(path.read_text(encoding="utf-8")))
        for target in INLINE_LINK.findall(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            where = f"{shown}: {target}"
            if not linked.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                problems.append(f"{where} (no heading with that anchor)")
    return problems


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail to docs/"
    )
    assert "make test" in README.read_text(encoding="utf-8")  # CI runs the README's command


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    assert broken_links(markdown_files()) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "guide.md").write_text("# Guide\n\n## Two words\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[fine](guide.md#two-words) [here](#top) [web](https://example.org/x)\n"
        "`[in code](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
        "[gone](missing.md) [wrong](guide.md#three-words)\n\n# Top\n",
        encoding="utf-8",
    )
    problems = broken_links([page])
    assert len(problems) == 2, problems
    assert "missing.md (no such file)" in problems[0]
    assert "guide.md#three-words (no heading with that anchor)" in problems[1]


def test_the_results_doc_holds_the_tables_the_benchmark_results_make() -> None:
    from benchmarks import table

    generated = table.table_body(table.render(ROOT / "benchmarks" / "results"))
    assert table.generated_block(ROOT / "docs" / "results.md") == generated, (
        "docs/results.md's benchmark tables differ from benchmarks/results/*.json: "
        "run `python -m benchmarks table --results-doc`"
    )


def test_the_results_doc_flag_fills_the_block_between_the_markers(tmp_path: Path) -> None:
    from benchmarks import table

    document = tmp_path / "results.md"
    before = f"# Results\n\n{table.START}\nold\n{table.END}\n\nafter\n"
    document.write_text(before, encoding="utf-8")
    table.update_results_doc("## Benchmarks\n\n### A table\n\n| a |\n|---|\n| 1 |\n", document)
    text = document.read_text(encoding="utf-8")
    assert table.generated_block(document) == "### A table\n\n| a |\n|---|\n| 1 |"
    assert text.startswith("# Results\n\n") and text.endswith("\n\nafter\n") and "old" not in text


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_architecture_doc_names_only_files_that_exist() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w/])((?:core|plugins|benchmarks|tests|\.ci)/[\w./-]*\w)", text))
    assert named, "the check found no paths: the pattern no longer matches the doc"
    assert sorted(path for path in named if not (ROOT / path).exists()) == []


def test_the_architecture_doc_places_every_floor_and_room_of_the_layers_contracts() -> None:
    """Each layers contract's floors are named in "Layers": those of ``llamagym`` by their
    name, the rooms inside a floor by their dotted path (``training.loop``)."""
    from llamagym.config.files import tomllib  # tomli before Python 3.11

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    layered = [contract for contract in contracts["tool"]["importlinter"]["contracts"]
               if contract["type"] == "layers"]
    assert {"llamagym", "llamagym.training"} <= {c for x in layered for c in x["containers"]}
    section = ARCHITECTURE.read_text(encoding="utf-8").split("## Layers", 1)[1]
    section = section.split("\n## ", 1)[0]
    for layers in layered:
        (container,) = layers["containers"]
        prefix = "" if container == "llamagym" else container.removeprefix("llamagym.") + "."
        floors = {prefix + name.strip() for layer in layers["layers"]
                  for name in re.split(r"[:|]", layer)}
        assert sorted(f for f in floors if f"`{f}`" not in section) == []
        allowed = len(layers["ignore_imports"])
        assert f"{allowed} {'import is' if allowed == 1 else 'imports are'} allowed" in section
