"""The TextArena agents on TextArena's real games: registration, the Gymnasium adapter,
legal moves, each game's progress, reply parsing, outcomes (an invalid move included),
baselines, conformance and a short training run on the tiny model."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import subprocess
import sys
from collections import deque

import pytest
import torch
from gymnasium.utils.env_checker import check_env
from llamagym_textarena.agent import (
    FrozenLakeAgent,
    GuessTheNumberAgent,
    LightsOutAgent,
    SudokuAgent,
    TextArenaAgent,
    TowerOfHanoiAgent,
)
from llamagym_textarena.env import TextArenaEnv
from llamagym_textarena.games import GAMES, fewest_presses, hanoi_distance

from llamagym.cli.run_commands import resolve_run_config
from llamagym.errors import ConfigError
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.resolver.layers import expert_baseline
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import assert_agent_conforms, tiny_agent
from llamagym.training.loop.trainer import Trainer
from llamagym_textarena import plugin


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny forwards on a shared machine run several times faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- plugin and registration -------------------------------------------------------------
def test_every_game_is_registered_with_its_distribution() -> None:
    plugins = get_plugins()
    for spec in plugin.AGENTS:
        registration = plugins.registry.get("agent", spec.name)
        assert registration.distribution == "llamagym-textarena"
        agent_class = registration.load()
        assert issubclass(agent_class, TextArenaAgent) and agent_class.name == spec.name
        assert agent_class.Config().game == spec.env_id  # the listed game is the default


def test_plugin_and_agent_modules_do_not_import_textarena() -> None:
    code = (
        "import sys, llamagym_textarena.plugin, llamagym_textarena.agent;"
        "print('textarena' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_game_option_takes_only_the_agents_own_games() -> None:
    agent = tiny_agent(TowerOfHanoiAgent, agent={"game": "TowerOfHanoi-v0-medium"})
    env = agent.make_env()
    _, info = env.reset(seed=0)
    assert "4 disks" in info["prompt"]
    with pytest.raises(ConfigError, match="agent.game"):
        tiny_agent(TowerOfHanoiAgent, agent={"game": "Wordle-v0"})


# -- the Gymnasium adapter -----------------------------------------------------------------
def test_env_passes_gymnasium_check_and_leaves_the_global_random_alone() -> None:
    env = TextArenaEnv("Mastermind-v0")
    check_env(env, skip_render_check=True)
    random.seed(123)
    expected = random.Random(123).random()
    env.reset(seed=5)
    env.step("[1 2 3 4]")
    assert random.random() == expected  # TextArena drew from this env's own state


def test_a_seed_deals_the_same_game() -> None:
    first, second = TextArenaEnv("FrozenLake-v0-random"), TextArenaEnv("FrozenLake-v0-random")
    boards = {first.reset(seed=s)[0] for s in range(6)}
    assert len(boards) > 1  # different seeds, different lakes
    for seed in range(6):
        assert first.reset(seed=seed) == second.reset(seed=seed)


def test_a_turn_shows_what_the_game_said_and_the_board() -> None:
    env = TextArenaEnv("TowerOfHanoi-v0")
    observation, info = env.reset(seed=0)
    assert observation.startswith("Current Board:") and "A: [3, 2, 1]" in observation
    assert "Tower of Hanoi" in info["prompt"] and info["legal_moves"] == ["[A B]", "[A C]"]
    assert info["expert_move"] == "[A C]"
    observation, reward, terminated, _, info = env.step("[A C]")
    assert observation.startswith("You moved disk 1 from A to C.") and "C: [1]" in observation
    assert (reward, terminated) == (0.0, False)
    # A refused move: the game's reason, and the unchanged board with it.
    observation, *_ = env.step("[A C]")
    assert "invalid move" in observation and "C: [1]" in observation


def test_the_optimal_player_solves_hanoi_in_the_fewest_moves() -> None:
    env = TextArenaEnv("TowerOfHanoi-v0-medium")
    _, info = env.reset(seed=0)
    moves = 0
    terminated = False
    while not terminated:
        _, reward, terminated, _, info = env.step(info["expert_move"])
        moves += 1
    assert moves == 2**4 - 1 and reward == 1.0 and info["won"]


def test_two_invalid_moves_end_the_game_as_the_game_says_and_nothing_raises() -> None:
    agent = tiny_agent(SudokuAgent)
    env = agent.make_env()
    _, info = env.reset(seed=0)
    # A digit no row, column or box forbids, but not the solution's: the game refuses it.
    solution = info["expert_move"]
    cell = solution.rsplit(" ", 1)[0]
    wrong = next(m for m in info["legal_moves"] if m.startswith(cell) and m != solution)
    _, _, terminated, _, info = env.step(wrong)
    assert not terminated and not info["invalid_move"]  # the game's warning
    _, reward, terminated, _, info = env.step("\x00 not a move " * 50)  # any text is a step
    assert terminated and info["invalid_move"] and not info["won"]
    assert 0.0 <= reward < 1.0
    assert agent.outcome(reward, info) == "invalid move"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("[1 1 1]")


# -- progress: each game's potential --------------------------------------------------------
def _unguessed_side(observation: str) -> str:
    """A number the last hint ruled out (Guess the Number's 1-20)."""
    return "[1]" if "higher" in observation else "[20]"


def _wrong_digit(expert_move: str) -> str:
    """The expert's Sudoku cell with a digit that is not the solution's."""
    row, col, digit = expert_move.strip("[]").split()
    return f"[{row} {col} {int(digit) % 9 + 1}]"


# Per game: a seed, then after the expert's (good) move a bad one, from the good move,
# the info and the observation after it, and its progress: a move undone, a guess the
# hints ruled out, or one the game refuses (nothing changes).
BAD_MOVES = {
    "TowerOfHanoi-v0": (0, lambda good, info, obs: f"[{good[3]} {good[1]}]", -1.0),
    "LightsOut-v0": (1, lambda good, info, obs: good, -1.0),  # pressed twice: undone
    "FrozenLake-v0": (2, lambda good, info, obs: {"[down]": "[up]"}.get(good, "[left]"), -1.0),
    "GuessTheNumber-v0": (3, lambda good, info, obs: _unguessed_side(obs), 0.0),
    "Mastermind-v0": (4, lambda good, info, obs: good, 0.0),  # tried already: refused
    "Sudoku-v0-very-easy": (5, lambda good, info, obs: _wrong_digit(info["expert_move"]), 0.0),
}


@pytest.mark.parametrize("game_id", BAD_MOVES)
def test_the_experts_move_gains_and_a_bad_one_does_not(game_id: str) -> None:
    seed, bad, bad_progress = BAD_MOVES[game_id]
    env = TextArenaEnv(game_id)
    _, info = env.reset(seed=seed)
    assert info["progress"] == 0.0 and info["potential"] < 0
    good = info["expert_move"]
    observation, _, terminated, _, info = env.step(good)
    assert info["progress"] > 0 and not terminated
    before = info["potential"]
    _, _, _, _, info = env.step(bad(good, info, observation))
    assert info["progress"] == bad_progress and info["potential"] == before + bad_progress


@pytest.mark.parametrize("family", GAMES)
def test_an_expert_episode_sums_to_the_start_potential(family: str) -> None:
    """Played to a win, the progress adds up to minus the start potential; in the games
    of a distance (moves, presses, steps, empty cells) every expert move gains 1."""
    game_id = GAMES[family].variants[0]
    env = TextArenaEnv(game_id)
    _, info = env.reset(seed=7)
    start, gained, terminated = info["potential"], [], False
    while not terminated:
        _, _, terminated, _, info = env.step(info["expert_move"])
        gained.append(info["progress"])
    assert info["won"] and info["potential"] == 0.0
    assert math.isclose(sum(gained), info["potential"] - start, abs_tol=1e-9)
    if family in ("GuessTheNumber", "Mastermind"):
        # Bits: each guess rules out some (the last may find what was already pinned).
        assert all(step > 0 for step in gained[:-1]) and gained[-1] >= 0
    else:
        assert gained == [1.0] * len(gained) == [1.0] * int(-start)


@pytest.mark.parametrize("game_id", [v for game in GAMES.values() for v in game.variants[:2]])
def test_any_play_sums_to_the_potentials_measured(game_id: str) -> None:
    """Random legal moves and unreadable ones, holes and invalid-move endings included:
    the progress adds up to the last potential measured less the first."""
    env = TextArenaEnv(game_id)
    rng = random.Random(0)
    for seed in range(2):
        _, info = env.reset(seed=seed)
        start, total, done = info["potential"], 0.0, False
        while not done:
            moves = info["legal_moves"]
            move = rng.choice(moves) if moves and rng.random() < 0.9 else "no move"
            _, _, terminated, truncated, info = env.step(move)
            assert isinstance(info["progress"], float) and math.isfinite(info["progress"])
            total += info["progress"]
            done = terminated or truncated
        assert math.isclose(total, info["potential"] - start, abs_tol=1e-9)


def test_hanoi_distance_is_the_shortest_solution_from_every_position() -> None:
    """Against a breadth-first search over all 3**4 positions of 4 disks."""
    disks = 4

    def moves(pegs: tuple[str, ...]):  # pegs[d - 1]: the peg of disk d
        for disk in range(1, disks + 1):
            if any(pegs[d - 1] == pegs[disk - 1] for d in range(1, disk)):
                continue  # a smaller disk lies on it
            for target in "ABC":
                if target != pegs[disk - 1] and all(pegs[d - 1] != target for d in range(1, disk)):
                    yield pegs[: disk - 1] + (target,) + pegs[disk:]

    goal = ("C",) * disks
    distance, queue = {goal: 0}, deque([goal])
    while queue:
        pegs = queue.popleft()
        for after in moves(pegs):
            if after not in distance:
                distance[after] = distance[pegs] + 1
                queue.append(after)
    assert len(distance) == 3**disks
    for pegs, moves_left in distance.items():
        peg_of = {disk: pegs[disk - 1] for disk in range(1, disks + 1)}
        assert hanoi_distance(peg_of, disks, "C") == moves_left


def test_fewest_presses_is_the_smallest_set_that_turns_the_lights_off() -> None:
    """Boards of up to 3 presses, against every set of at most 3 presses."""
    size, cells = 5, 25
    rng = random.Random(0)

    def pressed(presses) -> frozenset[int]:
        lit: set[int] = set()
        for cell in presses:
            row, col = divmod(cell, size)
            for dr, dc in ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1)):
                if 0 <= row + dr < size and 0 <= col + dc < size:
                    lit ^= {(row + dr) * size + col + dc}
        return frozenset(lit)

    smallest: dict[frozenset[int], int] = {}
    for count in range(3, -1, -1):
        for presses in itertools.combinations(range(cells), count):
            smallest[pressed(presses)] = count
    for _ in range(40):
        lit = pressed(rng.sample(range(cells), rng.randint(0, 3)))
        grid = [[r * size + c in lit for c in range(size)] for r in range(size)]
        presses = fewest_presses(grid)
        assert presses is not None
        assert pressed([cell for cell in range(cells) if presses >> cell & 1]) == lit
        assert presses.bit_count() == smallest[lit]


# -- replies -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "move"),
    [
        ("[A C]", "[A C]"),
        ("[a, c]", "[A C]"),
        ("I move the top disk: [ B  C ] now.", "[B C]"),
        ('{"action": "[A B]"}', "[A B]"),  # the JSON parser
        ("A C", "[A C]"),  # the first line as a move
        ("[C A]", None),  # well-formed, not legal now
        ("[A", None),
        ("", None),
    ],
)
def test_reply_parsing(reply: str, move: str | None) -> None:
    agent = tiny_agent(TowerOfHanoiAgent, rollout={"mode": "generate"})
    legal = ("[A B]", "[A C]", "[B C]")
    index = agent.plugins.extract_action(agent, reply, legal)
    assert (legal[index] if index is not None else None) == move


@pytest.mark.parametrize(
    ("reply", "move"),
    [
        ("[4,3,2,1,3,2,", "[4 3 2 1]"),  # ran on to the token limit
        ('[5 4 2 1, 2 3 "1', "[5 4 2 1]"),
        ("[4 3 2 1]", "[4 3 2 1]"),
        ("[5 5 4 2]", None),  # a closed move is taken as it is: repeats a digit
        ("[1 2 3", None),  # too few digits
        ("[1 2 3 4] tried", None),  # tried already
    ],
)
def test_a_mastermind_reply_that_runs_on_names_its_first_four_digits(reply, move) -> None:
    from llamagym_textarena.agent import MastermindAgent

    agent = tiny_agent(MastermindAgent, rollout={"mode": "generate"})
    env = agent.make_env()
    _, info = env.reset(seed=3)
    _, _, _, _, info = env.step("[1 2 3 4]")
    legal = agent.legal_actions(None, info)
    chosen = agent.action_index(agent.extract_action(reply), legal)
    assert (None if chosen is None else legal[chosen]) == move


def test_generate_mode_lists_a_few_moves_and_asks_for_the_format() -> None:
    agent = tiny_agent(FrozenLakeAgent, rollout={"mode": "generate"})
    env = agent.make_env()
    observation, info = env.reset(seed=0)
    assert agent.format_observation(observation, info).endswith("Legal moves: [down], [right]")
    assert "[down]" in agent.get_system_prompt()
    score = tiny_agent(FrozenLakeAgent)
    assert "Legal moves" not in score.format_observation(observation, info)
    assert agent.episode_context(observation, info).startswith("The game's rules:\nWelcome")


# -- baselines, conformance, training --------------------------------------------------
def test_baselines_and_outcomes() -> None:
    agent = tiny_agent(GuessTheNumberAgent, rollout={"num_envs": 2})
    binary = evaluate_baseline(agent, "binary-search", 8)
    assert binary.mean == 1.0 and binary.outcomes == {"won": 1.0, "lost": 0.0,
                                                      "invalid move": 0.0}
    random_play = evaluate_baseline(agent, "random", 8)
    assert random_play.outcomes["won"] < 1.0


@pytest.mark.parametrize("spec", plugin.AGENTS, ids=lambda spec: spec.name)
def test_every_game_has_an_expert_to_warm_start_from(spec) -> None:
    agent_class = get_plugins().registry.get("agent", spec.name).load()
    expert = expert_baseline(agent_class)  # what --warm-start expert plays
    assert expert in agent_class.baselines and expert != "random"


def test_the_lights_out_solver_turns_every_light_off() -> None:
    agent = tiny_agent(LightsOutAgent, rollout={"num_envs": 2})
    solver = evaluate_baseline(agent, "solver", 4)
    assert solver.outcomes["won"] == 1.0
    assert evaluate_baseline(agent, "random", 4).outcomes["won"] == 0.0


def test_a_recorded_move_is_written_as_the_model_writes_it_after_the_prefix(tmp_path,
                                                                           cli) -> None:
    path = tmp_path / "hanoi.jsonl"
    code, out, err = cli("record", "textarena-tower-of-hanoi", "-b", "optimal", "-n", "2",
                         "-o", path, "--mode", "generate")
    assert code == 0, out + err
    lines = path.read_text().splitlines()
    replies = [json.loads(line)["messages"][-1]["content"] for line in lines]
    # The prefix "[" opens the move, which closes itself: "[A C]", not "[[A C]}".
    assert replies and all(re.fullmatch(r"\[[ABC] [ABC]\]", reply) for reply in replies)
    agent = tiny_agent(TowerOfHanoiAgent, rollout={"mode": "generate"})
    assert agent.config.rollout.reply_prefix == "["
    assert agent.extract_action(replies[0]) == replies[0]


@pytest.mark.parametrize("spec", plugin.AGENTS, ids=lambda spec: spec.name)
def test_every_agent_conforms(spec) -> None:
    agent_class = get_plugins().registry.get("agent", spec.name).load()
    results = assert_agent_conforms(agent_class, name=spec.name, episodes=1)
    assert all(result.status == "pass" for result in results)


def test_short_training_run_changes_every_trainable_parameter(tmp_path) -> None:
    agent = tiny_agent(
        FrozenLakeAgent,
        rollout={"num_envs": 2},
        algorithm={"episodes_per_update": 2, "minibatch_size": 8, "epochs": 1},
        training={"episodes": 2, "minutes": None, "eval_episodes": 0},
        output={"dir": str(tmp_path), "quiet": True},
    )
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters() if p.requires_grad}
    summary = Trainer(agent, agent.session).run()
    assert summary.updates == 1
    unchanged = [
        name
        for name, parameter in agent.policy.named_parameters()
        if parameter.requires_grad and torch.equal(before[name], parameter.detach())
    ]
    assert unchanged == []


def test_a_mastermind_update_holds_the_codes_of_a_few_turns_at_a_time(tmp_path) -> None:
    """Every turn ranks up to 360 codes: a minibatch of 32 turns in one pass held 15.8 GB
    on the tiny model and was killed for memory. The update runs forward and backward
    over a few turns at a time, so only their activations are alive at once."""
    from llamagym_textarena.agent import MASTERMIND_MICROBATCH, MastermindAgent

    agent = tiny_agent(
        MastermindAgent,
        rollout={"num_envs": 1},
        algorithm={"episodes_per_update": 2, "minibatch_size": 32, "epochs": 1,
                   "microbatch_size": MastermindAgent.defaults["algorithm"]["microbatch_size"]},
        training={"episodes": 2, "minutes": None, "eval_episodes": 0},
        output={"dir": str(tmp_path), "quiet": True},
        agent={"max_episode_steps": 3},
    )
    backward_passes: list[int] = []
    weight = agent.policy.model.get_input_embeddings().weight
    hook = weight.register_hook(lambda grad: backward_passes.append(1))
    try:
        summary = Trainer(agent, agent.session).run()
    finally:
        hook.remove()
    assert summary.updates == 1 and summary.env_steps == 6  # 6 turns, one minibatch
    assert MASTERMIND_MICROBATCH < 6
    assert len(backward_passes) == -(-6 // MASTERMIND_MICROBATCH)  # 2 passes, not 1


def test_a_pretrained_model_writes_its_mastermind_code_and_tiny_ranks_them() -> None:
    """Ranking 360 codes a turn is too slow for a pretrained model on a CPU: it writes
    the code (generate mode) unless told to rank, and ranking keeps the small passes."""
    from llamagym_textarena.agent import MASTERMIND_MICROBATCH

    def resolved(**chosen: str):
        return resolve_run_config("textarena-mastermind", None, [], chosen)[1]

    tiny, real = resolved(), resolved(**{"model.name": "smollm2-135m"})
    assert tiny.config.rollout.mode == "score"
    assert real.config.rollout.mode == "generate"
    assert real.sources["rollout.mode"] == "pretrained-model defaults"
    ranked = resolved(**{"model.name": "smollm2-135m", "rollout.mode": "score"})
    assert ranked.config.rollout.mode == "score"
    assert ranked.config.algorithm.microbatch_size == MASTERMIND_MICROBATCH
    # Other games keep ranking their moves on a pretrained model.
    _, hanoi = resolve_run_config(
        "textarena-tower-of-hanoi", None, [], {"model.name": "smollm2-135m"}
    )
    assert hanoi.config.rollout.mode == "score"
