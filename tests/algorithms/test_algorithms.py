"""The algorithm plugins on the tiny model: each one moves every parameter it trains and
learns the bandit; target-KL, zero-variance groups, config errors, SFT warm-start, the
schedule and control they are given, fixed-seed metrics, and the state a checkpoint
needs."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import gymnasium
import pytest
import torch
from pydantic import ValidationError

from llamagym.algorithms.algorithm import AlgorithmContext
from llamagym.algorithms.algorithm_config import nest_warm_start_keys
from llamagym.distributed import SingleProcess
from llamagym.errors import ConfigError
from llamagym.resolver.layers import format_validation_error
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.schedule import Control, Schedule
from llamagym.testing import BanditAgent, action_probabilities, tiny_agent
from llamagym_builtins.demonstrations_file import demonstration_turns, load_demonstrations
from llamagym_builtins.grpo import GRPO
from llamagym_builtins.ppo import PPO
from llamagym_builtins.rloo import REINFORCE, RLOO
from llamagym_builtins.sft import ReplayBuffer

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce")
GROUPED = {"grpo": {"group_size": 4}, "rloo": {"group_size": 4}}


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: these models are tiny, and the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def agent_for(name: str, rollout: dict | None = None, **algorithm):
    settings = {"name": name, **GROUPED.get(name, {}), **algorithm}
    return tiny_agent(BanditAgent, rollout=rollout or {}, algorithm=settings)


def collect(agent, episodes: int) -> list[Episode]:
    envs = [agent.make_env() for _ in range(agent.config.rollout.num_envs)]
    return agent.engine.collect(envs, episodes, group_size=agent.algorithm.group_size)


def trained_parameters(algorithm) -> dict[str, torch.Tensor]:
    """Every parameter in the algorithm's optimizer, by name, as a copy."""
    in_optimizer = {id(p) for group in algorithm.optimizer.param_groups for p in group["params"]}
    return {
        name: parameter.detach().clone()
        for name, parameter in algorithm.policy.named_parameters()
        if id(parameter) in in_optimizer
    }


def assert_every_parameter_moved(algorithm, before: dict[str, torch.Tensor]) -> None:
    model_parameters = {
        "model." + name for name, p in algorithm.policy.model.named_parameters() if p.requires_grad
    }
    assert model_parameters <= set(before), "the optimizer must train the whole model"
    after = dict(algorithm.policy.named_parameters())
    unchanged = [name for name, value in before.items() if torch.equal(value, after[name].detach())]
    assert unchanged == []


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_trained_parameter_changes_and_the_loss_is_finite(name: str) -> None:
    agent = agent_for(name)
    before = trained_parameters(agent.algorithm)
    metrics = agent.algorithm.update(collect(agent, 16))
    assert metrics["policy_steps"] > 0
    assert math.isfinite(metrics["policy_loss"]) and math.isfinite(metrics["entropy"])
    assert_every_parameter_moved(agent.algorithm, before)
    if name != "ppo":  # critic-free: the value head is not theirs to train
        assert not any(n.startswith("value_head") for n in before)


def test_grpo_in_generate_mode_trains_the_sampled_replies() -> None:
    # The tiny model's replies are unparsable at first; a random fallback action makes
    # returns differ inside a group now and then, which is all GRPO needs.
    agent = agent_for(
        "grpo",
        rollout={"mode": "generate", "max_new_tokens": 4, "invalid_action": {"policy": "random"}},
        kl_coef=0.05,
    )
    before = trained_parameters(agent.algorithm)
    for _ in range(6):
        batch = collect(agent, 16)
        metrics = agent.algorithm.update(batch)
        if metrics["signal_turns"]:
            break
    assert metrics["policy_steps"] > 0 and math.isfinite(metrics["policy_loss"])
    assert metrics["kl_ref"] >= 0.0 and math.isfinite(metrics["kl_ref"])
    assert all(turn.action_tokens for episode in batch for turn in episode.turns)
    assert_every_parameter_moved(agent.algorithm, before)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_learns_the_better_lever_within_ten_updates(name: str) -> None:
    agent = agent_for(
        name, rollout={"num_envs": 32}, episodes_per_update=64, minibatch_size=64, epochs=2, lr=3e-3
    )
    assert action_probabilities(agent, 0)[1] < 0.9
    updates = 0
    while updates < 10 and action_probabilities(agent, 0)[1] <= 0.9:
        agent.algorithm.update(collect(agent, 64))
        updates += 1
    assert action_probabilities(agent, 0)[1] > 0.9, f"not learnt after {updates} updates"


class TwoStateBandit(gymnasium.Env):
    """One-step episodes from one of two states; the better lever depends on the state
    (hit at a low sum, stick at a high one), so a policy must read its prompt."""

    observation_space = gymnasium.spaces.Discrete(2)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.state = int(self.np_random.integers(2))
        return self.state, {}

    def step(self, action: int):
        better = 1 if self.state == 0 else 0
        payout = 0.8 if int(action) == better else 0.2
        return self.state, float(self.np_random.random() < payout), True, False, {}


class TwoStateAgent(BanditAgent):
    name = "two-state"
    action_names = ("stick", "hit")

    def format_observation(self, observation: int) -> str:
        return "Sum 5, dealer 10." if observation == 0 else "Sum 20, dealer 10."

    def make_env(self) -> TwoStateBandit:
        return TwoStateBandit()


def test_grpo_learns_an_action_that_depends_on_the_state() -> None:
    # Group-relative credit only compares episodes from the same seed, i.e. the same
    # state here: it must still tell the two states apart.
    agent = tiny_agent(
        TwoStateAgent,
        rollout={"num_envs": 32},
        algorithm={"name": "grpo", "group_size": 8, "episodes_per_update": 128,
                   "minibatch_size": 128, "epochs": 2, "lr": 1e-3},
    )
    for _ in range(20):
        agent.algorithm.update(collect(agent, 128))
        hit_low, hit_high = action_probabilities(agent, 0)[1], action_probabilities(agent, 1)[1]
        if hit_low > 0.9 and hit_high < 0.1:
            break
    assert hit_low > 0.9 and hit_high < 0.1


@pytest.mark.parametrize("microbatch_size", [None, 3])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_target_kl_stops_the_epochs_early(name: str, microbatch_size: int | None) -> None:
    # The first step moves the policy; the next minibatch (in this epoch, or the next one
    # when zero-variance groups left only one minibatch) already measures more than
    # 1.5 x the tiny target, so the update stops there instead of running 4 epochs.
    agent = agent_for(name, epochs=4, minibatch_size=8, target_kl=1e-7,
                      microbatch_size=microbatch_size)
    metrics = agent.algorithm.update(collect(agent, 16))
    assert metrics["target_kl_stop"] == 1.0 and metrics["target_kl_stops"] == 1.0
    assert metrics["policy_steps"] == 1.0 and metrics["epochs_run"] <= 2.0
    assert agent.algorithm.state_dict()["counters"]["target_kl_stops"] == 1


def counted_passes(algorithm) -> list[int]:
    """The turns of every forward pass the algorithm's update makes, as it makes them."""
    passes: list[int] = []
    evaluate = algorithm.scoring.evaluate

    def counting(turns, *rest):
        passes.append(len(turns))
        return evaluate(turns, *rest)

    algorithm.scoring.evaluate = counting
    return passes


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_micro_batches_take_the_steps_whole_minibatches_take(name: str) -> None:
    """A minibatch of 8 turns in pieces of 3, 3 and 2 (PPO's value loss, GRPO's KL to
    the reference): the same metrics and the same weights as one pass over the 8."""
    outcomes = []
    for microbatch_size in (None, 3):
        torch.manual_seed(0)
        agent = agent_for(name, epochs=2, minibatch_size=8, kl_coef=0.1,
                          microbatch_size=microbatch_size)
        agent.algorithm.freeze_reference()
        batch = collect(agent, 16)
        passes = counted_passes(agent.algorithm)
        metrics = agent.algorithm.update(batch)
        outcomes.append((passes, metrics, trained_parameters(agent.algorithm)))
    (whole, metrics, weights), (pieces, metrics_in_pieces, weights_in_pieces) = outcomes
    assert set(whole) <= {8} and set(pieces) <= {2, 3} and len(pieces) > len(whole)
    assert sum(whole) == sum(pieces)
    assert metrics_in_pieces == pytest.approx(metrics, rel=1e-4, abs=1e-6)
    assert metrics["policy_steps"] > 1
    # Summing in pieces reorders float additions; Adam divides each step by the root of
    # its second moment, which turns that rounding into ~1e-6 where a gradient is near 0.
    # A wrong split (a piece weighted by its own size, a lost piece) moves weights by ~lr.
    for key, value in weights.items():
        torch.testing.assert_close(weights_in_pieces[key], value, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_warmup_steps_take_a_rising_share_of_the_learning_rate(name: str) -> None:
    """With warmup_steps=4, steps 1-4 take 1/4, 2/4, 3/4 and all of the rate, and a resumed
    run goes on counting. Adam's first step moves every weight with a gradient by the
    whole rate it is given (its gradient over its own size), so the largest change of
    step 1 is a quarter of lr: without the warmup it would be lr."""
    lr = 1e-3
    settings = {"epochs": 2, "minibatch_size": 4, "lr": lr, "anneal_lr": False,
                "entropy_coef": 0.01, "warmup_steps": 4}
    agent = agent_for(name, **settings)
    algorithm = agent.algorithm
    optimizer, rates, first_change = algorithm.optimizer, [], []
    step = optimizer.step

    def recording_step(*args, **kwargs):
        before = trained_parameters(algorithm)
        result = step(*args, **kwargs)
        rates.append(optimizer.param_groups[0]["lr"])
        if not first_change:
            after = dict(algorithm.policy.named_parameters())
            first_change.append(
                max((after[n].detach() - value).abs().max().item() for n, value in before.items())
            )
        return result

    optimizer.step = recording_step
    metrics = algorithm.update(collect(agent, 16))
    assert metrics["policy_steps"] == 8
    assert rates == pytest.approx([lr / 4, lr / 2, 3 * lr / 4] + [lr] * 5)
    assert first_change[0] == pytest.approx(lr / 4, rel=1e-3)
    assert optimizer.param_groups[0]["lr"] == lr and metrics["lr"] == lr
    assert algorithm.state_dict()["counters"]["optimizer_steps"] == 8
    resumed = agent_for(name, **settings).algorithm
    resumed.load_state_dict(algorithm.state_dict())
    assert resumed.learning_rate.at(resumed.optimizer_steps + 1) == lr
    fresh = agent_for(name, **settings).algorithm
    assert fresh.learning_rate.at(fresh.optimizer_steps + 1) == lr / 4


def test_without_a_target_kl_every_epoch_runs() -> None:
    agent = agent_for("grpo", epochs=3, minibatch_size=8)
    metrics = agent.algorithm.update(collect(agent, 16))
    assert metrics["epochs_run"] == 3.0 and metrics["target_kl_stop"] == 0.0


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_zero_variance_groups_are_masked_counted_and_logged(entropy_coef: float) -> None:
    agent = agent_for("grpo", entropy_coef=entropy_coef)  # 16 episodes in 4 groups of 4
    batch = collect(agent, 16)
    groups = sorted({episode.group for episode in batch})
    assert len(groups) == 4
    for group in groups:
        members = [episode for episode in batch if episode.group == group]
        for rank, episode in enumerate(members):
            # the first group: all returns equal; the others: half 1, half 0
            episode.turns[-1].reward = 1.0 if group == groups[0] else float(rank % 2)
    metrics = agent.algorithm.update(batch)
    assert metrics["zero_variance_groups"] == 1.0
    assert metrics["zero_variance_fraction"] == 0.25
    assert metrics["signal_turns"] == 12.0
    # Without a regulariser the masked group is not even evaluated; with an entropy
    # bonus its turns stay in the batch with zero advantage, so the bonus reaches them.
    assert metrics["trained_turns"] == (16.0 if entropy_coef else 12.0)


def test_group_algorithms_need_whole_groups() -> None:
    for name in ("grpo", "rloo"):
        with pytest.raises(ConfigError, match=r"episodes_per_update.*multiple of group_size \(6\)"):
            tiny_agent(algorithm={"name": name, "group_size": 6})


@pytest.mark.parametrize("name", ("grpo", "rloo", "reinforce"))
def test_unsupported_credit_rule_is_a_config_error(name: str) -> None:
    unsupported = r"algorithm\.credit.*does not support.*'gae'.*discounted"
    with pytest.raises(ConfigError, match=unsupported):
        tiny_agent(algorithm={"name": name, "credit": "gae"})


def test_ppo_accepts_every_credit_rule() -> None:
    for rule in ("gae", "discounted", "equal", "terminal"):
        agent = tiny_agent(algorithm={"name": "ppo", "credit": rule})
        assert agent.resolved.algorithm.credit == rule


def test_grpo_trains_from_the_llamagym_act_loop() -> None:
    # Episodes from act/terminate_episode carry no seed group: the batch is one group.
    agent = agent_for("grpo", episodes_per_update=8)
    env = agent.make_env()
    metrics: dict[str, float] = {}
    for episode in range(8):
        observation, _ = env.reset(seed=episode)
        agent.act(observation)
        _, reward, *_ = env.step(1)
        agent.assign_reward(reward)
        metrics = agent.terminate_episode()
    assert metrics["episodes"] == 8.0 and metrics["zero_variance_fraction"] in (0.0, 1.0)


# -- SFT warm-start --------------------------------------------------------------------
def fake_episode(value: float, valid: bool = True) -> Episode:
    turn = Turn([1, 2], ["a", "b"], 0, "a", [-0.5], 0.0, reward=value, valid=valid)
    return Episode(turns=[turn], env_return=value, length=1)


def test_replay_buffer_keeps_the_top_k_and_stays_bounded() -> None:
    buffer = ReplayBuffer(capacity=5)
    for batch in range(4):
        # returns batch*10 + 0..7; only the 3 best of each batch are offered
        episodes = [fake_episode(batch * 10 + k) for k in range(8)]
        buffer.offer(episodes, top_k=3)
        assert len(buffer) <= 5
    assert buffer.returns() == [37.0, 36.0, 35.0, 27.0, 26.0]


def test_replay_buffer_bar_invalid_episodes_and_json_state() -> None:
    buffer = ReplayBuffer(capacity=4, min_return=0.0)
    buffer.offer([fake_episode(-1.0), fake_episode(0.0), fake_episode(2.0, valid=False)], top_k=8)
    assert len(buffer) == 0  # at or below the bar, or nothing valid to imitate
    buffer.offer([fake_episode(1.0), fake_episode(1.0), fake_episode(3.0)], top_k=8)
    restored = ReplayBuffer(capacity=4, min_return=0.0)
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert restored.returns() == buffer.returns() == [3.0, 1.0, 1.0]
    assert [t.reply for t in restored.turns()] == [t.reply for t in buffer.turns()]


def test_equal_returns_evict_the_oldest() -> None:
    buffer = ReplayBuffer(capacity=2)
    old, newer, newest = fake_episode(1.0), fake_episode(1.0), fake_episode(1.0)
    for episode in (old, newer, newest):
        buffer.offer([episode], top_k=1)
    kept = {id(turn) for turn in buffer.turns()}
    assert kept == {id(newer.turns[0]), id(newest.turns[0])}


def test_replay_per_task_keeps_each_tasks_best_episode() -> None:
    def played(game: int, value: float) -> Episode:
        episode = fake_episode(value)
        episode.info = {"game_index": game, "won": value > 0}
        return episode

    buffer = ReplayBuffer(capacity=8, per="game_index")
    buffer.offer([played(0, 3.0), played(0, 2.0), played(1, 1.0), played(2, 0.5)], top_k=8)
    assert sorted(buffer.returns()) == [0.5, 1.0, 3.0]  # one per game, game 0's best
    buffer.offer([played(0, 1.0), played(1, 4.0), played(2, 0.5)], top_k=8)
    # Game 0 keeps its 3; game 1 its better 4; game 2 the newer of equals.
    assert sorted(buffer.returns()) == [0.5, 3.0, 4.0]
    newest = played(2, 0.5)
    buffer.offer([newest], top_k=1)
    assert id(newest.turns[0]) in {id(turn) for turn in buffer.turns()}
    assert len(buffer) == 3
    # Without it, the three best episodes of any games.
    plain = ReplayBuffer(capacity=3)
    plain.offer([played(0, 3.0), played(0, 2.0), played(1, 1.0), played(2, 0.5)], top_k=8)
    assert sorted(plain.returns()) == [1.0, 2.0, 3.0]


def test_replay_per_an_unknown_key_names_the_keys_there_are() -> None:
    episode = fake_episode(1.0)
    episode.info = {"game_index": 0}
    with pytest.raises(ConfigError, match=r"replay_per='gmae_index'.*\['game_index'\]"):
        ReplayBuffer(capacity=4, per="gmae_index").offer([episode], top_k=1)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_demonstrations_loader_reads_both_formats(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "demos.jsonl",
        [
            json.dumps({"messages": [{"role": "user", "content": "Which lever?"},
                                     {"role": "assistant", "content": "right"}]}),
            "",
            json.dumps({"system": "Pull one lever.", "prompt": "Which lever?",
                        "response": "right"}),
        ],
    )
    conversations = [demonstration.messages for demonstration in load_demonstrations(path)]
    assert len(conversations) == 2
    assert conversations[1][0] == {"role": "system", "content": "Pull one lever."}
    assert all(c[-1] == {"role": "assistant", "content": "right"} for c in conversations)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "Which lever?", "response": ', "line 3: not valid JSON"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]}',
         "line 3: the last message must be the assistant's"),
        ('{"question": "Which lever?"}', "line 3: expected"),
        ('["right"]', "line 3: expected"),
        ('{"prompt": "Which lever?", "response": "up", "legal_actions": ["left", "right"]}',
         "line 3: the reply 'up' is not one of its 'legal_actions'"),
        ('{"prompt": "Which lever?", "response": "left", "legal_actions": "left"}',
         "line 3: 'legal_actions' must be a list of 1 to 4,096 strings"),
        ('{"prompt": "Which lever?", "response": "left", "legal_actions": []}',
         "line 3: 'legal_actions' must be a list"),
    ],
)
def test_demonstrations_loader_names_the_bad_line(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    good = json.dumps({"prompt": "Which lever?", "response": "right"})
    path = write_lines(tmp_path / "demos.jsonl", [good, good, bad_line, good])
    with pytest.raises(ConfigError, match=message):
        load_demonstrations(path)


def test_demonstrations_refuse_a_reply_prefix_with_observation_fields() -> None:
    tokenizer = tiny_agent().policy.tokenizer
    conversation = [{"role": "user", "content": "Which lever?"},
                    {"role": "assistant", "content": "right"}]
    with pytest.raises(ConfigError, match=r"names fields.*without \$fields"):
        demonstration_turns([conversation], tokenizer, 512, '{"sum": $sum, "action": "')
    # $$ is a dollar sign, as in a rollout: the prompt ends with '{"cost": "$1", "action": "'.
    [turn] = demonstration_turns([conversation], tokenizer, 512, '{"cost": "$$1", "action": "')
    prefix = tokenizer('{"cost": "$1", "action": "', add_special_tokens=False)["input_ids"]
    assert turn.prompt_tokens[-len(prefix) :] == prefix
    assert tokenizer.decode(turn.action_tokens) == 'right"}'


def test_demonstrations_warm_start_before_rl(tmp_path: Path) -> None:
    demo = {"system": BanditAgent().get_system_prompt(), "prompt": "Which lever?",
            "response": "right"}
    path = write_lines(tmp_path / "demos.jsonl", [json.dumps(demo)] * 8)
    agent = agent_for(
        "grpo", warm_start={"demonstrations": str(path), "lr": 1e-2, "demonstration_epochs": 3}
    )
    resolved = agent.resolved
    algorithm = resolved.algorithm_class(AlgorithmContext(
        agent.policy, resolved.algorithm, agent.config.rollout,
        Schedule(agent.config.rollout), SingleProcess(),
    ))
    sft = algorithm.sft  # building an algorithm trains nothing
    assert not sft.demonstrations_done and sft.steps == 0
    metrics = algorithm.warm_start()  # a run's first phase
    assert sft.demonstrations_done and sft.steps == 3
    assert metrics["sft_demo_loss_last"] < metrics["sft_demo_loss_first"]
    assert algorithm.warm_start() == {}  # once only
    # Building a run goes through the phase: the demonstrated lever is now preferred.
    untrained = action_probabilities(agent_for("grpo"), 0)[1]
    assert action_probabilities(agent, 0)[1] > untrained + 0.1


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_kl_reference_is_the_policy_after_the_demonstrations(tmp_path: Path, name: str) -> None:
    demo = {"system": BanditAgent().get_system_prompt(), "prompt": "Which lever?",
            "response": "right"}
    path = write_lines(tmp_path / "demos.jsonl", [json.dumps(demo)] * 8)
    agent = agent_for(name, warm_start={"demonstrations": str(path), "lr": 1e-2}, kl_coef=0.1)
    algorithm = agent.algorithm
    algorithm.warm_start()
    algorithm.freeze_reference()
    turns = [turn for episode in collect(agent, 8) for turn in episode.turns]
    with torch.no_grad():
        reference = algorithm.scoring.reference_logprobs(turns)
        current = algorithm.scoring.evaluate(turns).logprobs
    # RL starts with no KL to pay: the demonstrations' lesson is what it is pulled to.
    assert algorithm.sft.demonstrations_done
    assert torch.allclose(reference, current, atol=1e-6)


def test_sft_steps_after_each_update_on_the_best_episodes() -> None:
    agent = agent_for(
        "ppo", warm_start={"replay": True, "top_k": 4, "buffer_size": 6, "steps": 2}
    )
    for _ in range(3):
        metrics = agent.algorithm.update(collect(agent, 16))
        assert metrics["sft_buffer_episodes"] <= 6
    assert metrics["sft_buffer_episodes"] == 6 and math.isfinite(metrics["sft_loss"])
    assert agent.algorithm.sft.steps == 6


def test_state_dict_holds_everything_to_resume() -> None:
    settings = {"kl_coef": 0.1, "adaptive_kl_target": 0.001, "adaptive_kl_horizon": 16,
                "warm_start": {"replay": True}}
    agent = agent_for("grpo", **settings)
    agent.algorithm.update(collect(agent, 16))
    state = agent.algorithm.state_dict()
    assert state["kl_controller"]["coef"] != 0.1  # the controller moved it
    plain = {k: v for k, v in state.items() if k != "optimizer"}
    plain["warm_start"] = {k: v for k, v in state["warm_start"].items() if k != "optimizer"}
    json.dumps(plain)  # everything but optimizer tensors is JSON-able
    fresh = agent_for("grpo", **settings)
    fresh.algorithm.load_state_dict(state)
    assert fresh.algorithm.kl.coef == agent.algorithm.kl.coef
    assert fresh.algorithm.rng.random() == agent.algorithm.rng.random()
    buffers = fresh.algorithm.sft.buffer, agent.algorithm.sft.buffer
    assert buffers[0].returns() == buffers[1].returns()
    assert fresh.algorithm.updates == 1


def test_flat_sft_keys_name_their_new_place() -> None:
    for algorithm in (PPO, GRPO, RLOO, REINFORCE):
        with pytest.raises(ValidationError) as raised:
            algorithm.Config(sft_lr=1e-3, sft_warm_start=True, lr=1e-3)
        lines = format_validation_error(raised.value, prefix="algorithm.").splitlines()
        assert lines == [
            "algorithm.sft_lr: got 0.001; this key is now algorithm.warm_start.lr",
            "algorithm.sft_warm_start: got True; this key is now algorithm.warm_start.replay",
        ]
    settings = PPO.Config(warm_start={"lr": 1e-3, "replay": True})
    assert settings.warm_start.lr == 1e-3 and settings.warm_start.replay
    with pytest.raises(ValidationError, match="no demonstrations file"):
        PPO.Config(warm_start={"demonstrations": "missing.jsonl"})
    assert nest_warm_start_keys({"lr": 0.1, "sft_lr": 1e-3, "sft_warm_start": True}) == {
        "lr": 0.1, "warm_start": {"lr": 1e-3, "replay": True}
    }


def test_turns_read_back_from_json_keep_retries_and_default_the_temperature() -> None:
    retry = Turn([1], ["a"], None, "?", [-1.0], 0.0, valid=False, feedback="again")
    turn = Turn([1, 2], ["a", "b"], 1, "b", [-0.2], 0.5, retries=[retry], temperature=0.7)
    data = json.loads(json.dumps(dataclasses.asdict(Episode(turns=[turn], env_return=1.0))))
    episode = Episode.from_dict(data)
    assert episode.turns[0] == turn and isinstance(episode.turns[0].retries[0], Turn)
    del data["turns"][0]["temperature"]  # a turn recorded without it
    assert Episode.from_dict(data).turns[0].temperature == 1.0


# -- the learner's inputs: schedule, control, collectives ------------------------------
def test_schedule_and_control_are_given_at_construction() -> None:
    agent = agent_for("grpo", epochs=3, minibatch_size=8)
    schedule = Schedule(agent.config.rollout)
    epochs: list[tuple[int, int]] = []
    stop = [False]
    control = Control(should_stop=lambda: stop[0], on_epoch=lambda k, n: epochs.append((k, n)))
    algorithm = GRPO(AlgorithmContext(
        agent.policy, agent.algorithm.config, agent.config.rollout, schedule, SingleProcess(),
        control,
    ))
    batch = collect(agent, 16)
    schedule.set_progress(0.5)
    metrics = algorithm.update(batch)
    assert metrics["lr"] == pytest.approx(0.5 * algorithm.config.lr)
    assert epochs == [(1, 3), (2, 3), (3, 3)] and metrics["update_interrupted"] == 0.0
    stop[0] = True
    metrics = algorithm.update(batch)
    assert metrics["update_interrupted"] == 1.0 and metrics["policy_steps"] == 0.0


def test_an_algorithm_written_for_0_3_is_refused_where_it_is_defined_with_the_fix() -> None:
    with pytest.raises(TypeError) as refused:
        class OldConstructor(GRPO):
            def __init__(self, policy, config, rollout, **run):
                super().__init__(policy, config, rollout, **run)

    message = str(refused.value)
    assert "\n" not in message
    assert "OldConstructor.__init__ takes (policy, config, rollout)" in message
    assert "def __init__(self, context: AlgorithmContext)" in message

    class NewConstructor(GRPO):  # one argument without a default: the context
        def __init__(self, context, note=""):
            super().__init__(context)

    agent = agent_for("grpo")
    schedule = Schedule(agent.config.rollout)
    built = NewConstructor(AlgorithmContext(
        agent.policy, agent.algorithm.config, agent.config.rollout, schedule, SingleProcess(),
    ))
    assert built.schedule is schedule and built.control.should_stop() is False


# The metrics of one update on a fixed seed (CPU, one thread): a change to what an
# update computes shows here.
GOLDEN = {
    "ppo": (
        {"final_temperature": 0.5},
        {"name": "ppo", "kl_coef": 0.1, "minibatch_size": 8, "epochs": 2},
        {"policy_loss": -0.10258295387029648, "value_loss": 0.23443196713924408,
         "entropy": 0.5517695918679237, "kl_ref": 0.08693692460656166,
         "approx_kl": 0.06338132172822952, "clip_fraction": 0.75, "carried_turns": 0.0,
         "episodes": 16.0,
         "return_mean": 0.5, "invalid_rate": 0.0, "episode_length": 1.0,
         "policy_steps": 4.0, "epochs_run": 2.0, "target_kl_stop": 0.0,
         "update_interrupted": 0.0, "target_kl_stops": 0.0, "kl_coef": 0.1,
         "skipped_steps": 0.0, "value_mean": 0.5, "lr": 0.0005},
    ),
    "grpo": (
        {},
        {"name": "grpo", "group_size": 4, "kl_coef": 0.05, "entropy_coef": 0.01,
         "minibatch_size": 8},
        {"policy_loss": -0.05623875930905342, "entropy": 0.5907428860664368,
         "kl_ref": 0.06793591566383839, "approx_kl": 0.05322052538394928,
         "clip_fraction": 0.75, "carried_turns": 0.0, "episodes": 16.0, "return_mean": 0.125,
         "invalid_rate": 0.0, "episode_length": 1.0, "zero_variance_groups": 2.0,
         "zero_variance_fraction": 0.5, "signal_turns": 8.0, "trained_turns": 16.0,
         "policy_steps": 4.0, "epochs_run": 2.0, "target_kl_stop": 0.0,
         "update_interrupted": 0.0, "target_kl_stops": 0.0, "kl_coef": 0.05,
         "skipped_steps": 0.0, "lr": 0.0005},
    ),
}


@pytest.mark.parametrize("name", GOLDEN)
def test_updates_on_a_fixed_batch_repeat_their_metrics(name: str) -> None:
    rollout, settings, expected = GOLDEN[name]
    torch.manual_seed(0)
    agent = tiny_agent(BanditAgent, rollout=rollout, algorithm=settings)
    agent.algorithm.freeze_reference()
    agent.engine.schedule.set_progress(0.5)
    agent.algorithm.schedule.set_progress(0.5)  # the same object in a built run
    batch = collect(agent, 16)
    metrics = agent.algorithm.update(batch)
    assert list(metrics) == list(expected)
    assert metrics == pytest.approx(expected, abs=1e-6, rel=1e-6)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_state_dicts_alone_resume_an_update_exactly(name: str) -> None:
    settings = {"kl_coef": 0.1, "adaptive_kl_target": 0.001, "adaptive_kl_horizon": 16,
                "warm_start": {"replay": True, "steps": 2}, "minibatch_size": 8}
    torch.manual_seed(0)
    first = agent_for(name, **settings)
    first.algorithm.freeze_reference()
    first.algorithm.update(collect(first, 16))
    saved = copy.deepcopy(
        {"policy": first.policy.state_dict(), "algorithm": first.algorithm.state_dict(),
         "engine": first.engine.state_dict()}
    )
    expected = first.algorithm.update(collect(first, 16))

    torch.manual_seed(1)  # a resumed process starts elsewhere; the state says where to go
    second = agent_for(name, **settings)
    second.algorithm.freeze_reference()  # before the weights: the reference is the start's
    second.policy.load_state_dict(saved["policy"])
    second.algorithm.load_state_dict(saved["algorithm"])
    second.engine.load_state_dict(saved["engine"])
    assert second.algorithm.update(collect(second, 16)) == expected


def test_a_run_built_under_no_grad_still_trains(tmp_path: Path) -> None:
    """An evaluation that builds a run with demonstrations configured (its first use of
    ``agent.engine`` inside ``torch.no_grad()``) trains them all the same, and an update
    asked for under no_grad takes its steps."""
    demo = {"system": BanditAgent().get_system_prompt(), "prompt": "Which lever?",
            "response": "right"}
    path = write_lines(tmp_path / "demos.jsonl", [json.dumps(demo)] * 8)
    agent = agent_for("ppo", warm_start={"demonstrations": str(path), "lr": 1e-2})
    with torch.no_grad():
        algorithm = agent.algorithm  # builds the run: the warm start is its first phase
        # eight demonstrations are one batch: one step for each pass over them
        assert algorithm.sft.demonstrations_done
        assert algorithm.sft.steps == algorithm.sft.config.demonstration_epochs
        before = trained_parameters(algorithm)
        metrics = algorithm.update(collect(agent, 8))
    after = trained_parameters(algorithm)
    assert metrics["policy_loss"] == metrics["policy_loss"]  # a number, not NaN
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_a_turn_with_more_legal_actions_than_the_entropy_takes_runs_only_its_reply() -> None:
    """Generate mode's entropy runs each legal action's name through the model; a turn
    with more names than that bound (Mastermind's 360 codes) gets the next-token entropy
    and its update runs only its reply."""
    from llamagym.algorithms.turn_scoring import MOST_NAMED_ACTIONS

    agent = tiny_agent(BanditAgent, rollout={"mode": "generate"})
    policy, scoring = agent.policy, agent.algorithm.scoring
    encode = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    few = ["left", "right", "stay"]
    many = [f"code {k}" for k in range(MOST_NAMED_ACTIONS + 1)]
    reply = encode("pull it")  # no action's name (a pair met twice runs once)
    turns = [Turn(encode(prompt), names, 0, "pull it", [-0.1] * len(reply), 0.0,
                  action_tokens=reply)
             for prompt, names in (("Which lever?", few), ("Which code?", many))]
    names = scoring.named_actions(turns)
    assert [len(row) for row in names] == [len(few), 0]
    before = policy.head_positions
    with torch.no_grad():
        evaluation = scoring.evaluate(turns)
    assert policy.head_positions - before == 2 * len(reply) + sum(map(len, names[0]))
    assert float(evaluation.entropy[1, 0]) > math.log(len(few))  # the vocabulary's spread
