"""Release smoke test: run by ``.ci/release-check`` with the built wheel installed in a clean
virtualenv, from a temporary folder outside the repository (never from the checkout).

    python release_smoke.py REPO [--require-joblib]

Checks that jaxtransport is imported from that virtualenv's site-packages (not from REPO), then
exercises what a user does first: ``jt.register()``, a bit-exact ``jt.dumps``/``jt.loads`` round
trip of a jax.Array, ``jt.Pool.map`` with a jax.Array argument, a ``jaxtransport.multiprocessing``
queue put/get across a spawned process, and the joblib backend (when joblib is installed;
``--require-joblib`` makes its absence an error). Every step asserts its values; any failure
exits non-zero.
"""

from __future__ import annotations

import os
import pickle
import sys
import sysconfig


def double(x):
    return x * 2


def add_one(inbox, outbox):
    """A spawned process: take one array from ``inbox``, put it back plus one on ``outbox``."""
    outbox.put(inbox.get(timeout=120) + 1)


def same_bits(a, b) -> bool:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_where(repo: str) -> None:
    import importlib.metadata

    import jaxtransport as jt

    where = os.path.realpath(jt.__file__)
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    assert sys.prefix != sys.base_prefix, f"not in a virtualenv: {sys.prefix}"
    assert where.startswith(site + os.sep), f"jaxtransport imported from {where}, not from {site}"
    assert not where.startswith(os.path.realpath(repo) + os.sep), f"jaxtransport imported from the repository: {where}"
    assert not os.getcwd().startswith(os.path.realpath(repo)), os.getcwd()
    assert os.path.exists(os.path.join(os.path.dirname(where), "py.typed")), "py.typed not installed"
    installed = importlib.metadata.version("jaxtransport")
    assert installed == jt.__version__, (installed, jt.__version__)
    print(f"jaxtransport {jt.__version__} from {where}")


def main(repo: str, require_joblib: bool) -> None:
    check_where(repo)

    import jax
    import jax.numpy as jnp

    import jaxtransport as jt
    import jaxtransport.multiprocessing as jmp

    # 2 MiB of float32 and a bfloat16 array: over the Pool's and the queue's 1 MiB shared-memory
    # threshold, and a dtype numpy has only through ml_dtypes.
    x = jax.random.normal(jax.random.key(0), (512, 1024), dtype=jnp.float32)
    h = jnp.arange(4096, dtype=jnp.bfloat16).reshape(64, 64)

    # the codec, and pickle after register()
    for a in (x, h):
        data, buffers = jt.dumps(a)  # the metadata pickle, and the host buffers out-of-band
        for back in (jt.loads(data, buffers), jt.loads(data, [bytes(b) for b in buffers])):  # aliased, copied
            assert isinstance(back, jax.Array) and same_bits(back, a), "jt.dumps/jt.loads round trip differs"
    jt.register()
    back = pickle.loads(pickle.dumps(x, protocol=5))
    assert isinstance(back, jax.Array) and same_bits(back, x), "pickle round trip after jt.register() differs"
    print("codec: jt.dumps/jt.loads and pickle after jt.register(): bit-exact")

    # the Pool: spawned workers, jax.Array arguments and results through shared memory
    with jt.Pool(2) as pool:
        out = pool.map(double, [x, x + 1])
    assert all(isinstance(o, jax.Array) for o in out)
    assert same_bits(out[0], x * 2) and same_bits(out[1], (x + 1) * 2), "Pool.map results differ"
    print("Pool.map: 2 spawned workers, jax.Array arguments and results: bit-exact")

    # jaxtransport.multiprocessing: a queue to a spawned process and one back
    ctx = jmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=add_one, args=(inbox, outbox))
    proc.start()
    inbox.put(x)
    got = outbox.get(timeout=120)
    proc.join(60)
    assert proc.exitcode == 0, f"the spawned process exited with {proc.exitcode}"
    assert isinstance(got, jax.Array) and same_bits(got, x + 1), "queue round trip differs"
    print("jaxtransport.multiprocessing.Queue: put/get across a spawned process: bit-exact")

    # the joblib backend
    try:
        import joblib
    except ImportError:
        assert not require_joblib, "joblib is not installed (--require-joblib)"
        print("joblib: not installed, skipped")
    else:
        import jaxtransport.joblib as jtj

        jtj.register()
        try:
            with joblib.parallel_config(backend="jaxtransport", n_jobs=2):
                res = joblib.Parallel()(joblib.delayed(double)(a) for a in (x, x + 1))
        finally:
            jtj.shutdown()
        assert all(isinstance(r, jax.Array) for r in res)
        assert same_bits(res[0], x * 2) and same_bits(res[1], (x + 1) * 2), "joblib backend results differ"
        print(f"joblib {joblib.__version__}: Parallel(backend='jaxtransport', n_jobs=2): bit-exact")

    print("release smoke: OK")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit(f"usage: {sys.argv[0]} REPO [--require-joblib]")
    main(args[0], "--require-joblib" in args[1:])
