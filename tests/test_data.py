"""``jaxtransport.data.Loader`` through its public API, with real spawned workers: order and
determinism whatever the number of workers, epochs, shuffling and the remainder, sharding over
a CPU mesh, every way out of a loop (break, an exception, close, garbage collection, Ctrl-C)
leaving no worker and no /dev/shm entry, a worker's exception with its traceback, the error for
a function that returns no array tree, and a stopped worker that cannot hang the loop."""

from __future__ import annotations

import gc
import multiprocessing.pool
import os
import signal
import sys
import time

import jax
import numpy as np
import pytest

from jaxtransport.data import Loader

from .conftest import ROOT, alive, child_pids, popen_interruptible, run_python, shm_entries, wait_until

pytestmark = pytest.mark.timeout(120)


# -- what the workers run (module level: they import it by reference)
def noisy(i, rng):
    """The index and random numbers that depend on (seed, epoch, index) only."""
    return {"i": np.int64(i), "noise": rng.random(3), "img": np.full((2, 2), i % 251, np.uint8)}


def with_pid(i, rng):
    time.sleep(0.02)
    return {"i": np.int64(i), "pid": np.int64(os.getpid())}


def slow_after_two(i, rng):
    if i >= 2:
        time.sleep(0.3)
    return np.int64(os.getpid())


def fails_at_five(i, rng):
    if i == 5:
        raise KeyError(f"bad record {i}")
    return np.int64(i)


def returns_text(i, rng):
    return {"label": f"class {i}"}


def ragged(i, rng):
    return np.zeros(2 + i % 2)


def whole_batch(records, rng):
    return {"sum": np.asarray(records).sum(keepdims=True), "noise": rng.random(1)}


def host(batch):
    return jax.tree.map(np.asarray, batch)


def epochs_of(loader: Loader, epochs: int) -> list[list[dict]]:
    return [[host(b) for b in loader] for _ in range(epochs)]


def test_the_same_batches_in_order_whatever_the_number_of_workers():
    runs = {}
    for workers in (1, 2):
        with Loader(range(22), noisy, batch_size=4, seed=7, shuffle=True, workers=workers) as loader:
            assert len(loader) == 6
            runs[workers] = epochs_of(loader, 2)
    one, two = runs[1], runs[2]
    for e in range(2):
        order = np.concatenate([b["i"] for b in one[e]])
        assert sorted(order.tolist()) == list(range(22))  # every record once per epoch
        assert [len(b["i"]) for b in one[e]] == [4, 4, 4, 4, 4, 2]  # the remainder kept, last
        for b1, b2 in zip(one[e], two[e], strict=True):
            np.testing.assert_array_equal(b1["i"], b2["i"])
            np.testing.assert_array_equal(b1["noise"], b2["noise"])
            np.testing.assert_array_equal(b1["img"], (b1["i"] % 251).astype(np.uint8)[:, None, None] + np.zeros((2, 2), np.uint8))
    first, second = (np.concatenate([b["i"] for b in one[e]]) for e in range(2))
    assert first.tolist() != second.tolist()  # a new order each epoch
    assert first.tolist() != list(range(22))
    noise = {int(i): n.tolist() for e in range(2) for b in one[e] for i, n in zip(b["i"], b["noise"])}
    assert len({tuple(v) for v in noise.values()}) == 22  # each example its own numbers
    # Another seed: another order (the source's order without shuffle: the batch_transform test).
    with Loader(range(22), noisy, batch_size=4, seed=8, shuffle=True, workers=1, drop_remainder=True) as loader:
        assert len(loader) == 5
        other = epochs_of(loader, 1)[0]
    assert np.concatenate([b["i"] for b in other]).tolist() != first[:20].tolist()


def test_epochs_break_and_batches_across_epochs():
    with Loader(range(10), noisy, batch_size=3, seed=1, shuffle=True, workers=2, drop_remainder=True,
                start_epoch=4) as loader:
        assert len(loader) == 3 and loader.position is None
        batch = next(iter(loader))
        assert isinstance(batch["i"], jax.Array) and batch["img"].shape == (3, 2, 2)
        assert batch["img"].dtype == np.uint8
        assert loader.position == (4, 0)
        for b in loader:  # epoch 4 was left after one batch: this is epoch 5, from its first
            assert loader.epoch == 5
            break
        assert loader.position == (5, 0)
        stream = [host(b) for b in loader.batches(epochs=2)]  # epochs 6 and 7
        assert loader.position == (7, 2) and len(stream) == 6
        again = [host(b) for b in loader]  # epoch 8
    with Loader(range(10), noisy, batch_size=3, seed=1, shuffle=True, workers=1, drop_remainder=True,
                start_epoch=6) as fresh:
        expected = [host(b) for b in fresh.batches(epochs=3)]
    for a, b in zip(stream + again, expected, strict=True):  # resuming at an epoch gives it exactly
        np.testing.assert_array_equal(a["i"], b["i"])
        np.testing.assert_array_equal(a["noise"], b["noise"])


def test_a_batch_transform_gets_the_records_and_one_generator_per_batch():
    out = []
    for workers in (1, 2):
        with Loader(np.arange(9), batch_transform=whole_batch, batch_size=4, seed=3, workers=workers) as loader:
            out.append([host(b) for b in loader])
    assert [b["sum"].tolist() for b in out[0]] == [[6], [22], [8]]
    for a, b in zip(*out, strict=True):
        np.testing.assert_array_equal(a["noise"], b["noise"])


@pytest.mark.slow  # a fresh interpreter with 4 CPU devices: JAX's start and a pool's, about 13 s
def test_batches_sharded_over_a_cpu_mesh():
    code = f"""
import sys; sys.path.insert(0, {ROOT!r})
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtransport.data import Loader
from tests.test_data import noisy

if __name__ == "__main__":
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    with Loader(range(16), noisy, batch_size=8, seed=0, workers=2, sharding=mesh, data_axis="data") as loader:
        for b in loader:
            x = b["img"]
            assert x.sharding == NamedSharding(mesh, P("data")), x.sharding
            assert {{s.data.shape for s in x.addressable_shards}} == {{(4, 2, 2)}}
            assert len(x.addressable_shards) == 4  # split over data, replicated over model
    one = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with Loader(range(5), noisy, batch_size=2, workers=1, sharding=one) as loader:
        b = next(iter(loader))["img"]
        assert b.sharding == NamedSharding(one, P("batch")) and b.sharding.is_fully_addressable
    for bad, why in (
        (dict(batch_size=6, sharding=Mesh(np.array(jax.devices()), ("data",))), "split evenly over 4"),
        (dict(batch_size=8, sharding=Mesh(np.array(jax.devices()), ("data",))), "last, shorter batch"),
        (dict(batch_size=8, sharding=mesh), "say which one"),
        (dict(batch_size=8, sharding=mesh, data_axis="nope"), "no axis 'nope'"),
    ):
        try:
            Loader(range(18), noisy, workers=1, **bad)
        except ValueError as e:
            assert why in str(e), str(e)
        else:
            raise AssertionError(bad)
    print("OK")
"""
    proc = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_break_exception_close_and_collection_leave_no_worker_and_no_shm():
    before_children, before_shm = child_pids(), shm_entries()

    def workers_gone() -> bool:
        return not (child_pids() - before_children)

    with Loader(range(40), with_pid, batch_size=2, workers=2) as loader:
        for _ in loader:
            break
    assert workers_gone()
    with pytest.raises(ZeroDivisionError):
        with Loader(range(40), with_pid, batch_size=2, workers=2) as loader:
            for _ in loader:
                1 / 0  # noqa: B018
    assert workers_gone()
    loader = Loader(range(40), with_pid, batch_size=2, workers=2)
    next(iter(loader))
    loader.close()
    loader.close()  # twice is fine
    assert workers_gone()
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(loader))
    for _ in Loader(range(40), with_pid, batch_size=2, workers=2):  # nobody holds the loader
        break
    gc.collect()
    assert wait_until(workers_gone, 15), child_pids() - before_children
    assert not {e for e in shm_entries() - before_shm if e.startswith("jaxtransport")}


def test_a_worker_exception_is_raised_in_the_loop_with_its_traceback():
    with Loader(range(12), fails_at_five, batch_size=2, workers=2) as loader:
        it = iter(loader)
        assert [int(x) for x in next(it)] == [0, 1]
        assert [int(x) for x in next(it)] == [2, 3]
        with pytest.raises(KeyError, match="bad record 5") as info:
            next(it)
        cause = info.value.__cause__
        assert isinstance(cause, multiprocessing.pool.RemoteTraceback)
        assert "fails_at_five" in str(cause) and "test_data.py" in str(cause)
        if sys.version_info >= (3, 11):
            assert "batch 2 of epoch 0" in "".join(info.value.__notes__)
        with pytest.raises(RuntimeError, match="stopped after an error"):
            next(iter(loader))


def test_a_function_that_returns_no_array_tree_is_named_with_the_fix():
    with Loader(range(4), returns_text, batch_size=2, workers=1) as loader:
        with pytest.raises(TypeError) as info:
            next(iter(loader))
    text = str(info.value)
    assert "returns_text" in text and "test_data.py" in text and "['label']" in text
    assert "a str" in text and "source[0]" in text and "np.asarray" in text
    with Loader(range(4), ragged, batch_size=2, workers=1) as loader:
        with pytest.raises(ValueError, match=r"ragged.*float64\[3\].*crop or pad"):
            next(iter(loader))


def test_arguments_are_checked_before_any_worker_starts():
    before = child_pids()
    for kwargs, error, text in (
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=4, batch_transform=whole_batch), ValueError, "not both"),
        (dict(batch_size=40, drop_remainder=True), ValueError, "no batch"),
        (dict(batch_size=4, seed=-1), ValueError, "seed"),
        (dict(batch_size=4, pool_options={"placement": "device"}), TypeError, "placement"),
        (dict(batch_size=4, data_axis="data"), ValueError, "mesh"),
    ):
        with pytest.raises(error, match=text):
            Loader(range(10), noisy, **kwargs)
    with pytest.raises(TypeError, match="sequence"):
        Loader(iter(range(10)), noisy, batch_size=2)
    assert child_pids() == before


def test_a_stopped_worker_makes_the_loop_time_out_instead_of_hanging():
    with Loader(range(50), slow_after_two, batch_size=1, workers=1, prefetch=1, device_prefetch=1) as loader:
        it = iter(loader)
        pid = int(next(it)[0])  # no limit while the worker starts (seconds on a busy machine)
        loader.timeout = 1.5
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=r"timeout=1\.5"):
                for _ in range(5):  # what was already made comes first
                    next(it)
            assert time.monotonic() - start < 60
        finally:
            os.kill(pid, signal.SIGCONT)
        assert int(next(it)[0]) == pid  # it goes on once the worker does


_CTRL_C = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
from jaxtransport.data import Loader
from tests.conftest import _service_pids, child_pids
from tests.test_data import with_pid

if __name__ == "__main__":
    try:
        with Loader(range(10**6), with_pid, batch_size=2, workers=2) as loader:
            for i, b in enumerate(loader):
                if i == 3:
                    print("READY", flush=True)
                time.sleep(0.01)
    except KeyboardInterrupt:
        print("INTERRUPTED", sorted(child_pids() - _service_pids()), flush=True)
        raise
"""


@pytest.mark.slow  # a fresh interpreter and a pool's start: about 8 s
def test_ctrl_c_in_the_loop_ends_the_workers():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = popen_interruptible([sys.executable, "-c", _CTRL_C], env=env, stdout=-1, stderr=-1, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", line + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "INTERRUPTED []" in out, out + err
    assert "KeyboardInterrupt" in err and proc.returncode != 0


def test_importing_the_package_starts_nothing():
    proc = run_python(
        "import sys, threading, jaxtransport, jaxtransport.data\n"
        "assert 'jax' not in sys.modules, 'jax imported'\n"
        "assert 'jaxtransport.pool._facade' not in sys.modules\n"
        "assert threading.active_count() == 1\n"
        "from jaxtransport.data import _worker\n"
        "assert 'jax' not in sys.modules, 'the worker module imported jax'\n"
        "print('OK')"
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
    assert alive(os.getpid())
