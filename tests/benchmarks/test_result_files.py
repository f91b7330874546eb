"""Every result file in benchmarks/results names the commit it belongs to: ``commit``
(the code measured, with ``dirty`` saying whether changes sat on top) or, for files
written before the header recorded it, ``recorded_in`` (the commit that committed the
numbers). Reads the files only: no git history needed, so a shallow clone passes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FULL_HASH = re.compile(r"[0-9a-f]{40}")


def commit_key_problems(record: Any) -> list[str]:
    """What keeps ``record`` (a result file's parsed JSON) from naming its commit."""
    if not isinstance(record, dict):
        return [f"is a JSON {type(record).__name__}, not an object"]
    keys = [key for key in ("commit", "recorded_in") if key in record]
    if not keys:
        return ["names neither `commit` nor `recorded_in`"]
    if len(keys) == 2:
        return ["names both `commit` and `recorded_in`: keep `commit`"]
    problems = []
    value = record[keys[0]]
    if not (isinstance(value, str) and FULL_HASH.fullmatch(value)):
        problems.append(f"`{keys[0]}` is {value!r}, not a 40-hex-digit commit hash")
    if keys[0] == "commit" and not isinstance(record.get("dirty"), bool):
        problems.append(f"`dirty` is {record.get('dirty')!r}, not true or false")
    return problems


RESULT_FILES = sorted(RESULTS.glob("*.json"))


def test_the_results_folder_holds_result_files() -> None:
    assert len(RESULT_FILES) >= 60


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: path.name)
def test_every_result_file_names_its_commit(path: Path) -> None:
    assert commit_key_problems(json.loads(path.read_text(encoding="utf-8"))) == []


GOOD = "1c7eff22501ed7466bdb4b0d97a86ba2746154d3"


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"benchmark": "x"}, "names neither"),
        ([GOOD], "not an object"),
        ({"recorded_in": GOOD[:7]}, "not a 40-hex-digit"),
        ({"recorded_in": GOOD.upper()}, "not a 40-hex-digit"),
        ({"recorded_in": None}, "not a 40-hex-digit"),
        ({"commit": GOOD}, "`dirty` is None"),
        ({"commit": GOOD, "dirty": None, "unknown": "no git"}, "`dirty` is None"),
        ({"commit": GOOD, "dirty": "false"}, "`dirty` is 'false'"),
        ({"commit": None, "dirty": False}, "not a 40-hex-digit"),
        ({"commit": GOOD, "dirty": False, "recorded_in": GOOD}, "names both"),
    ],
)
def test_a_file_without_a_full_commit_hash_is_named(record: Any, problem: str) -> None:
    problems = commit_key_problems(record)
    assert len(problems) == 1 and problem in problems[0]


@pytest.mark.parametrize(
    "record",
    [{"commit": GOOD, "dirty": True}, {"commit": GOOD, "dirty": False}, {"recorded_in": GOOD}],
)
def test_a_file_naming_its_commit_passes(record: dict[str, Any]) -> None:
    assert commit_key_problems(record) == []
