PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The two ends of the supported range (README "Tested range"), each in its own virtualenv:
# the newest releases on the newest Python, the declared floor on the oldest Python.
PYENV_VERSIONS ?= $(HOME)/.pyenv/versions
NEWEST_PYTHON ?= $(lastword $(sort $(wildcard $(PYENV_VERSIONS)/3.13*/bin/python)))
FLOOR_PYTHON ?= $(lastword $(sort $(wildcard $(PYENV_VERSIONS)/3.10*/bin/python)))
NEWEST_VENV := .venv-newest
FLOOR_VENV := .venv-floor
# The subset run at both ends: every codec path, registration, pickling, the Pool and Ray.
# (The rollouts demo, Docker files, benchmarks and the multi-node Ray cluster run on the main venv.)
RANGE_TESTS ?= tests/test_codec.py tests/test_sharding.py tests/test_shm.py tests/test_pool.py \
	tests/test_pool_lifecycle.py tests/test_pool_memory.py tests/test_ray.py tests/test_usercode.py

.PHONY: venv demo test bench clean test-newest test-floor venv-newest venv-floor

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[ray,test,bench]'
	touch $(STAMP)

venv: $(STAMP)

# $(1): venv dir, $(2): python, $(3): constraints file
define range_venv
$(1)/.installed: pyproject.toml $(3)
	@test -n "$(2)" || { echo "no Python for $(1): set $(4)=/path/to/python"; exit 1; }
	rm -rf $(1)
	$(2) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -c $(3) -e '.[ray,test]'
	$(1)/bin/python -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|numpy|ml.dtypes|cloudpickle|ray) '
	touch $(1)/.installed
endef
$(eval $(call range_venv,$(NEWEST_VENV),$(NEWEST_PYTHON),.ci/newest.txt,NEWEST_PYTHON))
$(eval $(call range_venv,$(FLOOR_VENV),$(FLOOR_PYTHON),.ci/floor.txt,FLOOR_PYTHON))

venv-newest: $(NEWEST_VENV)/.installed
venv-floor: $(FLOOR_VENV)/.installed

demo: $(STAMP)
	$(PY) -m jaxtransport.rollouts --compare

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider $(RANGE_TESTS)

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider $(RANGE_TESTS)

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(FLOOR_VENV) build *.egg-info
