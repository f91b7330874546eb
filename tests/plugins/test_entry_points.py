"""Real entry-point discovery: build the Blackjack plugin's wheel, install it into a
fresh directory, and find it from a separate process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True,
        timeout=300,
    )


def test_installed_wheel_is_found_through_its_entry_point(tmp_path) -> None:
    wheels, site, source = tmp_path / "wheels", tmp_path / "site", tmp_path / "source"
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    shutil.copytree(ROOT / "llamagym_blackjack", source, ignore=shutil.ignore_patterns("tests"))
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source))
    [wheel] = wheels.glob("llamagym_blackjack-*.whl")
    pip("install", "--no-deps", "--target", str(site), str(wheel))
    # The fresh install comes first on sys.path, so it shadows the development copy.
    env = {**os.environ, "PYTHONPATH": str(site)}
    listing = subprocess.run(
        [sys.executable, "-m", "llamagym.cli", "list"], capture_output=True, text=True, env=env
    )
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if "blackjack" in line)
    assert "llamagym-blackjack" in row
    plugins = subprocess.run(
        [sys.executable, "-m", "llamagym.cli", "plugins"], capture_output=True, text=True, env=env
    )
    info = next(p for p in json.loads(plugins.stdout) if p["name"] == "blackjack")
    assert info["distribution"] == "llamagym-blackjack"
    assert info["location"].startswith(str(site))
    assert info["hooks"] == ["llamagym_register_agents"]
