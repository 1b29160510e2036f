# Two commands set up a fresh clone and run something (see README):
#   make dlrm    the main job: TorchRec's DLRM on dynamic tables, embedded synthetic Criteo-like data
#   make test    the test suite
# Both create .venv on first use: torch pinned to 2.13.0 (the CPU wheel), TorchRec without
# its GPU dependency, and this project built in place.
# make lint runs ruff, mypy and the import checks (config in pyproject.toml); CI (.ci/run) runs it before make test.
# make test-fast skips the tests marked slow (full DLRM trainings, multi-process runs): a quick local run.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup build lint test test-fast soak dlrm demo bench asv clean

$(VENV)/.installed: setup.py setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "torch==2.13.0" "numpy>=1.26" "Cython>=3.0" "setuptools>=68" wheel
	$(PIP) install "fbgemm-gpu-cpu==1.8.0"
	$(PIP) install --no-deps "torchrec==1.8.0"
	$(PIP) install tensordict "torchmetrics==1.0.3" tqdm pyre-extensions
	$(PIP) install "pytest>=8" pytest-xdist "hypothesis>=6.100" "jax[cpu]" flax optax flatbuffers "asv>=0.6" pyarrow
	$(PIP) install "ruff==0.17.6" "mypy==2.4.1" "import-linter==2.17"
	$(PIP) install --no-build-isolation -e .
	touch $@

setup: $(VENV)/.installed

# Rebuild the extension after editing cython_src/.
build: setup
	$(PIP) install --no-build-isolation -e .

PACKAGES := cncore cncore_torch cncore_numpy cn_dlrm cncore_jax
LINT_PATHS := cncore frontends asv_bench .ci
RUFF_PATHS := $(LINT_PATHS) tests examples

# Lint (ruff, over the tests and examples too), types (mypy), import layers (import-linter's contracts,
# then no import circle), and the public API's annotations and Args/Returns docstrings
# (.ci/check_api.py against .ci/api_gaps.txt).
lint: setup
	$(VENV)/bin/ruff check $(RUFF_PATHS)
	$(PY) -m mypy $(LINT_PATHS)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) .ci/check_imports.py
	$(PY) .ci/check_api.py

# --durations=30: CI's log names the slowest tests (the suite's budget is 15 minutes on 2 cores).
test: setup
	$(PY) -m pytest -n 2 -p no:cacheprovider --durations=30 --doctest-modules tests examples --pyargs $(PACKAGES)

# The suite without the tests marked slow (each over ~5 s: DLRM trainings, multi-process runs). CI runs them all.
test-fast: setup
	$(PY) -m pytest -n 2 -p no:cacheprovider -m "not slow" --doctest-modules tests examples --pyargs $(PACKAGES)

# Long randomised runs (thousands of hypothesis examples, growth to tens of millions of rows).
soak: setup
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -m soak -p no:cacheprovider tests

# ARGS are passed on, e.g. make dlrm ARGS="--compare --summary-json out.json"
dlrm: setup
	$(VENV)/bin/cn-dlrm $(ARGS)

# A NumPy-only training loop on a growing table (no PyTorch).
demo: setup
	$(PY) examples/demo.py

# The one-run comparisons against torch.nn.EmbeddingBag and FBGEMM (the README's benchmark tables):
# tables far beyond the LLC at three row dtypes, the 1M-row training step, each also beside busy cores;
# the row-wise Adagrad step against FBGEMM's TBE and every forward against a plain C gather, far beyond
# the LLC, torch with and without huge pages. Every table names the CPU, its caches and the load.
# make bench BENCH_ARGS=--quick: the same scripts on small shapes (a smoke run, a minute)
bench: setup
	$(PY) asv_bench/scripts/step_large.py $(BENCH_ARGS)
	$(PY) asv_bench/scripts/forward_large.py $(BENCH_ARGS)
	$(PY) asv_bench/scripts/forward_large.py --background-load --rows 8e6 --dims 64 $(BENCH_ARGS)
	$(PY) asv_bench/scripts/compare_reference.py $(BENCH_ARGS)
	$(PY) asv_bench/scripts/compare_reference.py --background-load --table-only $(BENCH_ARGS)

asv: setup
	cd asv_bench && ../$(PY) -m asv machine --yes && ../$(PY) -m asv run --python=same --quick --show-stderr

clean:
	rm -rf build $(VENV) *.egg-info cython_src/cncore/*.c cncore/*.so
