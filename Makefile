# make demo: set up .venv and run the demo. make test: set up .venv and run the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint format bench clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/tuner demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

# Everything but the multi-process runs: seconds, for the edit-test loop.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not distributed"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python bench/trainer_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
