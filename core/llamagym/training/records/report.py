"""The run's record on disk (``metrics.jsonl``) and the report made from it.

``metrics.jsonl`` holds one JSON object per line, told apart by ``kind``:

* ``"update"``, one per training update, with the fields in :data:`UPDATE_FIELDS` plus
  the algorithm's own (PPO: ``policy_loss``, ``value_loss``, ``entropy``,
  ``approx_kl``, ``kl_ref``, ``clip_fraction``, ``epochs_run``, ...);
* ``"evaluation"``, one per evaluation, with the fields in :data:`EVALUATION_FIELDS`;
* ``"resume"``, where a run continued from a checkpoint (``update``, ``checkpoint``);
* ``"diagnosis"``, a finding that the run cannot learn, said once a run (``update``,
  ``finding``, ``message``: what to do; :mod:`llamagym.training.loop.learning_signal`).

:func:`write_report` turns it and ``config.yaml`` into ``report.md`` and
``learning_curve.png``; ``llamagym report DIR`` calls it for a finished run, reading the
files back through :mod:`llamagym.training.records.run_files` (a damaged record is left out with
one warning). Names and text from those files reach the Markdown escaped
(:mod:`llamagym.display`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamagym.config import RunConfig
from llamagym.display import (
    code_block,
    markdown_line,
    outcome_names,
    outcome_shares,
    table_code,
)
from llamagym.errors import RunFileError, WriteError
from llamagym.paths import append_line, write_atomically
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.resolver.layers import leaf_keys
from llamagym.training.records.run_files import (
    read_metrics,
    read_plugins_record,
    read_run_config,
    read_transcripts,
)
from llamagym.training.records.transcripts import TRANSCRIPTS, render

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
REPORT = "report.md"
CURVE = "learning_curve.png"

UPDATE_FIELDS: Mapping[str, str] = {
    "kind": '"update"',
    "update": "number of this update, from 1",
    "total_episodes": "training episodes finished so far",
    "env_steps": "environment steps taken so far",
    "seconds": "wall-clock seconds of training so far (resumed runs continue the count)",
    "temperature": "sampling temperature of this update's rollouts (rollout.final_temperature)",
    "return_mean": "mean environment return of this update's episodes",
    "return_moving_average": "mean environment return of the last 500 training episodes",
    "invalid_rate": "share of this update's turns whose reply no parser understood",
    "episode_length": "mean turns per episode in this update",
    "env_steps_per_second": "environment steps per wall-clock second during this update",
    "env_failures": "environment errors so far (each drops its episode)",
}

EVALUATION_FIELDS: Mapping[str, str] = {
    "kind": '"evaluation"',
    "update": "updates trained before this evaluation",
    "total_episodes": "training episodes before this evaluation",
    "seconds": "wall-clock seconds the evaluation took, baselines included",
    "greedy": "true: argmax actions; false: sampled as in training",
    "name": '"agent"',
    "episodes": "evaluation episodes (the baselines play the same seeds)",
    "mean": "mean environment return",
    "ci95": "half-width of the 95% confidence interval of the mean (1.96 standard errors)",
    "invalid_rate": "share of turns whose reply no parser understood",
    "outcomes": "share of the episodes with each outcome the agent names "
    "(Agent.outcome_names, in that order, e.g. win/draw/loss); {} when it names none",
    "distinct_episodes": "different episodes among those played; 1 of several: all "
    "identical, the CI means nothing",
    "baselines": "the agent's baselines on the same seeds: [{name, episodes, mean, ci95, ...}]",
}


# -- the JSONL file ---------------------------------------------------------------------
def append_record(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line in one write: a crash or a full disk loses at most that line,
    never the lines before it (:func:`llamagym.paths.append_line`)."""
    append_line(Path(path), json.dumps(record) + "\n")


def rewrite_records(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Replace the file's content in one rename."""
    write_atomically(Path(path), "".join(json.dumps(r) + "\n" for r in records))


def records_until(records: Sequence[Mapping[str, Any]], update: int) -> list[dict[str, Any]]:
    """The records of a run up to and including update ``update``: what a run resumed
    from that update's checkpoint keeps (later lines would be written again)."""
    kept = []
    for record in records:
        if record.get("update", 0) > update:
            break
        if record.get("kind") == "evaluation" and record.get("update", 0) >= update:
            break
        kept.append(dict(record))
    return kept


# -- the report -----------------------------------------------------------------------
@dataclass
class ReportFiles:
    markdown: Path
    curve: Path | None


def _updates(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("kind") == "update"]


def _last_evaluation(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    evaluations = [r for r in records if r.get("kind") == "evaluation"]
    return evaluations[-1] if evaluations else None


def config_digest(config: Mapping[str, Any]) -> str:
    """A short fingerprint of the settings (the output directory left out), so two
    reports with the same digest came from the same configuration."""
    settings = json.loads(json.dumps(config, default=str))
    settings.get("output", {}).pop("dir", None)
    canonical = json.dumps(settings, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def format_speed(steps_per_second: float, unit: str = "steps/s") -> str:
    """A rate for people: two decimals below 1, one below 10, none above (``0.42 steps/s``,
    ``5.3 steps/s``, ``543 steps/s``, ``1,234 steps/s``), so a slow model never reads 0."""
    value = float(steps_per_second)
    if abs(value) < 1:
        number = f"{value:.2f}"
    elif abs(value) < 10:
        number = f"{value:.1f}"
    else:
        number = f"{value:,.0f}"
    return f"{number} {unit}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _identical(result: Mapping[str, Any]) -> bool:
    """Every one of several episodes was the same episode (``distinct_episodes`` 1)."""
    return result.get("episodes", 0) > 1 and result.get("distinct_episodes") == 1


def _evaluation_section(evaluation: Mapping[str, Any] | None) -> list[str]:
    if evaluation is None:
        return [
            "## Final evaluation",
            "",
            "None recorded: `training.eval_episodes` was 0, or the run was stopped early. "
            "Evaluate a checkpoint with `llamagym eval AGENT --checkpoint RUN_DIR`.",
            "",
        ]
    how = "greedy" if evaluation.get("greedy", True) else "sampled"
    lines = [
        "## Final evaluation",
        "",
        f"{evaluation['episodes']:,} episodes, {how} actions; every policy plays the same "
        "seeds. 95% CI = mean ± 1.96 standard errors.",
        "",
    ]
    rows = [("**trained agent**", evaluation)] + [
        (markdown_line(b["name"]), b)
        for b in sorted(evaluation.get("baselines", []), key=lambda b: -b["mean"])
    ]
    # The outcomes the agent names (Agent.outcome_names); none, no column.
    names = outcome_names([result for _, result in rows])
    outcome_header = f" {' / '.join(map(markdown_line, names))} |" if names else ""
    lines += [
        f"| policy | mean return | 95% CI |{outcome_header} invalid replies |",
        "|---|---:|---:|" + ("---:|" if names else "") + "---:|",
    ]
    for label, result in rows:
        low, high = result["mean"] - result["ci95"], result["mean"] + result["ci95"]
        interval = (
            "n/a: identical episodes"
            if _identical(result)
            else f"±{result['ci95']:.3f} [{low:+.3f}, {high:+.3f}]"
        )
        outcomes = f" {outcome_shares(result, names)} |" if names else ""
        # Baselines choose legal actions directly: they have no replies to be invalid.
        invalid = f"{result.get('invalid_rate', 0):.1%}" if result is evaluation else "n/a"
        lines.append(f"| {label} | {result['mean']:+.3f} | {interval} |{outcomes} {invalid} |")
    if _identical(evaluation):
        lines += [
            "",
            f"The trained agent's {evaluation['episodes']:,} episodes were all the same "
            "episode, so its mean is one episode's return and has no confidence interval: "
            "the environment starts from the same state whatever the seed, and its "
            "dynamics repeat what the same actions did. Evaluate one episode, or make the "
            "environment's `reset(seed=...)` choose its start state from the seed.",
        ]
    baselines = evaluation.get("baselines", [])
    if baselines:
        best = max(baselines, key=lambda b: b["mean"])
        gap = evaluation["mean"] - best["mean"]
        overlap = abs(gap) <= evaluation["ci95"] + best["ci95"]
        verdict = (
            "within the confidence intervals: no clear difference"
            if overlap
            else ("clearly better" if gap > 0 else "clearly worse")
        )
        beaten = [b["name"] for b in baselines if evaluation["mean"] - evaluation["ci95"]
                  > b["mean"] + b["ci95"]]
        lines += [
            "",
            f"Against the best baseline, {markdown_line(best['name'])}: {gap:+.3f} "
            f"({verdict}). "
            + (
                f"Clearly above: {', '.join(map(markdown_line, beaten))}."
                if beaten
                else "No baseline is clearly beaten."
            ),
        ]
    return lines + [""]


def _training_section(updates: Sequence[Mapping[str, Any]], records: Sequence[Mapping]) -> list:
    if not updates:
        return ["## Training", "", "No update was recorded.", ""]
    last = updates[-1]
    seconds = float(last.get("seconds", 0.0))
    rate = last.get("env_steps", 0) / seconds if seconds > 0 else 0.0
    resumes = [r for r in records if r.get("kind") == "resume"]
    rows = [
        ("updates", f"{last['update']:,}"),
        ("training episodes", f"{last.get('total_episodes', 0):,.0f}"),
        ("environment steps", f"{last.get('env_steps', 0):,.0f} ({format_speed(rate)})"),
        ("training wall time", _duration(seconds)),
        (
            "return, first → last update (mean of last 500 episodes)",
            f"{updates[0].get('return_moving_average', float('nan')):+.3f} → "
            f"{last.get('return_moving_average', float('nan')):+.3f}",
        ),
        ("invalid replies, last update", f"{last.get('invalid_rate', 0):.1%}"),
    ]
    if resumes:
        rows.append(
            ("resumed at update", ", ".join(str(r.get("update")) for r in resumes))
        )
    lines = ["## Training", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return lines + [""]


HEADLINE_SETTINGS = (
    "agent.name", "algorithm.name", "model.name", "rollout.mode", "rollout.num_envs",
    "training.episodes", "training.minutes", "training.seed",
)
_NOT_SETTINGS = ("output.dir", "output.quiet", "output.overwrite")


def _default_settings(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """Dotted key -> built-in default, the algorithm's own defaults included (None when
    the algorithm is not installed here, so every setting gets listed)."""
    defaults = leaf_keys(RunConfig().model_dump(mode="json"))
    try:
        name = config.get("algorithm", {}).get("name", "ppo")
        algorithm_config = get_plugins().registry.get("algorithm", name).load().Config()
    except Exception:
        return None
    defaults.update(leaf_keys(algorithm_config.model_dump(mode="json"), "algorithm."))
    return defaults


def settings_digest(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The headline settings, then every other setting whose value is not the default."""
    values = leaf_keys(config)
    defaults = _default_settings(config)
    rows = [(key, values[key]) for key in HEADLINE_SETTINGS if key in values]
    for key, value in values.items():
        if key in HEADLINE_SETTINGS or key in _NOT_SETTINGS:
            continue
        if defaults is None or key not in defaults or defaults[key] != value:
            rows.append((key, value))
    return rows


def _config_section(config: Mapping[str, Any], run_dir: Path) -> list[str]:
    if not config:
        return ["## Configuration", "", "config.yaml not found.", ""]
    agent = config.get("agent", {})
    lines = [
        "## Configuration",
        "",
        f"Digest `{config_digest(config)}` (sha256 of every setting but the output "
        "directory). The headline settings and every one that differs from its default "
        "follow; all of them, commented, are in [config.yaml](config.yaml).",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [
        f"| {markdown_line(key)} | {table_code(json.dumps(value, default=str))} |"
        for key, value in settings_digest(config)
    ]
    command = (
        f"llamagym run {agent.get('name') or 'AGENT'} --config {run_dir / 'config.yaml'} "
        "--output NEW_DIR"
    )
    return [*lines, "", "Reproduce (in a new run directory):", "", *code_block(command), ""]


def render_markdown(
    records: Sequence[Mapping[str, Any]],
    config: Mapping[str, Any],
    run_dir: Path,
    curve: Path | None,
) -> str:
    updates = _updates(records)
    evaluation = _last_evaluation(records)
    agent = config.get("agent", {}).get("name", "agent")
    algorithm = config.get("algorithm", {}).get("name", "?")
    model = config.get("model", {}).get("name", "?")
    train_seconds = float(updates[-1].get("seconds", 0.0)) if updates else 0.0
    eval_seconds = float(evaluation.get("seconds", 0.0)) if evaluation else 0.0
    lines = [
        f"# {markdown_line(agent)}: {markdown_line(algorithm)} on {markdown_line(model)}",
        "",
        f"Run directory {table_code(run_dir)}. Wall time {_duration(train_seconds + eval_seconds)} "
        f"(training {_duration(train_seconds)}, evaluation {_duration(eval_seconds)}).",
        "",
    ]
    lines += _evaluation_section(evaluation)
    if curve is not None:
        lines += [f"![Return during training]({curve.name})", ""]
    lines += _diagnosis_section(records)
    lines += _training_section(updates, records)
    lines += _transcripts_section(run_dir)
    lines += _plugins_section(run_dir)
    lines += _config_section(config, run_dir)
    return "\n".join(lines)


def _diagnosis_section(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The findings that the run could not learn, each with what to do."""
    diagnoses = [r for r in records if r.get("kind") == "diagnosis"]
    if not diagnoses:
        return []
    lines = [
        "## Diagnosis",
        "",
        "Signs that the run could not learn, each said once, at the update that found it, "
        "with what to try:",
        "",
    ]
    lines += [
        f"- update {record.get('update')}, {markdown_line(record.get('finding', ''))}: "
        f"{markdown_line(record.get('message', ''))}"
        for record in diagnoses
    ]
    return [*lines, ""]


def _transcripts_section(run_dir: Path) -> list[str]:
    """Two whole episodes from transcripts.jsonl: the earliest kept and the last (the
    final evaluation's, when there is one)."""
    try:
        records = read_transcripts(run_dir / TRANSCRIPTS, on_damage="skip")
    except RunFileError as error:
        logger.warning("%s; the report shows no transcripts", error)
        return []
    if not records:
        return []
    chosen = [records[0]] if len(records) == 1 else [records[0], records[-1]]
    lines = ["## Transcripts", "",
             f"Two of the episodes kept in `{TRANSCRIPTS}` (`llamagym play RUN` plays more).", ""]
    for record in chosen:
        lines += [*code_block(render(record), "text"), ""]
    return lines


def _plugins_section(run_dir: Path) -> list[str]:
    """Who answered the per-step hooks (prompt, observation text, parsing, reward
    shaping): the parser chain and any installed plugin that changed the run."""
    path = run_dir / "plugins.json"
    if not path.is_file():
        return []
    try:
        plugins = read_plugins_record(path)
    except RunFileError as error:
        logger.warning("%s; the report leaves the plugins out", error)
        return []
    lines = ["## Plugins that answered per-step hooks", "",
             "| plugin | distribution | hooks |", "|---|---|---|"]
    for plugin in plugins:
        hooks = ", ".join(h.removeprefix("llamagym_") for h in plugin.get("hooks", []))
        where = f"{plugin.get('distribution') or ''} {plugin.get('version') or ''}".strip()
        cells = (plugin["name"], where, hooks)
        lines.append("| " + " | ".join(map(markdown_line, cells)) + " |")
    return [*lines, ""]


def plot_learning_curve(
    records: Sequence[Mapping[str, Any]], config: Mapping[str, Any], path: Path
) -> Path:
    """Return against training episodes and against wall-clock minutes, with the
    baselines (from the final evaluation) as horizontal lines."""
    # The object API with an explicit Agg canvas: no pyplot, so no global backend
    # switch and no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    updates = _updates(records)
    evaluation = _last_evaluation(records)
    figure = Figure(figsize=(12, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    by_episodes, by_time = figure.subplots(1, 2, sharey=True)
    episodes = [r.get("total_episodes", 0) for r in updates]
    total_seconds = updates[-1].get("seconds", 0.0) if updates else 0.0
    # Short runs read better in seconds than in fractions of a minute.
    time_unit, time_scale = ("minutes", 60.0) if total_seconds >= 180 else ("seconds", 1.0)
    wall = [r.get("seconds", 0.0) / time_scale for r in updates]
    batch = [r.get("return_mean", float("nan")) for r in updates]
    average = [r.get("return_moving_average", float("nan")) for r in updates]
    marker = "o" if len(updates) < 15 else None
    palette = ["#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    baselines = sorted((evaluation or {}).get("baselines", []), key=lambda b: -b["mean"])
    how = "greedy" if (evaluation or {}).get("greedy", True) else "sampled"
    for axes, xs, label in (
        (by_episodes, episodes, "training episodes"),
        (by_time, wall, f"wall-clock {time_unit} of training"),
    ):
        axes.plot(xs, batch, color="#1f77b4", alpha=0.3, linewidth=1, marker=marker,
                  markersize=3, label="return, each update's episodes")
        axes.plot(xs, average, color="#1f77b4", linewidth=2.2, marker=marker, markersize=4,
                  label="return, mean of last 500 episodes")
        for color, baseline in zip(palette, baselines, strict=False):
            axes.axhline(baseline["mean"], color=color, linestyle="--", linewidth=1.2,
                         label=f"baseline {baseline['name']} ({baseline['mean']:+.3f})")
        if evaluation is not None and xs:
            # Just right of the last update, so it does not hide the curve's end.
            after = xs[-1] + 0.03 * (xs[-1] - xs[0] if len(xs) > 1 else max(xs[-1], 1))
            axes.errorbar([after], [evaluation["mean"]], yerr=[evaluation["ci95"]],
                          color="black", marker="D", markersize=6, capsize=4, zorder=5,
                          label=f"final evaluation ({how}), 95% CI "
                                f"({evaluation['mean']:+.3f} ± {evaluation['ci95']:.3f})")
        axes.set_xlabel(label)
        axes.grid(alpha=0.3)
    by_episodes.set_ylabel("episode return")
    agent = config.get("agent", {}).get("name", "agent")
    algorithm = config.get("algorithm", {}).get("name", "?")
    model = config.get("model", {}).get("name", "?")
    figure.suptitle(f"{agent}: {algorithm} on {model}, return during training")
    handles, labels = by_episodes.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=min(4, len(labels) or 1),
                  fontsize="small", frameon=False)
    if not updates:
        by_episodes.text(0.5, 0.5, "no updates recorded", ha="center",
                         transform=by_episodes.transAxes)
    path = Path(path)
    picture = io.BytesIO()
    figure.savefig(picture, format="png")
    write_atomically(path, picture.getvalue())
    return path


def load_config(run_dir: Path) -> dict[str, Any]:
    """The run's ``config.yaml``; {} without one, or (with a warning) when it is damaged:
    the report goes on without the settings."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    try:
        return read_run_config(path)
    except RunFileError as error:
        logger.warning("%s; the report leaves the settings out", error)
        return {}


def write_report(
    run_dir: Path,
    records: Sequence[Mapping[str, Any]] | None = None,
    config: Mapping[str, Any] | None = None,
) -> ReportFiles:
    """Write ``report.md`` and ``learning_curve.png`` into ``run_dir``.

    Without ``records``/``config`` they are read from the run's ``metrics.jsonl`` and
    ``config.yaml``. When the picture cannot be drawn (matplotlib missing or failing)
    the report is written without it, and :attr:`ReportFiles.curve` is None: nothing
    names a picture that was not written.
    """
    run_dir = Path(run_dir)
    if records is None:
        records = read_metrics(run_dir / METRICS, on_damage="skip")
    config = load_config(run_dir) if config is None else config
    picture = run_dir / CURVE
    curve: Path | None = picture
    try:
        plot_learning_curve(records, config, picture)
    except ImportError as error:
        logger.warning(
            "the report has no learning curve: matplotlib cannot be imported (%s); "
            "pip install matplotlib, then `llamagym report %s` draws it",
            error, run_dir,
        )
        curve = None
    except WriteError:
        raise  # the directory cannot take the report either
    except Exception as error:  # a failed picture must not cost the report
        logger.warning(
            "the report has no learning curve: drawing it failed: %s: %s",
            type(error).__name__, error,
        )
        picture.unlink(missing_ok=True)  # a half-written file is no picture
        curve = None
    markdown = run_dir / REPORT
    write_atomically(markdown, render_markdown(records, config, run_dir, curve))
    return ReportFiles(markdown, curve)
