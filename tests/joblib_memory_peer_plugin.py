"""pytest plugin: joblib's own Memory tests with ``joblib.Memory`` replaced by jaxtransport's.

Loaded by tests/test_joblib_peer.py into a pytest run of ``joblib.test.test_memory`` (imported
from the installed joblib, not copied). Before that module is imported, ``joblib.Memory`` and
``joblib.memory.Memory`` (where the module imports it from) are replaced by
``jaxtransport.joblib.Memory``, and JAX is imported, so that the Memory takes its JAX paths (the
pytree walk over every result, the array-aware hasher) on joblib's values too. joblib's parallel
backends are left as they are. Code that joblib's tests run in a fresh interpreter
(``subprocess.run``) keeps joblib's own Memory.
"""

from __future__ import annotations

import sys

import pytest


def pytest_configure(config):
    import jax  # noqa: F401  (jaxtransport.joblib.Memory skips its JAX paths while JAX is not loaded)
    import joblib
    import joblib.memory

    from jaxtransport.joblib import Memory

    joblib.Memory = Memory
    joblib.memory.Memory = Memory


def pytest_collection_modifyitems(session, config, items):
    # A joblib that imported Memory from elsewhere would run its own Memory here, and pass.
    from jaxtransport.joblib import Memory

    module = sys.modules.get("joblib.test.test_memory")
    if module is None or module.Memory is not Memory:
        raise pytest.UsageError("joblib.test.test_memory does not use jaxtransport.joblib.Memory")
