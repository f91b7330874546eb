"""Plugins written for LlamaGym 0.3 against this release, as docs/writing-a-plugin.md
says ("Plugins written for older layouts", "From 0.3 to 0.4"). tests/data/plugins-0.3
holds an env plugin and an algorithm plugin exactly as 0.3.0's `llamagym new-plugin`
wrote them (`lake03`, the FrozenLake example; `steps03`, REINFORCE), and a third
party's env plugin written against 0.3 (`corridor03`: an env of its own and every
declaration 0.3 let an agent make). Both declare the
0.3 series, which pip refuses beside this release until the range is widened; then the
env plugin passes its own tests as it is, and the algorithm plugin, whose module moved,
stops a run in one line naming the new one, and passes once its imports are the
guide's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from llamagym import __version__
from llamagym.devtools.scaffold import TEMPLATES

ROOT = Path(__file__).resolve().parents[2]
PLUGINS_0_3 = ROOT / "tests" / "data" / "plugins-0.3"
#: Each package, and how many tests its own suite holds.
PACKAGES = {"llamagym-lake03": 7, "llamagym-steps03": 5, "llamagym-corridor03": 0}
PINNED, WIDENED = "llamagym>=0.3,<0.4", "llamagym>=0.3,<0.6"
GUIDE = ROOT / "docs" / "writing-a-plugin.md"
LLAMAGYM = [sys.executable, "-m", "llamagym.cli"]
#: What a 0.3 algorithm changes for 0.4, in the guide's order: each line of 0.3.0's
#: template (exact, whole lines) and what the guide and 0.4's template have instead.
UPGRADES = [
    ("from llamagym.training.algorithm import Algorithm, AlgorithmConfig, minibatches, "
     "rollout_metrics\n",
     "from llamagym.algorithms.algorithm import Algorithm, AlgorithmContext, rollout_metrics\n"
     "from llamagym.algorithms.algorithm_config import AlgorithmConfig\n"
     "from llamagym.algorithms.batching import minibatches\n"),
    ("    def __init__(\n"
     "        self, policy: Policy, config: Steps03Config, rollout: RolloutSettings, **run: Any\n"
     "    ):\n"
     "        # ``run``: the run's schedule, process group and stop control (llamagym.run).\n"
     "        super().__init__(policy, config, rollout, **run)\n",
     "    def __init__(self, context: AlgorithmContext):\n"
     "        super().__init__(context)\n"
     "        config = self.config\n"),
    ("            evaluation = self.evaluate([turns[i] for i in batch])\n",
     "            evaluation = self.scoring.evaluate([turns[i] for i in batch])\n"),
]
PIP = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
       "--no-build-isolation", "--no-index"]


def widened_copy(package: str, directory: Path, requirement: str = WIDENED) -> Path:
    """A copy of the 0.3 package with its `llamagym` range widened to ``requirement``, as
    the guide says (the stored package stays as 0.3.0 wrote it)."""
    root = shutil.copytree(PLUGINS_0_3 / package, directory / package)
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    assert text.count(f'"{PINNED}"') == 1, "the package is not as 0.3.0's scaffold wrote it"
    pyproject.write_text(text.replace(f'"{PINNED}"', f'"{requirement}"'), encoding="utf-8")
    assert Version(__version__) in Requirement(requirement).specifier
    return root


def llamagym_requirement(pyproject: Path) -> Requirement:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return next(Requirement(line) for line in project["dependencies"]
                if Requirement(line).name == "llamagym")


def test_the_version_is_one_and_the_env_plugins_admit_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["version"] == __version__
    env_plugins = sorted(ROOT.glob("llamagym_*/pyproject.toml"))
    assert len(env_plugins) >= 5
    refused = [str(path.relative_to(ROOT)) for path in env_plugins
               if Version(__version__) not in llamagym_requirement(path).specifier]
    assert refused == []


def test_a_method_0_4_moved_names_its_place_and_is_there() -> None:
    from llamagym.algorithms.algorithm import MOVED_METHODS, Algorithm
    from llamagym.algorithms.turn_scoring import TurnScoring

    class Old(Algorithm):  # built bare: the lookups below need no policy
        pass

    algorithm = Old.__new__(Old)
    for name, place in MOVED_METHODS.items():
        with pytest.raises(AttributeError) as raised:
            getattr(algorithm, name)
        assert str(raised.value) == f"Old.{name} is {place} since LlamaGym 0.4"
        if place.startswith("self.scoring."):
            assert callable(getattr(TurnScoring, name))
    with pytest.raises(AttributeError, match="'Old' object has no attribute 'no_such_name'"):
        algorithm.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_pip_installs_a_0_3_plugin_beside_this_release_once_its_range_is_widened(
    package: str, tmp_path: Path
) -> None:
    """pip's resolver against the llamagym installed here, with no index to fall back
    on: the range as 0.3.0 wrote it asks for another llamagym; widened, it installs the
    plugin alone."""
    pinned = shutil.copytree(PLUGINS_0_3 / package, tmp_path / "pinned")
    assert Version(__version__) not in llamagym_requirement(pinned / "pyproject.toml").specifier
    refused = subprocess.run([*PIP, "--dry-run", "--quiet", str(pinned)],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert f"No matching distribution found for llamagym<0.4,>=0.3 (from {package}" in (
        refused.stderr)

    assert f"`{WIDENED}`" in GUIDE.read_text(encoding="utf-8")  # the range the guide gives
    widened = widened_copy(package, tmp_path)
    report = tmp_path / "report.json"
    accepted = subprocess.run(
        [*PIP, "--dry-run", "--quiet", "--report", str(report), str(widened)],
        capture_output=True, text=True, timeout=300,
    )
    assert accepted.returncode == 0, accepted.stderr
    installs = json.loads(report.read_text(encoding="utf-8"))["install"]
    assert [item["metadata"]["name"] for item in installs] == [package]


def installed(root: Path, site: Path) -> dict[str, str]:
    """``root`` installed into ``site`` (a directory of its own, so nothing stays
    installed), and the environment of a process that finds it there."""
    subprocess.run([*PIP, "--quiet", "--no-deps", "--target", str(site), str(root)],
                   check=True, capture_output=True, timeout=300)
    # One torch thread per process: the machine's cores are shared.
    return {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}


def own_tests(root: Path, env: dict[str, str], passing: bool = True) -> str:
    """The package's own tests, run in a process of their own: their output, whose last
    line sums them up."""
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=root, capture_output=True, text=True, timeout=900, env=env,
    )
    assert (tests.returncode == 0) == passing, tests.stdout + tests.stderr
    return tests.stdout.strip()


@pytest.mark.slow
def test_a_0_3_env_plugin_passes_its_own_tests_unchanged(tmp_path: Path) -> None:
    root = widened_copy("llamagym-lake03", tmp_path)
    summary = own_tests(root, installed(root, tmp_path / "site")).splitlines()[-1]
    assert summary.startswith(f"{PACKAGES['llamagym-lake03']} passed"), summary


def upgraded(module: Path, step: int) -> None:
    """Make the guide's change number ``step`` (from 0) to ``module``; the guide shows the
    new lines, and `llamagym new-plugin` writes them now."""
    old, new = UPGRADES[step]
    source = module.read_text(encoding="utf-8")
    assert source.count(old) == 1, "the module is not as 0.3.0's scaffold wrote it"
    guide = GUIDE.read_text(encoding="utf-8")
    template = (TEMPLATES / "algorithm" / "src" / "__PACKAGE__" / "algorithm.py").read_text(
        encoding="utf-8")
    assert [line for line in new.splitlines()
            if line.strip() not in guide or line not in template] == []
    module.write_text(source.replace(old, new), encoding="utf-8")


def refusal(root: Path, site: Path) -> str:
    """What `llamagym run` says of the algorithm of ``root``, installed into ``site``,
    which must stop it before anything is written: its one line."""
    output = site.with_name(f"run-{site.name}")
    run = subprocess.run(
        [*LLAMAGYM, "run", "blackjack", "--algorithm", "steps03", "--episodes", "8",
         "--eval-episodes", "0", "--quiet", "--output", str(output)],
        capture_output=True, text=True, timeout=600, env=installed(root, site),
    )
    assert run.returncode == 2 and run.stdout == "" and not output.exists(), run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    return run.stderr


@pytest.mark.slow
def test_a_0_3_algorithm_plugin_is_told_each_change_and_passes_with_the_guides(
    tmp_path: Path,
) -> None:
    """As 0.3.0 wrote it, a run with the algorithm stops before anything is written, in one
    line naming the module that moved; with the guide's imports, in one line naming the
    constructor 0.4 builds algorithms with; with that constructor, its update's call of
    `self.evaluate` fails naming `self.scoring.evaluate`; with that too, the plugin passes
    its own tests."""
    root = widened_copy("llamagym-steps03", tmp_path, requirement="llamagym>=0.4,<0.6")
    module = root / "src" / "llamagym_steps03" / "algorithm.py"
    loading = ("error: algorithm 'steps03' from plugin 'steps03' (distribution "
               "llamagym-steps03) failed to load 'llamagym_steps03.algorithm:Steps03': ")
    assert refusal(root, tmp_path / "site-0") == loading + (
        "ImportError: llamagym.training.algorithm is now llamagym.algorithms.algorithm: "
        "import it from there\n")
    upgraded(module, 0)
    line = refusal(root, tmp_path / "site-1")
    assert line.startswith(loading + "TypeError: llamagym_steps03.algorithm.Steps03.__init__")
    assert "`def __init__(self, context: AlgorithmContext)`" in line
    upgraded(module, 1)
    # The update still asks for a method 0.4 moved: the error names its place.
    output = own_tests(root, installed(root, tmp_path / "site-2"), passing=False)
    assert ("AttributeError: Steps03.evaluate is self.scoring.evaluate since LlamaGym 0.4"
            in output)
    upgraded(module, 2)
    summary = own_tests(root, installed(root, tmp_path / "site-3")).splitlines()[-1]
    assert summary.startswith(f"{PACKAGES['llamagym-steps03']} passed"), summary


def test_a_0_3_plugin_with_an_env_of_its_own_passes_check_unchanged(tmp_path: Path) -> None:
    """``llamagym-corridor03`` is written against 0.3 as a third party would: an Agent
    with ``legal_actions``, baselines, ``outcome_names``, ``pretrained_defaults`` and an
    ``env_kwargs`` property, its env registered by ``llamagym_register_envs``, its spec
    imported from ``llamagym.specs`` (0.5 moved it). Widened, it passes every check; its
    author's runs with deprecations shown name the new place, and with deprecations as
    errors (as 0.6 will treat the old name) the plugin fails in one line naming it."""
    root = widened_copy("llamagym-corridor03", tmp_path)
    env = installed(root, tmp_path / "site")
    check = subprocess.run([*LLAMAGYM, "check", "corridor03"], capture_output=True, text=True,
                           timeout=300, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "9 checks: 9 passed, 0 failed, 0 skipped" in check.stdout
    assert "PASS  baselines          one episode each: random" in check.stdout
    assert check.stderr.splitlines() == [  # and check names each import to change
        "warning: llamagym_corridor03/plugin.py:6: llamagym.specs moved to "
        "llamagym.plugin_runtime.registry in LlamaGym 0.5 and the old name goes in 0.6"]
    moved = ("llamagym.specs moved to llamagym.plugin_runtime.registry in LlamaGym 0.5 and "
             "the old name goes in 0.6: import it from llamagym.plugin_runtime.registry")
    shown = subprocess.run(
        [sys.executable, "-W", "default::DeprecationWarning", *LLAMAGYM[1:], "check",
         "corridor03"], capture_output=True, text=True, timeout=300, env=env)
    assert shown.returncode == 0 and f"DeprecationWarning: {moved}" in shown.stderr
    strict = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", *LLAMAGYM[1:], "check",
         "corridor03"], capture_output=True, text=True, timeout=300, env=env)
    assert strict.returncode == 2
    assert strict.stderr.splitlines()[0] == (
        "warning: plugin 'corridor03' (distribution llamagym-corridor03 0.1.0) failed to "
        f"import: DeprecationWarning: {moved}; disable it with "
        "LLAMAGYM_DISABLE_PLUGINS=corridor03")
