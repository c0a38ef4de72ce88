"""The JAX ecosystem through every transport, both ways: flax (linen ``TrainState`` + optax, nnx
``split``/``merge`` and ``Module`` objects), equinox modules, optax states, orbax checkpoints.

Each object goes to a worker as an argument and comes back as a result (the worker returns what
it received and what it computed from it) through the Pool (arguments/results and ``share()``),
the Executor, ``jaxtransport.multiprocessing`` Queue and Pipe, and Ray tasks and actors; both
are compared, bit for bit, with the same computation in this process. A linen ``TrainState``'s
treedef compares unequal after any pickle round trip (its static ``apply_fn`` is a bound method
of a new module instance), so trees are compared by key paths, node types, leaves, dtypes and
weak types; the treedef itself too wherever it survives pickling.

The libraries are the ``ecosystem`` extra (``pip install -e '.[ecosystem]'``); a case whose
library is missing skips with the reason. One pool, one executor, one process and one Ray
cluster serve the whole module; models are small (tens of KiB), above a 1 KiB ``shm_threshold``
so their arrays do travel through shared memory.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxtransport as jt

from .conftest import ROOT, memfd_mapped

# Slow (make test-slow): module-scoped pools, a Ray cluster and fresh interpreters per library.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

try:
    import optax
except ImportError:  # pragma: no cover - the ecosystem extra is not installed
    optax = None
try:
    import flax
    import flax.linen as nn
    from flax import nnx
    from flax.training import train_state
except ImportError:  # pragma: no cover
    flax = nn = nnx = train_state = None
try:
    import equinox as eqx
except ImportError:  # pragma: no cover
    eqx = None


def _missing(*names: str) -> str | None:
    """Why a case cannot run here (None: it can)."""
    have = {"flax": flax, "optax": optax, "equinox": eqx}
    gone = [n for n in names if have[n] is None]
    return f"needs {', '.join(gone)} (pip install -e '.[ecosystem]')" if gone else None


THRESHOLD = 1024  # bytes: every parameter array below goes through shared memory
D_IN, D_HID, D_OUT, BATCH = 32, 64, 4, 16


def batch():
    x = jax.random.normal(jax.random.key(1), (BATCH, D_IN), jnp.float32)
    y = jax.random.normal(jax.random.key(2), (BATCH, D_OUT), jnp.float32)
    return x, y


# --------------------------------------------------------------------------------------------
# The objects and one training step on each (module level: the workers import them)

if nn is not None and optax is not None:

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D_OUT)(nn.relu(nn.Dense(D_HID)(x)))

    @jax.jit
    def linen_step(state, x, y):
        def loss(p):
            return ((state.apply_fn({"params": p}, x) - y) ** 2).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))


def make_train_state():
    model = LinenMLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, D_IN)))["params"]
    return (train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), *batch())


if nnx is not None:

    class NnxMLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(D_IN, D_HID, rngs=rngs)
            self.l2 = nnx.Linear(D_HID, D_OUT, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] += 1
            return self.l2(nnx.relu(self.l1(x)))


def _nnx_train(model, x, y):
    def loss(m):
        return ((m(x) - y) ** 2).mean()

    grads = nnx.grad(loss)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads))
    return model(x)


def nnx_split_step(graphdef, state, x, y):
    model = nnx.merge(graphdef, state)
    out = _nnx_train(model, x, y)
    return (*nnx.split(model), out)


def make_nnx_split():
    return (*nnx.split(NnxMLP(nnx.Rngs(0))), *batch())


def nnx_module_step(model, x, y):
    out = _nnx_train(model, x, y)
    return model, out


def make_nnx_module():
    return (NnxMLP(nnx.Rngs(0)), *batch())


if eqx is not None:

    @eqx.filter_jit
    def eqx_step(model, x, y):
        def loss(m):
            return ((jax.vmap(m)(x) - y) ** 2).mean()

        grads = eqx.filter_grad(loss)(model)
        model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
        return model, jax.vmap(model)(x)


def make_eqx():
    return (eqx.nn.MLP(D_IN, D_OUT, D_HID, 2, key=jax.random.key(0)), *batch())


if optax is not None:
    OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))


def optax_step(params, opt_state, grads):
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def make_optax():
    params = {"w": jax.random.normal(jax.random.key(3), (D_IN, D_HID)), "b": jnp.zeros(D_HID)}
    opt_state = OPT.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.5), params)
    params, opt_state = optax_step(params, opt_state, grads)  # a count above 0, moments set
    return params, opt_state, grads


CASES = {
    # name: (libraries, make the arguments, the step run on them)
    "linen-trainstate-adam": (("flax", "optax"), "make_train_state", "linen_step"),
    "nnx-split-merge": (("flax",), "make_nnx_split", "nnx_split_step"),
    "nnx-module": (("flax",), "make_nnx_module", "nnx_module_step"),
    "equinox-mlp": (("equinox",), "make_eqx", "eqx_step"),
    "optax-chain-state": (("optax",), "make_optax", "optax_step"),
}


def case_args(name):
    libs, make, step = CASES[name]
    why = _missing(*libs)
    if why:
        pytest.skip(why)
    return globals()[make](), globals()[step]


def call_and_echo(fn, *args):
    """What the worker runs: the step on what it received, and what it received."""
    return fn(*args), args


def call_shared(fn, args):
    return call_and_echo(fn, *args)


# --------------------------------------------------------------------------------------------
# Comparing trees bit for bit


def _node_types(treedef):
    data = treedef.node_data()
    return (data[0] if data else None, tuple(_node_types(c) for c in treedef.children()))


def _flat(tree):
    """Key paths and leaves; nnx Modules as their graph state (they are graph nodes, not
    pytrees)."""
    if nnx is not None:
        tree = jax.tree_util.tree_map(lambda v: ("nnx", nnx.split(v)) if isinstance(v, nnx.Module) else v, tree,
                                      is_leaf=lambda v: isinstance(v, nnx.Module))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return leaves, treedef


def assert_same(got, want):
    g, gdef = _flat(got)
    w, wdef = _flat(want)
    assert [jax.tree_util.keystr(p) for p, _ in g] == [jax.tree_util.keystr(p) for p, _ in w]
    assert _node_types(gdef) == _node_types(wdef)
    if gdef != wdef:  # only a linen TrainState's static apply_fn may differ (a new bound method)
        assert train_state is not None and "TrainState" in str(_node_types(wdef)), (gdef, wdef)
    for (path, a), (_, b) in zip(g, w):
        where = jax.tree_util.keystr(path)
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array)), where
        if isinstance(b, (jax.Array, np.ndarray)):
            assert a.dtype == b.dtype and a.shape == b.shape, where
            assert getattr(a, "weak_type", None) == getattr(b, "weak_type", None), where
            if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
        elif callable(b):
            assert getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None), where
        else:
            assert a == b, where


def check(name, got, args, fn):
    """``got`` = the worker's (step result, echoed arguments): both as computed here."""
    result, echoed = got
    want = fn(*args)  # the same step in this process, on the same inputs
    assert_same(result, want)
    # An nnx Module is changed in place by the step, here as there: compared after it.
    assert_same(echoed, args)


# --------------------------------------------------------------------------------------------
# The transports (one of each for the module)


@pytest.fixture(scope="module")
def pool():
    with jt.Pool(1, shm_threshold=THRESHOLD) as p:
        yield p


@pytest.fixture(scope="module")
def executor():
    with jt.Executor(max_workers=1, shm_threshold=THRESHOLD) as ex:
        yield ex


def jmp_server(q_in, q_out, conn):
    """Serves calls from a Queue and from a Pipe until told to stop (or 10 idle minutes)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            msg = q_in.get(timeout=0.02)
        except queue.Empty:
            msg = None
        if msg == "stop":
            return
        if msg is not None:
            q_out.put(call_and_echo(msg[0], *msg[1]))
            deadline = time.monotonic() + 600
        if conn.poll(0.02):
            fn, args = conn.recv()
            conn.send(call_and_echo(fn, *args))
            deadline = time.monotonic() + 600


@pytest.fixture(scope="module")
def jmp_peer():
    import jaxtransport.multiprocessing as jmp

    ctx = jmp.get_context("spawn")
    q_in, q_out = ctx.Queue(shm_threshold=THRESHOLD), ctx.Queue(shm_threshold=THRESHOLD)
    here, there = ctx.Pipe(shm_threshold=THRESHOLD)
    proc = ctx.Process(target=jmp_server, args=(q_in, q_out, there))
    proc.start()
    try:
        yield q_in, q_out, here
    finally:
        q_in.put("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        for c in (here, there):
            c.close()
        for q in (q_in, q_out):
            q.close()
            q.join_thread()


class Runner:
    def run(self, fn, *args):
        return call_and_echo(fn, *args)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    import warnings

    import jaxtransport.ray as jr

    if ray.is_initialized():
        ray.shutdown()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        jr.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=1 << 29,
                runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}})
    try:
        yield ray, ray.remote(call_and_echo), ray.remote(Runner).remote()
    finally:
        ray.shutdown()
        jr.unregister()


# Each test names its transport's fixture as an argument: module-scoped processes then start
# before the leak check's snapshot of child processes.
CASE_NAMES = sorted(CASES)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_pool_arguments_and_results(case, pool):
    args, fn = case_args(case)
    check(case, pool.apply(call_and_echo, (fn, *args)), args, fn)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_pool_share(case, pool):
    args, fn = case_args(case)
    with pool.share(args) as shared:
        check(case, pool.apply(call_shared, (fn, shared)), args, fn)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_executor(case, executor):
    args, fn = case_args(case)
    check(case, executor.submit(call_and_echo, fn, *args).result(timeout=120), args, fn)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_multiprocessing_queue(case, jmp_peer):
    args, fn = case_args(case)
    q_in, q_out, _ = jmp_peer
    q_in.put((fn, args))
    check(case, q_out.get(timeout=120), args, fn)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_multiprocessing_pipe(case, jmp_peer):
    args, fn = case_args(case)
    conn = jmp_peer[2]
    conn.send((fn, args))
    assert conn.poll(120), "no answer on the pipe within 120 s"
    check(case, conn.recv(), args, fn)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("case", CASE_NAMES)
def test_ray_task(case, ray_cluster):
    args, fn = case_args(case)
    ray, task, _ = ray_cluster
    check(case, ray.get(task.remote(fn, *args), timeout=180), args, fn)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("case", CASE_NAMES)
def test_ray_actor(case, ray_cluster):
    args, fn = case_args(case)
    ray, _, actor = ray_cluster
    check(case, ray.get(actor.run.remote(fn, *args), timeout=180), args, fn)


def test_a_train_state_the_stock_pool_cannot_return_comes_back(pool):
    """The issue's case: the stock pool cannot even send a TrainState (optax's local
    functions); jaxtransport sends it and returns the updated one, usable for the next step."""
    args, fn = case_args("linen-trainstate-adam")
    state, x, y = args
    for _ in range(3):
        state = pool.apply(fn, (state, x, y))
    want = args[0]
    for _ in range(3):
        want = fn(want, x, y)
    assert_same(state, want)
    assert int(state.step) == 3
    assert_same(fn(state, x, y), fn(want, x, y))  # its tx and apply_fn work here


def test_a_tracer_inside_a_train_state_fails_fast_with_its_path(pool):
    args, fn = case_args("linen-trainstate-adam")

    @jax.jit
    def inside(state):
        pool.apply(call_and_echo, (fn, state, *args[1:]))
        return state

    with pytest.raises(jt.TracerTransportError, match=r"at args\[1\]\.step") as e:
        inside(args[0])
    assert isinstance(e.value, jax.errors.ConcretizationTypeError)
    assert pool.apply(abs, (-1,)) == 1  # nothing was sent; the pool is fine


# --------------------------------------------------------------------------------------------
# orbax: checkpoint a tree received from a worker


def worker_tree(seed):
    k = jax.random.key(seed)
    return {
        "w": jax.random.normal(k, (64, 64), jnp.float32),
        "b": jnp.arange(64, dtype=jnp.bfloat16),
        "step": jnp.asarray(7, jnp.int32),
        "np": np.arange(512, dtype=np.float64),
    }


def _orbax_round_trip(tree, path):
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, tree)
        ckpt.wait_until_finished()
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
        return ckpt.restore(path, target)


def _as_jax(tree):
    return jax.tree_util.tree_map(jnp.asarray, tree)


def test_orbax_saves_and_restores_a_tree_that_aliases_shared_memory(pool, tmp_path):
    got = pool.apply(worker_tree, (0,))
    assert memfd_mapped(got["w"].unsafe_buffer_pointer())  # it is the worker's shared memory
    restored = _orbax_round_trip(got, tmp_path / "aliased")
    assert_same(_as_jax(restored), _as_jax(worker_tree(0)))


def test_orbax_saves_a_tree_received_before_the_pool_closed(tmp_path):
    with jt.Pool(1, shm_threshold=THRESHOLD) as p:
        got = p.apply(worker_tree, (1,))
    assert memfd_mapped(got["w"].unsafe_buffer_pointer())  # still mapped: it owns the memory
    restored = _orbax_round_trip(got, tmp_path / "after_close")
    assert_same(_as_jax(restored), _as_jax(worker_tree(1)))


# --------------------------------------------------------------------------------------------
# equinox: a filter_jit function and a module defined in the user's __main__

EQX_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import equinox as eqx
    import jaxtransport as jt

    class Scaled(eqx.Module):
        mlp: eqx.nn.MLP
        scale: jax.Array

        def __call__(self, x):
            return self.mlp(x) * self.scale

    @eqx.filter_jit
    def step(model, x):
        grads = eqx.filter_grad(lambda m: jax.vmap(m)(x).sum())(model)
        model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.01 * g, grads))
        return model, jax.vmap(model)(x)

    def step_shared(tree):
        return step(*tree)

    def same(a, b):
        la, ta = jax.tree_util.tree_flatten(eqx.filter(a, eqx.is_array))
        lb, tb = jax.tree_util.tree_flatten(eqx.filter(b, eqx.is_array))
        return ta == tb and all(
            x.dtype == y.dtype and x.weak_type == y.weak_type and np.asarray(x).tobytes() == np.asarray(y).tobytes()
            for x, y in zip(la, lb))

    if __name__ == "__main__":
        model = Scaled(eqx.nn.MLP(8, 2, 16, 2, key=jax.random.key(0)), jnp.asarray(2.0))
        x = jax.random.normal(jax.random.key(1), (4, 8))
        want = step(model, x)
        with jt.Pool(1, start_method=sys.argv[1], shm_threshold=256) as p:
            got = p.apply(step, (model, x))
            with p.share((model, x)) as shared:
                got_shared = p.apply(step_shared, (shared,))
        print("SAME", same(got, want), same(got_shared, want), type(got[0]) is Scaled)
    """
)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_equinox_filter_jit_from_main(tmp_path, method):
    if eqx is None:
        pytest.skip(_missing("equinox"))
    script = tmp_path / "eqx_user.py"
    script.write_text(EQX_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(script), method], env=env, capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SAME True True True" in out.stdout, out.stdout + out.stderr[-3000:]
