"""How an algorithm scores its turns under the policy: now, with gradients
(:meth:`TurnScoring.evaluate`), as they were sampled (:meth:`TurnScoring.old_logprobs`),
and under the KL reference (:meth:`TurnScoring.reference_logprobs`); and the frozen
trunk filled once per update (:meth:`TurnScoring.keep_trunk`).

An :class:`~llamagym.algorithms.algorithm.Algorithm` holds one, as ``scoring``
(``self.scoring.evaluate(turns)``); it uses only the policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llamagym.algorithms.batching import prompt_pieces
from llamagym.models.passes import padded
from llamagym.models.policy import Evaluation, Policy, name_tokens
from llamagym.rollout.trajectory import Turn

#: The most legal actions a generate-mode turn's entropy is taken over. Each name runs
#: through the model in the update as a score-mode candidate does: Mastermind's 360
#: codes made SmolLM2-135M's first update ask for 26 GB.
MOST_NAMED_ACTIONS = 64


class TurnScoring:
    """How an algorithm scores its turns under ``policy``."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def sampling_temperature(self, turns: Sequence[Turn]) -> float | torch.Tensor:
        """The temperature ``turns`` were sampled at: one number when they share it (as
        a batch does), else one per turn, [N, 1]."""
        first = turns[0].temperature
        if all(turn.temperature == first for turn in turns):
            return first
        return torch.tensor([[turn.temperature] for turn in turns], device=self.policy.device)

    def evaluate(
        self, turns: Sequence[Turn], temperature: float | torch.Tensor | None = None
    ) -> Evaluation:
        """Current log-probabilities, entropy and values for ``turns`` (with gradients).
        Score mode's policy is taken at the temperature each turn was sampled at, or at
        ``temperature`` when given."""
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            if temperature is None:
                temperature = self.sampling_temperature(turns)
            return self.policy.evaluate_choices(
                prompts,
                [turn.candidates for turn in turns],
                chosen_actions(turns),
                temperature=temperature,
            )
        return self.policy.evaluate_replies(
            prompts, [turn.action_tokens for turn in turns], actions=self.named_actions(turns)
        )

    def named_actions(self, turns: Sequence[Turn]) -> list[list[list[int]]]:
        """Each generate-mode turn's legal actions as tokens: the entropy bonus is taken
        over them (:meth:`Policy.evaluate_replies`). Empty where the agent names none or
        more than :data:`MOST_NAMED_ACTIONS`: such a turn gets the next-token entropy."""
        named = [turn.legal_actions if len(turn.legal_actions) <= MOST_NAMED_ACTIONS else []
                 for turn in turns]
        names = sorted({name for row in named for name in row})
        encoded = name_tokens(self.policy.tokenizer, self.policy.eos_id, names)
        tokens = dict(zip(names, encoded, strict=True))
        return [[tokens[name] for name in row] for row in named]

    def old_logprobs(self, turns: Sequence[Turn], width: int) -> torch.Tensor:
        """The rollout-time log-probabilities, padded to ``width`` action units."""
        return self.padded([turn.logprobs for turn in turns], width)

    def padded(self, rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
        """Per-turn lists of per-unit numbers as a zero-padded [N, width] tensor."""
        return padded(rows, width, 0.0, dtype=torch.float32).to(self.policy.device)

    @torch.no_grad()
    def reference_logprobs(self, turns: Sequence[Turn]) -> torch.Tensor:
        """Log-probabilities of the chosen actions under the reference policy (the
        adapter switched off, or the frozen copy of a fully fine-tuned model). A loop
        that never froze it (:meth:`Algorithm.freeze_reference
        <llamagym.algorithms.algorithm.Algorithm.freeze_reference>`) has it frozen here,
        at the weights its first update starts from."""
        self.policy.freeze_reference()
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            return self.policy.evaluate_choices(
                prompts,
                [turn.candidates for turn in turns],
                chosen_actions(turns),
                temperature=self.sampling_temperature(turns),
                reference=True,
            ).logprobs
        replies = [turn.action_tokens for turn in turns]
        return self.policy.evaluate_replies(prompts, replies, reference=True).logprobs

    def reference_logprob_lists(self, turns: Sequence[Turn], chunk: int) -> list[list[float]]:
        """Reference log-probabilities of every turn, once per update (the reference
        never changes, so epochs reuse them), ``chunk`` turns per forward pass, those
        that share a prompt in the same pass."""
        lists: list[list[float]] = [[] for _ in turns]
        for piece in prompt_pieces(turns, range(len(turns)), chunk):
            table = self.reference_logprobs([turns[i] for i in piece]).cpu()
            for row, i in enumerate(piece):
                units = 1 if turns[i].candidates else len(turns[i].action_tokens)
                lists[i] = table[row, :units].tolist()
        return lists

    def keep_trunk(self, turns: Sequence[Turn], chunk: int) -> None:
        """Have the policy's frozen trunk (:attr:`Policy.trunk`) hold every turn of an
        update before its epochs: a pass without gradients, ``chunk`` turns at a time,
        runs the decoder where a context is new (a score-mode rollout already kept its
        prompts and candidates) and records it. The reference and every epoch then
        run only the trained layers. A trunk that filled its memory starts over here."""
        trunk = self.policy.trunk
        if trunk is None or not turns:
            return
        if trunk.full:
            trunk.clear()
        for piece in prompt_pieces(turns, range(len(turns)), chunk):
            batch = [turns[i] for i in piece]
            prompts = [turn.prompt_tokens for turn in batch]
            if batch[0].candidates:
                self.policy.keep_trunk(prompts, candidates=[turn.candidates for turn in batch])
            else:
                replies = [turn.action_tokens for turn in batch]
                self.policy.keep_trunk(prompts, replies=replies, actions=self.named_actions(batch))


def chosen_actions(turns: Sequence[Turn]) -> list[int]:
    """The index of the legal action each turn took (score mode's chosen candidate)."""
    chosen = []
    for turn in turns:
        if turn.action_index is None:
            raise ValueError(
                "a turn with no chosen action (action_index None) cannot be trained on"
            )
        chosen.append(turn.action_index)
    return chosen
