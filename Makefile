PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# .ci/dev.txt: constraints on this virtualenv (what only slows the suite is held back there).
# .ci/tools.txt: constraints on the test tools, for every virtualenv here.
TOOLS_CONSTRAINTS := .ci/tools.txt
DEV_CONSTRAINTS := .ci/dev.txt $(TOOLS_CONSTRAINTS)
PIP := $(PY) -m pip install -q $(addprefix -c ,$(DEV_CONSTRAINTS))
# One virtualenv, filled by what each command needs (a stamp per set of extras, redone when
# pyproject.toml changes): `make demo` installs jaxtransport with JAX only; `make test` adds
# Ray, joblib and diskcache, the Atari games (gymnasium's and envpool's) and the test and plotting tools (the whole suite runs); `make bench` adds Ray, joblib,
# matplotlib, loky and torch (the CPU wheel: the queue benchmark's torch.multiprocessing baseline).
# `make venv` is what `make test` installs (development, the docs tools included: the suite
# builds the documentation site). `make lint` adds ruff and mypy; `make docs` builds the site
# (docs/, Sphinx) into the git-ignored docs/_build/html, offline, warnings as errors; it installs
# Ray and joblib too (the API page imports jaxtransport.ray and jaxtransport.joblib).
# Each target must work as the first command on a fresh clone: its stamp installs every extra
# that what it runs imports (tests/test_make_targets.py checks this against pyproject.toml).
STAMP := $(VENV)/.installed
# Bytecode of the package's own modules, as pip writes it into a user's (non-editable) install:
# an editable install has none, and where PYTHONDONTWRITEBYTECODE is set (docker/, CI) Python
# never writes it, so every new process (each Pool worker) compiled jaxtransport from source.
# Python reads these files under that setting too; one whose source changed since is ignored
# (the module is compiled in memory, as without it). `make bench` refreshes them first.
COMPILE := $(PY) -m compileall -q jaxtransport
DEMO_STAMP := $(VENV)/.installed-demo
BENCH_STAMP := $(VENV)/.installed-bench
LINT_STAMP := $(VENV)/.installed-lint
DOCS_STAMP := $(VENV)/.installed-docs
# The suites run in TEST_JOBS test processes at once (pytest-xdist; Note [parallel test
# processes] in tests/conftest.py): most of a test's time is spent waiting on the processes it
# starts, so on CI's 2 cores 3 test processes finish the suite in about half the time of one.
# `make test TEST_JOBS=0` runs it in this one process (pytest's own order, -x and pdb work).
TEST_JOBS ?= 3
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadgroup)
# `make bench BENCH_ARGS="--quick"`; `--publish` rewrites benchmarks/results/ (default: the
# git-ignored benchmarks/results/scratch/).
BENCH_ARGS ?=

# The two ends of the supported range (README "Tested range"), each in its own virtualenv:
# the newest releases on the newest Python, the declared floor on the oldest Python.
PYENV_VERSIONS ?= $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions
NEWEST_PYTHON ?= $(lastword $(sort $(wildcard $(PYENV_VERSIONS)/3.13*/bin/python)))
FLOOR_PYTHON ?= $(lastword $(sort $(wildcard $(PYENV_VERSIONS)/3.10*/bin/python)))
NEWEST_VENV := .venv-newest
FLOOR_VENV := .venv-floor
# The subset run at both ends: every codec path, registration, pickling, the Pool and Ray, and
# CPython's own tests from that Python's test package (FailingInitializerResourcesTest exists from
# 3.13 on: it runs only at the newest end).
# (The rollouts demo, Docker files, benchmarks and the multi-node Ray cluster run on the main venv.)
RANGE_TESTS ?= tests/test_codec.py tests/test_sharding.py tests/test_shm.py tests/test_pool.py \
	tests/test_pool_lifecycle.py tests/test_pool_memory.py tests/test_ray.py tests/test_usercode.py \
	tests/test_cpython_compat.py tests/test_multiprocessing.py tests/test_forwarding.py \
	tests/test_async_exceptions.py

# `make test-platforms`: the Pool, Executor and jaxtransport.multiprocessing suites (not slow), and
# the Pool's never-hangs, crash, lifecycle and take-back suites, with
# Linux's facilities hidden in every process, parent and spawned workers (tests/platforms/
# sitecustomize.py, on PYTHONPATH): as on macOS (the portable path: POSIX shared memory, framed
# streams; spawn and forkserver), then as on Windows (in-band: no fd passing; spawn only). The
# paths are found by feature detection, not by JAXTRANSPORT_PLATFORM. Afterwards /dev/shm must hold
# no jaxtransport entry.
PLATFORM_TESTS ?= tests/test_pool.py tests/test_executor.py tests/test_multiprocessing.py tests/test_forwarding.py tests/test_pool_forwarding.py \
	tests/test_pool_never_hangs.py tests/test_pool_crash.py tests/test_pool_lifecycle.py tests/test_pool_take_back.py
SIMULATE := PYTHONPATH=$(CURDIR)/tests/platforms$${PYTHONPATH:+:$$PYTHONPATH}

.PHONY: venv demo test test-slow test-device bench clean test-newest test-floor venv-newest venv-floor lint docs test-platforms

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml $(DEV_CONSTRAINTS) | $(PY)
	$(PIP) -e '.[ray,test,ecosystem,atari,envpool,docs,joblib]'
	$(COMPILE)
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml $(DEV_CONSTRAINTS) | $(PY)
	$(PIP) -e .
	$(COMPILE)
	touch $(DEMO_STAMP)

# PyPI's torch wheel pulls in CUDA (gigabytes); the CPU wheel comes from PyTorch's index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(BENCH_STAMP): pyproject.toml $(DEV_CONSTRAINTS) | $(PY)
	$(PIP) --extra-index-url $(TORCH_INDEX) -e '.[ray,bench,joblib]'
	$(COMPILE)
	touch $(BENCH_STAMP)

# mypy checks against what `make test` installs (Ray, the extras): what it sees, and so which
# `type: ignore` comments are needed, must not depend on which target ran first.
$(LINT_STAMP): pyproject.toml $(DEV_CONSTRAINTS) | $(PY)
	$(PIP) -e '.[ray,test,ecosystem,atari,envpool,docs,joblib,lint]'
	touch $(LINT_STAMP)

$(DOCS_STAMP): pyproject.toml $(DEV_CONSTRAINTS) | $(PY)
	$(PIP) -e '.[ray,joblib,docs]'
	touch $(DOCS_STAMP)

venv: $(STAMP)

# $(1): venv dir, $(2): python, $(3): constraints file
define range_venv
$(1)/.installed: pyproject.toml $(3) $(TOOLS_CONSTRAINTS)
	@test -n "$(2)" || { echo "no Python for $(1): set $(4)=/path/to/python"; exit 1; }
	rm -rf $(1)
	$(2) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -c $(3) -c $(TOOLS_CONSTRAINTS) -e '.[ray,test]'
	$(1)/bin/python -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|numpy|ml.dtypes|cloudpickle|ray) '
	touch $(1)/.installed
endef
$(eval $(call range_venv,$(NEWEST_VENV),$(NEWEST_PYTHON),.ci/newest.txt,NEWEST_PYTHON))
$(eval $(call range_venv,$(FLOOR_VENV),$(FLOOR_PYTHON),.ci/floor.txt,FLOOR_PYTHON))

venv-newest: $(NEWEST_VENV)/.installed
venv-floor: $(FLOOR_VENV)/.installed

demo: $(DEMO_STAMP)
	$(PY) -m jaxtransport.rollouts --compare

# `make test`: the suite without the tests marked slow (Ray, the multi-node cluster, the demo
# end to end, the docs' examples, the ecosystem libraries, the stress test); `make test-slow`:
# those. CI runs both.
test: $(STAMP)
	$(PY) -m pytest -q -ra $(XDIST) -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -ra $(XDIST) -m slow

# `make test-device`: the tests marked device (tests/test_on_device.py), this process on whatever
# accelerator JAX finds (a TPU chip, a GPU); without one they skip, as in CI. On a machine whose
# Python already has JAX for its accelerator and no network: `make test-device DEVICE_PY=python3`
# (then nothing is installed; jaxtransport runs from this tree).
DEVICE_PY ?= $(PY)
test-device: $(if $(filter $(PY),$(DEVICE_PY)),$(STAMP))
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(DEVICE_PY) -m pytest -q -ra -m device -p no:cacheprovider tests/test_on_device.py

test-platforms: $(STAMP)
	JAXTRANSPORT_SIMULATE=macos $(SIMULATE) $(PY) -m pytest -q -ra $(XDIST) -m "not slow" -p no:cacheprovider $(PLATFORM_TESTS)
	JAXTRANSPORT_SIMULATE=windows $(SIMULATE) $(PY) -m pytest -q -ra $(XDIST) -m "not slow" -p no:cacheprovider \
		-k "not forkserver" -W ignore::RuntimeWarning $(PLATFORM_TESTS)
	@if ls /dev/shm | grep -q '^jaxtransport-'; then echo "test-platforms left /dev/shm/jaxtransport-* behind"; exit 1; fi

test-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_VENV)/bin/python -m pytest -q -ra $(XDIST) -p no:cacheprovider $(RANGE_TESTS)

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -q -ra $(XDIST) -p no:cacheprovider $(RANGE_TESTS)

# ruff (lint + format check) and mypy over jaxtransport/, configured in pyproject.toml.
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff format --check
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy

# -W: a warning (a broken link, a missing reference: nitpicky mode, -n) fails the build.
docs: $(DOCS_STAMP)
	$(PY) -m sphinx -b html -W -n --keep-going -q docs docs/_build/html
	@echo "docs: open docs/_build/html/index.html"

bench: $(BENCH_STAMP)
	$(COMPILE)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(FLOOR_VENV) build *.egg-info docs/_build

# The release check (.ci/release-check, the last step of .ci/run): build the sdist and the wheel
# (python -m build), check what they carry, install the wheel into a clean virtualenv outside the
# repository and run a smoke script there. Its virtualenvs live in a temporary folder, not .venv.
.PHONY: release-check
release-check:
	PYTHON=$(PYTHON) .ci/release-check
