"""The checks of ``llamagym check``, one function each, in the order they run
(:data:`CHECKS`, with the checks each one needs to have passed first). Each returns what
it verified, or raises :class:`~llamagym.devtools.check_context.CheckFailure` or
:class:`~llamagym.devtools.check_context.CheckSkipped`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from llamagym.devtools.check_context import (
    MAX_TURNS_PER_EPISODE,
    ROUND_TRIP_LISTS,
    SAMPLE_EPISODES,
    SAMPLE_STEPS_PER_EPISODE,
    SCORE_MODE_REPLY_TOKENS,
    SEEDED_STEPS,
    Check,
    CheckContext,
    CheckFailure,
    CheckSkipped,
    Sample,
    action_key,
    describe,
    reset_env,
    same_value,
    step_env,
)
from llamagym.devtools.fake_model import (
    ScriptedLLM,
    TurnBudgetExceededError,
    tokenizer_context,
)
from llamagym.errors import LlamaGymError
from llamagym.task.reply_parsers import OWN, PARSERS

if TYPE_CHECKING:
    from pydantic import BaseModel


# -- the checks -----------------------------------------------------------------------
#: A key no agent option is called: ``Config`` must refuse it (a typo must not pass).
_UNKNOWN_OPTION = "llamagym_check_unknown_option"


def options_contract(agent_class: type) -> tuple[type[BaseModel], BaseModel] | None:
    """The agent's ``Config`` and its defaults, or None when it declares none. Raises
    :class:`CheckFailure` when the options cannot serve as a run's ``agent`` section:
    ``Config`` is not a pydantic model, an option has no default or no description, is
    called ``name``, unknown keys pass, or the defaults do not survive ``config.yaml``."""
    from pydantic import BaseModel, ValidationError

    from llamagym.resolver.layers import format_validation_error

    declared = getattr(agent_class, "Config", None)
    if declared is None:
        return None
    owner = f"{agent_class.__name__}.Config"
    if not (isinstance(declared, type) and issubclass(declared, BaseModel)):
        raise CheckFailure(
            f"{owner} is {describe(declared, 60)}, not a pydantic model, so it is ignored "
            "and every agent.KEY setting is refused",
            "declare the options as a pydantic model: class Config(BaseModel), one "
            "Field(DEFAULT, description=...) per option",
        )
    fields = declared.model_fields
    if "name" in fields:
        raise CheckFailure(
            "an option is called 'name', but agent.name is the agent's registered name",
            "call the option something else",
        )
    required = [f"agent.{name}" for name, info in fields.items() if info.is_required()]
    if required:
        raise CheckFailure(
            f"{', '.join(required)} has no default, so a run that does not set it cannot start",
            "give every option a default: Field(DEFAULT, description=...)",
        )
    try:
        defaults = declared.model_validate({})
    except ValidationError as error:
        problems = format_validation_error(error, prefix="agent.", model=declared)
        raise CheckFailure(
            f"the defaults of {owner} do not validate: {problems.replace(chr(10), '; ')}",
            "make each default satisfy its own constraints",
        ) from error
    try:
        declared.model_validate({_UNKNOWN_OPTION: 1})
    except ValidationError:
        pass
    else:
        raise CheckFailure(
            f"{owner} accepts unknown keys, so a misspelt --set agent.KEY=VALUE changes "
            "nothing and says nothing",
            'refuse them: model_config = ConfigDict(extra="forbid")',
        )
    undocumented = [f"agent.{name}" for name, info in fields.items() if not info.description]
    if undocumented:
        raise CheckFailure(
            f"{', '.join(undocumented)} has no description, so `llamagym config show` "
            "cannot say what it does",
            'describe each option: Field(DEFAULT, description="...")',
        )
    _round_trip(declared, defaults, "defaults")
    return declared, defaults


def _round_trip(declared: type[BaseModel], values: BaseModel, what: str) -> None:
    """``values`` come back equal from the JSON a run's ``config.yaml`` holds (a resumed
    or loaded run reads its options from there)."""
    try:
        dumped = json.loads(json.dumps(values.model_dump(mode="json")))
        again = declared.model_validate(dumped)
    except Exception as error:
        raise CheckFailure(
            f"the options' {what} do not survive config.yaml: {type(error).__name__}: {error}",
            "use option types YAML holds: numbers, strings, booleans, lists and mappings",
        ) from error
    if again != values:
        raise CheckFailure(
            f"the options' {what} read back from config.yaml differ: {describe(values)} "
            f"became {describe(again)}",
            "use option types YAML holds: numbers, strings, booleans, lists and mappings",
        )


def check_options(ctx: CheckContext) -> str:
    """The agent's ``Config`` works as a run's ``agent`` section (see
    :func:`options_contract`), and the values this check runs with read back."""
    contract = options_contract(type(ctx.agent))
    if contract is None:
        return "no options (the agent declares no Config): agent.KEY settings are refused"
    declared, _ = contract
    values = ctx.agent.options
    if values is None:  # the agent replaced the options LlamaGym validated
        raise CheckFailure(
            "self.options is None although the agent declares a Config",
            "leave self.options as Agent.__init__ sets it",
        )
    _round_trip(declared, values, "values")
    listing = ", ".join(f"{name}={getattr(values, name)!r}" for name in declared.model_fields)
    count = len(declared.model_fields)
    if len(listing) > 80:
        listing = listing[:77] + "..."
    return (
        f"{count} option{'s' * (count != 1)} with defaults and descriptions, unknown keys "
        f"refused: {listing}"
    )


def check_make_env(ctx: CheckContext) -> str:
    try:
        env = ctx.make_env()
    except Exception as error:
        raise CheckFailure(
            f"make_env() raised {type(error).__name__}: {error}",
            "set env_id to a registered Gymnasium id (register your own env with the "
            "llamagym_register_envs hook), or override make_env(); install what the "
            "message says is missing",
        ) from error
    for method in ("reset", "step", "close"):
        if not callable(getattr(env, method, None)):
            raise CheckFailure(
                f"make_env() returned {type(env).__name__}, which has no {method}()",
                "return a gymnasium.Env (e.g. gymnasium.make(...))",
            )
    env.close()
    return f"make_env() gives {type(getattr(env, 'unwrapped', env)).__name__}"


_SEED_FIX = (
    "call super().reset(seed=seed) in your env's reset and draw every random number, "
    "hidden state included, from self.np_random (not random or numpy's global "
    "generator); training and evaluation replay episodes by seed"
)


def _scripted_play(ctx: CheckContext, env: Any) -> list[tuple[Any, ...]]:
    """``reset(seed)``, then up to :data:`SEEDED_STEPS` steps of a fixed rule over the
    legal actions: what each step gave (a hidden state shows in rewards and endings
    even where the observations stay the same)."""
    agent = ctx.agent
    observation, info = reset_env(env, ctx.seed)
    trace: list[tuple[Any, ...]] = [("reset", observation)]
    for step in range(SEEDED_STEPS):
        try:
            legal = list(agent.named_actions(observation, info) or [])
        except Exception:  # the legal-actions check says what is wrong with them
            break
        if not legal:
            break
        index = (3 * step + 1) % len(legal)
        result = step_env(env, agent.env_action(index, legal))
        observation, terminated, truncated = result[0], result[2], result[3]
        trace.append((legal[index], *result[:4]))
        if terminated or truncated:
            break
    return trace


def check_seeded_reset(ctx: CheckContext) -> str:
    first, second = ctx.make_env(), ctx.make_env()
    try:
        plays = [_scripted_play(ctx, first), _scripted_play(ctx, first)]
        plays.append(_scripted_play(ctx, second))
    finally:
        first.close()
        second.close()
    observation, again, other = (play[0][1] for play in plays)
    if not (same_value(observation, again) and same_value(observation, other)):
        raise CheckFailure(
            f"reset(seed={ctx.seed}) gave different observations: {describe(observation)}, "
            f"then {describe(again)} (same env) and {describe(other)} (a new env)",
            _SEED_FIX,
        )
    for where, play in (("the same env", plays[1]), ("a new env", plays[2])):
        for step, (ours, theirs) in enumerate(zip(plays[0], play, strict=False)):
            if not same_value(ours, theirs):
                fields = ("action", "observation", "reward", "terminated", "truncated")
                differ = [n for n, a, b in zip(fields, ours, theirs, strict=False)
                          if not same_value(a, b)]
                raise CheckFailure(
                    f"reset(seed={ctx.seed}) then the same actions played differently "
                    f"({where}): at step {step} ({ours[0]!r}) the {', '.join(differ)} "
                    f"differed: {describe(ours[1:], 60)} vs {describe(theirs[1:], 60)}. "
                    "A hidden state (a secret, a deck, a map) that ignores the seed",
                    _SEED_FIX,
                )
        if len(play) != len(plays[0]):
            raise CheckFailure(
                f"reset(seed={ctx.seed}) then the same actions ended after "
                f"{len(plays[0]) - 1} steps and after {len(play) - 1} ({where})",
                _SEED_FIX,
            )
    steps = len(plays[0]) - 1
    return (
        f"reset(seed={ctx.seed}) and {steps} scripted steps repeat: "
        f"{describe(observation, 50)}"
    )


def _check_legal(ctx: CheckContext, observation: Any, info: dict) -> list[str]:
    agent = ctx.agent
    try:
        legal = agent.named_actions(observation, info)
    except Exception as error:
        raise CheckFailure(
            f"legal_actions() raised {type(error).__name__}: {error}",
            "set action_names = (...) on the agent class (one word per Discrete action, "
            "in the env's order), or override legal_actions(observation, info)",
        ) from error
    legal = list(legal) if legal is not None else []
    where = f"for observation {describe(observation, 60)}"
    if not legal:
        raise CheckFailure(
            f"legal_actions() is empty {where}",
            "every observation an episode can reach needs at least one legal action",
        )
    if not all(isinstance(name, str) and name.strip() for name in legal):
        raise CheckFailure(
            f"legal_actions() {where} holds a name that is not a non-empty string: "
            f"{describe(legal)}",
            "action names are the words the model says: non-empty strings",
        )
    keys = [action_key(name) for name in legal]
    if len(set(keys)) != len(keys):
        twins = sorted({name for name in legal if keys.count(action_key(name)) > 1})
        raise CheckFailure(
            f"legal_actions() {where} holds names the parsers cannot tell apart: {twins}",
            "parsers ignore case and extra spaces: make every name distinct without them",
        )
    return legal


def check_legal_actions(ctx: CheckContext) -> str:
    """Walks the env with random legal actions, keeping what it meets for later checks."""
    import numpy as np

    agent = ctx.agent
    rng = np.random.default_rng(ctx.seed)
    env = ctx.make_env()
    try:
        space = getattr(env, "action_space", None)
        discrete = getattr(space, "n", None) if type(space).__name__ == "Discrete" else None
        names = agent.action_names
        if names is not None and discrete is not None and len(names) != int(discrete):
            raise CheckFailure(
                f"action_names has {len(names)} names but the env's action space is "
                f"Discrete({int(discrete)})",
                "give exactly one name per action, in the order of the env's action indices",
            )
        steps = 0
        for episode in range(SAMPLE_EPISODES):
            observation, info = reset_env(env, ctx.seed + episode)
            for _ in range(SAMPLE_STEPS_PER_EPISODE):
                legal = _check_legal(ctx, observation, info)
                ctx.samples.append(Sample(observation, info, legal))
                index = int(rng.integers(len(legal)))
                action = agent.env_action(index, legal)
                if space is not None and discrete is not None and not space.contains(action):
                    raise CheckFailure(
                        f"env_action({index}, ...) gave {action!r}, which is not in the "
                        f"env's action space {space}",
                        "override env_action(index, legal_actions) to return what "
                        "env.step expects",
                    )
                try:
                    observation, _, terminated, truncated, info = step_env(env, action)
                except CheckFailure:
                    raise
                except Exception as error:
                    raise CheckFailure(
                        f"env.step({action!r}) raised {type(error).__name__}: {error} "
                        f"(legal action {legal[index]!r})",
                        "every legal action must be accepted by env.step: check "
                        "legal_actions() and env_action()",
                    ) from error
                steps += 1
                if terminated or truncated:
                    break
    finally:
        env.close()
    sizes = sorted({len(sample.legal) for sample in ctx.samples})
    counts = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return f"{steps} random steps, {counts} legal actions at each"


def check_prompts(ctx: CheckContext) -> str:
    agent, tokenizer = ctx.agent, ctx.tokenizer
    plugins = agent.plugins
    system = plugins.system_prompt(agent)
    rollout = agent.config.rollout
    reserve = rollout.max_new_tokens if rollout.mode == "generate" else SCORE_MODE_REPLY_TOKENS
    context = tokenizer_context(tokenizer)
    budget = context - reserve
    longest, longest_text = 0, ""
    for sample in ctx.samples:
        try:
            text = plugins.format_observation(agent, sample.observation, sample.info)
        except Exception as error:
            raise CheckFailure(
                f"format_observation raised {type(error).__name__}: {error} for observation "
                f"{describe(sample.observation, 60)}",
                "format_observation must handle every observation the env can return",
            ) from error
        if not text.strip():
            raise CheckFailure(
                f"format_observation gave empty text for {describe(sample.observation, 60)}",
                "return a description of the observation the model can read",
            )
        if "$" in rollout.reply_prefix:
            from llamagym.rollout.prompts import fill_reply_prefix

            try:
                fill_reply_prefix(rollout.reply_prefix, agent, sample.observation)
            except LlamaGymError as error:
                raise CheckFailure(
                    str(error), "reply_fields must give every field the reply prefix names"
                ) from error
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": text})
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        size = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        if size > longest:
            longest, longest_text = size, text
    if longest > budget:
        raise CheckFailure(
            f"the longest prompt is {longest} tokens; the tiny model's context is {context}, "
            f"{reserve} of them kept for the reply (observation: {describe(longest_text)})",
            "shorten the system prompt or format_observation's text: the engine drops "
            "old turns to fit, but never the system prompt or the current observation",
        )
    where = "no system prompt" if not system else f"system prompt {len(system)} chars"
    return f"{len(ctx.samples)} observations rendered ({where}); longest {longest}/{budget} tokens"


def _legal_lists(ctx: CheckContext) -> list[list[str]]:
    seen: dict[tuple[str, ...], list[str]] = {}
    for sample in ctx.samples:
        seen.setdefault(tuple(sample.legal), sample.legal)
    return list(seen.values())[:ROUND_TRIP_LISTS]


def _read_by(parser: str | None) -> str:
    """What read a reply, for a failure line: the task's parser or a plugin."""
    if parser is None:
        return "no parser"
    if parser == OWN:
        return "the agent's extract_action"
    return f"the {parser} parser" if parser in PARSERS else f"plugin {parser!r}"


def check_action_round_trip(ctx: CheckContext) -> str:
    agent = ctx.agent
    problems: list[str] = []
    names = 0
    for legal in _legal_lists(ctx):
        for index, name in enumerate(legal):
            names += 1
            for label, reply in (("JSON", json.dumps({"action": name})), ("bare", name)):
                found, parser = agent.read_reply(reply, legal)
                if found != index:
                    got = "nothing" if found is None else repr(legal[found])
                    problems.append(f"{label} reply {reply!r} was read as {got} by "
                                    f"{_read_by(parser)}")
    if problems:
        more = len(problems) - 3
        shown = "; ".join(problems[:3]) + (f" (and {more} more)" if more > 0 else "")
        raise CheckFailure(
            shown,
            "an extract_action must match whole words (\"up\" is not in \"pickup\") and "
            "return None for replies it does not recognise; no action name may contain "
            "another as whole words",
        )
    return f"{names} names read back from {{\"action\": name}} and from the bare name"


def check_score_candidates(ctx: CheckContext) -> str:
    tokenizer = ctx.tokenizer
    lengths: list[int] = []
    for legal in _legal_lists(ctx):
        for name in legal:
            tokens = tokenizer(name, add_special_tokens=False)["input_ids"]
            if not tokens:
                raise CheckFailure(
                    f"action {name!r} tokenizes to nothing, so score mode cannot rank it",
                    "use action names made of ordinary characters",
                )
            lengths.append(len(tokens))
    return f"every legal action is a candidate of {min(lengths)}-{max(lengths)} tokens"


def check_baselines(ctx: CheckContext) -> str:
    import numpy as np

    agent = ctx.agent
    if not agent.baselines:
        raise CheckSkipped(
            "no baselines declared (optional: baselines = {name: policy} puts the trained "
            "agent's score next to them)"
        )
    played = []
    for name, baseline in agent.baselines.items():
        rng = np.random.default_rng(ctx.seed)
        env = ctx.make_env()
        try:
            if hasattr(baseline, "reset"):
                baseline.reset()
            observation, info = reset_env(env, ctx.seed)
            total, steps, done = 0.0, 0, False
            while not done:
                if steps >= MAX_TURNS_PER_EPISODE:
                    raise CheckFailure(
                        f"baseline {name!r} played {steps} steps without the episode ending",
                        "make episodes end: register the env with max_episode_steps or "
                        "wrap it in gymnasium.wrappers.TimeLimit",
                    )
                legal = list(agent.named_actions(observation, info))
                try:
                    choice = baseline(observation, info, legal, rng)
                except Exception as error:
                    raise CheckFailure(
                        f"baseline {name!r} raised {type(error).__name__}: {error}",
                        "a baseline is called as baseline(observation, info, legal_actions, "
                        "rng) and returns one of legal_actions",
                    ) from error
                if choice not in legal:
                    raise CheckFailure(
                        f"baseline {name!r} returned {choice!r}, not one of {describe(legal)}",
                        "a baseline returns the *name* of a legal action, exactly as listed",
                    )
                action = agent.env_action(legal.index(choice), legal)
                observation, reward, terminated, truncated, info = step_env(env, action)
                total += reward
                steps += 1
                done = terminated or truncated
        finally:
            env.close()
        played.append(f"{name} {total:+g}")
    return "one episode each: " + ", ".join(played)


def _scripted_replies(ctx: CheckContext) -> list[str]:
    """Replies a model might give: JSON, a bare name, and one nothing can parse."""
    names = ctx.samples[0].legal if ctx.samples else []
    replies = ["I am not sure what to do."]  # first, so the fallback path always runs
    replies += [json.dumps({"action": name}) for name in names[:3]] + names[:2]
    return replies


def check_episodes(ctx: CheckContext) -> str:
    agent = ctx.agent
    episodes = ctx.episodes
    budget = episodes * MAX_TURNS_PER_EPISODE
    summaries = []
    modes: tuple[Literal["score", "generate"], ...] = ("score", "generate")
    for mode in modes:
        llm = ScriptedLLM(_scripted_replies(ctx), cycle=True, tokenizer=ctx.tokenizer)
        try:
            finished = llm.play(
                agent,
                episodes,
                num_envs=min(2, episodes),
                seed=ctx.seed,
                mode=mode,
                max_turns=budget,
            )
        except TurnBudgetExceededError as error:
            raise CheckFailure(
                f"{mode} mode: {episodes} episodes did not end within {budget} decisions",
                "make episodes end: register the env with max_episode_steps or wrap it "
                "in gymnasium.wrappers.TimeLimit",
            ) from error
        if len(finished) != episodes:
            raise CheckFailure(
                f"{mode} mode: {len(finished)} of {episodes} episodes finished; the env "
                "raised during the others (see the warnings above)",
                "env.reset and env.step must not raise for legal actions",
            )
        turns = [turn for episode in finished for turn in episode.turns]
        bad = [t for t in turns if t.action_index is None or t.action_index >= len(t.legal_actions)]
        if bad or not turns:
            raise CheckFailure(
                f"{mode} mode: {len(bad)} turns ended without a legal action",
                "report this as a LlamaGym bug, with the agent",
            )
        summary = f"{mode} mode {len(finished)} episodes, {len(turns)} turns"
        if mode == "generate":
            invalid = sum(not turn.valid for turn in turns)
            summary += f" ({len(turns) - invalid} replies read, {invalid} given a fallback)"
        summaries.append(summary)
    return "; ".join(summaries)


CHECKS: tuple[Check, ...] = (
    Check("options", check_options),
    Check("make-env", check_make_env),
    Check("seeded-reset", check_seeded_reset, ("make-env",)),
    Check("legal-actions", check_legal_actions, ("seeded-reset",)),
    Check("prompts", check_prompts, ("legal-actions",)),
    Check("action-round-trip", check_action_round_trip, ("legal-actions",)),
    Check("score-candidates", check_score_candidates, ("legal-actions",)),
    Check("baselines", check_baselines, ("seeded-reset",)),
    Check("episodes", check_episodes, ("legal-actions",)),
)
CHECK_NAMES: tuple[str, ...] = tuple(check.name for check in CHECKS)

