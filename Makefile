# make setup: a virtual environment in .venv with solforge (editable), its dependencies and dev tools.
# make test:  the test suite (CPU tests through Triton's interpreter; GPU tests run when CUDA is present).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Versions installed when the machine has no torch yet (a CPU machine). An unpinned torch would
# pull several GB of CUDA packages; 2.13.0 resolves to the CPU build there. A machine that already
# has torch (a GPU box) keeps its own: the venv sees system packages and nothing replaces them.
CPU_PINS := torch==2.13.0 triton==3.6.0 transformers==5.17.0

.PHONY: setup test lint clean

setup:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install $(CPU_PINS)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install triton==3.6.0
	$(BIN)/python -c "import transformers" 2>/dev/null || $(BIN)/pip install transformers==5.17.0
	$(BIN)/pip install -e ".[hf,dev]"
	$(BIN)/solforge --help > /dev/null

test:
	$(BIN)/python -m pytest -q tests

lint:
	$(BIN)/ruff check solforge tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache solforge.egg-info
