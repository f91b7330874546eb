"""The results tables are keyed by commit: in the README's results table and the SmolLM2
table of docs/results.md, each row's last cell links the result file(s) the row reports,
each link named by the first digits of the file's ``commit`` (or, for files written
before the header recorded it, ``recorded_in``). Reads files only, no git history."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: (document, section heading, the table's header row)
TABLES = [
    (ROOT / "README.md", "## Results", "| Claim | Result | Command | Machine | Commit |"),
    (
        ROOT / "docs" / "results.md",
        "## SmolLM2-135M-Instruct",
        "| What | Result | Command | Machine | Commit |",
    ),
]

#: Rows whose numbers are in no result file (a command-line run, an evaluation, a test):
#: their last cell keeps the date. The first words of the row's first cell, per document.
NO_RESULT_FILE = {
    "README.md": [],
    "results.md": [
        "TextWorld rollout, score mode, the whole history",
        "TextWorld, score mode, 30 min, seed 0, with the whole history in the prompt",
        "TextWorld, score mode, 30 min, seed 0, the state in the observation",
        "TextWorld zero-shot, SmolLM2-135M, the 20 training games",
        "The bfloat16 trunk against float32",
        "Blackjack zero-shot from the command line",
    ],
}

LINK = re.compile(r"\[([0-9a-f]{7,40})\]\(([^()\s]+)\)")
CELL = re.compile(rf"{LINK.pattern}(?: / {LINK.pattern})*")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def table_rows(document: Path, heading: str, header: str) -> list[list[str]]:
    """The cells of each row of the first table after ``heading`` (its header must be
    ``header``)."""
    lines = document.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    at = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    assert lines[at] == header, f"{document.name}: the table under {heading} starts {lines[at]!r}"
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def commit_cell_problems(cell: str, document_dir: Path) -> list[str]:
    """What is wrong with a Commit cell: it must be links ``[hash](path)`` joined by
    `` / ``, each to a result file whose commit (or ``recorded_in``) starts with hash."""
    if not CELL.fullmatch(cell):
        return [f"{cell!r} is not [short hash](result file) links joined by ' / '"]
    problems = []
    for shown, target in LINK.findall(cell):
        path = (document_dir / target).resolve()
        if path.parent != RESULTS or path.suffix != ".json":
            problems.append(f"{target} is not a result file in benchmarks/results")
            continue
        if not path.is_file():
            problems.append(f"{target} does not exist")
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        full = record.get("commit") or record.get("recorded_in") or ""
        if not full.startswith(shown):
            problems.append(f"{target} names commit {full[:12] or 'none'}, not {shown}")
    return problems


@pytest.mark.parametrize(("document", "heading", "header"), TABLES, ids=["readme", "results-doc"])
def test_every_results_row_links_its_result_files_by_commit(
    document: Path, heading: str, header: str
) -> None:
    exempt = NO_RESULT_FILE[document.name]
    problems = []
    seen_exempt = set()
    for cells in table_rows(document, heading, header):
        assert len(cells) == 5, f"{document.name}: a row of {len(cells)} cells: {cells[0][:60]}"
        claim, last = cells[0], cells[-1]
        kept = [prefix for prefix in exempt if claim.lstrip("*").startswith(prefix)]
        if kept and DATE.fullmatch(last):
            seen_exempt.update(kept)
            continue
        problems += [f"{claim[:50]}: {p}" for p in commit_cell_problems(last, document.parent)]
    assert problems == []
    assert seen_exempt == set(exempt), "rows listed as having no result file are gone"


def test_a_commit_cell_that_does_not_name_its_file_s_commit_is_caught() -> None:
    docs = ROOT / "docs"
    good = "[1c7eff2](../benchmarks/results/smollm2-textworld-leasttried-seed1.json)"
    old = "[4a75c45](../benchmarks/results/smollm2-textworld-progress-seed1.json)"
    recorded = "[77502ba](../benchmarks/results/textworld.json)"
    assert commit_cell_problems(good, docs) == []
    assert commit_cell_problems(f"{good} / {old} / {recorded}", docs) == []
    for cell, problem in [
        ("2026-11-28", "is not [short hash]"),
        (good.replace("1c7eff2", "617d4c5"), "names commit 1c7eff22501e, not 617d4c5"),
        (good.replace("seed1", "seed9"), "does not exist"),
        ("[1c7eff2](../README.md)", "is not a result file"),
        ("[1c7eff2](../benchmarks/results/learning.png)", "is not a result file"),
        (f"{good}, {old}", "is not [short hash]"),
        (good.replace("1c7eff2", "1c7e"), "is not [short hash]"),
    ]:
        problems = commit_cell_problems(cell, docs)
        assert len(problems) == 1 and problem in problems[0], (cell, problems)
