"""pytest plugin: joblib's own tests with its process backends replaced by jaxtransport's.

Loaded by tests/test_joblib_peer.py into a pytest run of ``joblib.test.test_parallel`` (imported
from the installed joblib, not copied). Before that module is imported, joblib's two process
backends, ``"loky"`` (also joblib's default) and ``"multiprocessing"``, are registered as
``jaxtransport.joblib.JaxTransportBackend``: every test that runs a process backend in this
interpreter runs ours. Code that joblib's tests run in a fresh interpreter
(``check_subprocess_call``) keeps joblib's own backends.
"""

from __future__ import annotations


def pytest_configure(config):
    import joblib

    from jaxtransport.joblib import JaxTransportBackend

    joblib.register_parallel_backend("loky", JaxTransportBackend)
    joblib.register_parallel_backend("multiprocessing", JaxTransportBackend)


def pytest_collection_modifyitems(config, items):
    """``JAXTRANSPORT_PEER_SHARD=i/n`` keeps every n-th test from the i-th (in collection
    order): tests/test_joblib_peer.py runs the module as n such shards, one pytest run each, so
    that the suite's test processes share them out (Note [parallel test processes])."""
    import os

    shard = os.environ.get("JAXTRANSPORT_PEER_SHARD")
    if not shard:
        return
    i, n = (int(v) for v in shard.split("/"))
    keep = [item for k, item in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i])
    items[:] = keep


def pytest_unconfigure(config):
    from jaxtransport.joblib import shutdown

    shutdown()
