# distlab: `make demo` and `make test` each bootstrap .venv from nothing (MPI comes from the mpich wheel on PyPI).
PYTHON3 ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.distlab-installed
NP      ?= 2
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: all venv build demo test test-fast docs bench clean distclean

all: build

# Create the venv and install distlab (editable) with its test extras. Re-runs when the packaging files change.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel "Cython>=3.0" "numpy>=2.0"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# Compile the Cython core twin in place (incremental: only changed .pyx files are rebuilt).
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace -j 2

demo: build
	$(PY) -m distlab run -n $(NP) --timeline ddp_timeline.json examples/train_ddp.py

# The one test command (CI runs it through .ci/run). `python -P` keeps the repo root off sys.path.
test: build
	$(PY) -P -m pytest -q -p no:cacheprovider tests

# The docs: Sphinx with warnings as errors, offline once the `docs` extra is installed. Installs only the extra's
# requirements (the project itself is installed by $(STAMP)); the API reference is generated from the reference
# twin, so the docs need no compiled core. Output: docs/_build/html/index.html.
docs: $(STAMP)
	$(PY) -m pip install -q $$($(PY) docs/_scripts/extra_requirements.py docs)
	$(PY) -P -m sphinx -W --keep-going -b html docs docs/_build/html

bench: build
	for b in benchmarks/bench_*.py; do $(PY) -P $$b || exit 1; done

clean:
	rm -rf build core/*.c core/*.so docs/_build .pytest_cache

distclean: clean
	rm -rf $(VENV) *.egg-info src/*.egg-info
