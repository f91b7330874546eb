"""Code written against LlamaGym 0.2's module layout fails with one line that names the
new place, never with a bare ModuleNotFoundError."""

from __future__ import annotations

import importlib

import pytest

from llamagym import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_names_its_new_one(old: str) -> None:
    new = MOVED_MODULES[old]
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


def test_the_names_of_llamagym_itself_did_not_move() -> None:
    import llamagym

    for name in ("Agent", "Algorithm", "AlgorithmConfig", "Episode", "Turn", "Policy",
                 "RunConfig", "load_model_and_tokenizer", "load_agent", "hookimpl"):
        assert getattr(llamagym, name) is not None


def test_the_resolvers_names_left_in_config_and_run_point_to_config_layers() -> None:
    import llamagym.config_layers as config_layers
    import llamagym.run as run

    with pytest.raises(ImportError, match="import it from llamagym.config_layers"):
        from llamagym.config import resolve_config  # noqa: F401
    with pytest.raises(AttributeError):
        importlib.import_module("llamagym.config").no_such_name  # noqa: B018
    # run.py kept the names it defined before: code importing them from there still works.
    assert run.resolve_agent_config is config_layers.resolve_agent_config
    assert run.run_layers is config_layers.run_layers
