"""Where does start-up cost land? (issue 22: no JAX import the data does not need)

Every repetition runs in a fresh interpreter (``python -m benchmarks.startup --probe CASE``), so
that whether the parent has imported JAX is what the row says, and no import is already done.

Questions, one per row name:

- ``startup_numpy`` / ``startup_numpy_jax_parent``: from the pool's constructor to the first
  result of a numpy-only task, in a parent that never imported JAX / that imported it before
  (not timed). Baseline: ``multiprocessing.Pool`` (spawn) in the same kind of parent.
- ``startup_jax``: the same for a task that uses JAX on a small ``jax.Array`` argument, in a
  parent that imported JAX. Baseline: ``multiprocessing.Pool``.
- ``first_jax_argument_now`` / ``first_jax_argument_2s``: a started pool (its first numpy
  task done), then a task taking a large ``jax.Array``: at once, or after the parent spent 2 s
  on its own work (building a model, say). Baseline: the same call repeated on that pool (the
  steady state, median of 3).
- ``first_share_4_workers``: a started 4-worker pool, then ``share()`` of a tree of large
  ``jax.Array`` leaves and one task per worker reading it. Baseline: the same again with a new
  tree (the steady state).

The start-up rows depend on whether jaxtransport's modules have bytecode: a fresh interpreter
(the parent, each worker) compiles every module it imports that has none, and with
``PYTHONDONTWRITEBYTECODE`` (docker/, CI) none is ever written. A user's ``pip install`` writes
it (the stdlib that ``multiprocessing.Pool`` runs ships it); an editable install has it once
``make venv`` / ``make bench`` ran ``compileall``. Each row records it (``bytecode``: ``current``,
``none``, or ``k of n modules``) and the environment line says it.

``jaxtransport.Pool`` rows come with the default ``preload_jax`` (workers import JAX in the
background when the parent has it) and with ``preload_jax=False`` (workers import JAX in the
first task that needs it: the behaviour before issue 22). ``ratio`` is the baseline's median /
this row's median (higher is better); ``vs_baseline`` its inverse (this row's time in baselines).

    python -m benchmarks --only startup [--quick] [--publish]
    python -m benchmarks.startup [--quick] [--reps N] [--size-mib M]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from . import _common

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JT, JT_LAZY, MP = "jaxtransport.Pool", "jaxtransport.Pool preload_jax=False", "multiprocessing.Pool"
STEADY = "steady state (same pool)"


# -- task bodies (importable: workers import this module; no JAX at import)
def noop(x=None):
    return x


def numpy_task(x):
    return float(np.asarray(x).sum())


def jax_task(x):
    import jax.numpy as jnp

    return float(jnp.asarray(x).sum())


def nbytes_of(x):
    return int(x.nbytes)


def read_leaf(args):
    tree, i = args
    return float(tree["w"][i])


# -- probes: each runs in a fresh interpreter and prints one JSON line
def _pool(kind: str, n: int = 1):
    if kind == "mp":
        return multiprocessing.get_context("spawn").Pool(n)
    import jaxtransport as jt

    return jt.Pool(n, preload_jax=False if kind == "jt_lazy" else None)


def probe_startup(kind: str, task: str, jax_parent: bool) -> dict:
    if jax_parent:
        import jax
        import jax.numpy as jnp

        jax.devices()
        arg = jnp.ones(1000) if task == "jax" else np.ones(1000)
    else:
        arg = np.ones(1000)
    fn = jax_task if task == "jax" else numpy_task
    t = time.perf_counter()
    with _pool(kind) as pool:
        pool.apply(fn, (arg,))
        dt = time.perf_counter() - t
    return {"seconds": dt, "jax_in_parent": "jax" in sys.modules}


def probe_first_argument(kind: str, size: int, pause: float) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.arange(size // 4, dtype=jnp.float32).block_until_ready()
    with _pool(kind) as pool:
        pool.apply(numpy_task, (np.ones(4),))  # started: the first result is back
        time.sleep(pause)
        t = time.perf_counter()
        assert pool.apply(nbytes_of, (x,)) == size
        first = time.perf_counter() - t
        steady = []
        for _ in range(3):
            y = jax.block_until_ready(x + 0)  # a new array (the same one again goes by handle)
            t = time.perf_counter()
            pool.apply(nbytes_of, (y,))
            steady.append(time.perf_counter() - t)
            del y
    return {"seconds": first, "steady": statistics.median(steady)}


def probe_first_share(kind: str, size: int, workers: int = 4) -> dict:
    import jax.numpy as jnp

    trees = [{"w": jnp.arange(size // 4, dtype=jnp.float32) + k, "b": jnp.ones(1024)} for k in range(2)]
    for t in trees:
        t["w"].block_until_ready()
    with _pool(kind, workers) as pool:
        pool.map(numpy_task, [np.ones(4)] * workers, chunksize=1)  # started
        times = []
        for tree in trees:
            t = time.perf_counter()
            with pool.share(tree) as shared:
                pool.map(read_leaf, [(shared, i) for i in range(workers)], chunksize=1)
            times.append(time.perf_counter() - t)
    return {"seconds": times[0], "steady": times[1]}


PROBES = {
    "startup_numpy": lambda kind, size: probe_startup(kind, "numpy", False),
    "startup_numpy_jax_parent": lambda kind, size: probe_startup(kind, "numpy", True),
    "startup_jax": lambda kind, size: probe_startup(kind, "jax", True),
    "first_jax_argument_now": lambda kind, size: probe_first_argument(kind, size, 0.0),
    "first_jax_argument_2s": lambda kind, size: probe_first_argument(kind, size, 2.0),
    "first_share_4_workers": lambda kind, size: probe_first_share(kind, size),
}


def _probe(name: str, kind: str, size: int) -> dict:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--probe", name, kind, str(size)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PROBE ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"probe {name} {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[-1][len("PROBE "):])


# -- the run
def _row(name, size, transport, ts, base=None, **extra):
    return _common.median_row(name, size, transport, ts, base, inverse=True, **extra)


def bytecode_state(root: str = os.path.join(ROOT, "jaxtransport")) -> str:
    """Whether the probes' jaxtransport (this tree's) has bytecode its imports will use: a
    ``__pycache__`` file per module whose header names this Python and the source's current
    mtime and size (what the import system checks). ``"current"``, ``"none"``, or ``"k of n
    modules"``."""
    import importlib.util

    total = current = 0
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in files:
            if not f.endswith(".py"):
                continue
            total += 1
            src = os.path.join(dirpath, f)
            try:
                with open(importlib.util.cache_from_source(src), "rb") as fh:
                    head = fh.read(16)
                st = os.stat(src)
            except OSError:
                continue
            flags = int.from_bytes(head[4:8], "little")
            stamp = (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
            if head[:4] == importlib.util.MAGIC_NUMBER and (
                flags & 1 or (int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")) == stamp
            ):
                current += 1  # a timestamp pyc matching the source (or a hash-based one)
    if total and current == total:
        return "current"
    return "none" if current == 0 else f"{current} of {total} modules"


def _print(r):
    vs = f"  {r['vs_baseline']:.2f}x baseline" if r.get("vs_baseline") else ""
    _common.print_median_row(r, name_width=26, size_width=5, seconds_width=7, tail=vs)


def run(quick: bool = False, reps: int | None = None, size: int | None = None) -> list[dict]:
    reps = reps or (2 if quick else 3)
    size = size or (64 * MIB if quick else 256 * MIB)
    print("environment:", environment(), flush=True)
    bytecode = bytecode_state()
    rows: list[dict] = []
    for name in ("startup_numpy", "startup_numpy_jax_parent", "startup_jax"):
        kinds = ("jt", "mp") if name == "startup_numpy" else ("jt", "jt_lazy", "mp")
        times: dict = {k: [] for k in kinds}
        for rep in range(reps):
            order = kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]  # rotate: drift hits all
            for kind in order:
                times[kind].append(_probe(name, kind, 0)["seconds"])
        base = statistics.median(times["mp"])
        for kind in kinds:
            label = {"jt": JT, "jt_lazy": JT_LAZY, "mp": MP}[kind]
            rows.append(_row(name, 0, label, times[kind], base=None if kind == "mp" else base, baseline=MP,
                             bytecode=bytecode))
            _print(rows[-1])
    for name in ("first_jax_argument_now", "first_jax_argument_2s", "first_share_4_workers"):
        got: dict = {"jt": [], "jt_lazy": []}
        for rep in range(reps):
            for kind in (("jt", "jt_lazy") if rep % 2 == 0 else ("jt_lazy", "jt")):
                got[kind].append(_probe(name, kind, size))
        for kind, label in (("jt", JT), ("jt_lazy", JT_LAZY)):
            steady = [g["steady"] for g in got[kind]]
            rows.append(_row(name, size, f"{label}: {STEADY}", steady))
            _print(rows[-1])
            rows.append(_row(name, size, label, [g["seconds"] for g in got[kind]], base=statistics.median(steady),
                             baseline=STEADY))
            _print(rows[-1])
    return rows


def environment() -> str:
    return f"{_common.versions_line()}, jaxtransport bytecode: {bytecode_state()}"


def check_targets(rows: list[dict]) -> list[str]:
    """Issue 22, tightened by issue 43: numpy-only start-up within 1.3x of multiprocessing.Pool
    with or without JAX in the parent; the first JAX argument 2 s after start-up within 3x of
    the steady state."""
    out = []
    for r in rows:
        v = r.get("vs_baseline")
        if v is None or r["transport"] != JT:
            continue
        limit = {"startup_numpy": 1.3, "startup_numpy_jax_parent": 1.3, "first_jax_argument_2s": 3.0}.get(r["name"])
        if limit:
            out.append(f"{'PASS' if v <= limit else 'MISS'} {r['name']}: {v:.2f}x {r['baseline']} (<= {limit}x)")
    return out


def main(argv=None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--probe"]:
        name, kind, size = argv[1], argv[2], int(argv[3])
        print("PROBE " + json.dumps(PROBES[name](kind, size)), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--size-mib", type=int, default=None, help="the large array's size (default 256)")
    args = ap.parse_args(argv)
    rows = run(quick=args.quick, reps=args.reps, size=args.size_mib * MIB if args.size_mib else None)
    _common.print_targets(check_targets(rows))


if __name__ == "__main__":
    sys.exit(_common.main_of_module("benchmarks.startup", cpu=True))
