"""A trained agent as a standard model directory that plain transformers (and peft)
load without LlamaGym: ``llamagym export RUN --to DIR [--merge]``.

The directory holds

* the weights: a LoRA run's adapter in PEFT's format (``adapter_config.json`` +
  ``adapter_model.safetensors``), or with ``merge`` the adapter merged into the base
  model; a fully fine-tuned model as a whole (``config.json`` + ``model.safetensors``);
* the tokenizer, with its chat template;
* ``generation_config.json`` with the run's sampling settings;
* ``value_head.safetensors``, the policy's value head (PPO's critic), beside the model;
* ``llamagym.json``: the agent and the run's config, so ``llamagym.load_agent(DIR)``
  acts exactly as the checkpoint did;
* ``README.md``, a model card: what was trained on which environment, with which
  algorithm, for how long, and its final evaluation beside the baselines.

The export is written into a hidden sibling directory and moved into place file by file
when complete, so a failed export (a full disk) leaves the target as it was. With
``overwrite`` the files it writes replace their namesakes, and the model files of the
other kind (:data:`ADAPTER_FILES` or :data:`MODEL_FILES`) that it did not write are
deleted, so the directory holds one export; no other file is touched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
from transformers import GenerationConfig

from llamagym.display import markdown_line, outcome_names, outcome_shares
from llamagym.errors import LlamaGymError, WriteError
from llamagym.models.registry import get_model_entry
from llamagym.paths import write_failure, write_failure_text
from llamagym.training.records.run_files import ExportMeta, check, read_json_file

if TYPE_CHECKING:
    from llamagym.models.policy import Policy
    from llamagym.task import Task

logger = logging.getLogger(__name__)

#: The file that marks an exported directory and carries the agent and its config.
EXPORT_META = "llamagym.json"
#: Where a run that keeps no checkpoints of LlamaGym's own (the TRL backend) exports its
#: trained model; `load_agent(RUN)` loads it from there.
RUN_EXPORT = "model"
EXPORT_FORMAT = 1
VALUE_HEAD = "value_head.safetensors"
#: What an adapter export's model is, and what a whole (or merged) model is, in the file
#: names PEFT and transformers write (glob patterns): an export of one kind removes the
#: other's from the directory it overwrites.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "pytorch_model-*-of-*.bin",
)


def check_export_target(directory: Path, overwrite: bool) -> None:
    """Refuse, in one line, a ``--to`` that cannot receive an export: a file, a path
    under a file, a symbolic link to nothing or to itself, or (without ``overwrite``)
    a directory that holds something."""
    directory = Path(directory)
    shown = repr(str(directory))
    try:
        directory.stat()
    except FileNotFoundError:
        if directory.is_symlink():
            raise LlamaGymError(
                f"--to {shown} is a symbolic link to {os.readlink(directory)!r}, which does not "
                "exist; remove the link or choose another --to"
            ) from None
        _check_parents(directory)
        return
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise LlamaGymError(
                f"--to {shown} is a symbolic link that leads back to itself; remove the link "
                "or choose another --to"
            ) from None
        if error.errno == errno.ENOTDIR:
            _check_parents(directory)
        raise LlamaGymError(
            f"--to {shown} cannot be used ({error.strerror or error}); choose another --to"
        ) from None
    if not directory.is_dir():
        raise LlamaGymError(
            f"--to {shown} is a file, not a directory; choose a directory to export into"
        )
    if any(directory.iterdir()) and not overwrite:
        raise LlamaGymError(
            f"{str(directory)!r} is not empty; export into a new directory (or pass "
            "--overwrite to replace what is there)"
        )


def _check_parents(directory: Path) -> None:
    for parent in directory.parents:
        if parent.is_dir():
            return
        if parent.exists() or parent.is_symlink():
            raise LlamaGymError(
                f"--to {str(directory)!r} lies under {str(parent)!r}, which is not a "
                "directory; choose another --to"
            )


def export_agent(
    agent: Task,
    policy: Policy,
    directory: Path,
    *,
    merge: bool = False,
    evaluation: Mapping[str, Any] | None = None,
    training: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    weights: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``policy``, trained on ``agent``'s task, into ``directory`` (see the module
    docstring).
    ``evaluation`` is the run's last evaluation record (with its baselines) and
    ``training`` its counters (updates, episodes, seconds), for the model card.
    ``weights``, a state dict of the policy's model gathered from the processes of a
    sharded run, is written instead of the model's own (not with ``merge``)."""
    if weights is not None and merge:
        raise ValueError("export_agent: merge with gathered weights is not supported")
    directory = Path(directory)
    check_export_target(directory, overwrite)
    target = directory.resolve()  # a link to a directory: the export goes beside its files
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
    except OSError as error:
        raise LlamaGymError(
            f"cannot export into {str(directory)!r}: {error.strerror or error} "
            f"({str(error.filename or target.parent)!r}); choose another --to"
        ) from None
    try:
        kind = _write_export(agent, policy, staging, merge, evaluation, training, weights)
        _move_into(staging, target)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        failure = _write_failure(error, directory)
        if failure is None:
            raise
        raise failure from error
    logger.info("exported %s (%s weights) to %s", agent.config.agent.name, kind, directory)
    return directory


def _write_failure(error: BaseException, directory: Path) -> LlamaGymError | None:
    """One line for an export that could not be written (a full disk, no permission)."""
    failure = write_failure(error) if isinstance(error, Exception) else None
    if failure is None:
        return None
    return WriteError(
        f"could not export into {str(directory)!r}: "
        f"{write_failure_text(failure, Path(directory).parent)}, then export again (what "
        "was there is unchanged)"
    )


def _move_into(staging: Path, target: Path) -> None:
    """Publish the finished export in ``staging`` as ``target``: one rename for a new
    directory; else each file replaces its namesake, after the model files of the other
    kind (which this export did not write) are deleted."""
    if not target.exists():
        os.rename(staging, target)
        return
    written = {path.name for path in staging.iterdir()}
    for pattern in (*ADAPTER_FILES, *MODEL_FILES):
        for stale in target.glob(pattern):
            if stale.name not in written and (stale.is_file() or stale.is_symlink()):
                stale.unlink()
    for name in sorted(written):
        os.replace(staging / name, target / name)
    with contextlib.suppress(OSError):
        staging.rmdir()


def _write_export(
    agent: Task,
    policy: Policy,
    directory: Path,
    merge: bool,
    evaluation: Mapping[str, Any] | None,
    training: Mapping[str, Any] | None,
    state_dict: Mapping[str, Any] | None = None,
) -> str:
    """Write every file of the export into the empty ``directory``; returns its kind
    (``adapter``, ``merged`` or ``full``)."""
    model: Any = policy.model  # its adapter methods are peft's, unknown to torch's types
    adapter = hasattr(model, "peft_config")
    if adapter and merge:
        model = model.merge_and_unload()
    if merge and not adapter:
        logger.warning(
            "--merge: nothing to merge, the run fine-tuned the whole model (no LoRA "
            "adapter); the export holds the whole model"
        )
    if adapter and not merge:
        base = _base_model_id(agent, policy)
        for settings in model.peft_config.values():
            settings.base_model_name_or_path = base
    with warnings.catch_warnings():
        # peft looks the base model up on the Hub to see whether its vocabulary changed;
        # offline that is two warnings about a lookup that does not matter here.
        warnings.filterwarnings("ignore", message=".*Unable to fetch remote file.*")
        warnings.filterwarnings("ignore", message=".*Could not find a config file.*")
        if state_dict is None:
            model.save_pretrained(directory)
        else:
            model.save_pretrained(directory, state_dict=dict(state_dict))
    policy.tokenizer.save_pretrained(directory)
    rollout = agent.config.rollout
    generation = GenerationConfig(
        do_sample=True,
        temperature=rollout.final_temperature or rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k or None,
        max_new_tokens=rollout.max_new_tokens,
        eos_token_id=policy.eos_id,
        pad_token_id=policy.pad_id,
    )
    generation.save_pretrained(directory)
    head = {k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()}
    safetensors.torch.save_file(head, str(directory / VALUE_HEAD))
    weights = "merged" if adapter and merge else "adapter" if adapter else "full"
    meta = {
        "format": EXPORT_FORMAT,
        "agent": agent.config.agent.name,
        "weights": weights,
        "config": agent.config.model_dump(mode="json"),
    }
    (directory / EXPORT_META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    card = model_card(agent, policy, weights, evaluation, training)
    (directory / "README.md").write_text(card, encoding="utf-8")
    return weights


def _base_model_id(agent: Task, policy: Policy) -> str:
    """What an adapter's config names as its base: the registry's Hub id for a
    registry name, else the directory the base model was loaded from."""
    name = agent.config.model.name
    entry = get_model_entry(name)
    if entry is not None and entry.hub_id:
        return entry.hub_id
    loaded_from = getattr(getattr(policy.model, "config", None), "_name_or_path", "")
    return str(loaded_from or name)


def read_export_meta(directory: Path) -> dict[str, Any] | None:
    """The ``llamagym.json`` of an exported directory, checked against its schema
    (:class:`~llamagym.training.records.run_files.ExportMeta`), or None when it is not one."""
    path = Path(directory) / EXPORT_META
    if not path.is_file():
        return None
    try:
        meta = read_json_file(path)
    except (OSError, ValueError) as error:
        raise LlamaGymError(f"{str(path)!r} is damaged: it {error}") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise LlamaGymError(
            f"{str(path)!r} is not an export this LlamaGym reads (format "
            f"{meta.get('format') if isinstance(meta, dict) else '?'!r}, expected "
            f"{EXPORT_FORMAT})"
        )
    problem = check(ExportMeta, meta)
    if problem is not None:
        raise LlamaGymError(
            f"{str(path)!r} is damaged: {problem}; export the run again (llamagym export)"
        )
    return meta


def model_card(
    agent: Task,
    policy: Policy,
    weights: str,
    evaluation: Mapping[str, Any] | None,
    training: Mapping[str, Any] | None,
) -> str:
    config = agent.config
    name = config.agent.name
    env = agent.env_id or type(agent).__name__
    base = _base_model_id(agent, policy)
    library = "peft" if weights == "adapter" else "transformers"
    lines = [
        "---",
        f"library_name: {library}",
        f"base_model: {json.dumps(base)}",  # a YAML string, whatever the name holds
        "tags: [llamagym, reinforcement-learning, " + json.dumps(name) + "]",
        "---",
        "",
        f"# {markdown_line(name)}: {markdown_line(config.algorithm.name)} on "
        f"{markdown_line(config.model.name)}",
        "",
        f"An LLM agent for `{env}` trained online with reinforcement learning by LlamaGym "
        f"(`{config.algorithm.name}`, {config.rollout.mode} mode).",
        "",
    ]
    if training:
        lines += [
            f"Training: {training.get('updates', 0):,} updates, "
            f"{training.get('episodes', 0):,} episodes, {training.get('env_steps', 0):,} "
            f"env steps, {float(training.get('seconds', 0.0)) / 60:.1f} minutes; seed "
            f"{config.training.seed}.",
            "",
        ]
    how = {"adapter": "a LoRA adapter (PEFT)", "merged": "the base model with the LoRA "
           "adapter merged in", "full": "the whole fine-tuned model"}[weights]
    lines += [f"Weights: {how}.", ""]
    if evaluation:
        lines += _evaluation_table(evaluation)
    lines += _how_it_acts(agent)
    lines += _loading(weights, config.model.name)
    lines += [
        "With LlamaGym: `llamagym.load_agent(\"THIS_DIR\")` returns the agent, ready to "
        "`act`.",
        "",
    ]
    return "\n".join(lines)


def _how_it_acts(agent: Task) -> list[str]:
    """The model card's section on the prompt and how a reply becomes an action."""
    rollout = agent.config.rollout
    return [
        "## How it acts",
        "",
        f"System prompt: {agent.get_system_prompt()!r}. Each observation is one user turn "
        "in the model's chat template.",
        "",
        (
            "Score mode: each legal action's name is scored as the assistant's reply "
            "(mean log-probability of its tokens) and the highest is taken."
            if rollout.mode == "score"
            else "Generate mode: the reply is sampled (settings in generation_config.json)"
            + (f" after the prefix {rollout.reply_prefix!r}"
               + (" ($fields filled from each observation by the agent's reply_fields)"
                  if "$" in rollout.reply_prefix else "")
               if rollout.reply_prefix else "")
            + " and parsed for an action (JSON first, then the action names)."
        ),
        "",
    ]


def _loading(weights: str, model_name: str) -> list[str]:
    """The model card's section on loading the export with peft or transformers."""
    lines = ["## Loading", "", "```python"]
    if weights == "adapter":
        lines += [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            'model = AutoPeftModelForCausalLM.from_pretrained("THIS_DIR")',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")',
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'model = AutoModelForCausalLM.from_pretrained("THIS_DIR")',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")',
        ]
    lines += ["```", ""]
    if weights == "adapter" and _registry_name(model_name):
        lines += [
            f"`base_model` is the Hub id. Offline, load the base LlamaGym used (for a "
            f"registry model, the converted copy in its model cache; `llamagym models "
            f"fetch {model_name}` prints its directory) and the adapter on it:",
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            "",
            'base = AutoModelForCausalLM.from_pretrained("BASE_DIR")',
            'model = PeftModel.from_pretrained(base, "THIS_DIR")',
            "```",
            "",
        ]
    return lines


def _registry_name(name: str) -> bool:
    return get_model_entry(name) is not None


def _evaluation_table(evaluation: Mapping[str, Any]) -> list[str]:
    how = "greedy" if evaluation.get("greedy", True) else "sampled"
    rows: Sequence[Mapping[str, Any]] = [
        {**evaluation, "name": "this model"}, *evaluation.get("baselines", [])
    ]
    # The outcomes the agent names (Agent.outcome_names); none, no column.
    names = outcome_names(rows)
    header = f" {' / '.join(map(markdown_line, names))} |" if names else ""
    lines = [
        f"## Evaluation ({evaluation.get('episodes', 0):,} episodes, {how}, baselines on "
        "the same seeds)",
        "",
        f"| policy | mean return | 95% CI |{header}",
        "|---|---|---|" + ("---|" if names else ""),
    ]
    for row in rows:
        shares = f" {outcome_shares(row, names)} |" if names else ""
        lines.append(
            f"| {markdown_line(row.get('name', '?'))} | "
            f"{float(row.get('mean', float('nan'))):+.3f} | "
            f"±{float(row.get('ci95', float('nan'))):.3f} |{shares}"
        )
    return [*lines, ""]
