"""The trainable policy: a causal LM, its tokenizer and a value head, with the batched
forward passes the rollout engine and the algorithms share.

Both action modes come out as the same shape so every algorithm has one code path:
per turn, log-probabilities of its "action units" with a mask (one unit, the chosen
candidate, in score mode; the reply tokens in generate mode), a value and an entropy.

The policy is built from parts it holds, each with one job and what that job needs:
the batched passes (passes.py: a batch laid out and run, and the frozen trunk's kept
states), the passes from each env's turn cache (turn_passes.py, holding the cache) and
generate mode's pass (generation.py). decoder.py holds what differs between models and
transformers versions.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llamagym import moved_name as _moved_name
from llamagym.models.decoder import (
    checkpointable_layers,
    decoder_and_head,
    hidden_size,
    is_peft,
    max_context,
    model_device,
)
from llamagym.models.generation import Generation, reply_prefixes, sampling_processors
from llamagym.models.legal_replies import LegalReplies, ReplyTree
from llamagym.models.pass_memory import attention_heads
from llamagym.models.passes import BatchedPasses, PassCounts
from llamagym.models.trunk import TrunkStates, first_trained_layer
from llamagym.models.turn_cache import TurnCache
from llamagym.models.turn_passes import TurnCachePasses

__all__ = ["Evaluation", "Policy", "Replies", "name_tokens"]


@dataclass
class Evaluation:
    """Per-turn quantities a loss needs; ``logprobs``/``entropy``/``mask`` are [N, T]."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor


@dataclass
class Replies:
    """Generate mode's replies to a batch of prompts, as the rollout keeps them: each
    reply's tokens, each token's log-probability under the policy (the model's plain
    softmax, before any temperature, top-k or top-p) and the value of each prompt."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    values: list[float]

    @classmethod
    def joined(cls, parts: Sequence[Replies]) -> Replies:
        """The replies of consecutive groups of prompts, as one batch's."""
        return cls(
            [tokens for part in parts for tokens in part.tokens],
            [logprobs for part in parts for logprobs in part.logprobs],
            [value for part in parts for value in part.values],
        )

    @classmethod
    def unscored(cls, tokens: Sequence[Sequence[int]]) -> Replies:
        """Replies from a sampler that computes no log-probabilities (each 0)."""
        return cls([list(t) for t in tokens], [[0.0] * len(t) for t in tokens], [0.0] * len(tokens))


def name_tokens(tokenizer: Any, eos_id: int, names: Sequence[str]) -> list[list[int]]:
    """The tokens of each action name as the model would say it (an empty name is the
    end-of-turn token, so it still gets a score)."""
    if not names:
        return []
    encoded = tokenizer(list(names), add_special_tokens=False)["input_ids"]
    return [list(tokens) or [eos_id] for tokens in encoded]


def _owners(candidates: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, int]]:
    """(row, option) of each candidate, in the order a pass lists them."""
    return [(i, j) for i, options in enumerate(candidates) for j in range(len(options))]


def _choice_pairs(candidates: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, Any]]:
    """Score mode's (prompt index, candidate) pairs, in :func:`_owners` order."""
    return [(i, option) for i, options in enumerate(candidates) for option in options]


def _named_options(actions: Sequence[Sequence[Sequence[int]]] | None) -> list[list[Any]]:
    """Each generate-mode row's action names as tokens; empty where no row names any."""
    options = [list(row) for row in actions or []]
    return options if any(options) else []


def _reply_pairs(
    replies: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]]
) -> list[tuple[int, Any]]:
    """Generate mode's pairs: each reply after its prompt, then each row's action names."""
    pairs: list[tuple[int, Any]] = [(i, reply) for i, reply in enumerate(replies)]
    return pairs + [(i, option) for i, row in enumerate(options) for option in row]


class Policy(nn.Module):
    """A causal LM and a value head on its last hidden state, as the rollout and the
    algorithms use them: :meth:`score` and :meth:`generate` act, :meth:`evaluate_choices`
    and :meth:`evaluate_replies` give what a loss needs, all through
    :meth:`_continuations` (one pass per batch). The passes are run by the parts the
    constructor builds: :attr:`passes` (:class:`~llamagym.models.passes.BatchedPasses`),
    :attr:`turn_passes` (:class:`~llamagym.models.turn_passes.TurnCachePasses`, from each
    env's turn cache) and :attr:`generation`
    (:class:`~llamagym.models.generation.Generation`)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        device: torch.device | str | None = None,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        # A TRL value-head wrapper (the original LlamaGym's model) holds the LM inside.
        model = getattr(model, "pretrained_model", model)
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.device = torch.device(device) if device is not None else model_device(model)
        self.value_head = nn.Linear(hidden_size(model), 1).to(self.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self._reference: nn.Module | None = None
        self.max_context = max_context(model, tokenizer)
        #: What the passes ran: LM-head positions and decoder token positions.
        self.counts = PassCounts()
        # The LM stays in eval mode for good (see train()); gradient checkpointing is
        # switched on per pass, on the decoder layers alone, where gradients are taken.
        self.checkpointed_layers = checkpointable_layers(model) if gradient_checkpointing else []
        # The frozen trunk: the decoder layers below the lowest trained one (with
        # ``model.lora_layers``); None when every layer trains. See models/trunk.py.
        start = first_trained_layer(decoder_and_head(model)[0])
        self.passes = BatchedPasses(
            model, self.device, self.pad_id, TrunkStates(start) if start else None,
            self.checkpointed_layers, self.counts,
        )
        self.turn_passes = TurnCachePasses(self.passes, attention_heads(model), TurnCache())
        self.generation = Generation(self.passes, self.turn_passes, tokenizer, self.eos_id)
        if self.checkpointed_layers:
            # transformers 5 renamed gradient_checkpointing_enable (the old name warns).
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                # transformers' method: torch's stubs type module attributes Tensor | Module.
                model.gradient_checkpointing_enable(  # type: ignore[operator]
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.model.eval()

    # -- what the parts hold -------------------------------------------------------------
    @property
    def trunk(self) -> TrunkStates | None:
        """What the frozen trunk computed for the token contexts seen so far in passes
        without gradients (None when every layer trains); held by :attr:`passes`."""
        return self.passes.trunk

    @trunk.setter
    def trunk(self, trunk: TrunkStates | None) -> None:
        self.passes.trunk = trunk

    @property
    def turn_cache(self) -> TurnCache | None:
        """Each rollout env's key/value cache from its last turn (models/turn_cache.py),
        read by :meth:`score` and :meth:`generate` when the engine names the rows' envs
        (``keys``); None where the model keeps no plain cache (every prompt then runs
        whole, its shared prefix once, as without keys). Held by :attr:`turn_passes`."""
        return self.turn_passes.cache

    @turn_cache.setter
    def turn_cache(self, cache: TurnCache | None) -> None:
        self.turn_passes.cache = cache

    @property
    def attention_heads(self) -> int:
        """The model's attention heads (what a pass's attention memory grows with)."""
        return self.turn_passes.attention_heads

    @property
    def head_positions(self) -> int:
        """Positions the LM head has been applied at (each a vocabulary-wide matmul)."""
        return self.counts.head_positions

    @property
    def positions_run(self) -> int:
        """Token positions the decoder has run in the policy's passes (every row and
        column of its calls, padding included)."""
        return self.counts.positions_run

    def drop_turn_cache(self, key: Hashable) -> None:
        """Forget what the turn cache keeps for ``key`` (its env's episode ended)."""
        self.turn_passes.drop(key)

    def train(self, mode: bool = True) -> Policy:
        """Only the value head follows ``mode``: the LM always runs as in eval mode.

        Rollouts score in eval mode and the update recomputes the same log-probabilities,
        so dropout anywhere in the LM would make the two differ before any step (PPO's
        ratio would not start at 1). Gradient checkpointing is not tied to train mode
        either: :meth:`_checkpointing` turns it on for the passes that take gradients.
        """
        self.training = mode
        self.value_head.train(mode)
        return self

    # -- parameters ----------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def uses_adapter(self) -> bool:
        return is_peft(self.model)

    # -- forward passes --------------------------------------------------------------
    @contextlib.contextmanager
    def _reference_context(self, reference: bool) -> Iterator[nn.Module]:
        if not reference:
            yield self.model
        elif self.uses_adapter:
            # The reference policy is the same weights with the adapter switched off:
            # no second copy of the model in memory.
            # PEFT's method: torch's stubs type module attributes Tensor | Module.
            with self.model.disable_adapter():  # type: ignore[operator]
                yield self.model
        else:
            if self._reference is None:
                raise RuntimeError("call policy.freeze_reference() before training starts")
            yield self._reference

    def freeze_reference(self) -> None:
        """Fix the KL reference policy at the current weights.

        With a LoRA adapter this costs nothing (the adapter is switched off instead);
        for full fine-tuning it keeps a frozen copy, affordable for small models only.
        """
        if self.uses_adapter or self._reference is not None:
            return
        self._reference = copy.deepcopy(self.model).eval()
        for parameter in self._reference.parameters():
            parameter.requires_grad_(False)

    @torch.no_grad()
    def keep_trunk(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]] | None = None,
        replies: Sequence[Sequence[int]] | None = None,
        actions: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """Have :attr:`trunk` hold the contexts that :meth:`evaluate_choices`
        (``candidates``) or :meth:`evaluate_replies` (``replies``, ``actions``) would
        pass through: one pass without gradients (no LM head) where any is new."""
        if self.trunk is None or self.trunk.disabled:
            return
        if candidates is not None:
            pairs = _choice_pairs(candidates)
        else:
            pairs = _reply_pairs(replies or [], _named_options(actions))
        laid = self.passes.lay_out(prompts, pairs)
        if not self.trunk.holds(laid.layout):
            self.passes.hidden(decoder_and_head(self.model)[0], laid)

    def _continuations(
        self,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        reference: bool = False,
        entropy: bool = False,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probabilities of continuation tokens, for (prompt index, tokens) pairs.

        Returns per-token logprobs [P, T], their mask [P, T], per-token entropy [P, T]
        (if asked) and the hidden state at each pair's last prompt token [P, H].

        One forward pass does it all. Each distinct prompt is one row, left-padded so
        all prompts end in the same column, and the distinct continuations of that
        prompt follow it side by side, each attending to its prompt and its own earlier
        tokens only (a block of the attention mask). Scoring A candidates costs one row,
        not A, and a prompt met in many turns (a small state space such as Blackjack's
        repeats prompts all the time; a seed group's episodes all start from one) is
        computed once, as is a continuation met after it more than once (the same reply,
        the same candidate): the pairs that repeat it share its numbers, and gradients.
        The tokens every prompt starts with (system prompt, chat template...) run once
        for the whole batch, as a cache. Where the model has a frozen trunk that holds
        the pass's contexts, only the layers above it run (``BatchedPasses.hidden``). A
        rollout pass that names each prompt's env (``keys``) runs only what the env's turn
        cache does not hold (``TurnCachePasses.hidden_from_turns``), unless the trunk
        holds it all.
        """
        turns = None
        if keys is not None and not reference and not torch.is_grad_enabled():
            turns = self.turn_passes.turns()
        # The plain layout, unless the turn caches will lay the pass out (where the
        # trunk holds every context, its top layers alone cost less).
        laid = None
        if turns is None or self.trunk is not None:
            laid = self.passes.lay_out(prompts, pairs)
            if self.trunk is not None and self.trunk.holds(laid.layout):
                turns = None
        with self._reference_context(reference) as model:
            decoder, head = decoder_and_head(model)
            if turns is not None:
                assert keys is not None
                laid, hidden = self.turn_passes.hidden_from_turns(
                    decoder, prompts, pairs, keys, turns
                )
            else:
                assert laid is not None
                hidden = self.passes.hidden(decoder, laid, reference)
            token_logprobs, mask, token_entropy = self.passes.pair_logprobs(
                head, laid, hidden, entropy
            )
        if reference:
            return token_logprobs, mask, token_entropy, None
        rows = torch.tensor(laid.pair_rows, device=self.device)
        ends = [laid.layout.end_column(k) for k in laid.pair_unique]
        state_hidden = hidden[rows, torch.tensor(ends, device=self.device)]
        return token_logprobs, mask, token_entropy, state_hidden

    def _values(self, state_hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(state_hidden.float()).squeeze(-1)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        reference: bool = False,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score each legal action string after its prompt.

        Returns ``scores`` [N, A] (mean log-likelihood per token, -inf where a prompt has
        fewer than A candidates) and ``values`` [N]. ``keys`` (the rollout's: one per
        prompt, naming its env's episode) lets each prompt start from its env's turn
        cache (:attr:`turn_cache`) and keeps the prompt there for the next turn.
        """
        tails = [sum(max(len(tokens) - 1, 0) for tokens in row) for row in candidates]
        groups = self.turn_passes.row_groups(
            prompts, tails, 0, None if reference else keys, "a score pass"
        )
        if len(groups) > 1:  # rows of unlike lengths, or too much memory: one pass each
            parts = [
                self.score([prompts[i] for i in group], [candidates[i] for i in group],
                           reference, None if keys is None else [keys[i] for i in group])
                for group in groups
            ]
            width = max(scores.shape[1] for scores, _ in parts)
            # The groups' rows back in the order of the prompts.
            order = torch.tensor([i for group in groups for i in group]).argsort()
            return (
                torch.cat([nn.functional.pad(scores, (0, width - scores.shape[1]),
                                             value=float("-inf")) for scores, _ in parts]
                          )[order.to(self.device)],
                torch.cat([values for _, values in parts])[order.to(self.device)],
            )
        token_logprobs, mask, _, state_hidden = self._continuations(
            prompts, _choice_pairs(candidates), reference, keys=keys
        )
        scores = self._option_scores(token_logprobs, mask, candidates)
        if reference:
            return scores, torch.zeros(len(prompts), device=self.device)
        first_option = torch.tensor(
            [k for k, (_, option) in enumerate(_owners(candidates)) if option == 0]
        )
        assert state_hidden is not None, "_continuations gives hidden states off reference"
        return scores, self._values(state_hidden[first_option.to(self.device)])

    def _option_scores(
        self,
        token_logprobs: torch.Tensor,
        mask: torch.Tensor,
        candidates: Sequence[Sequence[Sequence[int]]],
    ) -> torch.Tensor:
        """Each candidate's mean log-likelihood per token, from the rows of
        ``token_logprobs`` that hold the candidates in order, as [N, A] (-inf pads)."""
        owners = _owners(candidates)
        option_scores = token_logprobs.sum(-1) / mask.sum(-1)
        num_actions = max(len(options) for options in candidates)
        scores = torch.full((len(candidates), num_actions), float("-inf"), device=self.device)
        owner_rows = torch.tensor([i for i, _ in owners], device=self.device)
        owner_cols = torch.tensor([j for _, j in owners], device=self.device)
        return scores.index_put((owner_rows, owner_cols), option_scores)

    @staticmethod
    def action_log_probs(
        scores: torch.Tensor, temperature: float | torch.Tensor = 1.0
    ) -> torch.Tensor:
        """Score mode's policy over the legal actions: the log-softmax of the candidates'
        ``scores`` [N, A] (from :meth:`score`) divided by ``temperature``, a number or
        one per row ([N, 1]). A padding column (score -inf) gets -inf."""
        return (scores / temperature).log_softmax(-1)

    @staticmethod
    def policy_entropy(log_policy: torch.Tensor) -> torch.Tensor:
        """The entropy [N, 1] of each row of a policy over actions given as log-probs
        [N, A], where -inf marks a padding column."""
        return -(log_policy.exp() * log_policy.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)

    def evaluate_choices(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        chosen: Sequence[int],
        temperature: float | torch.Tensor = 1.0,
        reference: bool = False,
    ) -> Evaluation:
        """Score mode: log-probability of the chosen candidate among all of them, under
        the current policy or (``reference``) the KL reference, whose values are 0."""
        scores, values = self.score(prompts, candidates, reference=reference)
        log_policy = self.action_log_probs(scores, temperature)
        index = torch.tensor(chosen, device=self.device)[:, None]
        logprobs = log_policy.gather(-1, index)
        entropy = self.policy_entropy(log_policy)
        mask = torch.ones_like(logprobs)
        return Evaluation(logprobs, entropy, mask, values)

    def evaluate_replies(
        self,
        prompts: Sequence[Sequence[int]],
        replies: Sequence[Sequence[int]],
        reference: bool = False,
        actions: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> Evaluation:
        """Generate mode: per-token log-probabilities of each reply after its prompt.

        The entropy is the policy's over the legal actions where ``actions`` gives a
        row's action names as tokens: the spread of score mode's policy (a softmax over
        each name's mean log-likelihood) at the reply's start, the same at every token
        of the reply. A bonus on it keeps the choice between actions open without
        pushing probability to tokens that name no action (which an entropy over the
        whole vocabulary rewards). A row without names (empty, or no ``actions``) gets
        the entropy of each token's next-token distribution.
        """
        options = _named_options(actions) if not reference else []
        named = [bool(row) for row in options] or [False] * len(replies)
        logprobs, mask, entropy, state_hidden = self._continuations(
            prompts,
            _reply_pairs(replies, options),
            reference,
            entropy=not reference and not all(named),
        )
        count = len(replies)
        width = max(1, max(len(reply) for reply in replies))
        reply_logprobs, reply_mask = logprobs[:count, :width], mask[:count, :width]
        if reference:
            zeros = torch.zeros(count, device=self.device)
            return Evaluation(reply_logprobs, torch.zeros_like(reply_logprobs), reply_mask, zeros)
        assert state_hidden is not None, "_continuations gives hidden states off reference"
        spread = entropy[:count, :width] if entropy is not None else torch.zeros_like(reply_mask)
        if options:
            has_names = torch.tensor(named, device=self.device)[:, None]
            scores = self._option_scores(logprobs[count:], mask[count:], options)
            # A row without names gets a stand-in (uniform) policy, dropped below.
            log_policy = self.action_log_probs(torch.where(has_names, scores, 0.0))
            over_actions = self.policy_entropy(log_policy)
            spread = torch.where(has_names, over_actions * reply_mask, spread)
        return Evaluation(reply_logprobs, spread, reply_mask, self._values(state_hidden[:count]))

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        reply_prefix: str | Sequence[str] = "",
        should_stop: Callable[[], bool] | None = None,
        keys: Sequence[Hashable] | None = None,
        reply_trees: Sequence[ReplyTree | None] | None = None,
    ) -> Replies:
        """Sample one reply per prompt in one batched ``generate`` (left padding), with
        the log-probabilities and values the rollout keeps, from the same passes.

        Sampling draws from ``generator`` (the caller's seeded state), so a run's replies
        repeat with its seed. The model's own sampling settings (a chat model's
        temperature or top-p) do not apply: the rollout settings are the one source.
        A reply ends at the end-of-turn token, or where it closes the JSON object that
        it (or ``reply_prefix``, which the prompts already end with: one for all, or one
        per prompt) opened. Every reply ends, cut short, once ``should_stop()`` (asked
        between tokens) says so: a stop requested or a time budget used up.

        The tokens all prompts start with (system prompt, chat template) run once, as a
        cache copied to every row; each row's own tokens follow after its padding, so
        the padding sits between the shared prefix and the rest. Each step's logits
        (kept for the whole batch: rows x new tokens x vocabulary) give the replies'
        log-probabilities, and the decoder's first call, over the prompts, the state
        each value is read from, so no pass over the prompts runs twice.

        With ``keys`` (the rollout's: one per prompt, naming its env's episode), each
        row starts from its env's turn cache instead (``TurnCachePasses.turn_inputs``),
        and what the row ran, its prompt and reply, is kept there for the next turn.
        With ``reply_trees``, a row with a tree writes only what it allows
        (:class:`~llamagym.models.legal_replies.LegalReplies`).
        """
        prefixes = reply_prefixes(reply_prefix, len(prompts))
        # A reply ends where the model's context does.
        longest = max((len(prompt) for prompt in prompts), default=0)
        max_new_tokens = max(1, min(max_new_tokens, self.max_context - longest))
        groups = self.turn_passes.row_groups(
            prompts, [0] * len(prompts), max_new_tokens, keys, "a generation"
        )
        if len(groups) > 1:  # one pass would take too much memory: one per group
            def part(rows: list[int]) -> Replies:
                return self.generate(
                    [prompts[i] for i in rows], max_new_tokens, temperature, top_p, top_k,
                    greedy, generator, [prefixes[i] for i in rows], should_stop,
                    None if keys is None else [keys[i] for i in rows],
                    None if reply_trees is None else [reply_trees[i] for i in rows],
                )

            return Replies.joined([part(group) for group in groups])
        processors = [] if greedy else sampling_processors(temperature, top_p, top_k, generator)
        if reply_trees is not None and any(reply_trees):  # before sampling: what may be drawn
            processors.insert(0, LegalReplies(reply_trees))
        replies, logprobs, states = self.generation.run(
            prompts, prefixes, keys, max_new_tokens, processors, should_stop
        )
        return Replies(replies, logprobs, self._values(states).tolist())


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
