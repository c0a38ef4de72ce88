"""What ``register()``'s documentation says about a Tracer on a stock ``multiprocessing.Queue``:
the queue pickles in its feeder thread, so the error is reported there and the item is dropped;
``check_transportable`` fails at the call site instead."""

from __future__ import annotations

import multiprocessing
import queue

import jax
import jax.numpy as jnp
import pytest

import jaxtransport as jt


def test_a_tracer_on_a_stock_queue_is_reported_from_the_feeder_thread_and_dropped(capfd):
    q = multiprocessing.get_context("spawn").Queue()
    at_call_site = {}
    jt.register()
    try:

        @jax.jit
        def step(x):
            q.put({"w": x})  # returns normally: pickled later, on the feeder thread
            try:
                jt.check_transportable({"w": x})
            except jt.TracerTransportError as e:
                at_call_site["error"] = e
            return x * 2

        step(jnp.ones(3))
        with pytest.raises(queue.Empty):
            q.get(timeout=2)  # dropped: the consumer never receives it
        q.put("next")  # the queue itself keeps working
        assert q.get(timeout=30) == "next"
    finally:
        jt.unregister()
        q.close()
        q.join_thread()
    printed = capfd.readouterr().err
    assert "TracerTransportError" in printed and "Cowardly refusing" in printed
    assert "['w']" in str(at_call_site["error"])


def test_register_and_the_docs_document_it():
    import os

    from .conftest import ROOT

    doc = jt.register.__doc__
    assert "multiprocessing.Queue" in doc and "feeder thread" in doc and "check_transportable" in doc
    with open(os.path.join(ROOT, "docs", "guides", "codec.md"), encoding="utf-8") as f:
        guide = f.read()  # the codec and register() guide of the documentation site
    assert "feeder thread" in guide and "jt.check_transportable(obj)` before `q.put(obj)`" in guide
