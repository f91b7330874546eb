"""Generate TextWorld games locally, seeded and cached.

Games are made with TextWorld's own generator (``textworld.generator.make_game`` then
``compile_game``, the same two calls ``tw-make custom`` makes), so nothing is downloaded:
the Inform 7 compiler ships inside the ``textworld`` wheel.

Layout of the cache (default ``$LLAMAGYM_CACHE/textworld``, else
``~/.cache/llamagym/textworld``)::

    textworld/
      w3-o5-q2-2-s0-tw1.7.0/      one folder per (parameters, seed, TextWorld version)
        game.z8                   the story file an interpreter plays
        game.json                 TextWorld's game description (needed for admissible
                                  commands, walkthrough and score tracking)
        game.ni                   Inform 7 source, kept for debugging
        llamagym_game.json        our record: parameters, hash, objective, walkthrough

The TextWorld version is part of the folder name because the generator's output for a
given seed is only stable within one version; after an upgrade the games are rebuilt
instead of silently reusing files that no longer match what the generator would make.

A folder is generated under a temporary name beside its final place and renamed when
complete, so a folder that exists is always whole, and two processes racing for the same
game both end up with the one that won the rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from llamagym import errors

__all__ = [
    "GAME_RECORD",
    "GameGenerationError",
    "GameInfo",
    "MissingDependencyError",
    "check_game_files",
    "default_cache_dir",
    "game_hash",
    "games_as_dicts",
    "list_games",
    "make_game",
    "make_games",
]

#: The largest games generated: TextWorld's generator takes a few minutes at most to
#: make one this large on a CPU; past them its search for a quest grows without bound.
MAX_WORLD_SIZE = 20
MAX_OBJECTS = 50
MAX_QUEST_LENGTH = 20
#: The largest seed TextWorld's generator takes (numpy's).
MAX_SEED = 2**32 - 1
#: The most games a pool (or one `textworld-games make`) holds.
MAX_GAMES = 100_000

#: Name of the metadata file written beside every generated game.
GAME_RECORD = "llamagym_game.json"

_STORY_NAME = "game.z8"
_INSTALL_HINT = (
    "TextWorld is not installed: pip install 'llamagym-textworld[textworld]' "
    "(or pip install textworld)"
)

QuestLength = int | tuple[int, int]


class MissingDependencyError(errors.MissingDependencyError):
    """TextWorld is needed but not installed. A LlamaGym error, so the CLI prints the
    install hint as one line (exit code 2) instead of a traceback."""

    def __init__(self, message: str = _INSTALL_HINT) -> None:
        # The base class composes its own sentence from (package, purpose); ours names
        # the plugin's extra, so the message is set directly.
        errors.LlamaGymError.__init__(self, message)


class GameGenerationError(errors.LlamaGymError, RuntimeError):
    """TextWorld could not build a game with the requested parameters."""


@dataclass(frozen=True)
class GameInfo:
    """What :func:`list_games` knows about one cached game, read from its record file."""

    path: Path
    world_size: int
    nb_objects: int
    quest_min_length: int
    quest_max_length: int
    seed: int
    textworld_version: str
    game_hash: str
    objective: str
    walkthrough: tuple[str, ...]
    max_score: int
    generation_seconds: float


def default_cache_dir() -> Path:
    """Folder holding generated games: ``$LLAMAGYM_CACHE/textworld`` or the user default.

    Read on every call (not at import) so a test or a user can point ``LLAMAGYM_CACHE``
    somewhere else at any time.
    """
    root = os.environ.get("LLAMAGYM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "llamagym"
    return base / "textworld"


def game_hash(story_file: str | os.PathLike[str]) -> str:
    """SHA-256 of a Z-machine story file, ignoring its compile-date serial number.

    Inform stamps the compile date (YYMMDD) into header bytes 0x12-0x17, so the same game
    compiled on two days differs in exactly those six bytes. Zeroing them gives a hash
    that identifies the game itself, which is what "same seed, same game" should compare.
    """
    data = bytearray(Path(story_file).read_bytes())
    if len(data) >= 0x18:
        data[0x12:0x18] = b"\0" * 6
    return hashlib.sha256(bytes(data)).hexdigest()


def _textworld_version() -> str:
    """Installed TextWorld version, without importing it (the import costs ~0.5 s)."""
    try:
        return metadata.version("textworld")
    except metadata.PackageNotFoundError as exc:
        raise MissingDependencyError() from exc


def _import_textworld() -> Any:
    # Imported here rather than at module level so that llamagym-textworld can be
    # installed, listed and imported without the optional TextWorld dependency.
    try:
        import textworld
        import textworld.generator
    except ImportError as exc:
        raise MissingDependencyError() from exc
    return textworld


def quest_bounds(quest_length: QuestLength) -> tuple[int, int]:
    """``(min, max)`` commands of a quest given as N or (MIN, MAX); a ValueError naming
    the bounds when it is outside 1 to MAX_QUEST_LENGTH or MIN > MAX."""
    if isinstance(quest_length, int):
        lo = hi = quest_length
    else:
        lo, hi = (int(v) for v in quest_length)
    if lo < 1 or hi < lo or hi > MAX_QUEST_LENGTH:
        raise ValueError(f"quest_length must be 1 <= MIN <= MAX <= {MAX_QUEST_LENGTH}, "
                         f"got {quest_length!r}")
    return lo, hi


def _game_dir_name(
    world_size: int, nb_objects: int, quest: tuple[int, int], seed: int, version: str
) -> str:
    return f"w{world_size}-o{nb_objects}-q{quest[0]}-{quest[1]}-s{seed}-tw{version}"


def _generate_into(
    folder: Path,
    world_size: int,
    nb_objects: int,
    quest: tuple[int, int],
    seed: int,
) -> dict[str, Any]:
    """Build and compile one game into ``folder``; return the record to store beside it."""
    textworld = _import_textworld()
    from textworld.generator import QuestGenerationError

    options = textworld.GameOptions()
    # An int seed makes TextWorld derive its map/objects/quest/grammar seeds from it (as
    # ``tw-make --seed`` does), so one number pins down the whole game.
    options.seeds = seed
    options.nb_rooms = world_size
    options.nb_objects = nb_objects
    options.chaining.min_length = quest[0]
    options.chaining.max_length = quest[1]
    # GameOptions keeps TextWorld's Python default of one linear quest (breadth 1; the
    # tw-make CLI defaults to up to 5 sub-quests instead), so depth bound = length bound,
    # which is also how tw-make's --quest-length sets max_depth.
    options.chaining.max_depth = quest[1]
    options.path = str(folder / _STORY_NAME)
    options.force_recompile = True

    start = time.perf_counter()
    try:
        # Looked up on the module at call time (not imported by name) so tests can
        # replace them to prove a cached game is not rebuilt.
        game = textworld.generator.make_game(options)
        story = textworld.generator.compile_game(game, options)
    except QuestGenerationError as exc:
        raise GameGenerationError(
            f"TextWorld found no quest of length {quest[0]}-{quest[1]} in a world of "
            f"{world_size} rooms and {nb_objects} objects (seed {seed}); try a larger "
            "world or a shorter quest"
        ) from exc
    elapsed = time.perf_counter() - start

    walkthrough = list(game.metadata.get("walkthrough") or [])
    return {
        "world_size": world_size,
        "nb_objects": nb_objects,
        "quest_min_length": quest[0],
        "quest_max_length": quest[1],
        "seed": seed,
        "textworld_version": textworld.__version__,
        "game_hash": game_hash(story),
        "objective": game.objective,
        "walkthrough": walkthrough,
        "max_score": int(game.max_score),
        "generation_seconds": round(elapsed, 3),
        "story_file": Path(story).name,
    }


def make_game(
    world_size: int = 3,
    nb_objects: int = 5,
    quest_length: QuestLength = 2,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Return the path of a generated game's ``.z8`` file, generating it on first use.

    Args:
        world_size: number of rooms.
        nb_objects: minimum number of objects (TextWorld adds distractors up to it).
        quest_length: number of actions the quest needs, or a ``(min, max)`` range from
            which TextWorld picks (seeded, so still reproducible).
        seed: generation seed; the same parameters and seed give the same game.
        cache_dir: folder holding the games; default :func:`default_cache_dir`.

    Raises:
        MissingDependencyError: TextWorld is not installed.
        GameGenerationError: no quest fits the parameters.
    """
    if not (1 <= world_size <= MAX_WORLD_SIZE and 0 <= nb_objects <= MAX_OBJECTS):
        raise ValueError(f"world_size must be 1 to {MAX_WORLD_SIZE} and nb_objects 0 to "
                         f"{MAX_OBJECTS}, got {world_size} and {nb_objects}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be 0 to {MAX_SEED}, got {seed}")
    quest = quest_bounds(quest_length)
    version = _textworld_version()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / _game_dir_name(world_size, nb_objects, quest, seed, version)

    story = final / _STORY_NAME
    if (final / GAME_RECORD).is_file() and story.is_file():
        return story  # Cache hit: no TextWorld import, no compiler run.

    root.mkdir(parents=True, exist_ok=True)
    # Same filesystem as the final folder, so the rename below is atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        record = _generate_into(tmp, world_size, nb_objects, quest, seed)
        # The record is written last: its presence marks a complete folder.
        (tmp / GAME_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        # mkdtemp makes the folder owner-only; a game is not secret, and a cache shared
        # between users (LLAMAGYM_CACHE on a shared disk) must stay readable.
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished the same game first (the target exists and is
            # not empty). Its copy is equivalent, so keep it and drop ours.
            if not (final / GAME_RECORD).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return story


def make_games(
    n: int,
    first_seed: int = 0,
    world_size: int = 3,
    nb_objects: int = 5,
    quest_length: QuestLength = (1, 3),
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Generate (or fetch from the cache) ``n`` games with seeds ``first_seed ... + n - 1``.

    With a ``(min, max)`` ``quest_length`` each game's quest length is drawn by TextWorld
    from that range, giving a pool of varied difficulty that is still reproducible.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    return [
        make_game(world_size, nb_objects, quest_length, first_seed + i, cache_dir) for i in range(n)
    ]


def list_games(cache_dir: str | os.PathLike[str] | None = None) -> list[GameInfo]:
    """Every complete game in the cache, sorted by folder name. Needs no TextWorld.

    Half-written temporary folders and folders whose record is unreadable are skipped,
    so a crash during generation never shows up here as a broken game.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not root.is_dir():
        return []
    games: list[GameInfo] = []
    for record_file in sorted(root.glob(f"*/{GAME_RECORD}")):
        folder = record_file.parent
        if folder.name.startswith("."):
            continue
        try:
            record = json.loads(record_file.read_text(encoding="utf-8"))
            story = folder / str(record.get("story_file", _STORY_NAME))
            if not story.is_file():
                continue
            games.append(
                GameInfo(
                    path=story,
                    world_size=int(record["world_size"]),
                    nb_objects=int(record["nb_objects"]),
                    quest_min_length=int(record["quest_min_length"]),
                    quest_max_length=int(record["quest_max_length"]),
                    seed=int(record["seed"]),
                    textworld_version=str(record["textworld_version"]),
                    game_hash=str(record["game_hash"]),
                    objective=str(record["objective"]),
                    walkthrough=tuple(record["walkthrough"]),
                    max_score=int(record["max_score"]),
                    generation_seconds=float(record["generation_seconds"]),
                )
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return games


def _record_as_dict(info: GameInfo) -> dict[str, Any]:
    """JSON-friendly form of a :class:`GameInfo` (for CLI listings)."""
    data = asdict(info)
    data["path"] = str(info.path)
    data["walkthrough"] = list(info.walkthrough)
    return data


def games_as_dicts(cache_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """:func:`list_games` as plain dictionaries, e.g. for ``json.dumps``."""
    return [_record_as_dict(g) for g in list_games(cache_dir)]


def check_game_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Resolve game paths and check each has the ``.json`` TextWorld needs beside it."""
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"TextWorld game not found: {path}")
        if not path.with_suffix(".json").is_file():
            raise FileNotFoundError(
                f"{path.with_suffix('.json')} is missing: only TextWorld-generated games "
                "(with their .json description) give admissible commands and walkthroughs"
            )
        out.append(path)
    return out
