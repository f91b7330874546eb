"""One rule for names that moved: a name lives in exactly one module, every import names
that module, and code written against an older layout keeps working for the release that
moved it, with a DeprecationWarning naming the new place, then fails with one line that
names the new place, never with a bare ModuleNotFoundError or a silent re-export."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from functools import cache
from pathlib import Path

import pytest

import llamagym
from llamagym import MOVED_MODULES, MOVED_NAMES, goes_in, moved_module

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"llamagym_builtins": ROOT / "plugins" / "llamagym_builtins",
            "llamagym": ROOT / "core" / "llamagym"}
#: Where code that imports LlamaGym lives: the package, its plugins, the env plugins,
#: tests, benchmarks, docs (their code blocks) and the templates of `llamagym new-plugin`.
SOURCES = ["core", "plugins", "tests", "benchmarks", "docs", *sorted(
    path.name for path in ROOT.glob("llamagym_*") if path.is_dir())]
FROM_IMPORT = re.compile(r"^\s*from\s+(llamagym\.[\w.]+)\s+import\s+(\([^)]*\)|.*)$", re.M)
CHANGELOG = ROOT / "CHANGELOG.md"
THIS_RELEASE = ".".join(llamagym.__version__.split(".")[:2])
GONE = sorted(old for release, moved in MOVED_MODULES.items() if release != THIS_RELEASE
              for old in moved)
DEPRECATED = sorted(MOVED_MODULES.get(THIS_RELEASE, {}))


@pytest.mark.parametrize("old", GONE)
def test_a_module_moved_before_this_release_fails_in_one_line_naming_its_new_one(
    old: str
) -> None:
    new, _ = moved_module(old)
    importlib.import_module(new)  # the new one exists
    if new.startswith(old + "."):  # a package took the old module's name
        package = importlib.import_module(old)
        module = importlib.import_module(new)
        public = next(n for n, value in vars(module).items()
                      if getattr(value, "__module__", None) == new and not n.startswith("_"))
        with pytest.raises(ImportError, match=f"import it from {new}"):
            getattr(package, public)
        with pytest.raises(AttributeError):
            package.no_such_name  # noqa: B018
    else:
        with pytest.raises(ImportError, match=f"{old} is now {new}"):
            importlib.import_module(old)


@pytest.mark.parametrize("old", DEPRECATED)
def test_a_module_moved_in_this_release_still_imports_with_a_warning_naming_its_new_one(
    old: str
) -> None:
    new, release = moved_module(old)
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning) as caught:
        exec(compile(f"import {old}", __file__, "exec"), {})  # the statement a plugin has
    module = sys.modules[old]
    assert module is importlib.import_module(new)  # the same module: one set of names
    assert [str(w.message) for w in caught] == [
        f"{old} moved to {new} in LlamaGym {release} and the old name goes in "
        f"{goes_in(release)}: import it from {new}"]
    assert caught[0].filename == __file__  # the warning points at the import


def test_a_moved_module_goes_in_the_next_minor_release(monkeypatch: pytest.MonkeyPatch) -> None:
    old = DEPRECATED[0]
    new, release = moved_module(old)
    sys.modules.pop(old, None)
    monkeypatch.setattr(llamagym, "__version__", f"{goes_in(release)}.0")
    with pytest.raises(ImportError) as raised:
        importlib.import_module(old)
    assert str(raised.value) == f"{old} is now {new}: import it from there"


def test_a_method_plugins_forwarded_to_its_registry_warns_and_answers_as_the_registry(
) -> None:
    from llamagym.plugin_runtime.manager import MOVED_METHODS, Plugins

    plugins = Plugins()
    answers = {"agents": (), "algorithms": (), "models": (), "model": ("tiny",),
               "get": ("agent", "blackjack")}
    assert set(MOVED_METHODS) == set(answers)
    for name, args in answers.items():
        with pytest.warns(DeprecationWarning) as caught:
            old = getattr(plugins, name)(*args)
        assert str(caught[0].message) == (f"Plugins.{name} is Plugins.registry.{name} since "
                                          "LlamaGym 0.5, and the old name goes in 0.6")
        assert caught[0].filename == __file__
        assert old == getattr(plugins.registry, name)(*args)
        assert f".{name}()`" in CHANGELOG.read_text(encoding="utf-8")
    with pytest.raises(AttributeError, match="'Plugins' object has no attribute 'agent'"):
        plugins.agent  # noqa: B018


def test_the_changelog_lists_every_move_and_the_release_it_goes_in() -> None:
    text = CHANGELOG.read_text(encoding="utf-8")
    missing = []
    for release, moved in MOVED_MODULES.items():
        section = _section(text, release)
        missing += [f"{release}: {old}" for old, new in moved.items()
                    if f"`{old}` -> `{new}`" not in section]
        if release == THIS_RELEASE:
            assert f"go in {goes_in(release)}" in section
    assert missing == []


def _section(text: str, release: str) -> str:
    """The sections of every patch release of ``release`` (0.5: ``## 0.5.1``, ``## 0.5.0``)."""
    parts = text.split("\n## ")[1:]
    found = [part for part in parts if part.split(None, 1)[0].startswith(release + ".")]
    assert found, f"no section for {release} in CHANGELOG.md"
    return "\n".join(found)


MOVED = sorted((old, name, new) for old, homes in MOVED_NAMES.items()
               for new, names in homes.items() for name in names)


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_a_moved_name_imported_from_its_old_module_names_the_one_that_defines_it(
    old: str, name: str, new: str
) -> None:
    assert name in defined_in(new)  # the new module defines it, not re-exports it
    assert name not in defined_in(old)
    with pytest.raises(ImportError) as raised:
        exec(f"from {old} import {name}", {})  # the statement a plugin would have
    assert str(raised.value) == f"{name} is not in {old}; import it from {new}"
    with pytest.raises(AttributeError):
        importlib.import_module(old).no_such_name  # noqa: B018


#: 0.3.0's modules of training/ that 0.4 put in rooms (training/loop, checkpoint, records)
#: or on floors of their own (llamagym.distributed, llamagym.trl_backend), written out
#: here rather than read from MOVED_MODULES, so a dropped entry fails.
TRAINING_0_3 = {
    "trainer": "llamagym.training.loop.trainer", "budget": "llamagym.training.loop.budget",
    "progress": "llamagym.training.loop.progress",
    "final_evaluation": "llamagym.training.loop.final_evaluation",
    "run_start": "llamagym.training.loop.run_start",
    "run_state": "llamagym.training.loop.run_state",
    "run_directory": "llamagym.training.loop.run_directory",
    "update_metrics": "llamagym.training.loop.update_metrics",
    "checkpoint_errors": "llamagym.training.checkpoint.errors",
    "checkpoint_state": "llamagym.training.checkpoint.state",
    "checkpoint_tensors": "llamagym.training.checkpoint.tensors",
    "checkpoint_trust": "llamagym.training.checkpoint.trust",
    "report": "llamagym.training.records.report",
    "transcripts": "llamagym.training.records.transcripts",
    "run_files": "llamagym.training.records.run_files",
    "run_lock": "llamagym.training.records.run_lock",
    "export": "llamagym.training.records.export",
    "distributed": "llamagym.distributed", "trl_backend": "llamagym.trl_backend.trainer",
    "trl_rollout": "llamagym.trl_backend.rollout",
    "trl_settings": "llamagym.trl_backend.settings",
    "sharded": "llamagym.trl_backend.sharded",
}


@pytest.mark.parametrize(("old", "new"), sorted(TRAINING_0_3.items()))
def test_a_0_3_training_module_fails_in_one_line_naming_its_room(old: str, new: str) -> None:
    with pytest.raises(ImportError) as raised:
        importlib.import_module(f"llamagym.training.{old}")
    assert str(raised.value) == f"llamagym.training.{old} is now {new}: import it from there"
    importlib.import_module(new)


def test_a_name_of_0_3_s_checkpoint_module_names_the_module_of_the_room_that_has_it() -> None:
    """``llamagym.training.checkpoint`` is the checkpoints' room now, a package: what the
    0.3 module offered is in one of its modules, and asking the package says which."""
    for name, new in (("save_training_checkpoint", "store"), ("find_checkpoint", "store"),
                      ("CheckpointMismatchError", "errors"), ("check_model_source", "trust")):
        with pytest.raises(ImportError) as raised:
            exec(f"from llamagym.training.checkpoint import {name}", {})
        assert str(raised.value) == (f"{name} is not in llamagym.training.checkpoint; "
                                     f"import it from llamagym.training.checkpoint.{new}")


def test_the_names_of_llamagym_itself_did_not_move() -> None:
    import llamagym

    for name in ("Agent", "Algorithm", "AlgorithmConfig", "Episode", "Turn", "Policy",
                 "RunConfig", "load_model_and_tokenizer", "load_agent", "hookimpl"):
        assert getattr(llamagym, name) is not None


def test_no_module_offers_a_name_it_imports() -> None:
    """``__all__`` lists what the module defines; ``import x as x`` re-exports nothing."""
    offered = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if "templates" in path.parts or path == PACKAGES["llamagym"] / "__init__.py":
                continue  # `from llamagym import Agent`, the package's front door, stays
            module = _module_name(package, folder, path)
            imported = _bindings(module)[1]
            listed = _all_of(path)
            offered += [f"{module}.{name}" for name in listed if name in imported]
            offered += [f"{module}.{name} (as itself)" for name in _self_aliases(path)]
    assert offered == []


def test_every_import_of_a_llamagym_name_names_the_module_that_defines_it() -> None:
    files = [*ROOT.glob("*.md"), *(path for top in SOURCES for path in (ROOT / top).rglob("*"))]
    elsewhere = []
    for path in sorted(files):
        if path.suffix not in (".py", ".md") or any(
            part.startswith(".") or part == "build" for part in path.relative_to(ROOT).parts
        ):
            continue
        text = path.read_text(encoding="utf-8")
        for match in FROM_IMPORT.finditer(text):
            module = match.group(1)
            if _source(module) is None:
                continue  # an example's own package (docs)
            body = re.sub(r"#[^\n]*", "", match.group(2)).strip("() \n")
            for name in (part.split()[0] for part in body.split(",") if part.strip()):
                if name not in defined_in(module) and not _is_submodule(module, name):
                    line = text.count("\n", 0, match.start()) + 1
                    elsewhere.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name}")
    assert elsewhere == []


def defined_in(module: str) -> set[str]:
    """The names ``module`` defines (def, class, assignment, declaration), or imports
    as a whole module (``import tomllib``): never a name taken from another module."""
    return _bindings(module)[0]


def _is_submodule(package: str, name: str) -> bool:
    return _source(f"{package}.{name}") is not None and name not in _bindings(package)[1]


@cache
def _bindings(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(names defined, names taken with ``from ... import``) at the top of ``module``."""
    source = _source(module)
    assert source is not None, module
    defined: set[str] = set()
    imported: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(n.id for t in targets for n in ast.walk(t)
                               if isinstance(n, ast.Name))
            elif isinstance(node, ast.Import):
                defined.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module != module:
                imported.update(a.asname or a.name for a in node.names)  # not own submodules
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(source.read_text(encoding="utf-8")).body)
    return frozenset(defined), frozenset(imported)


def _source(module: str) -> Path | None:
    package = next((p for p in PACKAGES if module == p or module.startswith(p + ".")), None)
    if package is None:
        return None
    path = PACKAGES[package].joinpath(*module.split(".")[package.count(".") + 1:])
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = path.relative_to(folder).with_suffix("").parts
    return ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _all_of(path: Path) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


def _self_aliases(path: Path) -> list[str]:
    return [a.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ImportFrom) for a in node.names if a.asname == a.name]


def test_check_names_each_import_of_a_moved_module_in_the_plugins_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llamagym.devtools.moved_imports import moved_imports

    package = tmp_path / "movedpkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "agent.py").write_text(
        "import llamagym.config_layers\n"
        "from llamagym import specs, Agent\n"
        "from llamagym.models.policy import Policy\n"  # a package kept its name
        "def f():\n    from llamagym.training.trainer import Trainer\n")
    (package / "sub" / "broken.py").write_text("def (:\n")  # no import to report
    (package / "sub" / "big.py").write_text("import llamagym.specs\n" + "#" * (1 << 20))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert moved_imports("movedpkg.agent") == [
        "movedpkg/agent.py:1: llamagym.config_layers moved to llamagym.resolver.layers in "
        "LlamaGym 0.5 and the old name goes in 0.6",
        "movedpkg/agent.py:2: llamagym.specs moved to llamagym.plugin_runtime.registry in "
        "LlamaGym 0.5 and the old name goes in 0.6",
        "movedpkg/agent.py:5: llamagym.training.trainer moved to "
        "llamagym.training.loop.trainer in LlamaGym 0.4 and is gone since 0.5",
    ]
    assert moved_imports("llamagym.testing") == []  # LlamaGym's own: not read
    assert moved_imports("no_such_package_here.agent") == []
