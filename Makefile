# The two commands of the README: `make demo` and `make test`. Both create .venv on
# first use and install the project with its env plugins into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch is all the demo and tests need; pin it so pip does not fetch a
# multi-GB CUDA build. Override e.g. TORCH="torch==2.14.1" or add an index URL.
TORCH ?= torch==2.13.0
PLUGINS := -e ./llamagym_blackjack -e ./llamagym_cartpole -e "./llamagym_textworld[textworld]"
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml llamagym_blackjack/pyproject.toml llamagym_cartpole/pyproject.toml llamagym_textworld/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,quantize,report]" $(PLUGINS)
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/llamagym run blackjack

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python -m benchmarks all

clean:
	rm -rf $(VENV) runs build *.egg-info
