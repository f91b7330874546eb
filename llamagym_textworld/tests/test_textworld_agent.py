"""The TextWorld agent and plugin: prompts, reply parsing, context bounds, baselines,
the ``textworld-games`` command, the missing-TextWorld hint and a short training run.

Games are generated once per module into the session's temporary LlamaGym cache (the
root conftest points ``LLAMAGYM_CACHE`` there); a tiny game takes about half a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch
import typer
from gymnasium.utils.env_checker import check_env
from typer.testing import CliRunner

pytest.importorskip("textworld")

from llamagym_textworld.agent import TextWorldAgent, closest_command
from llamagym_textworld.cli import games_app

from llamagym.errors import ConfigError, LlamaGymError
from llamagym.errors import MissingDependencyError as LlamaGymMissingDependency
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_agent, evaluate_baseline
from llamagym.testing import tiny_agent
from llamagym.training.loop.trainer import Trainer
from llamagym_textworld import plugin

# Two small games whose quests are both two commands long (see the env tests).
TINY_GAMES = {"games": 2, "world_size": 2, "nb_objects": 3, "quest_min_length": 2,
              "quest_max_length": 2, "max_episode_steps": 10}
LEGAL = [
    "close chest",
    "examine board",
    "examine chest",
    "go north",
    "go south",
    "inventory",
    "look",
    "put Advent Calendar on table",
    "take keycard",
    "unlock box with keycard",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny forwards on a shared machine run several times faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def agent() -> TextWorldAgent:
    return tiny_agent(TextWorldAgent, agent=TINY_GAMES, rollout={"num_envs": 2})


@pytest.fixture(scope="module")
def env(agent: TextWorldAgent):
    made = agent.make_env()
    yield made
    made.close()


# -- plugin and registration -------------------------------------------------------------
def test_registered_with_its_distribution_and_command() -> None:
    registration = get_plugins().registry.get("agent", "textworld")
    assert registration.distribution == "llamagym-textworld"
    assert registration.load() is TextWorldAgent
    cli = typer.Typer()
    plugin.llamagym_register_commands(cli=cli)
    assert [group.name for group in cli.registered_groups] == ["textworld-games"]


def test_plugin_and_agent_modules_do_not_import_textworld() -> None:
    code = (
        "import sys, llamagym_textworld.plugin, llamagym_textworld.agent;"
        "print('textworld' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_missing_textworld_is_a_one_line_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    real_version = metadata.version

    def version(name: str) -> str:
        if name == "textworld":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setitem(sys.modules, "textworld", None)  # `import textworld` now fails
    assert "textworld" in get_plugins().registry.agents()  # still listed
    agent = tiny_agent(TextWorldAgent, agent={**TINY_GAMES, "first_seed": 500})
    with pytest.raises(LlamaGymMissingDependency) as raised:
        agent.make_env()
    message = str(raised.value)
    assert isinstance(raised.value, LlamaGymError)
    assert "\n" not in message and "pip install 'llamagym-textworld[textworld]'" in message


def test_missing_textworld_cli_exits_2_with_one_line() -> None:
    code = (
        "import sys; from importlib import metadata; real = metadata.version\n"
        "def version(name):\n"
        "    if name == 'textworld': raise metadata.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "metadata.version = version; sys.modules['textworld'] = None\n"
        "sys.argv = ['llamagym', 'textworld-games', 'make', '--count', '1']\n"
        "from llamagym.cli import main; main()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "LLAMAGYM_CACHE": os.environ["LLAMAGYM_CACHE"]},
    )
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip install" in errors[0]
    assert "Traceback" not in out.stderr


def test_games_command_makes_and_lists() -> None:
    runner = CliRunner()
    made = runner.invoke(
        games_app,
        ["make", "--count", "1", "--world-size", "2", "--nb-objects", "3",
         "--quest-length", "2", "--seed", "0"],
    )
    assert made.exit_code == 0, made.output
    assert "w2-o3-q2-2-s0-" in made.output and made.output.strip().endswith("textworld")
    listed = runner.invoke(games_app, ["list"])
    assert listed.exit_code == 0 and "w2-o3-q2-2-s0" in listed.output
    bad = runner.invoke(games_app, ["make", "--quest-length", "3-2"])
    assert bad.exit_code == 2 and "MIN <= MAX" in bad.output


def test_options_are_validated() -> None:
    from llamagym.errors import ConfigError

    with pytest.raises(ConfigError, match="agent.games"):
        tiny_agent(TextWorldAgent, agent={"games": 0})
    with pytest.raises(ConfigError, match="quest_min_length .* above"):
        tiny_agent(TextWorldAgent, agent={"quest_min_length": 4, "quest_max_length": 2})


@pytest.mark.parametrize(
    "key, value",
    [
        ("world_size", "1000000000"),
        ("nb_objects", "1000000000"),
        ("quest_max_length", "1000000000"),
        ("max_episode_steps", "1000000000"),
        ("max_observation_chars", "1000000000"),
        ("first_seed", "1000000000000000000000000"),
        ("win_bonus", "nan"),
        ("win_bonus", "inf"),
        ("step_penalty", "1e400"),
    ],
)
def test_a_size_past_what_textworld_generates_is_refused_in_one_line(
    key, value, tmp_path, cli
) -> None:
    """A world, a quest or a seed TextWorld's generator cannot make in bounded time (or
    at all), and a reward that is not a finite number, are named before anything runs."""
    from llamagym.testing import one_error_line

    code, _, err = cli("run", "textworld", "--model", "tiny", "--episodes", "4", "-q",
                       "-o", tmp_path / "run", "--set", f"agent.{key}={value}")
    assert code == 2, err
    assert one_error_line(err).startswith(f"error: agent.{key}: got ")
    assert not (tmp_path / "run").exists()


def test_the_games_command_refuses_a_world_past_its_bounds(tmp_path) -> None:
    from llamagym_textworld.games import MAX_WORLD_SIZE, make_game

    runner = CliRunner()
    for option, value in [("--world-size", "1000000000"), ("--nb-objects", "1000000000"),
                          ("--quest-length", "2-1000000000"), ("--seed", str(2**40))]:
        result = runner.invoke(games_app, ["make", "--count", "1", option, value])
        assert result.exit_code == 2, (option, result.output)
    with pytest.raises(ValueError, match=f"world_size must be 1 to {MAX_WORLD_SIZE}"):
        make_game(MAX_WORLD_SIZE + 1, 5, 2, 0, cache_dir=tmp_path)


# -- prompts -------------------------------------------------------------------------
def test_the_goal_is_said_once_in_the_system_prompt_and_the_banner_dropped(env) -> None:
    agent = tiny_agent(TextWorldAgent, agent=TINY_GAMES, rollout={"mode": "generate"})
    observation, info = env.reset(seed=0)
    assert info["objective"] in observation and "$$$$" in observation  # the raw text
    text = agent.format_observation(observation, info)
    assert "$$$$" not in text and info["objective"] not in text
    assert "-= " in text  # the room's description is kept
    commands = text.rsplit("\n\n", 1)[1]
    assert commands == "Valid commands: " + ", ".join(info["admissible_commands"])
    slot = agent.engine.new_slot(observation, info, None, None)
    assert slot.system_prompt == f"{agent.get_system_prompt()}\n\nGoal: {info['objective']}"
    # The episode keeps it, and so does its transcript.
    from llamagym.training.records.transcripts import transcript

    assert transcript(agent, slot.episode, "training", 0)["system"] == slot.system_prompt
    # Every turn of the episode starts with the same tokens: system prompt and goal.
    _, [first], _ = agent.engine.render_prompts([slot])
    slot.history += [{"role": "user", "content": text}, {"role": "assistant", "content": "look"}]
    slot.observation, slot.info = env.step("look")[0], info
    _, [second], _ = agent.engine.render_prompts([slot])
    goal = agent.policy.tokenizer(info["objective"], add_special_tokens=False)["input_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b),
                  len(first))
    assert shared > len(goal)


def test_system_prompt_asks_for_json_only_when_the_reply_is_parsed() -> None:
    generate = tiny_agent(TextWorldAgent, rollout={"mode": "generate"}).get_system_prompt()
    score = tiny_agent(TextWorldAgent).get_system_prompt()
    assert '{"command": "go north"}' in generate
    assert "{" not in score and score.endswith("Reply with one valid command.")


@pytest.mark.parametrize(
    ("options", "observation", "expected"),
    [
        ({"list_commands": True}, "You open the chest.", "You open the "
         "chest.\n\nValid commands: look, open chest"),
        ({}, "You open the chest.", "You open the chest."),  # score mode
        ({"list_commands": False}, "You open the chest.", "You open the chest."),
        ({"list_commands": False, "max_observation_chars": 50}, "word " * 40,
         ("word " * 10).rstrip() + " ..."),
        ({"list_commands": False}, "", ""),
    ],
)
def test_observation_text(options: dict, observation: str, expected: str) -> None:
    agent = tiny_agent(TextWorldAgent, agent=options)
    info = {"objective": "Open it.", "admissible_commands": ["look", "open chest"]}
    assert agent.format_observation(observation, info) == expected


def test_prompts_never_exceed_the_context(agent: TextWorldAgent, env) -> None:
    """A whole long episode of history: the oldest turns go, the goal and the current
    observation stay, and the prompt fits with room for the reply."""
    long_memory = tiny_agent(
        TextWorldAgent, agent=TINY_GAMES, rollout={"history_turns": None, "mode": "generate"}
    )
    observation, info = env.reset(seed=1)
    engine = long_memory.engine
    slot = engine.new_slot(observation, info, None, None)
    commands = ["look", "inventory", "examine " + info["admissible_commands"][0].split()[-1]]
    for step in range(60):
        user = long_memory.format_observation(observation, info)
        command = commands[step % len(commands)]
        observation, _, terminated, truncated, info = env.step(command)
        slot.history += [{"role": "user", "content": user},
                         {"role": "assistant", "content": command}]
        if terminated or truncated:  # the env cuts episodes at 10 steps: play on afresh
            observation, info = env.reset(seed=1)
    slot.observation, slot.info = observation, info
    user_texts, prompts, *_ = engine.render_prompts([slot])
    policy = long_memory.policy
    budget = policy.max_context - long_memory.config.rollout.max_new_tokens
    full = policy.tokenizer.apply_chat_template(
        engine.prompts._messages(slot, user_texts[0], slot.history), tokenize=False
    )
    uncut = policy.tokenizer(full, verbose=False)["input_ids"]
    assert len(uncut) > policy.max_context  # the whole history would not fit
    assert len(prompts[0]) <= budget
    text = policy.tokenizer.decode(prompts[0])
    assert text.endswith(user_texts[0] + "<|end|>\n<|assistant|>\n")
    assert slot.system_prompt.endswith(f"Goal: {info['objective']}")
    assert slot.system_prompt in text  # the goal with it


# -- parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "command"),
    [
        ('{"command": "go south"}', "go south"),  # JSON parser
        ('I think {"action": "look"}', "look"),
        ("go north", "go north"),  # the agent: the reply is the command
        ("Go North.", "go north"),
        ("> take keycard", "take keycard"),
        ("Command: inventory\nbecause I want to see what I hold", "inventory"),
        ("take the keycard", "take keycard"),  # the agent: close enough to one command
        ("go nort", "go north"),
        ("put advent calendar on the table", "put Advent Calendar on table"),
        ("unlock the box with the keycard", "unlock box with keycard"),
        ("First go south, then go north", "go north"),  # regex: the last one named
        ("Let me think. " * 30 + "go south", "go south"),  # named late in a long line
        ("Action: look", "look"),
        ("go nouth", None),  # as close to north as to south: no guess
        ("examine", None),  # which thing?
        ("dance", None),
        ("", None),
    ],
)
def test_reply_parsing(agent: TextWorldAgent, reply: str, command: str | None) -> None:
    index = agent.plugins.extract_action(agent, reply, LEGAL)
    assert (LEGAL[index] if index is not None else None) == command


def test_fuzzy_match_needs_a_clear_winner() -> None:
    assert closest_command("take the key card", LEGAL, 0.8) == LEGAL.index("take keycard")
    assert closest_command("go", ["go north", "go south"], 0.0) is None  # a tie
    assert closest_command("open door", LEGAL, 0.8) is None


# -- environment, actions, baselines ---------------------------------------------------
def test_env_made_by_the_agent_passes_check_env(env) -> None:
    check_env(env, skip_render_check=True)


def test_walkthrough_wins_through_the_agents_action_mapping(agent: TextWorldAgent, env) -> None:
    for game_index in range(TINY_GAMES["games"]):
        observation, info = env.reset(options={"game_index": game_index})
        for command in info["walkthrough"]:
            legal = list(agent.legal_actions(observation, info))
            action = agent.env_action(legal.index(command), legal)
            assert action == command
            observation, reward, terminated, truncated, info = env.step(action)
        assert terminated and info["won"]


def test_baselines(agent: TextWorldAgent) -> None:
    walkthrough = evaluate_baseline(agent, "walkthrough", 4)
    assert walkthrough.mean == 1.0
    random_play = evaluate_baseline(agent, "random", 4)
    assert 0.0 <= random_play.mean < 1.0


def test_the_place_of_a_choice_is_the_room_and_least_tried_is_refused_by_name(env) -> None:
    agent = tiny_agent(TextWorldAgent, agent=TINY_GAMES)
    observation, info = env.reset(seed=0)
    looked, _, _, _, again = env.step("look")
    assert agent.exploration_place(observation, info) == agent.exploration_place(looked, again)
    assert agent.legal_actions(looked, again) == again["admissible_commands"]
    with pytest.raises(ConfigError, match="rollout.explore"):
        tiny_agent(TextWorldAgent, agent={**TINY_GAMES, "least_tried": False})


def test_evaluations_count_games_won_from_the_game_state_not_the_return() -> None:
    # A win bonus and a step penalty put a won game's return anywhere; the outcome
    # still says whether the game was won.
    agent = tiny_agent(
        TextWorldAgent,
        agent={**TINY_GAMES, "max_episode_steps": 4, "win_bonus": 0.5, "step_penalty": 0.3},
        rollout={"num_envs": 2},
    )
    walkthrough = evaluate_baseline(agent, "walkthrough", 4)
    assert walkthrough.outcomes == {"won": 1.0, "lost": 0.0}
    assert walkthrough.mean < 1.0  # won, with a return below the quest's 1
    # The trained agent's evaluation reads each episode's last info the same way.
    examples: list = []
    result = evaluate_agent(agent.evaluation_engine(), 4, examples=examples)
    won = sum(episode.info.get("won") is True for episode in examples) / 4
    assert result.outcomes == {"won": won, "lost": 1 - won}


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_every_action_taken_is_admissible(mode: str) -> None:
    agent = tiny_agent(
        TextWorldAgent,
        agent={**TINY_GAMES, "max_episode_steps": 3},
        rollout={"mode": mode, "num_envs": 1, "history_turns": 1, "max_new_tokens": 6},
    )
    env = agent.make_env()
    episodes = agent.engine.collect([env], 1, seeds=[0])
    env.close()
    (episode,) = episodes
    assert 1 <= episode.length <= 3
    for turn in episode.turns:
        assert turn.legal_actions and turn.action_index is not None
        assert turn.user_text and "Goal: " not in turn.user_text
        if mode == "score":
            assert turn.reply == turn.legal_actions[turn.action_index]
            assert len(turn.candidates) == len(turn.legal_actions)


def test_short_training_run_changes_every_trainable_parameter(tmp_path) -> None:
    agent = tiny_agent(
        TextWorldAgent,
        # A step penalty makes every return non-zero, so the value head gets a gradient.
        agent={**TINY_GAMES, "max_episode_steps": 3, "step_penalty": 0.1,
               "list_commands": False},
        rollout={"num_envs": 2, "history_turns": 0},
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


def test_a_pretrained_model_learns_from_the_games_progress_by_default() -> None:
    from llamagym.resolver.layers import resolve_agent_config

    model = {"model": {"name": "smollm2-135m"}}
    pretrained = resolve_agent_config(TextWorldAgent, [("flags", model)])
    assert pretrained.config.rollout.progress_reward == 1.0
    assert pretrained.algorithm.gamma == 0.5 and pretrained.algorithm.lr == 5e-4
    tiny = resolve_agent_config(TextWorldAgent, [])
    assert tiny.config.rollout.progress_reward == 0.0 and tiny.algorithm.gamma == 0.95
