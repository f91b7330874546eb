"""The CartPole agent: the state as text, LEFT/RIGHT, learning defaults and baselines.

Numbers are rendered with a fixed number of decimals and an explicit sign, glued to the
``=`` before them (``pole angle=+0.03``). The tiny model's tokenizer splits digits one per
token, and with nothing but ``=`` in front the sign is always a token of its own, so
every observation (while each value stays below 10 in size) has the same token count
and a digit of the same place value always sits at the same position. A small model can
then learn "the sign token after *angle* and the digit two places later" instead of
memorising whole numbers. A space before the sign would break this: the tiny
tokenizer merges `` -`` into one token but not `` +``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llamagym.agent import Agent
from llamagym_cartpole.plugin import CARTPOLE

LEFT, RIGHT = "LEFT", "RIGHT"

# Replies a small model tends to give instead of the full word, checked only after the
# JSON parser and before the regex over LEFT/RIGHT (which already finds the words).
_SHORT_ANSWERS = {"l": LEFT, "r": RIGHT, "<": LEFT, ">": RIGHT, "←": LEFT, "→": RIGHT}


class CartPoleOptions(BaseModel):
    """The ``agent`` section keys this agent reads (``--set agent.precision=3``)."""

    model_config = ConfigDict(extra="forbid")
    precision: int = Field(
        2, ge=0, le=6, description="Decimals shown for each of the state numbers."
    )
    cart: bool = Field(
        True,
        description="Show the cart's position and velocity. Without them the text holds "
        "the pole's angle and angular velocity only (half the tokens), which is all the "
        "angle+velocity baseline reads to balance the pole for 500 steps.",
    )


def random_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def push_toward_lean(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """Push the cart under the pole: right when it leans right. Fails within ~40 steps,
    because it reacts only once the pole has already tipped and then overcorrects."""
    return RIGHT if float(observation[2]) > 0 else LEFT


def angle_and_velocity(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """Push toward where the pole will lean a moment from now (angle + 0.5 x angular
    velocity). This damps the swing and balances for the full 500 steps from almost
    every start: the ceiling a learned policy can be measured against."""
    angle, angular_velocity = float(observation[2]), float(observation[3])
    return RIGHT if angle + 0.5 * angular_velocity > 0 else LEFT


# A pretrained model's batch shape, in both action modes (see CartPoleAgent).
_PRETRAINED_ALGORITHM = {
    "lr": 5e-4,
    "episodes_per_update": 8,
    "minibatch_size": 64,
    "microbatch_size": 64,
    "epochs": 4,
    "target_kl": None,
}


@CARTPOLE.bind  # name, description and env_id come from the registration
class CartPoleAgent(Agent):
    action_names = (LEFT, RIGHT)  # index 0 pushes left, 1 right: CartPole-v1's Discrete(2)
    baselines = {
        "random": random_action,
        "pole-angle": push_toward_lean,
        "angle+velocity": angle_and_velocity,
    }
    expert_baseline = "angle+velocity"
    # Episodes run up to 500 turns, so a handful of them already holds thousands of
    # decisions: few episodes per update, a moderate number of envs in lockstep, and
    # credit by GAE with a discount so a turn answers for the next ~100 steps, not 500.
    # Minibatches of 64 give several small policy steps per batch; with 256 the policy
    # barely moved in our runs. The value loss (returns up to ~100) is weighted down so
    # its gradient does not drown the policy's in the shared trunk; the value head has
    # no other gradient, and Adam's per-parameter scaling lets it learn at full speed.
    # Sampling cools from temperature 1 to 0.3 over the run's budget: early rollouts
    # explore, late ones play almost as the greedy policy that is evaluated, so training
    # sees the states greedy play drifts into (off-centre carts sampled play never meets).
    # Constant temperatures (1, 0.5), three decimals and 2 epochs were each tried over
    # 3 seeds and gave a lower mean greedy length (see this plugin's README).
    defaults = {
        # explore all: the rounded angle and velocity come back often within an episode,
        # and the right push there is the same each time (trying the other is a fall).
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 0,
                    "final_temperature": 0.3, "reply_prefix": '{"action": "',
                    "max_new_tokens": 8, "explore": "all"},
        "algorithm": {
            "name": "ppo",
            "lr": 1e-3,
            "episodes_per_update": 8,
            "minibatch_size": 64,
            "epochs": 4,
            "credit": "gae",
            "gamma": 0.99,
            "gae_lambda": 0.95,
            "entropy_coef": 0.0,
            "value_coef": 0.01,
        },
        # One torch thread: these forwards are too small to split, and on a busy machine
        # a second thread mostly waits for a core (measured ~10x slower, not faster).
        "training": {"minutes": 15, "eval_episodes": 100, "threads": 1},
    }

    # A pretrained model through LoRA on its last layers (SmolLM2-135M: docs/results.md).
    # Each turn's cost is its new tokens, so the observation drops the cart
    # (the pole's two numbers are all the angle+velocity rule reads) and score mode puts
    # the action names right after the assistant header: ~25 new tokens a turn instead
    # of ~43. The batch shape is tiny's (8 episodes, minibatches of 64, 4 epochs): an
    # update from the kept trunk runs 4 layers, so epochs are cheap next to the rollout.
    # The adapter moves few weights: lr 5e-4, as Blackjack's score mode, and no
    # target-KL stop, as in tiny's recipe.
    # Generate mode keeps all of that and the JSON reply prefix: the model writes the
    # action name and closes the object (`LEFT"}`: two tokens). Sampled from the whole
    # vocabulary, half of the untrained model's replies name no action (`SHOOT`,
    # `DISABLED`; benchmarks/real_model.py formats); from its two likeliest tokens, none
    # of the first 5 updates' did, 4-25% of updates 6-14's (`ALRIGHT`, `MUSIC`: where
    # one name dominates, the runner-up token is not the other name), 0.4% at the end
    # as the temperature cooled. Replies this short need no gradient checkpointing.
    pretrained_defaults = {
        "score": {
            "agent": {"cart": False},
            "rollout": {"num_envs": 8, "reply_prefix": ""},
            "algorithm": _PRETRAINED_ALGORITHM,
        },
        "generate": {
            "agent": {"cart": False},
            "model": {"gradient_checkpointing": False},
            "rollout": {"num_envs": 8, "top_k": 2},
            "algorithm": _PRETRAINED_ALGORITHM,
        },
    }

    #: Options under ``agent.`` (``--set agent.KEY=VALUE``); ``self.options`` holds them.
    Config = CartPoleOptions
    options: CartPoleOptions

    def get_system_prompt(self) -> str:
        if self.config.rollout.mode == "generate":
            return (
                'Keep the pole upright. Reply with JSON only: {"action": "LEFT"} to push '
                'the cart left, or {"action": "RIGHT"} to push it right.'
            )
        return "Keep the pole upright. Answer LEFT or RIGHT."

    def format_observation(self, observation: Any) -> str:
        position, velocity, angle, angular_velocity = (float(x) for x in observation)
        number = self.format_number
        pole = f"pole angle={number(angle)} angular velocity={number(angular_velocity)}"
        if not self.options.cart:
            return pole[0].upper() + pole[1:]
        return f"Cart position={number(position)} velocity={number(velocity)}, {pole}"

    def format_number(self, value: float) -> str:
        """``+0.03`` / ``-1.25``: fixed decimals and a sign, even for zero."""
        text = f"{value:+.{self.options.precision}f}"
        # Rounding a tiny negative gives "-0.00"; show it as "+0.00" so zero looks one way.
        return "+" + text[1:] if float(text) == 0 else text

    def extract_action(self, response: str) -> str | None:
        words = response.strip().split()
        if len(words) == 1:
            return _SHORT_ANSWERS.get(words[0].strip(".!").lower())
        return None
