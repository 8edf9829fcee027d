VENV ?= .venv
STAMP := $(VENV)/.tandem-installed
TANDEM := $(VENV)/bin/tandem
MODEL ?= smollm2

.PHONY: install run test bench lint

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) bash scripts/install.sh

# Install if needed, prepare the default model, serve it.
# Serving (`tandem run`) arrives with the frontend and worker; until then this installs and prepares.
run: install
	$(TANDEM) model prepare $(MODEL)

test: install
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: install
	$(VENV)/bin/python bench/runtime_bench.py

lint: install
	$(VENV)/bin/ruff check tandem tests bench
