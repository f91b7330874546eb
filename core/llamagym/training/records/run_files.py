"""The files of a run directory, read back: one reader per kind, each checked on the way in.

A run directory is data, like a checkpoint: people send runs to each other, and nothing
in one may crash, hang or mislead a command that reads it. Each reader here bounds what
it reads (the bytes of a file, the bytes of a line), checks every record against its
schema (the pydantic models below) and names what was wrong in one line: the file, the
line or field, and what was expected (:class:`~llamagym.errors.RunFileError`).

* ``metrics.jsonl`` (:func:`read_metrics`): update, evaluation, resume and diagnosis
  records;
* ``transcripts.jsonl`` (:func:`read_transcripts`): whole episodes;
* ``plugins.json`` (:func:`read_plugins_record`): who answered per-step hooks;
* the run's ``config.yaml`` (:func:`read_run_config`): through the config reader, whose
  YAML loader refuses alias bombs and deep nesting;
* a checkpoint's ``checkpoint.json`` (:data:`CHECKPOINT_META`, read by
  ``checkpoint.read_meta``) and an export's ``llamagym.json`` (:data:`EXPORT_META`,
  read by ``export.read_export_meta``).

The JSON-lines readers take ``on_damage``: ``"raise"`` (what ``run --resume`` and
``export`` need: they rewrite or rely on the file) or ``"skip"`` (``report``, ``play
--kept``: a damaged record is left out, with one warning for the whole file). A torn last
line, which a crash mid-write leaves, is skipped with a warning either way.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError

from llamagym.config.files import read_config_file
from llamagym.display import clipped
from llamagym.errors import ConfigError, RunFileError

logger = logging.getLogger(__name__)

OnDamage = Literal["raise", "skip"]

#: The most bytes one line of ``metrics.jsonl`` may hold (a record is under 2 KB).
MAX_METRICS_LINE = 1 << 20
#: The most bytes ``metrics.jsonl`` may hold: about a million updates.
MAX_METRICS_FILE = 512 << 20
#: The most bytes one transcript (one whole episode on one line) may hold.
MAX_TRANSCRIPT_LINE = 8 << 20
#: The most bytes of a JSON file of a run (``plugins.json``, ``checkpoint.json``,
#: ``llamagym.json``) that are read.
MAX_JSON_FILE = 64 << 20
_CHUNK = 1 << 16


# -- schemas --------------------------------------------------------------------------------
class _Record(BaseModel):
    """Types are checked as written (strict: ``"1"`` is no number, ``true`` no integer);
    fields it does not name pass (an algorithm adds its own metrics)."""

    model_config = ConfigDict(strict=True, extra="allow")


Count = Annotated[int, Field(ge=0)]


class UpdateRecord(_Record):
    kind: Literal["update"]
    update: Count
    total_episodes: float = 0
    env_steps: float = 0
    seconds: float = 0.0
    return_mean: float | None = None
    return_moving_average: float | None = None
    invalid_rate: float = 0.0


class Result(_Record):
    """One policy's evaluation: the trained agent's, or a baseline's."""

    name: str
    episodes: Count = 0
    mean: float
    ci95: float
    invalid_rate: float = 0.0
    outcomes: dict[str, float] = {}
    distinct_episodes: Count | None = None


class EvaluationRecord(Result):
    kind: Literal["evaluation"]
    name: str = "agent"
    update: Count
    total_episodes: float = 0
    seconds: float = 0.0
    greedy: bool = True
    baselines: list[Result] = []


class ResumeRecord(_Record):
    kind: Literal["resume"]
    update: Count
    checkpoint: str = ""


class DiagnosisRecord(_Record):
    """A finding that the run cannot learn (``llamagym.training.loop.learning_signal``)."""

    kind: Literal["diagnosis"]
    update: Count
    finding: str
    message: str = ""


METRICS_RECORDS: dict[str, type[_Record]] = {
    "update": UpdateRecord,
    "evaluation": EvaluationRecord,
    "resume": ResumeRecord,
    "diagnosis": DiagnosisRecord,
}


class TranscriptTurn(_Record):
    observation: str = ""
    action: JsonValue = None
    reply: str | None = None
    parser: str | None = None
    probability: float | None = None
    reward: float = 0.0


class Transcript(_Record):
    kind: str = "episode"
    update: Count | None = None
    seed: int | None = None
    return_: float = Field(0.0, alias="return")
    system: str = ""
    turns: list[TranscriptTurn]


class PluginRecord(_Record):
    """A plugin that answered per-step hooks (``plugins.json``, a checkpoint's
    ``plugins``)."""

    name: str
    distribution: str | None = None
    version: str | None = None
    hooks: list[str] = []


PLUGINS_RECORD = TypeAdapter(list[PluginRecord])


class Counters(_Record):
    updates: Count = 0
    episodes: Count = 0
    env_steps: Count = 0
    env_failures: Count = 0
    seconds: float = 0.0
    recent_returns: list[float] = []


class _Named(_Record):
    name: str = ""


class ConfigSections(_Record):
    """What every reader of a recorded run config relies on: the sections are mappings,
    and the agent, algorithm and model are named by text."""

    agent: _Named = _Named()
    algorithm: _Named = _Named()
    model: _Named = _Named()
    rollout: dict[str, Any] = {}
    training: dict[str, Any] = {}
    output: dict[str, Any] = {}


class CheckpointMeta(_Record):
    """``checkpoint.json``. Its ``state`` is checked where it is decoded, against the
    model and optimizer it loads into."""

    format: Count = 0
    llamagym_version: str | None = None
    agent: str | None = None
    algorithm: str | None = None
    model: str | None = None
    update: Count | None = None
    episodes: Count | None = None
    counters: Counters | None = None
    config: ConfigSections
    plugins: list[PluginRecord] = []
    state: dict[str, Any] | None = None


CHECKPOINT_META = CheckpointMeta


class ExportMeta(_Record):
    """``llamagym.json`` of an exported directory."""

    format: int
    agent: str
    weights: Literal["adapter", "merged", "full"]
    config: ConfigSections


EXPORT_META = ExportMeta


# -- problems, in words ---------------------------------------------------------------------
def schema_problem(error: ValidationError) -> str:
    """The first thing wrong with a record, in words: ``field 'update': Input should be
    a valid integer, got 'x'``."""
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    got = "" if first["type"] == "missing" else f", got {clipped(first.get('input'), 40)}"
    what = f"field {where!r}" if where else "the record"
    return f"{what}: {first['msg']}{got}"


def check(schema: type[BaseModel], data: Any) -> str | None:
    """What makes ``data`` not fit ``schema``, or None when it fits."""
    if not isinstance(data, dict):
        return f"holds a JSON {_json_type(data)}, not an object"
    try:
        schema.model_validate(data)
    except ValidationError as error:
        return schema_problem(error)
    return None


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


# -- bounded reading ------------------------------------------------------------------------
def _lines(path: Path, max_line: int) -> Iterator[tuple[int, bytes | None, bool]]:
    """``(line number, bytes or None when longer than max_line, ended by a newline)``
    for each line, reading at most ``max_line`` bytes of any line into memory."""
    with path.open("rb") as handle:
        number = 0
        while True:
            line = handle.readline(max_line + 1)
            if not line:
                return
            number += 1
            if len(line) > max_line and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of the line, unkept
                    line = handle.readline(_CHUNK)
                yield number, None, True
                continue
            ended = line.endswith(b"\n")
            yield number, line, ended


def _size_problem(path: Path, limit: int) -> str | None:
    size = path.stat().st_size
    if size > limit:
        return (
            f"is {size:,} bytes, more than the {limit:,} LlamaGym reads of it (no run "
            "writes one that large)"
        )
    return None


def _read_jsonl(
    path: Path,
    schema: type[_Record] | dict[str, type[_Record]],
    *,
    on_damage: OnDamage,
    max_line: int,
    max_file: int | None = None,
    keep_last: int | None = None,
) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, each checked against ``schema`` (one model, or
    one per value of the record's ``kind``)."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        too_large = _size_problem(path, max_file) if max_file is not None else None
        if too_large is not None:
            raise RunFileError(f"{str(path)!r} {too_large}; {_FIX[on_damage]}")
        records: deque[dict[str, Any]] = deque(maxlen=keep_last)
        damaged: list[str] = []
        for number, line, ended in _lines(path, max_line):
            if line is not None and not line.strip():
                continue
            record, problem = _parse_line(line, max_line, schema)
            if problem is None:
                records.append(record)
                continue
            if not ended and problem.startswith("is not JSON"):
                logger.warning(
                    "%r line %d is cut short (a write was interrupted); skipped", str(path), number
                )
                continue
            if on_damage == "raise":
                raise RunFileError(f"{str(path)!r} line {number} {problem}; {_FIX['raise']}")
            damaged.append(f"line {number} {problem}")
    except OSError as error:
        raise RunFileError(
            f"{str(path)!r} cannot be read ({error.strerror or error}); check its permissions"
        ) from None
    if damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        logger.warning(
            "%r: skipped %d damaged record(s): %s%s", str(path), len(damaged), damaged[0], more
        )
    return list(records)


_FIX = {
    "raise": "the file is damaged or was edited: restore it from a copy, or delete that line",
    "skip": "the file is damaged or was edited: restore it from a copy",
}


def _parse_line(
    line: bytes | None, max_line: int, schema: type[_Record] | dict[str, type[_Record]]
) -> tuple[dict[str, Any], str | None]:
    """A line's record, or the problem with it, in words."""
    if line is None:
        return {}, f"is longer than {max_line:,} bytes, more than any record"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return {}, (
            f"is not UTF-8 text (byte 0x{line[error.start]:02x} at column {error.start + 1})"
        )
    try:
        record = json.loads(text)
    except RecursionError:
        return {}, "is not JSON (nested too deeply)"
    except ValueError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return {}, f"is not JSON ({first})"
    if not isinstance(schema, dict):
        return record, check(schema, record)
    if not isinstance(record, dict):
        return {}, f"holds a JSON {_json_type(record)}, not an object"
    kind = record.get("kind")
    if not isinstance(kind, str) or kind not in schema:
        return {}, f"field 'kind' is {clipped(kind, 40)}, expected one of {', '.join(schema)}"
    return record, check(schema[kind], record)


def read_json_file(path: Path, limit: int = MAX_JSON_FILE) -> Any:
    """The JSON value of a file of at most ``limit`` bytes; ``ValueError`` saying why it
    is not one (too large, not UTF-8, not JSON), ``OSError`` when it cannot be read."""
    path = Path(path)
    too_large = _size_problem(path, limit)
    if too_large is not None:
        raise ValueError(too_large)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"is not text (byte 0x{raw[error.start]:02x} at offset "
                         f"{error.start} is not UTF-8)") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("is not valid JSON (nested too deeply)") from None
    except ValueError as error:
        raise ValueError(f"is not valid JSON ({str(error).splitlines()[0]})") from None


# -- the readers ----------------------------------------------------------------------------
def read_metrics(path: Path, on_damage: OnDamage = "raise") -> list[dict[str, Any]]:
    """Every record of a ``metrics.jsonl``, checked by its ``kind``."""
    return _read_jsonl(
        path, METRICS_RECORDS, on_damage=on_damage, max_line=MAX_METRICS_LINE,
        max_file=MAX_METRICS_FILE,
    )


def read_transcripts(
    path: Path, on_damage: OnDamage = "raise", keep_last: int | None = None
) -> list[dict[str, Any]]:
    """The transcripts in a ``transcripts.jsonl`` (the last ``keep_last`` of them), or []
    without the file. The file is read line by line, so its size costs time, not memory."""
    return _read_jsonl(
        path, Transcript, on_damage=on_damage, max_line=MAX_TRANSCRIPT_LINE,
        keep_last=keep_last,
    )


def read_plugins_record(path: Path) -> list[dict[str, Any]]:
    """``plugins.json``: a list of plugins, each with its name, distribution, version and
    hooks."""
    path = Path(path)
    try:
        data = read_json_file(path)
    except (OSError, ValueError) as error:
        raise RunFileError(f"{str(path)!r} {error}; {_FIX['skip']}") from None
    try:
        PLUGINS_RECORD.validate_python(data)
    except ValidationError as error:
        problem = (
            f"holds a JSON {_json_type(data)}, expected a list of plugins"
            if not isinstance(data, list) else schema_problem(error)
        )
        raise RunFileError(f"{str(path)!r} {problem}; {_FIX['skip']}") from None
    return list(data)


def read_run_config(path: Path) -> dict[str, Any]:
    """A run's recorded ``config.yaml`` through the one config reader (bounded size,
    nesting and alias expansion), with its sections checked."""
    data = _read_config(path)
    problem = check(ConfigSections, data)
    if problem is not None:
        raise RunFileError(f"{str(path)!r} {problem}; {_FIX['skip']}")
    return data


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return read_config_file(Path(path))
    except ConfigError as error:
        raise RunFileError(str(error)) from None
