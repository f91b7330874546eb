"""Importing bitsandbytes under LlamaGym asks the Hub for no kernel (``llamagym.NoHubKernels``).

Each case runs in a fresh interpreter that records in a file each import of ``kernels``
and each ``get_kernel`` call, so what would reach the Hub is seen without a network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: A stand-in ``kernels`` package, first on the path.
STAND_IN = """
import json, os
def _note(what):
    with open(os.environ["KERNELS_LOG"], "a") as log:
        log.write(json.dumps(what) + "\\n")
_note("imported")
"""

#: The real ``kernels`` package, its get_kernel recording each call before it runs.
RECORDED = """
import json, os, kernels
_get_kernel = kernels.get_kernel
def get_kernel(repo_id, *args, **kwargs):
    with open(os.environ["KERNELS_LOG"], "a") as log:
        log.write(json.dumps({"get_kernel": repo_id}) + "\\n")
    return _get_kernel(repo_id, *args, **kwargs)
kernels.get_kernel = get_kernel
"""


def _run(
    tmp_path: Path, script: str, *, stand_in: bool
) -> tuple[subprocess.CompletedProcess, list]:
    if stand_in:
        (tmp_path / "kernels").mkdir()
        (tmp_path / "kernels" / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "kernels.jsonl"
    prelude = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
    prelude += "" if stand_in else RECORDED
    completed = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True,
        text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "KERNELS_LOG": str(log)},
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return completed, calls


def test_the_guarded_module_cannot_import_kernels_and_others_still_can(tmp_path) -> None:
    """The mechanism, on any CPU: a module under the guard's name finds ``import kernels``
    failing while it runs, and ``kernels`` is importable again afterwards."""
    (tmp_path / "probe.py").write_text(
        "try:\n    import kernels\n    REACHED = True\nexcept ImportError:\n    REACHED = False\n")
    completed, calls = _run(tmp_path, """
        import llamagym
        finder = next(f for f in sys.meta_path if isinstance(f, llamagym.NoHubKernels))
        finder.guarded = "probe"
        import probe
        import kernels
        print(probe.REACHED, kernels.__file__.startswith(sys.path[0]))
    """, stand_in=True)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["False", "True"]
    assert calls == ["imported"]  # once, after the probe; never from it


def test_peft_imports_bitsandbytes_without_asking_the_hub_for_a_kernel(tmp_path) -> None:
    """The real import chain: llamagym, then peft, which imports bitsandbytes. Where the CPU
    has avx512_bf16, bitsandbytes would call get_kernel here; it does not, and stderr
    stays quiet."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("kernels")
    completed, calls = _run(tmp_path, """
        import llamagym, peft, bitsandbytes.functional as functional
        print(bool(functional.has_avx512bf16()))
    """, stand_in=False)
    assert completed.returncode == 0, completed.stderr
    assert calls == [], calls
    assert "kernels" not in completed.stderr, completed.stderr
