"""A scripted fake language model, and the policy stand-in it plays through.

:class:`ScriptedLLM` answers from a script (a list of replies, or a function of the
prompt) and records what it was shown. :class:`FakePolicy` stands where
:class:`llamagym.models.policy.Policy` stands in the rollout engine: it encodes the script's
replies with a real tokenizer (the offline tiny model's by default), so the replies go
through the real extraction chain and the real invalid-action policy, with no model
loaded. The conformance checks (:mod:`llamagym.devtools.conformance`) play their
episodes with it, and :mod:`llamagym.testing` offers it as the ``fake_llm`` fixture.

Nothing heavy is imported at module level: torch and transformers load on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from llamagym.agent import Agent
    from llamagym.models.policy import Replies
    from llamagym.rollout.trajectory import Episode


class ScriptExhaustedError(AssertionError):
    """A :class:`ScriptedLLM` was asked for more replies than its script holds."""


class TurnBudgetExceededError(AssertionError):
    """A :class:`FakePolicy` was asked for more decisions than its budget allows."""


Script = Sequence[str] | Callable[[str], str]


class ScriptedLLM:
    """A fake language model that replies from a script.

    ``replies`` is a list of reply texts, given in order (with ``cycle=True`` it starts
    over when it runs out; otherwise running out is an error, because a test that
    miscounted its turns should say so), or a function from the rendered prompt text
    to a reply. Every prompt seen and reply given is recorded in :attr:`prompts` and
    :attr:`replies`, so a test can assert on exactly what the model was shown. In score
    mode the script is not asked (every legal action scores the same, so actions are
    drawn uniformly), but every prompt is still recorded in :attr:`prompts`.
    """

    def __init__(self, replies: Script, *, cycle: bool = False, tokenizer: Any = None):
        if not callable(replies) and not list(replies):
            raise ValueError("a ScriptedLLM needs at least one reply")
        self.script = replies if callable(replies) else list(replies)
        self.cycle = cycle
        self.tokenizer = tokenizer
        self.prompts: list[str] = []
        self.replies: list[str] = []

    def reply(self, prompt: str) -> str:
        """The next reply of the script for ``prompt`` (recorded)."""
        if callable(self.script):
            text = self.script(prompt)
        else:
            position = len(self.replies)
            if position >= len(self.script) and not self.cycle:
                raise ScriptExhaustedError(
                    f"the scripted LLM was asked for reply {position + 1} but its script "
                    f"holds {len(self.script)}; add replies or pass cycle=True"
                )
            text = self.script[position % len(self.script)]
        self.prompts.append(prompt)
        self.replies.append(text)
        return text

    def policy(self, max_turns: int | None = None) -> FakePolicy:
        """A policy stand-in answering from this script (tiny tokenizer by default)."""
        if self.tokenizer is None:
            self.tokenizer = load_tiny_tokenizer()
        return FakePolicy(self, self.tokenizer, max_turns=max_turns)

    def attach(self, agent: Agent) -> Agent:
        """Make ``agent`` decide with this fake: ``agent.act`` and ``agent.engine`` then
        run the real engine and extraction chain with no model loaded. Training is not
        possible with a fake (it has no weights); ``agent.algorithm`` would fail."""
        agent.use_policy(self.policy())
        return agent

    def play(
        self,
        agent: Agent,
        episodes: int = 1,
        *,
        num_envs: int = 1,
        seed: int = 0,
        mode: Literal["generate", "score"] = "generate",
        max_turns: int | None = None,
    ) -> list[Episode]:
        """Play ``episodes`` seeded episodes of ``agent``'s env with this fake model.

        Generate mode (the default) asks the script for every reply; score mode gives
        every legal action the same score, so actions are drawn uniformly. For the play,
        ``agent.config.rollout.mode`` is ``mode``, so the agent's prompts are those of a
        real run in that mode; it is put back afterwards.
        """
        from llamagym.rollout.engine import RolloutEngine

        rollout = agent.config.rollout
        settings = rollout.model_copy(update={"mode": mode, "num_envs": num_envs})
        engine = RolloutEngine(agent, self.policy(max_turns), settings, seed=seed)
        own_mode, rollout.mode = rollout.mode, mode
        try:
            return engine.play(episodes)
        finally:
            rollout.mode = own_mode
            engine.close()


class FakePolicy:
    """What :class:`~llamagym.rollout.engine.RolloutEngine` needs of a policy, with no model.

    ``generate`` encodes the script's reply with the real tokenizer and appends the
    end-of-turn token, as a model would; log-probabilities, values and scores are all
    zero. ``max_turns`` bounds the decisions taken, so an environment that never ends
    an episode fails a test instead of hanging it.
    """

    def __init__(self, llm: ScriptedLLM, tokenizer: Any, max_turns: int | None = None):
        self.llm = llm
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.max_context = tokenizer_context(tokenizer)
        import torch

        self.device = torch.device("cpu")
        self.training = False
        self.max_turns = max_turns
        self.turns = 0
        # A run is built around a policy's weights (an algorithm makes its optimizer
        # over them); a fake has one, which nothing trains: updates need a real model.
        self.model = torch.nn.Module()
        self.model.register_parameter("weight", torch.nn.Parameter(torch.zeros(1)))

    def trainable_parameters(self) -> list[Any]:
        return list(self.model.parameters())

    def train(self, mode: bool = True) -> FakePolicy:
        self.training = mode
        return self

    def eval(self) -> FakePolicy:
        return self.train(False)

    def _count(self, rows: int) -> None:
        self.turns += rows
        if self.max_turns is not None and self.turns > self.max_turns:
            raise TurnBudgetExceededError(
                f"more than {self.max_turns} decisions were asked of the fake model"
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        generator: Any = None,  # the script decides; nothing is sampled
        reply_prefix: str | Sequence[str] = "",
        should_stop: Any = None,  # a scripted reply is one step
        keys: Sequence[Any] | None = None,  # no model, no cache to keep
        reply_trees: Any = None,  # a scripted reply is written as the script says
    ) -> Replies:
        from llamagym.models.generation import reply_prefixes
        from llamagym.models.policy import Replies

        self._count(len(prompts))
        replies = []
        for prompt, prefix in zip(prompts, reply_prefixes(reply_prefix, len(prompts)), strict=True):
            text = self.llm.reply(self.tokenizer.decode(list(prompt)))
            # The prompt ends with the reply prefix: a scripted reply written in full
            # continues after it.
            text = text.removeprefix(prefix) if prefix else text
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            # A real model cannot say more than max_new_tokens either.
            replies.append((list(tokens) + [self.eos_id])[:max_new_tokens])
        return Replies.unscored(replies)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        reference: bool = False,
        keys: Sequence[Any] | None = None,
    ) -> tuple[Any, Any]:
        import torch

        self._count(len(prompts))
        self.llm.prompts += [self.tokenizer.decode(list(prompt)) for prompt in prompts]
        width = max(len(options) for options in candidates)
        scores = torch.full((len(prompts), width), float("-inf"))
        for row, options in enumerate(candidates):
            scores[row, : len(options)] = 0.0
        return scores, torch.zeros(len(prompts))


def tokenizer_context(tokenizer: Any, default: int = 2048) -> int:
    """The tokenizer's context length, or ``default`` when it declares none."""
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if limit and limit < 1_000_000 else default


_tokenizers: dict[Path, Any] = {}


def load_tiny_tokenizer() -> Any:
    """The offline tiny model's tokenizer (built into the cache on first use)."""
    from llamagym.models.tiny import build_tiny_model

    directory = build_tiny_model()
    if directory not in _tokenizers:
        from transformers import AutoTokenizer

        _tokenizers[directory] = AutoTokenizer.from_pretrained(directory)
    return _tokenizers[directory]

