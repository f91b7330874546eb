"""The generated tables of docs/results.md are keyed by the commit each row measured:
its last cell links the result file by the commit's first digits, with "+ changes" when
the tree had uncommitted changes on top; a file from before the header recorded the
commit says so ("commit not recorded"), beside the commit that added it, which is not
passed off as the code measured. Reads files only, no git history."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks import table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
A, B = "a" * 40, "b" * 40
LINK = r"\[(?P<hash>[0-9a-f]{7})\]\(\.\./benchmarks/results/(?P<file>[^()\s]+\.json)\)"
MEASURED = re.compile(rf"{LINK}(?P<state> \+ changes| \(tree state unknown\))?")
NOT_RECORDED = re.compile(rf"commit not recorded \(measured \d{{4}}-\d\d-\d\d, added in {LINK}\)")


def _cell(source: dict[str, Any], result: dict[str, Any] | None = None) -> str:
    return table._commit_cell(source, {"result_file": "x.json", **(result or source)})


@pytest.mark.parametrize(
    ("dirty", "cell"),
    [
        (False, "[aaaaaaa](../benchmarks/results/x.json)"),
        (True, "[aaaaaaa](../benchmarks/results/x.json) + changes"),
        (None, "[aaaaaaa](../benchmarks/results/x.json) (tree state unknown)"),
    ],
)
def test_a_measured_commit_is_a_link_to_its_file(dirty: bool | None, cell: str) -> None:
    assert _cell({"commit": A, "dirty": dirty, "date": "2026-11-22T01:00:00"}) == cell


def test_a_file_without_a_measured_commit_says_so() -> None:
    retrofitted = {"recorded_in": B, "date": "2026-11-22T01:00:00+00:00"}
    assert _cell(retrofitted) == (
        "commit not recorded (measured 2026-11-22, added in "
        "[bbbbbbb](../benchmarks/results/x.json))"
    )
    assert table._commit_name(retrofitted) == "commit not recorded"
    assert table._commit_name({"commit": A, "dirty": True}) == "commit aaaaaaa + changes"


def test_a_row_with_its_own_provenance_is_keyed_by_its_own_commit() -> None:
    """A rerun of some rows keeps the others' own provenance: a kept row is not given the
    commit of the run that kept it."""
    result = {"commit": A, "dirty": False, "result_file": "algorithms.json"}
    own = {"command": "python benchmarks/algorithms.py --only ppo", "commit": B, "dirty": True}
    kept = {"command": "python benchmarks/algorithms.py", "date": "2026-11-22"}
    assert table._provenance(result, own)[-1].startswith("[bbbbbbb](")
    assert table._provenance(result, own)[-1].endswith(" + changes")
    assert table._provenance(result, kept)[-1].startswith("commit not recorded (measured 2026")
    assert table._provenance(result, {"setup": "ppo"})[-1].startswith("[aaaaaaa](")


def test_the_machine_cell_names_the_cpu_flags_or_that_they_were_not_recorded() -> None:
    zen4 = {"cores": 2, "cpu_model": "AMD EPYC",
            "cpu_flags": {"avx2": True, "fma": True, "avx512f": True, "avx512_bf16": True,
                          "amx_bf16": False, "amx_int8": False}}
    assert table._machine(zen4) == "2 cores, AMD EPYC (avx2, avx512f, avx512_bf16)"
    old = {"cores": 2, "cpu_model": "AMD EPYC"}
    assert table._machine(old) == "2 cores, AMD EPYC (CPU flags not recorded)"
    unknown = {**old, "cpu_flags": dict.fromkeys(table.SHOWN_FLAGS)}
    assert table._machine(unknown) == "2 cores, AMD EPYC (CPU flags not recorded)"
    bare = {**old, "cpu_flags": dict.fromkeys(table.SHOWN_FLAGS, False)}
    assert table._machine(bare) == "2 cores, AMD EPYC (no avx2, avx512 or amx)"


def _generated_rows() -> list[tuple[str, list[str]]]:
    """(header row, cells) of every row of every table between docs/results.md's markers."""
    rows, header = [], ""
    for line in table.generated_block().splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            header = "" if not line.startswith("|") else header
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if not header:
            header = line
            assert cells[-1] == "Commit", f"a generated table ends in {cells[-1]!r}: {line}"
            continue
        rows.append((header, cells))
    return rows


def test_every_generated_row_is_keyed_by_the_commit_it_measured() -> None:
    rows = _generated_rows()
    assert len(rows) > 50
    problems = []
    for _, cells in rows:
        last = cells[-1]
        measured, retrofitted = MEASURED.fullmatch(last), NOT_RECORDED.fullmatch(last)
        match = measured or retrofitted
        if match is None:
            problems.append(f"{cells[0]}: {last!r} names no commit")
            continue
        record = json.loads((RESULTS / match["file"]).read_text(encoding="utf-8"))
        key = "commit" if measured else "recorded_in"
        if not str(record.get(key) or "").startswith(match["hash"]):
            problems.append(f"{cells[0]}: {match['file']} has no {key} {match['hash']}")
        if measured and (match["state"] == " + changes") != (record.get("dirty") is True):
            problems.append(f"{cells[0]}: {match['file']}'s dirty is {record.get('dirty')}")
    assert problems == []
