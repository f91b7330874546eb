"""A checkpoint's episodes in progress are data: a carried turn that is not what the
engine records (an index outside its choices, log-probabilities or candidates of the
wrong number) is refused when the run resumes, in one line naming the field, exit 2,
with every file of the run as it was."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from llamagym.training.checkpoint import store as checkpoints

FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
    "--checkpoint-every", "1",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1",
]

# Each tampering of the first carried turn, and the words its refusal must hold.
TAMPERINGS: dict[str, tuple[Callable[[dict], None], str]] = {
    "no log-probability": (lambda t: t.update(logprobs=[]), "logprobs"),
    "3 log-probabilities for one choice": (
        lambda t: t.update(logprobs=[-0.1, -0.2, -0.3]), "logprobs"),
    "3 candidates for 2 legal actions": (
        lambda t: t.update(candidates=[*t["candidates"], t["candidates"][0]]), "candidates"),
    "action_index 99": (lambda t: t.update(action_index=99), "action_index"),
    "action_index -1": (lambda t: t.update(action_index=-1), "action_index"),
    "action_index null": (lambda t: t.update(action_index=None), "action_index"),
    "no candidates": (lambda t: t.update(candidates=[]), "candidates"),
    "candidates of each other's action": (
        lambda t: t.update(candidates=t["candidates"][::-1]), "candidates"),
    # found when the episode is played again: what the step showed and earned
    "another prompt": (lambda t: t.update(prompt_tokens=t["prompt_tokens"][1:]), "prompt"),
    "another user text": (lambda t: t.update(user_text=t["user_text"] + "!"), "prompt"),
    "another reply": (lambda t: t.update(reply=t["reply"] + "!"), "history"),
}


def _run(tmp_path_factory, *options: str) -> Path:
    """A CartPole run of 2 updates whose last checkpoint carries episodes in progress."""
    import sys

    from llamagym.cli import main

    run_dir = tmp_path_factory.mktemp("carried") / "run"
    argv = sys.argv
    sys.argv = ["llamagym", "run", "cartpole", "--episodes", "16", "-o", str(run_dir), *FAST,
                *options]
    try:
        with pytest.raises(SystemExit) as stopped:
            main()
    finally:
        sys.argv = argv
    assert stopped.value.code in (None, 0)
    return run_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return _run(tmp_path_factory)


@pytest.fixture(scope="module")
def trained_generating(tmp_path_factory) -> Path:
    """The same in generate mode, re-prompting an invalid reply (its retries untrained)."""
    return _run(tmp_path_factory, "--mode", "generate",
                "--set", "rollout.invalid_action.policy=reprompt",
                "--set", "rollout.invalid_action.train_on_reprompts=false")


def _digest(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_a_tampered_carried_turn_is_refused_at_load(case, trained, tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    checkpoint = checkpoints.find_checkpoint(run_dir)
    meta_file = checkpoint / checkpoints.META
    meta = json.loads(meta_file.read_text())
    slots = meta["state"]["engine"]["carried"]["slots"]
    episode = next(s["episode"] for s in slots if s is not None and s["episode"]["turns"])
    tamper, field = TAMPERINGS[case]
    tamper(episode["turns"][0])
    meta_file.write_text(json.dumps(meta))
    before = _digest(run_dir)

    code, _, err = cli("run", "cartpole", "--episodes", "24", "--resume", run_dir, "--quiet")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in err
    assert _digest(run_dir) == before


def test_a_carried_turn_that_is_not_its_steps_is_refused(trained, tmp_path, cli) -> None:
    """A turn that claims another of its legal actions than the one its step played is
    found when the episode is played again, and refused in one line."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    meta_file = checkpoints.find_checkpoint(run_dir) / checkpoints.META
    meta = json.loads(meta_file.read_text())
    slots = meta["state"]["engine"]["carried"]["slots"]
    turn = next(s["episode"]["turns"][0] for s in slots if s is not None and s["episode"]["turns"])
    turn["action_index"] = 1 - turn["action_index"]  # CartPole: the other push
    meta_file.write_text(json.dumps(meta))
    weights = (checkpoints.find_checkpoint(run_dir) / checkpoints.WEIGHTS).read_bytes()

    code, _, err = cli("run", "cartpole", "--episodes", "24", "--resume", run_dir, "--quiet")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "action_index is not the action its step took" in lines[0]
    assert [p.name for p in checkpoints.list_checkpoints(run_dir)] == [
        p.name for p in checkpoints.list_checkpoints(trained)]
    assert (checkpoints.find_checkpoint(run_dir) / checkpoints.WEIGHTS).read_bytes() == weights


# -- any change at all: a property search over a real checkpoint's episodes in progress --
#: The fields of a turn the replay cannot know: the model's own numbers when it played
#: (checked only to be finite) and what the training never reads.
NOT_REPLAYED = {"logprobs", "value", "temperature", "policy_version", "parser", "env_action",
                "feedback", "ends_episode"}


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every place in a JSON value: each container's items and each leaf."""
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*path, index))
    return found


def _mutated(saved: dict, path: tuple, how: str, value: Any) -> dict:
    changed = copy.deepcopy(saved)
    parent = changed
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if how == "set":
        parent[key] = value
    elif how == "delete":
        del parent[key]
    elif how == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif how == "add-key" and isinstance(parent[key], dict):
        parent[key]["extra"] = value
    else:
        parent[key] = value
    return changed


#: A re-prompted turn's failed attempts, as far as a replay knows them: the first one's
#: prompt is the decision's; the later ones' prompts and every sampled token are the
#: model's own (their token ids are checked to be the model's).
RETRY_FIELDS = ("legal_actions", "action_index", "reply", "reward", "valid", "feedback")


def _replayed_fields(turn) -> dict[str, Any]:
    kept = {k: v for k, v in dataclasses.asdict(turn).items() if k not in NOT_REPLAYED}
    retries = [{k: getattr(r, k) for k in RETRY_FIELDS} for r in turn.retries]
    return kept | {"logprobs": len(turn.logprobs), "retries": retries,
                   "first_prompt": (turn.retries or [turn])[0].prompt_tokens}


def _what_the_replay_keeps(engine) -> list[Any]:
    """Each env's replayed episode (None: none), in the fields a replay checks."""
    kept = []
    for slot in engine._carried.slots:
        if slot is None or not slot.steps:
            kept.append(None)
            continue
        turns = [_replayed_fields(t) for t in slot.episode.turns]
        kept.append((slot.steps, slot.rewards, slot.history, slot.episode.system_prompt,
                     slot.episode.length, slot.episode.env_return, slot.episode.seed, turns))
    return kept


LEAVES = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, 1, -1, 2, 99, 2**31, -(2**63), 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(-2, 60000), max_size=3), st.just({}),
)


@pytest.fixture(scope="module")
def trained_on_retries(tmp_path_factory) -> Path:
    """Generate mode, re-prompting an invalid reply and training on its failed attempts."""
    return _run(tmp_path_factory, "--mode", "generate",
                "--set", "rollout.invalid_action.policy=reprompt")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["trained", "trained_generating", "trained_on_retries"])
def test_no_change_to_an_episode_in_progress_is_trained_on_unseen(run, request) -> None:
    """Whatever one change makes of a real checkpoint's episodes in progress (a field
    set to any JSON value, deleted, duplicated, a key added), loading it either refuses
    it with a ValueError or keeps episodes the replay agrees with in every field it can
    check; it never raises anything else."""
    from hypothesis import HealthCheck, given, settings

    from llamagym.agent import load_agent

    trained = request.getfixturevalue(run)
    engine = load_agent(trained).engine
    saved = checkpoints.read_meta(checkpoints.find_checkpoint(trained))["state"]["engine"]
    # its random streams as it has them
    state = {**engine.state_dict(), "carried": saved["carried"]}
    engine.load_state_dict(state)
    expected = _what_the_replay_keeps(engine)
    assert any(kept is not None for kept in expected)  # there is something to tamper with
    turns = [t for s in saved["carried"]["slots"] if s for t in s["episode"]["turns"]]
    assert (run != "trained") == any(t["retries"] for t in turns)  # re-prompted turns too
    # Places grouped by the field they are in, each field as likely as another (a prompt
    # holds hundreds of token ids, a turn one reward).
    fields: dict[str, list[tuple]] = {}
    for place in _paths(state["carried"]):
        if place and place[0] == "slots":
            named = [key for key in place if isinstance(key, str)]
            fields.setdefault(named[-1], []).append(place)
    places = st.sampled_from(sorted(fields)).flatmap(lambda name: st.sampled_from(fields[name]))

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(place=places,
           how=st.sampled_from(["set", "delete", "duplicate", "add-key"]), value=LEAVES)
    def one_change(place, how, value) -> None:
        carried_state = _mutated(state["carried"], place, how, value)
        try:
            engine.load_state_dict({**state, "carried": carried_state})
        except ValueError:
            return  # refused
        for got, want in zip(_what_the_replay_keeps(engine), expected, strict=True):
            assert got is None or got == want, (place, how, value)

    one_change()
