"""``llamagym record``: demonstrations played by a baseline, read back by the SFT warm-start."""

from __future__ import annotations

import json
import re

import pytest
import torch
from llamagym_blackjack.agent import BlackjackAgent, basic_strategy
from llamagym_blackjack.exact import reachable_states

from llamagym.config import RunConfig
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym_builtins.demonstrations_file import load_demonstrations

OBSERVATION = re.compile(r"Sum (\d+), dealer (\d+), usable ace (yes|no)\.")


def state_of(user_text: str) -> tuple[int, int, bool]:
    total, dealer, ace = OBSERVATION.fullmatch(user_text).groups()
    return int(total), int(dealer), ace == "yes"


def test_each_decision_of_the_baseline_becomes_a_demonstration(tmp_path, cli) -> None:
    path = tmp_path / "demos" / "basic.jsonl"
    code, out, _ = cli("record", "blackjack", "-b", "basic-strategy", "-n", "50", "-o", path,
                       "--mode", "generate")
    assert code == 0, out
    # The file the warm-start reads; generate mode names no legal actions.
    demonstrations = load_demonstrations(path)
    assert all(demonstration.legal_actions is None for demonstration in demonstrations)
    conversations = [demonstration.messages for demonstration in demonstrations]
    assert len(conversations) >= 50  # at least one decision per episode
    assert f"{len(conversations)} demonstrations from 50 episodes" in out
    # Recorded as the model sees it in generate mode, where the reply format is asked for.
    prompt = BlackjackAgent(config={"rollout": {"mode": "generate"}}).get_system_prompt()
    assert '{"action": "hit"}' in prompt
    for messages in conversations:
        system, user, reply = messages  # Blackjack keeps no history
        assert system == {"role": "system", "content": prompt}
        assert reply["role"] == "assistant"
        # The reply is what the baseline plays in the state the user message shows,
        # written as the model writes it: after the reply prefix, closed.
        action = basic_strategy(state_of(user["content"]), {}, [], None)
        assert reply["content"] == '{"action": "' + action + '"}'
        assert json.loads(reply["content"]) == {"action": action}
    # The recorded play scores what the baseline scores (a different set of seeds).
    recorded = float(re.search(r"mean return ([+-][\d.]+)", out).group(1))
    assert abs(recorded - evaluate_baseline(BlackjackAgent(), "basic-strategy", 50).mean) < 0.6


def test_unknown_baseline_names_the_known_ones_and_writes_nothing(tmp_path, cli) -> None:
    path = tmp_path / "demos.jsonl"
    code, _, err = cli("record", "blackjack", "-b", "perfect", "-o", path)
    assert code == 2
    assert "no baseline 'perfect'" in err and "basic-strategy" in err
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_random_play_teaches_the_reply_format_and_no_preference(tmp_path, cli) -> None:
    path = tmp_path / "random.jsonl"
    assert cli("record", "blackjack", "-b", "random", "-n", "600", "-o", path,
               "--mode", "generate")[0] == 0
    before, after = (
        BlackjackAgent(
            # A whole config: the built-in defaults, not the agent's, but for the reply
            # prefix the demonstrations were written after.
            config=RunConfig.model_validate({
                "agent": {"name": "blackjack"},
                "rollout": {"mode": "generate", "num_envs": 8, "reply_prefix": '{"action": "'},
                "algorithm": {"name": "ppo", "warm_start": {
                    "lr": 1e-3, "demonstration_epochs": 4,
                    **({"demonstrations": str(demos)} if demos else {}),
                }},
            })
        )
        for demos in (None, path)
    )
    states = reachable_states()
    for agent in (before, after):
        agent.algorithm  # noqa: B018  (building the run runs the warm-start)
    with torch.no_grad():
        untrained, warm = (
            agent.engine.decide(
                [agent.engine.new_slot(state, {}, None, None) for state in states], greedy=False
            )
            for agent in (before, after)
        )
    invalid = [sum(not turn.valid for turn in turns) / len(states) for turns in (untrained, warm)]
    assert invalid[0] > 0.5  # a random model rarely says "stick" or "hit"
    assert invalid[1] < 0.15
    hits = sum(turn.valid and turn.legal_actions[turn.action_index] == "hit" for turn in warm)
    assert 0.25 < hits / len(states) < 0.75  # both actions, neither preferred


def test_recording_filtered_to_an_outcome_keeps_only_those_episodes(tmp_path, cli) -> None:
    """Random TextWorld play filtered to its wins: every recorded episode ends in a won
    game, replayed command by command on a fresh env; an unknown outcome is refused."""
    pytest.importorskip("textworld")
    from llamagym_textworld.agent import TextWorldAgent

    games = ["--set", "agent.games=2", "--set", "agent.world_size=2",
             "--set", "agent.nb_objects=3", "--set", "agent.quest_max_length=2",
             "--set", "agent.max_episode_steps=10", "--set", "rollout.history_turns=null"]
    path = tmp_path / "wins.jsonl"
    code, out, _ = cli("record", "textworld", "-b", "random", "-n", "40", "--outcome", "won",
                       "-o", path, *games)
    assert code == 0, out
    kept = int(re.search(r"from (\d+) of 40 episodes", out).group(1))
    assert 0 < kept < 40  # random play wins some of these games, not all
    demonstrations = load_demonstrations(path)
    conversations = [demonstration.messages for demonstration in demonstrations]
    # Recorded in score mode, TextWorld's: each reply is a command among those offered.
    assert all(d.messages[-1]["content"] in d.legal_actions for d in demonstrations)
    # With the whole history, an episode's first decision is the one without any, and
    # its last decision holds all of it.
    starts = [k for k, messages in enumerate(conversations) if len(messages) == 3]
    assert len(starts) == kept and starts[0] == 0
    episodes = [conversations[end - 1] for end in [*starts[1:], len(conversations)]]
    agent = TextWorldAgent(config={"agent": {"games": 2, "world_size": 2, "nb_objects": 3,
                                             "quest_max_length": 2, "max_episode_steps": 10}})
    env = agent.make_env()
    for messages in episodes:
        commands = [m["content"] for m in messages if m["role"] == "assistant"]
        goal = messages[0]["content"].split("Goal: ", 1)[1]
        won = False
        for game in range(2):
            _, info = env.reset(options={"game_index": game})
            if info["objective"] != goal:
                continue
            for command in commands:
                _, _, terminated, truncated, info = env.step(command)
            won = info["won"]
        assert won, commands
    env.close()
    code, _, err = cli("record", "textworld", "-b", "random", "--outcome", "victory",
                       "-o", tmp_path / "none.jsonl", *games)
    assert code == 2 and "no outcome 'victory'" in err and "won, lost" in err


def test_score_mode_demonstrations_teach_the_choice_among_the_legal_actions(
    tmp_path, cli
) -> None:
    """Recorded in score mode (Blackjack's), a demonstration is the prompt a score-mode
    rollout renders, the action's name and the actions it was chosen from; the warm
    start trains score mode's own choice on it: after it, the greedy policy plays the
    basic strategy in more of the reachable states than before."""
    path = tmp_path / "basic.jsonl"
    code, out, _ = cli("record", "blackjack", "-b", "basic-strategy", "-n", "400", "-o", path)
    assert code == 0, out
    demonstrations = load_demonstrations(path)
    system_prompt = BlackjackAgent().get_system_prompt()  # score mode's
    for demonstration in demonstrations:
        system, user, reply = demonstration.messages
        assert system == {"role": "system", "content": system_prompt}
        assert demonstration.legal_actions == ["stick", "hit"]
        assert reply["content"] == basic_strategy(state_of(user["content"]), {}, [], None)
    before, after = (
        BlackjackAgent(config={"rollout": {"num_envs": 8}, "algorithm": {"warm_start": {
            "lr": 3e-3, "demonstration_epochs": 3,
            **({"demonstrations": str(demos)} if demos else {}),
        }}})
        for demos in (None, path)
    )
    states = reachable_states()
    agreement = []
    for agent in (before, after):
        with torch.no_grad():  # building the run (and its warm start) under no_grad
            turns = agent.engine.decide(
                [agent.engine.new_slot(state, {}, None, None) for state in states],
                greedy=True,
            )
        assert all(turn.candidates for turn in turns)  # score mode's choices
        played = [turn.legal_actions[turn.action_index] for turn in turns]
        expert = [basic_strategy(state, {}, [], None) for state in states]
        agreement.append(sum(a == b for a, b in zip(played, expert, strict=True)) / len(states))
    assert after.algorithm.sft.demonstrations_done
    assert agreement[1] > agreement[0] + 0.1, agreement
