"""Shared fixtures. Nothing here reaches the network; caches go to a temp directory."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

import pytest

# Each env plugin's folder has the same name as its package (llamagym_blackjack/ holds
# src/llamagym_blackjack/). Import the installed packages before pytest walks those
# folders, so a folder is never mistaken for the package it contains.
for _package in ("llamagym_blackjack", "llamagym_cartpole", "llamagym_textworld",
                 "llamagym_textarena", "llamagym_babyai", "llamagym_textworld_express",
                 "llamagym_openenv"):
    with contextlib.suppress(ImportError):  # not installed: its tests skip or fail alone
        importlib.import_module(_package)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The tiny model is faster on one thread than on two contending ones, and one thread
# keeps CPU results bit-for-bit repeatable.
import torch  # noqa: E402

torch.set_num_threads(1)

# Property tests draw the same examples on every run (derandomize), so CI never fails on
# a draw that a local run did not make. To explore other draws while working on a
# parser, load hypothesis's "default" profile instead.
from hypothesis import settings  # noqa: E402

settings.register_profile("repeatable", derandomize=True)
settings.load_profile("repeatable")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Build the tiny model once per session in a temp cache, never in the user's home."""
    if "LLAMAGYM_CACHE" not in os.environ:
        os.environ["LLAMAGYM_CACHE"] = str(tmp_path_factory.mktemp("llamagym-cache"))
    yield


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    """Every test starts from a freshly loaded plugin runtime."""
    from llamagym.plugin_runtime import manager as plugin_manager

    monkeypatch.delenv("LLAMAGYM_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("LLAMAGYM_LOAD_PLUGINS", raising=False)
    plugin_manager.reset_plugins()
    yield
    plugin_manager.reset_plugins()


@pytest.fixture(autouse=True)
def _restore_process_state():
    """A run sets logging up and pins torch threads for the whole process: give every
    test the state it would have had alone."""
    import logging

    import torch

    root, package = logging.getLogger(), logging.getLogger("llamagym")
    handlers, level, threads = list(root.handlers), package.level, torch.get_num_threads()
    yield
    root.handlers[:] = handlers
    package.setLevel(level)
    torch.set_num_threads(threads)


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run the ``llamagym`` CLI in this process: ``cli("run", "blackjack", ...)`` gives
    ``(exit code, stdout, stderr)``."""
    from llamagym.cli import main

    def run(*args) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["llamagym", *map(str, args)])
        with pytest.raises(SystemExit) as stopped:
            main()
        out, err = capsys.readouterr()
        code = stopped.value.code
        return (0 if code is None else int(code)), out, err

    return run
