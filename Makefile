# The two commands of the README: `make demo` and `make test`. Both create .venv on
# first use and install the project with its env plugins into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is installed first, on its own, so the project's range (>=2.2,<2.15) is already
# met and pip fetches no other build. A CPU build is all the demo and tests need: where
# PyPI's default wheel is a CUDA one (Linux), pass TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PLUGINS := -e ./llamagym_blackjack -e ./llamagym_cartpole -e "./llamagym_textworld[textworld]" \
	-e ./llamagym_textarena -e ./llamagym_babyai -e ./llamagym_textworld_express -e ./llamagym_openenv
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast lint bench clean

$(STAMP): pyproject.toml llamagym_blackjack/pyproject.toml llamagym_cartpole/pyproject.toml \
		llamagym_textworld/pyproject.toml llamagym_textarena/pyproject.toml llamagym_babyai/pyproject.toml \
		llamagym_textworld_express/pyproject.toml llamagym_openenv/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev,quantize,trl]" $(PLUGINS)
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/llamagym run blackjack

# The whole suite, as CI runs it, on two workers (pytest-xdist).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

# The loop while developing: on two workers (pytest-xdist), without the tests of a minute
# or more (`slow`: benchmark smoke runs, several processes, TRL, property searches) and
# without the real SmolLM2 (`real_model`); `make test` runs everything, as CI does.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not real_model"

# Style (ruff), types (mypy on core/ and plugins/) and floors (import-linter).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python .ci/package-checks

bench: $(STAMP)
	$(BIN)/python -m benchmarks all

clean:
	rm -rf $(VENV) runs build *.egg-info
