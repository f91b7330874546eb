"""The README's classic-API example, run as written: the mean sampled return of its last
1,000 episodes and the exact value of the greedy policy it learned.

    python benchmarks/readme_example.py            # the README's 20,000 episodes
    python benchmarks/readme_example.py --quick    # 500 episodes: a smoke run

The example's code block is taken from README.md and executed unchanged (``--quick``
only shortens its loop). Its prompt shows the player's total alone, so the greedy
policy is a stick/hit choice per total, valued exactly with
``llamagym_blackjack.exact`` (the dealer's card and a usable ace unseen); beside it,
always stick and the best rule on the total alone.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    refuse_dirty_tree,
    write_script_result,
)

README = Path(__file__).resolve().parent.parent / "README.md"
LOOP = "range(20000)"


def readme_example() -> str:
    """The README's first Python block (the classic API example)."""
    found = re.search(r"```python\n(import gymnasium as gym\n.*?)```", README.read_text(), re.S)
    if found is None or LOOP not in found.group(1):
        raise SystemExit(f"README.md holds no classic-API example looping over {LOOP}")
    return found.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="500 episodes: a smoke run.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    refuse_dirty_tree("readme_example", args.quick, args.allow_dirty)
    code = readme_example()
    episodes = 500 if args.quick else 20_000
    code = code.replace(LOOP, f"range({episodes})")

    started = time.perf_counter()
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)
    seconds = time.perf_counter() - started

    from llamagym_blackjack.exact import policy_value

    agent, returns = namespace["agent"], namespace["returns"]
    engine = agent.engine
    totals = list(range(4, 22))
    slots = [engine.new_slot((total, 1, False), {}, None, None) for total in totals]
    turns = engine.decide(slots, greedy=True)
    names = agent.action_names
    greedy = {total: names[turn.action_index] for total, turn in zip(totals, turns, strict=True)}
    best_rule = max(
        (policy_value(lambda s, k=k: "hit" if s[0] < k else "stick"), k) for k in range(4, 23)
    )
    last = returns[-1000:]
    result = {
        "episodes": episodes,
        "seconds": seconds,
        "sampled_return_last_1000": sum(last) / len(last),
        "greedy_policy": "".join("H" if greedy[t] == "hit" else "s" for t in totals),
        "greedy_exact_value": policy_value(lambda s: greedy[s[0]]),
        "always_stick_exact_value": policy_value(lambda s: "stick"),
        "best_total_rule": {"hit_below": best_rule[1], "exact_value": best_rule[0]},
    }
    path = write_script_result("readme_example", args.quick, args.output, result)
    print(f"{result} -> {path}")


if __name__ == "__main__":
    main()
