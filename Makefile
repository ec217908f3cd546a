# Two commands do all the set-up on a fresh machine with Python and pip:
#   make run    create .venv, install spmd with MPI from PyPI, run FSDP on 4 MPI ranks
#   make test   the same install, then lint (ruff, mypy), the tests on threads (two pytest workers) and under
#               mpiexec -n 2, 3, 4 (and 8 for the 3-D compositions),
#               then the network path: the MPI tests and main jobs with no shared memory between ranks,
#               then the wheel and `pip install .` in fresh venvs, run from outside the tree,
#               then the language model's journey at toy size (prepare, train, resume on another mesh, generate);
#               about 9 minutes on 2 cores
#   make test-all  make test, then the tests marked slow (make test-docs): every README block as pasted, every
#               generated table and transcript against its recipe, the benchmarks' plumbing, the leak test,
#               the planner at 400 GB; about 10 minutes more, and the timed recipes' own (the LM's step about
#               6, the two text races about 20)
#   make docs   rewrite the README's generated tables, transcripts and memory pictures from their recipes
#   make bench  numpy vs DP and FSDP on threads and MPI, written to bench-results/
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= mpich,test,bench,bpe
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
# Every MPI test run aborts the whole job if one rank fails, and times out a hung test.
MPI_PYTEST := -m mpi4py -m pytest --with-mpi -x -q
# The network path on one machine: MPICH treats every rank as on another node, UCX sends over TCP sockets
# (tests/test_network_path.py checks that this is so; keep NETWORK_ENV there in step).
NETWORK_ENV := MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp,self

.PHONY: install run run-dp test test-all test-docs docs lint test-threads test-mpi test-network test-install test-journey \
	bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

run: install
	$(MPIEXEC) -n 4 $(PY) -m spmd fsdp --check

run-dp: install
	$(MPIEXEC) -n 4 $(PY) -m spmd dp --check

test: lint test-threads test-mpi test-network test-install test-journey

lint: install
	$(VENV)/bin/ruff check spmd tests
	$(VENV)/bin/ruff format --check spmd tests
	$(VENV)/bin/mypy spmd

# pytest-xdist's workers: a thread test runs its ranks in one Python process, so one worker uses about one core
test-threads: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -n auto -m "not slow"

test-all: test test-docs

# The tests marked slow: every README block run as pasted (a benchmark as its quick twin), every generated table
# and transcript run from its recipe and compared (tests/test_docs.py), the benchmarks' plumbing, thousands of small
# calls leaking nothing, the planner on the problem statement's 400 GB model
test-docs: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -n auto -m slow

# The README's generated figures (between <!-- recipe: NAME --> and <!-- end: NAME -->), rewritten from the sh block
# beside each (about 35 minutes, most of it the timed benchmarks'); python -m spmd.observe.docs --check compares
# instead, NAME ... picks some
docs: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m spmd.observe.docs

test-mpi: install
	@for n in 2 3 4; do \
		echo "== tests on $$n MPI ranks"; \
		$(MPIEXEC) -n $$n $(PY) $(MPI_PYTEST) || exit 1; \
	done
	@echo "== the 3-D compositions and expert-parallel layouts on 8 MPI ranks (8 processes on these cores: small shapes)"
	$(MPIEXEC) -n 8 $(PY) $(MPI_PYTEST) tests/test_composition.py tests/test_moe.py
	@# The README's recipes (tests/test_readme.py, in test-docs) run the 8-rank pp x fsdp x tp+sp and
	@# fsdp x cp x tp (ring, Ulysses) checks and the checkpoint resume (4 ranks -> 3) under mpirun.

test-network: install
	@for n in 2 4; do \
		echo "== tests on $$n MPI ranks, network path ($(NETWORK_ENV))"; \
		$(NETWORK_ENV) $(MPIEXEC) -n $$n $(PY) $(MPI_PYTEST) || exit 1; \
	done
	$(NETWORK_ENV) $(MPIEXEC) -n 4 $(PY) -m spmd fsdp --check
	$(NETWORK_ENV) $(MPIEXEC) -n 4 $(PY) -m spmd mlp-fsdp-tp --mesh fsdp=2,tp=2 --check

# Install as users on a cluster do (the wheel, and `pip install .`, each in a throwaway venv) and run from outside
# the source tree: an editable install cannot show a wheel that leaves a subpackage out.
test-install: install
	PYTHON=$(PYTHON) bash tests/install/check_install.sh

# The README's language-model journey at toy size, as a user types it: prepare, train on 4 MPI ranks, resume on 2,
# generate; then a BPE corpus of a glob of files (the bpe extra) trained on and generated from.
test-journey: install
	PY="$(CURDIR)/$(PY)" MPIEXEC="$(CURDIR)/$(MPIEXEC)" bash tests/journey.sh

# The full benchmarks (about 50 minutes on 2 cores: the matmul's 7, the fresh-process matmul's 2, the training
# steps' 30, the LM's step 6, 150 s of text training each side 6): tables, chart and raw results in bench-results/.
bench: install
	$(PY) -m spmd.bench --out bench-results
	$(PY) -m spmd.bench.fresh --out bench-results
	$(PY) -m spmd.bench.train --out bench-results
	$(PY) -m spmd.bench lm --out bench-results
	$(PY) -m spmd.bench text --out bench-results

clean:
	rm -rf $(VENV) .pytest_cache
