"""``llamagym textworld-games make|list``: build the games a run will play, or see them.

The same parameters and seed always give the same game, and a game already in the
cache is reused, so ``make`` is also the way to pre-build a run's pool before training.
"""

from __future__ import annotations

import json
import re

import typer

from llamagym_textworld.games import (
    MAX_GAMES,
    MAX_OBJECTS,
    MAX_SEED,
    MAX_WORLD_SIZE,
    quest_bounds,
)

games_app = typer.Typer(
    help="Generate TextWorld games into the cache, or list the cached ones.",
    no_args_is_help=True,
)


def parse_quest_length(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"2-3"`` -> (2, 3)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        raise typer.BadParameter(f"expected N or MIN-MAX, e.g. 2 or 2-3; got {text!r}")
    low = int(match.group(1))
    try:
        return quest_bounds((low, int(match.group(2) or low)))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@games_app.command("make")
def make_command(
    count: int = typer.Option(20, "--count", "-n", min=1, max=MAX_GAMES, help="How many games."),
    world_size: int = typer.Option(
        3, "--world-size", min=1, max=MAX_WORLD_SIZE, help="Rooms per game."
    ),
    nb_objects: int = typer.Option(
        5, "--nb-objects", min=0, max=MAX_OBJECTS, help="Objects per game."
    ),
    quest_length: str = typer.Option("2-3", "--quest-length", help="N or MIN-MAX commands."),
    seed: int = typer.Option(
        0, "--seed", min=0, max=MAX_SEED - MAX_GAMES, help="Seed of the first game; then +1 each."
    ),
) -> None:
    """Generate COUNT games with seeds SEED, SEED+1, ... (cached ones are reused)."""
    from llamagym_textworld.games import default_cache_dir, make_game

    quest = parse_quest_length(quest_length)
    for offset in range(count):
        path = make_game(world_size, nb_objects, quest, seed + offset)
        typer.echo(str(path))
    typer.echo(f"{count} games in {default_cache_dir()}", err=True)


@games_app.command("list")
def list_command(
    as_json: bool = typer.Option(False, "--json", help="Print the records as JSON."),
) -> None:
    """List the games in the cache: parameters, seed, quest length and objective."""
    from llamagym_textworld.games import default_cache_dir, games_as_dicts, list_games

    if as_json:
        typer.echo(json.dumps(games_as_dicts(), indent=2))
        return
    games = list_games()
    if not games:
        typer.echo(f"no games in {default_cache_dir()}; make some with "
                   "`llamagym textworld-games make`")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"TextWorld games in {default_cache_dir()}", title_justify="left")
    for column in ("seed", "rooms", "objects", "quest", "walkthrough", "folder"):
        table.add_column(column)
    for game in games:
        table.add_row(
            str(game.seed),
            str(game.world_size),
            str(game.nb_objects),
            f"{game.quest_min_length}-{game.quest_max_length}",
            " / ".join(game.walkthrough),
            game.path.parent.name,
        )
    Console().print(table)
