VENV ?= .venv
STAMP := $(VENV)/.tandem-installed
TANDEM := $(VENV)/bin/tandem
MODEL ?= smollm2

.PHONY: install run test bench lint

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh

# Install if needed, then serve the model (`tandem run` prepares the default model first if needed).
# Extra flags: make run RUN_ARGS="--workers 2".
run: install
	$(TANDEM) run --model $(MODEL) $(RUN_ARGS)

# Two pytest-xdist workers, each taking whole units (tests/support/plugins.py work_units): the real-vLLM tests
# on the session's shared engines in one, every other module in its own. TEST_WORKERS=0 runs the suite in one
# process.
TEST_WORKERS ?= 2
test: install
	$(VENV)/bin/python -m pytest -q --durations=25 -n $(TEST_WORKERS) $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/python bench/runtime_bench.py

lint: install
	$(VENV)/bin/ruff check tandem tests bench
