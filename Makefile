# make setup: a virtual environment in .venv with solforge (editable), its dependencies and dev tools.
# make test:  the test suite (CPU tests through Triton's interpreter; GPU tests run when CUDA is present),
#             in TEST_WORKERS processes (pytest-xdist).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Versions installed when the machine has no torch yet (a CPU machine). An unpinned torch would
# pull several GB of CUDA packages; 2.13.0 resolves to the CPU build there. A machine that already
# has torch (a GPU box) keeps its own: the venv sees system packages and nothing replaces them.
CPU_PINS := torch==2.13.0 triton==3.6.0 transformers==5.17.0
# Extra pip flags, e.g. PIP_FLAGS="--no-index --find-links DIR --no-build-isolation" offline.
PIP_FLAGS ?=
# Optional extras: ray is there so the Ray runner's test runs in CI (an offline GPU box without a
# ray wheel can pass EXTRAS=hf,dev).
EXTRAS ?= hf,dev,ray
# pytest-xdist workers for `make test` (CI: 2 cores); each worker's torch gets its share of the
# cores (tests/conftest.py); the large-GPU-memory tests share one worker (--dist loadgroup).
TEST_WORKERS ?= 2
# --no-compile: pip would byte-compile every file of every package it installs (torch's thousands:
# half of its install time here); Python compiles what is imported, on first import, instead.
PIP := $(BIN)/pip install --no-compile $(PIP_FLAGS)

.PHONY: setup test lint clean

setup:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@# A python that already has torch (a GPU box, often itself a venv, whose packages
	@# --system-site-packages does not reach): the new venv sees its site-packages through a .pth.
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  $(PYTHON) -c "import site; print(*site.getsitepackages(), sep='\n')" \
	    > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_solforge_host.pth"; \
	  echo "using the torch of $(PYTHON): $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; fi
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) $(CPU_PINS)
	$(BIN)/python -c "import triton" 2>/dev/null || $(PIP) triton==3.6.0
	$(BIN)/python -c "import transformers" 2>/dev/null || $(PIP) transformers==5.17.0
	@# solforge itself: built with the venv's own setuptools where it has a recent one (no isolated
	@# build environment to make first), else in pip's isolated one
	if $(BIN)/python -c "import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" 2>/dev/null; \
	  then $(PIP) --no-build-isolation -e ".[$(EXTRAS)]"; else $(PIP) -e ".[$(EXTRAS)]"; fi
	$(BIN)/solforge --help > /dev/null
	@# report.html is tested in a real headless Chromium: Debian's package, where apt can install it
	@# (CI runs as root). It installs in the background (its downloads and unpacking took about 40 s
	@# before the tests could start): the test waits for .chromium-install (apt's exit status, written
	@# when done; the log beside it) and skips saying why if there is no chromium after all.
	@if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  rm -f .chromium-install; \
	  ( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium); \
	    echo $$? > .chromium-install ) > .chromium-install.log 2>&1 < /dev/null & \
	  echo "installing chromium in the background (.chromium-install.log)"; fi

# PYTHONDONTWRITEBYTECODE (set on some CI images) is cleared for the run: the tests start many Python
# processes (tuning workers, bench scripts, distributed ranks), which would otherwise each compile
# solforge's modules (and pytest each worker's rewritten test modules) from source again.
test:
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

lint:
	$(BIN)/ruff check solforge tests bench tools

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache solforge.egg-info
