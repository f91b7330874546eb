"""The benchmark tables of docs/results.md, made from ``benchmarks/results/*.json``.

    python -m benchmarks table                 # full results -> results/table.md (and stdout)
    python -m benchmarks table --quick         # the smoke-run results -> results/table-quick.md
    python -m benchmarks table --results-doc   # ... and into docs/results.md

Every row names the command that produced it, the machine (cores, CPU model and the
CPU flags its speed depends on) and the commit it measured, linked to the JSON file the
row comes from, with "+ changes" when the tree had uncommitted changes on top. A file
from before the header recorded the commit says so in its row: "commit not recorded",
with the date it was made and the commit that added it (``recorded_in``), which is not
the code measured. A part without a result file is left out.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_RESULTS_DIR, machine_label, result_path
from llamagym.display import markdown_line

Row = list[str]


def _paths(directory: Path, name: str, quick: bool) -> list[Path]:
    """The result files of a section: ``<name>.json`` (``<name>-quick.json``), or for a
    name ending in ``*`` every file it matches (full or quick, as asked)."""
    if not name.endswith("*"):
        path = result_path(directory, name, quick)
        return [path] if path.is_file() else []
    found = Path(directory).glob(result_path(Path(), name, quick).name)
    return [path for path in found if path.stem.endswith("-quick") == quick]


def _load(directory: Path, name: str, quick: bool) -> list[dict[str, Any]]:
    """The results of a section; those of a ``*`` name by model (``tiny`` first), then
    by the date each was made. Each has its file's name as ``result_file``, and one with a
    ``.png`` of its name beside it has that as its ``plot``."""
    results = []
    for path in _paths(directory, name, quick):
        result = json.loads(path.read_text(encoding="utf-8"))
        result["result_file"] = path.name  # what its rows link to
        if path.with_suffix(".png").is_file():  # its plot, beside it by name
            result["plot"] = path.with_suffix(".png").name
        results.append(result)
    return sorted(results, key=lambda r: (r.get("model") != "tiny", str(r.get("date"))))


def _number(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "–"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _spread(summary: Mapping[str, Any] | None, digits: int = 1) -> str:
    """``median [min–max]``, or the median alone for a single run."""
    if not summary:
        return "–"
    text = _number(summary["median"], digits)
    if summary.get("n", 1) > 1:
        text += f" [{_number(summary['min'], digits)}–{_number(summary['max'], digits)}]"
    return text


#: Where docs/results.md, the tables' home, finds the result files (and their plots).
RESULTS_LINK = "../benchmarks/results/"
#: The CPU flags a Machine cell names, where the CPU has them: fp32 FMA width, bfloat16
#: dot products and matrix tiles (a result file records more: ``SPEED_FLAGS``).
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def _machine(machine: Mapping[str, Any]) -> str:
    """``2 cores, AMD EPYC (avx2, avx512f, avx512_bf16)``: cores, CPU model and which of
    :data:`SHOWN_FLAGS` it has, or that its file did not record them."""
    flags = machine.get("cpu_flags") or {}
    if all(flags.get(flag) is None for flag in SHOWN_FLAGS):
        return f"{machine_label(machine)} (CPU flags not recorded)"
    have = [flag for flag in SHOWN_FLAGS if flags.get(flag)]
    return f"{machine_label(machine)} ({', '.join(have) or 'no avx2, avx512 or amx'})"


def _tree_state(source: Mapping[str, Any]) -> str:
    """What sat on top of the commit measured: " + changes" (uncommitted changes), ""
    (none), or " (tree state unknown)" (git could not tell)."""
    return {True: " + changes", False: ""}.get(source.get("dirty"), " (tree state unknown)")


def _commit_name(source: Mapping[str, Any]) -> str:
    """``commit 40ee9cb + changes``; ``commit not recorded`` for a file from before the
    header recorded it."""
    if not source.get("commit"):
        return "commit not recorded"
    return f"commit {str(source['commit'])[:7]}{_tree_state(source)}"


def _commit_cell(source: Mapping[str, Any], result: Mapping[str, Any]) -> str:
    """The Commit cell of a row whose provenance is ``source`` (the result, or a row that
    carries its own): the commit it measured as a link to ``result``'s file; for a file
    from before the header recorded it, that it was not, with the row's date and the
    commit that added the file (``recorded_in``, not the code measured)."""
    target = f"{RESULTS_LINK}{result.get('result_file', '')}"
    commit = source.get("commit")
    if commit:
        return f"[{str(commit)[:7]}]({target}){_tree_state(source)}"
    date = str(source.get("date") or result.get("date") or "")[:10]
    measured = f"measured {date}, " if date else ""
    added = result.get("recorded_in")
    where = f"added in [{str(added)[:7]}]({target})" if added else f"[file]({target})"
    return f"commit not recorded ({measured}{where})"


def _provenance(result: Mapping[str, Any], row: Mapping[str, Any] | None = None) -> Row:
    """Command, Machine and Commit cells: of ``row`` where it carries its own (a rerun of
    some rows keeps the others' own), else of ``result``."""
    source = row if row is not None and "command" in row else result
    command = source.get("command")
    return [f"`{command}`" if command else "–", _machine(source.get("machine") or {}),
            _commit_cell(source, result)]


def _table(header: Sequence[str], rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


PROVENANCE = ("Command", "Machine", "Commit")


def throughput_section(result: Mapping[str, Any]) -> str:
    updates = {(u["side"], u["mode"], u.get("max_position_embeddings")): u
               for u in result["updates"]}
    rows = []
    for row in result["rows"]:
        positions = row.get("max_position_embeddings")
        update = updates.get((row["side"], row["mode"], positions))
        side = "LlamaGym" if row["side"] == "llamagym" else f"LlamaGym 0.1.1 ({positions} pos.)"
        update_text = "–"
        if update and update["update_seconds"]:
            turns = update["turns_per_update"]["median"] if update["turns_per_update"] else None
            update_text = f"{_spread(update['update_seconds'], 2)} ({_number(turns, 0)} turns)"
        rows.append([
            side, row["mode"], str(row["num_envs"]),
            _spread(row["env_steps_per_second"]),
            _spread(row["generated_tokens_per_second"]),
            update_text,
            _number(row["peak_rss_mb"]["median"], 0) if row["peak_rss_mb"] else "–",
            *_provenance(result),
        ])
    text = _table(("Side", "Mode", "Envs", "Env steps/s", "Tokens/s", "s / update",
                   "Peak RSS (MB)", *PROVENANCE), rows)
    lines = []
    for ratio in result["ratios"]:
        steps = ratio["env_steps_per_second"]
        with_updates = ratio["env_steps_per_second_with_updates"]
        tokens = ratio["generated_tokens_per_second"]
        spread_text = ""
        if steps["low"] != steps["high"]:
            spread_text = f"range {steps['low']:.0f}–{steps['high']:.0f}×; "
        line = (f"- Ours / peer at {ratio['num_envs']} envs, {ratio['mode']} mode: "
                f"**{steps['ratio']:.0f}×** env steps/s ({spread_text}target "
                f"{result['settings']['target_ratio']:g}×, "
                f"{'met' if ratio['meets_target'] else 'missed'})")
        if with_updates:
            line += f"; {with_updates:.0f}× with updates included"
        if tokens:
            line += f"; {tokens['ratio']:.0f}× generated tokens/s"
        lines.append(line + ".")
    threads = result.get("threads")
    heading = f"### Throughput (Blackjack, tiny model, {threads} torch thread(s) per side)"
    return "\n\n".join(filter(None, [heading, text, "\n".join(lines)]))


def profile_section(result: Mapping[str, Any]) -> str:
    columns = ("model forward", "prompt rendering", "tokenisation", "extraction",
               "env.step", "env.reset")
    rows = []
    for entry in result["summary"]:
        shares = entry["categories"]
        other = sum(s["median"] for name, s in shares.items() if name not in columns)
        rows.append([
            entry.get("model_name", "tiny"), entry["mode"], str(entry["num_envs"]),
            *[f"{shares[name]['median']:.0%}" if name in shares else "–" for name in columns],
            f"{other:.0%}",
            f"{entry['forward_share_ceiling']:.0%}" if entry.get("forward_share_ceiling") else "–",
            *_provenance(result),
        ])
    heading = "### Where the rollout's time goes (share of wall time)"
    target = result["settings"]["target_forward_share"]
    note = (f"Target: model forward ≥ {target:.0%}. \"Other\" is the policy's tensor work "
            "(padding, log-softmax, gathers), sampling, and the engine's loop. \"Ceiling\" is "
            "the forward's share if the framework cost nothing: model forward against the "
            "env's own reset and step alone.")
    return "\n\n".join([heading, _table(("Model", "Mode", "Envs", "Forward", "Prompt rendering",
                                          "Tokenisation", "Extraction", "env.step",
                                          "env.reset", "Other", "Ceiling", *PROVENANCE),
                                         rows), note])


def learning_section(result: Mapping[str, Any]) -> str:
    rows = []
    for side, label in (("ours", "LlamaGym (defaults)"), ("peer", "LlamaGym 0.1.1 (defaults)")):
        block = result[side]
        runs = block["runs"]
        if not runs:
            continue
        finals = [r["final"] if side == "ours" else r["evaluation"] for r in runs]
        per_seed = ", ".join(f"{f['mean']:+.3f} ± {f['ci95']:.3f}" for f in finals)
        episodes = finals[0]["episodes"]
        if side == "ours":
            reached = block["seeds_reaching_threshold"]
            time_text = (f"{_spread(block['time_to_threshold'], 0)} s ({reached}/{len(runs)} "
                         "seeds)") if block["time_to_threshold"] else f"not reached (0/{len(runs)})"
            exact = [r.get("final_exact") for r in runs]
            if all(value is not None for value in exact):
                per_seed += " (exact: " + ", ".join(f"{v:+.3f}" for v in exact) + ")"
        else:
            time_text = "final evaluation only"
        rows.append([label, f"{result['budget_minutes']:g} min",
                     f"{block['final_mean_over_seeds']:+.3f}", per_seed, str(episodes),
                     time_text, *_provenance(result)])
    baselines = ", ".join(f"{name} {value:+.3f}" for name, value in result["baselines"].items())
    heading = "### Learning per wall-clock (Blackjack, greedy evaluation)"
    note = f"Baselines: {baselines}."
    return "\n\n".join([heading, _table(
        ("Side", "Budget", "Mean return (over seeds)", "Per seed (± 95% CI)", "Eval episodes",
         f"Time to {result['threshold']:+.2f}", *PROVENANCE), rows), note])


def scaling_section(result: Mapping[str, Any]) -> str:
    rows = []
    for row in sorted(result["models"], key=lambda r: (r["mode"], r["parameters"])):
        rows.append([
            row["size"], f"{row['parameters'] / 1e6:.2f}M", "LoRA" if row["lora"] else "full",
            row["mode"], _spread(row["env_steps_per_second"]),
            f"{_spread(row['update_seconds'], 2)} ({row['episodes_per_update']} episodes)",
            *_provenance(result),
        ])
    models = _table(("Model", "Parameters", "Training", "Mode", "Env steps/s (32 envs)",
                     "s / update", *PROVENANCE), rows)
    rows = []
    for row in sorted(result["history"], key=lambda r: r["history_turns"]):
        rows.append([
            str(row["history_turns"]), _number(row["prompt_tokens_mean"]["median"], 0),
            _spread(row["env_steps_per_second"]),
            f"{_spread(row['update_seconds'], 2)} ({_number(row['turns_per_update']['median'], 0)}"
            " turns)",
            *_provenance(result),
        ])
    history = _table(("History turns", "Prompt tokens", "Env steps/s (32 envs)", "s / update",
                      *PROVENANCE), rows)
    return "\n\n".join(["### Scaling with model size", models,
                        "### Scaling with prompt length (tiny model, score mode)", history])


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**missed**"}.get(met, "–")


def algorithms_section(result: Mapping[str, Any]) -> str:
    rows = []
    for name, row in result["summary"].items():
        per_seed = ", ".join(
            f"{run['mean']:+.3f}" for run in result["runs"] if run["setup"] == name
        )
        target = "–" if row["target"] is None else f"≥ {row['target']:+.3f}"
        rows.append([
            name, row["mode"], f"**{row['mean']:+.3f}** ± {row['ci95']:.3f}", per_seed,
            f"{row['invalid_rate']:.2%}", _number(row["episodes"], 0), target,
            _verdict(row.get("meets_target")), *_provenance(result, row),
        ])
    minutes = round(result["minutes_per_run"], 2)
    heading = (f"### Algorithms on Blackjack ({minutes:g} min of training per "
               f"run, {len(result['seeds'])} seeds, greedy evaluation on "
               f"{result['eval_episodes']:,} episodes per seed)")
    note = ("Mean over seeds with a t-based 95% CI over the seed means; always-stick scores "
            "-0.180 and basic strategy -0.046. Settings of each row: `SETUPS` in "
            "`benchmarks/algorithms.py`.")
    return "\n\n".join([heading, _table(
        ("Row", "Mode", "Mean return", "Per seed", "Invalid replies", "Episodes seen",
         "Target", "", *PROVENANCE), rows), note])


def cartpole_section(result: Mapping[str, Any]) -> str:
    summary = result["summary"]
    rows = [[
        f"seed {run['seed']}", f"{run['greedy_mean_length']:.1f} ± {run['ci95']:.1f}",
        f"{run['train_seconds'] / 60:.1f} min", f"{run['episodes']:,}",
        max((f"{p['greedy_mean_length']:.0f} at {p['seconds'] / 60:.1f} min"
             for p in run.get("greedy_curve", [])), default="–",
            key=lambda text: float(text.split()[0])),
        *_provenance(result),
    ] for run in result["runs"]]
    spread = summary["ci95_over_seeds"]
    rows.append([
        "**mean**", f"**{summary['greedy_mean_length']:.1f}**"
        + (f" ± {spread:.1f}" if spread is not None else ""), "", "", "",
        *_provenance(result),
    ])
    baselines = ", ".join(f"{k} {v:.1f}" for k, v in summary["baselines"].items())
    heading = (f"### CartPole-v1 (tiny model, greedy mean length over "
               f"{result['eval_episodes']} episodes, max 500)")
    note = (f"Target ≥ {summary['target']:.0f}: {_verdict(summary['meets_target'])}. "
            f"Baselines: {baselines}. Length against training time, greedy at every "
            "checkpoint and sampled in training: `benchmarks/results/cartpole.png`.")
    return "\n\n".join([heading, _table(
        ("Run", "Greedy length", "Training", "Episodes", "Best checkpoint", *PROVENANCE), rows),
        note])


def textworld_section(result: Mapping[str, Any]) -> str:
    summary = result["summary"]
    rows = [[
        f"seed {run['seed']}", f"{run['success']['training']:.0%}",
        f"{run['success']['unseen']:.0%}", f"{run['train_seconds'] / 60:.1f} min",
        f"{run['episodes']:,}", *_provenance(result),
    ] for run in result["runs"]]
    pools = summary["baselines"]  # {pool: {baseline: success rate}}
    baselines = ", ".join(
        f"{name} {pools['training'][name]:.0%} / {pools['unseen'][name]:.0%}"
        for name in pools["training"]
    )
    heading = (f"### TextWorld ({result['games_per_pool']} training + "
               f"{result['games_per_pool']} unseen games, {result['world_size']} rooms, quests "
               f"of {'-'.join(map(str, result['quest_length']))}; tiny model, score mode)")
    note = (f"Success = won within {result['max_episode_steps']} steps. Target ≥ "
            f"{summary['target_training_games']:.0%} on the training games: "
            f"{_verdict(summary['meets_target'])}. Baselines (training / unseen): {baselines}.")
    return "\n\n".join([heading, _table(
        ("Run", "Training games", "Unseen games", "Training", "Episodes", *PROVENANCE), rows),
        note])


def _policy(numbers: Mapping[str, Any]) -> str:
    """``40% won, +0.52`` (``+0.52`` for an env with no outcome to win), with the invalid
    moves and replies where there were any."""
    won = "" if numbers.get("won") is None else f"{numbers['won']:.0%} won, "
    text = f"{won}{numbers['mean']:+.2f}"
    for key, label in (("invalid_move", "invalid moves"), ("invalid_reply", "invalid replies")):
        if numbers.get(key):
            text += f", {numbers[key]:.0%} {label}"
    return text


def _training_cell(training: Mapping[str, Any]) -> str:
    """Episodes, updates and minutes of a training run; the run's whole time beside its
    training time where they differ by a minute or more (a warm start, the model's
    loading, its final checkpoint)."""
    updates = training["updates"]
    cell = (f"{training['episodes']:,} episodes, {updates} update{'' if updates == 1 else 's'}, "
            f"{training['train_seconds'] / 60:.1f} min")
    wall = training.get("wall_seconds")
    if wall is not None and wall - training["train_seconds"] >= 60:
        cell += f" ({wall / 60:.1f} min in all)"
    return cell


def env_plugins_section(result: Mapping[str, Any]) -> str:
    """``benchmarks/env_plugins.py``: per agent, its baselines, zero-shot and trained."""
    rows = []
    where = [_machine(result.get("machine") or {}), _commit_cell(result, result)]
    for row in result["agents"]:
        if "zero_shot" not in row:  # its evaluation failed: the row says how, and where
            rows.append([f"`{row['agent']}`", f"`{row['env_id']}`", row["failed"], *[""] * 5,
                         *where])
            continue
        baselines = row["baselines"]
        training = row.get("training")
        rows.append([
            f"`{row['agent']}`", f"`{row['env_id']}`",
            _policy(baselines["random"]) if "random" in baselines else "–",
            "; ".join(f"{name}: {_policy(numbers)}" for name, numbers in baselines.items()
                      if name != "random") or "–",
            _policy(row["zero_shot"]["agent"]),
            _policy(row["trained"]["agent"]) if "trained" in row else "–",
            "–" if training is None else training.get("failed") or _training_cell(training),
            f"`{(training or row['zero_shot'])['command']}`", *where,
        ])
    first, count = result["eval_seed"], result["eval_episodes"]
    budget = result.get("budget") or {}
    trained = (f", {budget['minutes']:g} min of training per agent" if budget.get("minutes")
               else ", an episode budget per agent" if budget.get("episodes") else "")
    heading = (f"### Env plugins: what a small model learns ({result['model']}"
               f"{', zero-shot only' if result['zero_shot_only'] else trained}, "
               f"{_commit_name(result)})")
    note = (f"Greedy evaluation, {count} episodes per policy on the same seeds "
            f"({first}-{first + count - 1}{_evaluated_on(result)}): share won, mean return, "
            "and the share of episodes "
            "a game ended for invalid moves and of replies naming no legal move, where any. "
            f"{result['threads']} torch threads, one run at a time, at niceness "
            f"{result['niceness']}. Made by "
            f"`{result['command']}`, {str(result.get('date', '–'))[:10]}.")
    curves = [_curve_line(row, result.get("plot")) for row in result["agents"]
              if row.get("curve")]
    said = [_diagnosis_line(row) for row in result["agents"]
            if "diagnoses" in (row.get("training") or {})]
    return "\n\n".join([heading, _table(
        ("Agent", "Env", "Random", "Expert", "Zero-shot", "Trained", "Training", "Command",
         "CPU", "Commit"), rows), note, *curves, *said])


def _diagnosis_line(row: Mapping[str, Any]) -> str:
    """What a row's run said of its learning signal (its ``diagnosis`` records), escaped:
    the messages quote action names from the env."""
    findings = row["training"]["diagnoses"]
    if not findings:
        return f"`{row['agent']}`, the run's dead-signal checks: none fired."
    told = "; ".join(f"update {f['update']}, {markdown_line(f['finding'])}: "
                     f"{markdown_line(f['message'])}" for f in findings)
    return f"`{row['agent']}`, what the run said of its learning signal: {told}."


def _evaluated_on(result: Mapping[str, Any]) -> str:
    """The settings the evaluations alone played with (``env_plugins.py --eval-set``)."""
    settings = result.get("eval_set") or []
    return f", with {', '.join(f'`{s}`' for s in settings)}" if settings else ""


def _curve_line(row: Mapping[str, Any], plot: str | None) -> str:
    """A row's checkpoints (``env_plugins.py --curve-every``): the share won at each."""
    points = ", ".join(
        f"update {p['update']} ({'?' if p['minutes'] is None else format(p['minutes'], '.1f')}"
        f" min) {'–' if p['won'] is None else format(p['won'], '.0%')}" for p in row["curve"])
    shown = f" ([plot]({RESULTS_LINK}{plot}))" if plot else ""
    return f"`{row['agent']}`, greedy share won at each checkpoint{shown}: {points}."


def openenv_server_section(result: Mapping[str, Any]) -> str:
    """``benchmarks/openenv_server.py``: env steps/s through ``llamagym serve`` against in
    process, the server's memory over many episodes, and the soak with its kills."""
    rates = {(r["agent"], r["sessions"], r["side"]): r["env_steps_per_second"]
             for r in result["rows"]}
    rows = []
    for agent, sessions in dict.fromkeys((r["agent"], r["sessions"]) for r in result["rows"]):
        local = rates.get((agent, sessions, "in process"))
        cells = [agent, str(sessions), _number(local, 0)]
        for side in ("server, lockstep", "server, concurrent"):
            served = rates.get((agent, sessions, side))
            share = f" ({served / local:.0%})" if served and local else ""
            cells.append(f"{_number(served, 0)}{share}")
        rows.append([*cells, *_provenance(result)])
    text = _table(("Agent", "Sessions", "In process", "Server, lockstep",
                   "Server, concurrent", *PROVENANCE), rows)
    lines = []
    memory = result.get("server_memory")
    if memory:
        lines.append(
            f"- Server RSS over {memory['episodes']:,} Blackjack episodes: "
            f"{memory['rss_mb_after_first_tenth']:.1f} MB after the first tenth, "
            f"{memory['rss_mb_at_end']:.1f} MB at the end "
            f"({memory['growth_after_first_tenth_percent']:+.1f}%), peak "
            f"{memory['peak_rss_mb']:.1f} MB.")
    soak = result.get("soak")
    if soak:
        lines.append(
            f"- Soak: a {soak['minutes']:g}-min tiny-model run of agent `openenv`, its server "
            f"killed and restarted every {soak['kill_every_seconds']:g} s "
            f"({soak['server_kills']} kills): exit code {soak['exit_code']}, "
            f"{'hung' if soak['hung'] else 'no hang'}, {soak['updates']:,} updates "
            f"{'numbered without a gap' if soak['updates_numbered_without_gap'] else 'with a gap'}"
            f", {soak['env_failures']} env failures (episodes dropped).")
    heading = "### OpenEnv server (env steps/s, random legal actions; loopback)"
    return "\n\n".join(filter(None, [heading, text, "\n".join(lines)]))


SECTIONS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "algorithms": algorithms_section,
    "cartpole": cartpole_section,
    "textworld": textworld_section,
    # One file per model and run (`env_plugins.py --output`).
    "env-plugins-*": env_plugins_section,
    "throughput": throughput_section,
    "breakdown": profile_section,
    "learning": learning_section,
    "scaling": scaling_section,
    "openenv-server": openenv_server_section,
}


def render(directory: Path, quick: bool = False) -> str:
    parts = []
    for name, section in SECTIONS.items():
        parts.extend(section(result) for result in _load(directory, name, quick))
    if not parts:
        return "(no benchmark results yet: run `python -m benchmarks all`)\n"
    title = "## Benchmarks" + (" (smoke run: --quick, not for comparison)" if quick else "")
    return "\n\n".join([title, *parts]) + "\n"


def _quick(directory: Path, quick: bool | None) -> bool:
    """``quick``, or where None the kind of result that exists, full preferred."""
    if quick is None:
        return not any(_paths(directory, name, False) for name in SECTIONS)
    return quick


def beside_results(table: str) -> str:
    """``table`` (its links made for docs/results.md) with its links to the result files
    made for a page in the results folder itself (``table.md``)."""
    return table.replace(f"]({RESULTS_LINK}", "](")


def write_table(directory: Path, quick: bool | None = None) -> Path:
    """Write ``table.md`` (full results, if any) or ``table-quick.md``; return its path."""
    directory = Path(directory)
    quick = _quick(directory, quick)
    path = directory / f"table{'-quick' if quick else ''}.md"
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(beside_results(render(directory, quick)), encoding="utf-8")
    return path


RESULTS_DOC = Path(__file__).resolve().parents[1] / "docs" / "results.md"
START, END = "<!-- benchmark tables: start -->", "<!-- benchmark tables: end -->"


def _split(document: Path) -> tuple[str, str, str]:
    """``document``'s text before, between and after its two marker lines."""
    text = document.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{document} has no {START} ... {END} block to fill")
    head, rest = text.split(START, 1)
    block, tail = rest.split(END, 1)
    return head, block, tail


def generated_block(document: Path = RESULTS_DOC) -> str:
    """The tables between ``document``'s two marker lines, without the blank lines around."""
    return _split(document)[1].strip()


def table_body(table: str) -> str:
    """``table`` without its ``## Benchmarks`` title: the part that goes between the markers."""
    return (table.split("\n", 2)[2] if table.startswith("## ") else table).strip()


def update_results_doc(table: str, document: Path = RESULTS_DOC) -> Path:
    """Put ``table`` (without its title) between ``document``'s two marker lines."""
    head, _, tail = _split(document)
    document.write_text(f"{head}{START}\n\n{table_body(table)}\n\n{END}{tail}",
                        encoding="utf-8")
    return document


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tabulate the --quick results")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_RESULTS_DIR,
                        help="where the result files are (default: benchmarks/results)")
    parser.add_argument("--results-doc", action="store_true",
                        help="also put the tables into docs/results.md, between its marker lines")


def main_from_args(args: argparse.Namespace) -> int:
    path = write_table(args.output_dir, args.quick)
    print(path.read_text(encoding="utf-8"), end="")
    if getattr(args, "results_doc", False):
        table = render(Path(args.output_dir), _quick(Path(args.output_dir), args.quick))
        print(f"updated {update_results_doc(table)}")
    return 0
