"""Entry point of the plugin: one agent per TextWorldExpress game, each stated once here
(name, the game in a line, the game's name in TextWorldExpress). Nothing here imports
TextWorldExpress, py4j or the agent module, so ``llamagym list`` stays fast and starts
no JVM."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec


def _spec(game: str, attribute: str, description: str) -> AgentSpec:
    return AgentSpec(
        name=f"twx-{game}",
        entry_point=f"llamagym_textworld_express.agent:{attribute}",
        description=f"TextWorldExpress {description}",
        env_id=f"textworld-express:{game}",
    )


COIN = _spec("coin", "CoinAgent", "Coin Collector: search the rooms of a house for the coin "
             "and take it")
COOKINGWORLD = _spec("cookingworld", "CookingWorldAgent", "CookingWorld: gather the "
                     "ingredients of the cookbook's recipe, prepare them, cook the meal, eat it")
TWC = _spec("twc", "CommonsenseAgent", "TextWorld Commonsense: put objects away where they "
            "belong (a dirty dish in the dishwasher)")
MAPREADER = _spec("mapreader", "MapReaderAgent", "Map Reader: fetch a coin from the room the "
                  "task names, with a map, and put it in the box at the start")
ARITHMETIC = _spec("arithmetic", "ArithmeticAgent", "Arithmetic: solve the math problem, then "
                   "put the bundle of that many objects in the box")
SORTING = _spec("sorting", "SortingAgent", "Sorting: put the objects in the box in order of "
                "increasing quantity (units differ)")
SIMONSAYS = _spec("simonsays", "SimonSaysAgent", "Simon Says: do exactly the action Simon "
                  "says, step after step")
PECKINGORDER = _spec("peckingorder", "PeckingOrderAgent", "Pecking Order: read the "
                     "instructions book and follow it until the game is done")
AGENTS = (COIN, COOKINGWORLD, TWC, MAPREADER, ARITHMETIC, SORTING, SIMONSAYS, PECKINGORDER)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    for spec in AGENTS:
        register(spec)
