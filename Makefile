# Two commands for a fresh machine with Python 3.11: `make demo` and `make test`.
# Each creates .venv when it is missing and installs the project with the pinned versions of
# constraints.txt (torch's CPU build, so no multi-GB CUDA wheels).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := test,dev,s3,gcs,plot,wandb,fp8,index

.PHONY: demo test test-fast test-gpu lint format docs install clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --progress-bar off -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python jobs/demo.py

# The tests in two parts, both always run: first all but the slow ones of tests/system, in TEST_PROCESSES
# pytest processes (pytest-xdist; on a 2-core machine one's waits are the other's time), then those one at
# a time (each starts its own jobs, Rays or clusters, and several hold them to timings).
TEST_PROCESSES ?= 2

test: $(STAMP)
	@status=0; \
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) -m "not (system and slow)" || status=$$?; \
	$(BIN)/python -m pytest -m "system and slow" tests/system || status=$$?; \
	exit $$status

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) -m "not slow"

# On a CUDA machine: the tests marked gpu (FSDP2 bf16 step, embedding actor, NCCL through Ray Train).
# pip resolves torch to its CUDA build on a Linux GPU machine; without CUDA they are all skipped.
test-gpu: $(STAMP)
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'devices', torch.cuda.device_count())"
	$(BIN)/python -m pytest -m gpu -rs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# docs/options.md from the jobs' parsers, the layout in docs/design.md from the module docstrings
# (a test fails when either is stale).
docs: $(STAMP)
	$(BIN)/python jobs/docs.py

clean:
	rm -rf $(VENV) demo-output .pytest_cache .ruff_cache
