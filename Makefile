# The two quick-start commands: `make run` (train the default model) and `make test`. Besides them: `make lint` (ruff,
# pydoclint, mypy: the checks .pre-commit-config.yaml runs) and `make docs` (the site, into site/).
# `make run` installs the package and its runtime dependencies only; `make test` adds the test tools and the oracles
# (torch's CPU build, pytorch-optimizer, transformers) to the same .venv. Each install runs once (a stamp file) and
# again when pyproject.toml changes.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
LINT_STAMP := $(VENV)/.installed-lint
DOCS_STAMP := $(VENV)/.installed-docs
# torch's CPU build: a wheel named +cpu where the configured indexes have one, else PyTorch's CPU index (PyPI's
# Linux wheel is the CUDA build, several GB with its nvidia-* dependencies).
TORCH := torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# test processes (pytest-xdist): 2 for the 2-core CI machine; `make test WORKERS=0` runs in this process
WORKERS ?= 2

$(RUN_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q "$(TORCH)+cpu" 2>/dev/null || $(BIN)/pip install -q --index-url $(TORCH_CPU_INDEX) $(TORCH)
	$(BIN)/pip install -q -e ".[dev,oracles,wandb,mlflow,viz]"
	touch $(TEST_STAMP)

$(LINT_STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q -e ".[lint]"
	touch $(LINT_STAMP)

# the site renders the stored notebook executions (docs/notebooks/) and reads the trainer's --help, so it needs the
# runtime install, not the test tools
$(DOCS_STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

.PHONY: install install-test install-lint install-docs run test bench lint docs
install: $(RUN_STAMP)
install-test: $(TEST_STAMP)
install-lint: $(LINT_STAMP)
install-docs: $(DOCS_STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m research.train $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup --durations=25 $(ARGS)

bench: $(TEST_STAMP)
	$(BIN)/python -m research.bench $(ARGS)

# ruff everywhere; types (mypy) on the library, the trainer and research/verdicts; docstring sections (pydoclint) on
# the library, the trainer's front door and research/verdicts
TYPED := optim models sharding research/train research/verdicts
DOCUMENTED := optim models sharding research/verdicts research/train/__init__.py research/train/command.py \
	research/train/loop.py research/train/config/__init__.py research/train/steps/step.py
lint: $(LINT_STAMP)
	$(BIN)/ruff check .
	$(BIN)/pydoclint $(DOCUMENTED)
	$(BIN)/mypy $(TYPED)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
