# The two quick-start commands: `make run` (train the default model) and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0  # alone first, so nothing pulls a CUDA build
	$(BIN)/pip install -q -e ".[dev,oracles]"
	touch $(STAMP)

.PHONY: install run test bench
install: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m research.train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m research.bench $(ARGS)
