"""The model a checkpoint names: a checkpoint's config never turns on
``trust_remote_code``, and a local model directory that maps classes to code of its own
is refused unless the user allows it."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from llamagym.paths import expand_user
from llamagym.training.checkpoint.errors import UntrustedModelError

# The warnings of checkpoints come from one logger, whichever module gives them.
logger = logging.getLogger("llamagym.training.checkpoint.store")

#: How a user lets a checkpoint's model run its own code, wherever a checkpoint is loaded.
TRUST_HINT = (
    "llamagym eval (or play) --trust-remote-code, llamagym run --resume ... "
    "--trust-remote-code, or load_agent(..., trust_remote_code=True)"
)


def dotted(config: dict[str, Any], key: str) -> Any:
    """The value of ``config`` at a dotted key (``model.name``); None where any part of
    the path is missing or not a mapping."""
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def untrusted_config(meta: dict[str, Any]) -> dict[str, Any]:
    """A copy of a checkpoint's config to build a run or agent from, with
    ``model.trust_remote_code`` off: only the user can turn it on, never the checkpoint."""
    config = copy.deepcopy(meta["config"])
    model = config.setdefault("model", {})
    model["trust_remote_code"] = False
    return config


def _code_map(model_name: str) -> tuple[str, str] | None:
    """The file of the local model directory ``model_name`` that maps classes to Python
    code of its own (``auto_map``) and the modules it names; ``None`` for anything else
    (the tiny model, a Hub id, a GGUF file, a directory without ``auto_map``)."""
    if not model_name or model_name.strip().lower() == "tiny":
        return None
    local = expand_user(model_name)
    if not local.is_dir():
        return None
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((local / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            targets = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            modules = sorted(
                {
                    str(target).split(".")[0]
                    for item in targets
                    for target in (item if isinstance(item, (list, tuple)) else [item])
                    if target
                }
            )
            return name, ", ".join(modules) or "?"
    return None


def check_model_source(
    meta: dict[str, Any], model_name: str, trust_remote_code: bool, directory: Path
) -> None:
    """Before the model of a checkpoint (``meta``) is loaded as ``model_name``: with
    ``trust_remote_code`` (which only the user can give) a warning that the model's own
    code will run; without it, a local model directory that maps classes to its own
    Python code (``auto_map``) is refused, since loading it would either run that code
    or quietly swap in another class. A checkpoint that recorded
    ``trust_remote_code = true`` says so in a warning."""
    if trust_remote_code:
        logger.warning(
            "trust_remote_code is on: loading model %r (checkpoint %s) will run Python code "
            "that comes with it",
            model_name,
            directory,
        )
        return
    code = _code_map(model_name)
    if code is not None:
        file, modules = code
        raise UntrustedModelError(
            f"checkpoint {str(directory)!r} names model {model_name!r}, a local directory "
            f"whose {file} maps classes to Python code of its own (auto_map: {modules}); "
            f"loading it would run that code, so it is refused (if you trust that code, "
            f"allow it: {TRUST_HINT})"
        )
    if dotted(meta.get("config", {}), "model.trust_remote_code") is True:
        logger.warning(
            "checkpoint %s records model.trust_remote_code = true; a checkpoint cannot turn "
            "it on, so model %r loads without its own code (if you trust that code, allow "
            "it: %s)",
            directory,
            model_name,
            TRUST_HINT,
        )
