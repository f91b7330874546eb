"""The TextWorldExpress games this plugin plays, and the parameters each one takes.

A game is generated from a parameter string, ``"numLocations=5,includeDoors=0"``:
comma-separated ``key=value`` pairs, each value an integer in the key's range. The keys
and ranges are TextWorldExpress 1.1's (its README's tables); a game with no parameters
takes only the empty string. :func:`parse_game_params` reads a string against one game's
keys before anything starts Java, so a misspelt key or a value out of range is one line
naming the key and what is allowed. Nothing here imports TextWorldExpress.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GAMES", "Game", "Parameter", "game_params_text", "parse_game_params"]


@dataclass(frozen=True)
class Parameter:
    """One generation parameter: its key, the integers it takes and what it does."""

    key: str
    low: int
    high: int
    description: str

    def allowed(self) -> str:
        return f"{self.key} ({self.low}-{self.high}: {self.description})"


@dataclass(frozen=True)
class Game:
    """One TextWorldExpress game: its name there (``coin``), its title, its parameters,
    the parameter string an episode is generated with unless the run says otherwise,
    and the steps an episode gets."""

    name: str
    title: str
    parameters: tuple[Parameter, ...]
    default_params: str
    max_episode_steps: int

    def parameter(self, key: str) -> Parameter | None:
        return next((p for p in self.parameters if p.key == key), None)


def _locations(high: int) -> Parameter:
    return Parameter("numLocations", 1, high, "rooms in the world")


_DOORS = Parameter("includeDoors", 0, 1, "rooms have doors to open")
_INVENTORY = Parameter("limitInventorySize", 0, 1, "the inventory holds a few items")

GAMES: dict[str, Game] = {
    game.name: game
    for game in (
        Game(
            "coin", "Coin Collector",
            (_locations(11), Parameter("numDistractorItems", 0, 10, "objects other than the coin"),
             _DOORS, _INVENTORY),
            "numLocations=8,numDistractorItems=0,includeDoors=0,limitInventorySize=0", 40,
        ),
        Game(
            "cookingworld", "CookingWorld",
            (_locations(11), Parameter("numIngredients", 1, 5, "ingredients in the recipe"),
             Parameter("numDistractorItems", 0, 10, "ingredients the recipe does not use"),
             _DOORS, _INVENTORY),
            "numLocations=1,numIngredients=2,numDistractorItems=2,includeDoors=0,"
            "limitInventorySize=0", 50,
        ),
        Game(
            "twc", "TextWorld Commonsense",
            (_locations(3), Parameter("numItemsToPutAway", 1, 10, "objects to put away"),
             _DOORS, _INVENTORY),
            "numLocations=1,numItemsToPutAway=2,includeDoors=0,limitInventorySize=0", 30,
        ),
        Game(
            "mapreader", "Map Reader",
            (_locations(50),
             Parameter("maxDistanceApart", 1, 8, "rooms between the start and the coin"),
             Parameter("maxDistractorItemsPerLocation", 0, 3, "objects other than the coin "
                       "per room"),
             _DOORS, _INVENTORY),
            "numLocations=8,maxDistanceApart=3,maxDistractorItemsPerLocation=0,includeDoors=0,"
            "limitInventorySize=0", 40,
        ),
        Game("arithmetic", "Arithmetic", (), "", 30),
        Game("sorting", "Sorting", (), "", 30),
        Game(
            "simonsays", "Simon Says",
            (Parameter("gameLength", 1, 1000, "actions to repeat, in order"),
             Parameter("numDistractors", 0, 5, "actions offered that were not asked for"),
             Parameter("memorization", 0, 1, "the whole sequence is shown at the first step "
                       "only"),
             Parameter("verbose", 0, 1, "each right action is acknowledged (with "
                       "memorization)")),
            "gameLength=5,numDistractors=3,memorization=0,verbose=0", 30,
        ),
        Game("peckingorder", "Pecking Order", (), "", 30),
    )
}

_PAIR = re.compile(r"([A-Za-z]{1,40})=(-?[0-9]{1,40})")
#: A parameter string longer than this is refused unread (every real one is far shorter).
MAX_PARAMS_CHARS = 500


def parse_game_params(game: Game, text: str) -> dict[str, int]:
    """The parameters ``text`` sets, in the game's order, or a ValueError in one line
    naming the key or value at fault and the keys the game allows."""
    if len(text) > MAX_PARAMS_CHARS:
        raise ValueError(f"{len(text):,} characters; a parameter string is at most "
                         f"{MAX_PARAMS_CHARS}")
    allowed = "; ".join(p.allowed() for p in game.parameters) or "none: give the empty string"
    values: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item and not text.strip():
            break  # the empty string: the game's own defaults
        pair = _PAIR.fullmatch(item.replace(" ", ""))
        if pair is None:
            raise ValueError(f"{item[:60]!r} is not KEY=INTEGER; {game.name} takes {allowed}")
        key, value = pair.group(1), int(pair.group(2))
        parameter = game.parameter(key)
        if parameter is None:
            raise ValueError(f"{game.name} has no parameter {key!r}; it takes {allowed}")
        if key in values:
            raise ValueError(f"{key} is given twice")
        if not parameter.low <= value <= parameter.high:
            raise ValueError(
                f"{key}={value} is out of range: {parameter.allowed()}"
            )
        values[key] = value
    return {p.key: values[p.key] for p in game.parameters if p.key in values}


def game_params_text(values: dict[str, int]) -> str:
    """The parameter string TextWorldExpress reads: ``key=value`` pairs, comma-separated."""
    return ",".join(f"{key}={value}" for key, value in values.items())
