"""Conformance checks for agents.

``llamagym check AGENT`` and :func:`llamagym.testing.assert_agent_conforms` run the
same small, named checks, in the spirit of Gymnasium's ``check_env``. Each one passes,
fails (saying what is wrong and how to fix it) or is skipped (saying why): a check
whose prerequisite failed is skipped, so one broken ``make_env`` gives one failure, not
eight.

The checks need no trained model. Prompts are rendered with the tiny model's tokenizer
and chat template; episodes are played by the scripted fake model of
:mod:`llamagym.devtools.fake_model`, so replies go through the real extraction chain and
the real invalid-action policy.

Nothing heavy is imported at module level: ``llamagym --help`` imports the CLI module
that imports this one.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import llamagym
from llamagym import moved_name as _moved_name
from llamagym.devtools.agent_checks import CHECK_NAMES, CHECKS, options_contract
from llamagym.devtools.check_context import CheckContext, CheckFailure, CheckSkipped

if TYPE_CHECKING:
    from llamagym.agent import Agent

Status = Literal["pass", "fail", "skip"]


# -- results ------------------------------------------------------------------------
@dataclass
class CheckResult:
    """One check's outcome. ``detail`` says what was verified (pass), what is wrong
    (fail) or why it did not run (skip); ``fix`` says how to put a failure right."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def lines(self) -> list[str]:
        label = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}[self.status]
        lines = [f"{label}  {self.name:<18} {self.detail}"]
        if self.fix:
            lines.append(f"      {'':<18} fix: {self.fix}")
        return lines


def format_results(results: Sequence[CheckResult]) -> str:
    """Every result as ``PASS/FAIL/SKIP name detail`` lines, then a one-line tally."""
    lines = [line for result in results for line in result.lines()]
    failed = sum(result.failed for result in results)
    passed = sum(result.status == "pass" for result in results)
    skipped = len(results) - failed - passed
    lines.append(f"{len(results)} checks: {passed} passed, {failed} failed, {skipped} skipped")
    return "\n".join(lines)


def _unexpected(error: Exception) -> CheckResult:
    """A check that crashed: the error and where in the plugin's code it came from."""
    ours = Path(llamagym.__file__).resolve().parent
    frames = traceback.extract_tb(error.__traceback__)
    outside = [f for f in frames if ours not in Path(f.filename).resolve().parents]
    where = f" at {outside[-1].filename}:{outside[-1].lineno}" if outside else ""
    return CheckResult(
        "", "fail", f"raised {type(error).__name__}: {error}{where}", "see the error above"
    )


def check_agent(
    agent_class: type[Agent],
    config: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    episodes: int = 4,
    seed: int = 0,
    skip: Sequence[str] = (),
) -> list[CheckResult]:
    """Run every conformance check on ``agent_class`` and return the results in order.

    ``config`` is laid over the agent's ``defaults`` (e.g. ``{"agent": {"games": 2}}``);
    ``name`` is the registered agent name (default: the class's ``name``); checks named
    in ``skip`` are reported as skipped.
    """
    from llamagym.config import deep_merge

    unknown = sorted(set(skip) - set(CHECK_NAMES))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(CHECK_NAMES)}")
    layers = deep_merge(dict(config or {}), {"output": {"dir": None, "quiet": True}})
    layers = deep_merge({"agent": {"name": name or agent_class.name}}, layers)
    try:
        agent = agent_class(config=layers)
    except Exception as error:
        try:  # options that cannot work say so by name, and the other checks wait
            options_contract(agent_class)
        except CheckFailure as failure:
            first = CheckResult("options", "fail", failure.problem, failure.fix)
            return [first] + [
                CheckResult(check.name, "skip", "needs options to pass")
                for check in CHECKS
                if check.name != "options"
            ]
        return [
            CheckResult(
                "construct",
                "fail",
                f"{agent_class.__name__}(config=...) raised {type(error).__name__}: {error}",
                "check the agent's defaults and its options (agent.KEY values)",
            )
        ]
    ctx = CheckContext(agent, seed=seed, episodes=episodes)
    results: list[CheckResult] = []
    outcome: dict[str, Status] = {}
    for check in CHECKS:
        blocked = [need for need in check.needs if outcome.get(need) != "pass"]
        if check.name in skip:
            result = CheckResult(check.name, "skip", "skipped on request")
        elif blocked:
            result = CheckResult(check.name, "skip", f"needs {', '.join(blocked)} to pass")
        else:
            try:
                result = CheckResult(check.name, "pass", check.run(ctx))
            except CheckFailure as failure:
                result = CheckResult(check.name, "fail", failure.problem, failure.fix)
            except CheckSkipped as skipped:
                result = CheckResult(check.name, "skip", str(skipped))
            except Exception as error:
                result = _unexpected(error)
                result.name = check.name
        outcome[check.name] = result.status
        results.append(result)
    return results


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
