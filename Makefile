# Two commands set up everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATASET := .trainpipe/datasets/markov-v256
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Two test files at a time (pytest-xdist), each file whole on one worker (its module fixtures: a Slurm site, a cloud
# fake): half the suite waits on processes, not the CPU. The tests are written for 2 loaded cores.
TEST_WORKERS ?= 2

.PHONY: run test install lint clean

$(BIN)/trainpipe: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: this exact version is a CPU build here; anything looser pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/trainpipe

$(DATASET)/manifest.json: | $(BIN)/trainpipe
	$(BIN)/trainpipe dataset synth $(DATASET) --tokens 20000000

run: $(BIN)/trainpipe $(DATASET)/manifest.json
	$(BIN)/trainpipe run examples/local.yaml

test: $(BIN)/trainpipe
	scripts/install-system-packages
	scripts/install-azure-tools
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=60 -n $(TEST_WORKERS) --dist loadfile

lint: $(BIN)/trainpipe
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .trainpipe
