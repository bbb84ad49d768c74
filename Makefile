# make demo: set up .venv and run the demo. make test: set up .venv and run the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup system-deps demo test test-fast check-floors lint format bench clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip's byte-compiling of every installed module (torch's thousands) was 86 of its 154 s on this
# VM; --no-compile skips it and one import of the stack every test process loads writes the
# bytecode it uses (the rest is compiled when first imported; this VM's environment sets
# PYTHONDONTWRITEBYTECODE, hence the env -u).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -e '.[all,test]'
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -c "import torch, torch.distributed.tensor, \
	  torch.distributed.fsdp, torch.distributed.pipelining, optuna, pandas, sqlalchemy, pytest, \
	  tuner.cli, trainer.benchmark, trainer.memcheck, api.main"
	touch $(STAMP)

demo: setup
	$(BIN)/tuner demo
	$(BIN)/tuner best --model llama-tiny

# The layering rules (pyproject.toml's import-linter contracts) fail CI as a lint error does.
# Every group of the suite in two pytest runs, each printing its 25 slowest tests:
# - the Slurm tests (marker slurm: a cluster of their own, jobs, node faults, the chaos run) in one
#   process, started first and in the background: most of their time is waiting on Slurm (a job's
#   start, a node's timeout, a time limit of a minute) with the machine's load near 1. Their output
#   is printed when they end (the file: $$SLURM_LOG, or a new one in /tmp);
# - meanwhile, at the same priority (under nice 10 the Slurm run's trials took ~90 % of the
#   cores whenever both ran, and the foreground became the longer of the two: 28 min against 21),
#   everything else on both cores (pytest-xdist; a worker that runs out steals the other's queue):
#   the single-process groups, the multi-process trials (ranks of their own, forked from one
#   server: tests/trainer/conftest.py) and the browser; one OpenMP thread a process (two workers of
#   two threads on two cores spin: 15 % slower, quiet).
# Each run runs whatever the other gave. docs/benchmarks.md, "Test suite", has the timings.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest tests --durations=25
test: setup system-deps
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	log=$${SLURM_LOG:-$$(mktemp /tmp/parallel-tuner-slurm-tests.XXXXXX)}; \
	echo "make test: the Slurm tests run in the background, output in $$log"; \
	$(PYTEST) -p no:cacheprovider -m "slurm" >"$$log" 2>&1 & slurm_pid=$$!; \
	OMP_NUM_THREADS=1 $(PYTEST) -n 2 --dist worksteal -m "not slurm"; rest=$$?; \
	wait $$slurm_pid; slurm=$$?; \
	echo "==================== the Slurm tests (in the background) ===================="; \
	cat "$$log"; \
	exit $$(( rest || slurm ))

# The store tests start their own PostgreSQL server, the Slurm tests their own Slurm cluster
# (scripts/slurm-local.sh), the dashboard tests drive Debian's chromium (Playwright's own browser
# download is not used): install the binaries when missing (as root, e.g. CI on a fresh
# machine); otherwise say what to install.
system-deps:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	else echo "PostgreSQL server binaries missing: sudo apt-get install postgresql" >&2; exit 1; fi
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "Chromium missing (dashboard tests): sudo apt-get install chromium" >&2; exit 1; fi
	@bash scripts/slurm-local.sh install

# Everything but the multi-process runs, the Slurm cluster, the browser, the memory oracle's
# simulations, other frameworks' checks of our exports and the slow single-process groups, for the
# edit-test loop (the study runner's state machine is in it): on both cores (pytest-xdist), with
# bytecode cached (pytest rewrites and re-parses ~400 modules a run when PYTHONDONTWRITEBYTECODE is
# set). 2 min 43 s on this 2-core VM (docs/benchmarks.md, "Test suite"). make test stays one process.
test-fast: setup
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest tests -n 2 -m "not distributed and not slurm and not browser and not slow and not oracle and not external"

# Every declared dependency at its floor (constraints/floors.txt) in a throwaway venv, then ruff and
# the fast group there (scripts/check-floors.sh, docs/dependencies.md). Needs PyPI; CI runs it.
check-floors:
	PYTHON=$(PYTHON) bash scripts/check-floors.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python -m bench.trainer_overhead

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
