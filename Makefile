PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
# One virtualenv, filled by what each command needs (a stamp per set of extras, redone when
# pyproject.toml changes): `make demo` installs jaxtransport with JAX only; `make test` adds
# Ray and the test and plotting tools (the whole suite runs); `make bench` adds Ray and
# matplotlib. `make venv` installs everything (development).
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
BENCH_STAMP := $(VENV)/.installed-bench
# `make bench BENCH_ARGS="--quick"`; `--publish` rewrites benchmarks/results/ (default: the
# git-ignored benchmarks/results/scratch/).
BENCH_ARGS ?=

.PHONY: venv demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) -e '.[ray,test,bench]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PIP) -e .
	touch $(DEMO_STAMP)

$(BENCH_STAMP): pyproject.toml | $(PY)
	$(PIP) -e '.[ray,bench]'
	touch $(BENCH_STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m jaxtransport.rollouts --compare

test: $(STAMP)
	$(PY) -m pytest -q -ra

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
