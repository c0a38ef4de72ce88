"""Where the demo's workers run, and how arrays reach them: Pool or Ray, jaxtransport or stock.

Each backend does three things per iteration: ``broadcast(params)`` makes the policy available to
every worker once (``Pool.share`` / ``ray.put``; the stock Pool has no broadcast, so the
parameters travel with every task, as they do with ``multiprocessing.Pool``), ``map(handle,
tasks)`` runs one rollout task per worker and returns the results in order, and
``release(handle)`` frees the broadcast. On Ray the tasks run on one actor per worker.
``close()`` shuts everything the backend started down; leaving the ``with`` block on an error
(or Ctrl-C) terminates the workers instead of waiting for them.

The stock variants run the same loop through the same calls with ``multiprocessing.Pool``
(spawn context) or Ray's default serialization: the only difference measured is the transport.

``threads`` is the baseline without processes, the design of cleanba and Sebulba: actor
threads in the learner's process, ``queue.Queue`` for parameters and trajectories, nothing
serialized (:class:`ThreadsBackend`). It runs the same actor loop as the streaming ``queue``
backend.

Every backend runs either environment: a task is ``(carry, key, frame_size, steps)`` for
CartPole and ``(spec, slot, key, steps)`` for Atari (``_worker.run_task``), whose environments
stay in the process that steps them (``_atari``). ``map`` returns ``_worker.Rollout`` records.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from .. import _copies
from .._procenv import NO_PREALLOCATION, apply_environ, environ_overlay
from . import _atari as atari
from . import _cpus as cpus_budget
from . import _worker as worker

BACKENDS = ("pool", "ray", "queue", "threads")
TRANSPORTS = ("jaxtransport", "stock")
INFERENCE = ("actor", "learner")

# Without a CPU budget (``_cpus``), when the workers fill the machine's cores: Eigen's operations
# on the calling thread, not on a pool spanning all cores (the reason Ray sets OMP_NUM_THREADS=1
# for its tasks). (XLA has no flag ``intra_op_parallelism_threads``: jaxlib sizes its CPU thread
# pools from the affinity mask, or from ``PJRT_NPROC``, which the budget sets.)
_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def worker_env(
    workers: int, budget: cpus_budget.Budget | None = None, learner_platform: str | None = None
) -> dict[str, str]:
    """Environment variables for the workers of a run with ``workers`` workers (the same for
    the stock and the jaxtransport transports): no GPU memory grab unless this process's
    environment says otherwise, and its ``JAX_PLATFORMS`` and ``XLA_FLAGS``; ``JAX_PLATFORMS=cpu``
    when the learner (this process) runs on an accelerator (``learner_platform`` not ``"cpu"``:
    the actors act on the CPU, the accelerator is the learner's); the thread counts of a CPU
    ``budget`` (``PJRT_NPROC``, ``OMP_NUM_THREADS``), or without one, single-threaded Eigen when
    the workers fill the cores."""
    env = dict(NO_PREALLOCATION)
    for name in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS"):
        if name in os.environ:
            env[name] = os.environ[name]
    if learner_platform is not None and learner_platform != "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "")
    if budget is not None and budget.on:
        env.update(budget.env())
    elif workers >= (os.cpu_count() or 1) and "xla_cpu_multi_thread_eigen" not in flags:
        env["XLA_FLAGS"] = f"{flags} {_ONE_THREAD}".strip()
    return env


_ACTOR: worker.ActorInfo | None = None  # this worker's, once warmed up (_warm_up)


def _probe(seconds: float) -> worker.ActorInfo:
    """A task that says which worker ran it, on which device and cores (see
    ``_PoolBackend.wait_ready``)."""
    time.sleep(seconds)
    return _ACTOR or worker.actor_info()


def _warm_up(env: dict[str, str], warm: tuple | None, cpus: cpus_budget.PoolCpus | Sequence[int] | None = None) -> None:
    """Pool initializer (and Ray actor's start): pin this process to its cores (``cpus``: a
    Pool's budget, from which it claims a slot, or the cores themselves), set the worker
    environment and run CPU computations inline (:func:`_enter_actor`), all before this process
    first uses JAX (whose thread pools are sized then), then compile the rollout for this run's
    shapes, so every worker pays compilation while the pool starts, not inside a timed
    iteration."""
    global _ACTOR
    if isinstance(cpus, cpus_budget.PoolCpus):
        cpus = cpus.claim()
    _enter_actor(env, cpus)
    _warm(warm)
    _ACTOR = worker.actor_info()


def _enter_actor(env: dict[str, str], cpus: Sequence[int] | None) -> None:
    """The start of an actor process (a Pool worker, a streaming actor, a Ray actor), before JAX
    initialises there: pin it to ``cpus`` (its CPU budget), set the worker environment, and run
    its CPU computations on the calling thread (``_worker``'s Note [acting inline])."""
    cpus_budget.apply(cpus)
    apply_environ(env)
    worker.run_inline()


def _warm(warm: tuple | None) -> None:
    """Compile (and for Atari, build the environments of ``warm.slot``) in this process."""
    if isinstance(warm, atari.Warm):
        atari.warm_up(warm)
    elif warm is not None:
        worker.warm_up(*warm)


def _for_slot(warm: tuple | None, slot: int) -> tuple | None:
    """``warm`` for the actor of ``slot``: an Atari actor builds its environments at start."""
    return warm._replace(slot=slot) if isinstance(warm, atari.Warm) else warm


class Backend:
    """The interface the training loop uses; see the module docstring. After
    :meth:`wait_ready`, ``actors`` says where each actor runs (``_worker.ActorInfo``: its
    process, JAX device and cores, as the actor itself read them)."""

    name: str
    actors: Sequence[worker.ActorInfo] = ()

    def broadcast(self, params: Any) -> Any:
        raise NotImplementedError

    def map(self, handle: Any, tasks: Sequence[tuple]) -> list:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        pass

    def wait_ready(self) -> None:
        """Block until every worker has started and compiled the rollout (its start-up), so
        that the first timed iteration measures transport, not process start and compilation.
        Raises TimeoutError after the task timeout."""

    def close(self) -> None:
        """Stop the workers after the tasks in flight (none, between iterations)."""

    def terminate(self) -> None:
        """Stop the workers now (on an error or Ctrl-C); defaults to :meth:`close`."""
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.terminate()


def _timeout_error(name: str, timeout: float) -> TimeoutError:
    return TimeoutError(
        f"{name}: no rollout result within --task-timeout={timeout:g}s. A worker died or hung "
        "(multiprocessing.Pool never reports a killed worker, python/cpython#66587), or the "
        "rollouts are slower than that: check the workers' output above, and raise "
        "--task-timeout for very large --envs/--steps"
    )


class _PoolBackend(Backend):
    """What both Pool backends share: ``self._pool`` has the multiprocessing.Pool API."""

    name: str
    timeout: float
    workers: int
    _pool: Any
    _cpus: cpus_budget.PoolCpus | None = None  # the workers' CPU budget, whose claim folder close() removes

    def map(self, handle, tasks):
        res = self._pool.starmap_async(worker.run_task, [(handle, *t) for t in tasks], chunksize=1)
        try:
            return res.get(self.timeout)
        except multiprocessing.TimeoutError:
            raise _timeout_error(self.name, self.timeout) from None

    def wait_ready(self):
        # A worker takes tasks only after its initializer (start-up and compilation) has run:
        # once every worker's pid has answered a probe, all of them are ready. A probe lasts
        # long enough that a ready worker cannot take every probe of a round by itself.
        deadline = time.monotonic() + self.timeout
        seen: dict[int, worker.ActorInfo] = {}
        while len(seen) < self.workers:
            left = deadline - time.monotonic()
            res = self._pool.map_async(_probe, [0.05] * self.workers, chunksize=1)
            try:
                seen.update((info.pid, info) for info in res.get(max(left, 0.001)))
            except multiprocessing.TimeoutError:
                raise _timeout_error(self.name, self.timeout) from None
        self.actors = list(seen.values())

    def close(self):
        try:
            self._pool.close()
            self._pool.join()
        finally:
            self._remove_claims()

    def terminate(self):
        try:
            self._pool.terminate()
            self._pool.join()
        finally:
            self._remove_claims()

    def _remove_claims(self) -> None:
        if self._cpus is not None:
            self._cpus.remove()


class StockPool(_PoolBackend):
    """``multiprocessing.Pool`` (spawn): arguments and results pickled through its pipes."""

    def __init__(
        self,
        workers: int,
        warm: tuple | None,
        timeout: float,
        budget: cpus_budget.Budget | None = None,
        learner_platform: str | None = None,
    ):
        self.name = "pool/stock"
        self.timeout, self.workers = timeout, workers
        ctx = multiprocessing.get_context("spawn")
        env = worker_env(workers, budget, learner_platform)
        self._cpus = cpus_budget.PoolCpus.make(budget) if budget is not None else None
        try:
            with environ_overlay(env):  # spawned workers start with the parent's environment
                self._pool = ctx.Pool(workers, initializer=_warm_up, initargs=(env, warm, self._cpus))
        except BaseException:
            self._remove_claims()
            raise

    def broadcast(self, params):
        return params  # pickled again into every task: multiprocessing has no broadcast


class JaxtransportPool(_PoolBackend):
    """``jaxtransport.Pool``: arrays through recycled shared memory, parameters ``share()``d."""

    def __init__(
        self,
        workers: int,
        warm: tuple | None,
        timeout: float,
        budget: cpus_budget.Budget | None = None,
        learner_platform: str | None = None,
    ):
        self.name = "pool/jaxtransport"
        self.timeout, self.workers = timeout, workers
        from ..pool import Pool  # jaxtransport.Pool

        env = worker_env(workers, budget, learner_platform)
        self._cpus = cpus_budget.PoolCpus.make(budget) if budget is not None else None
        try:
            self._pool = Pool(
                workers, initializer=_warm_up, initargs=(env, warm, self._cpus), start_method="spawn", worker_env=env
            )
        except BaseException:
            self._remove_claims()
            raise

    def broadcast(self, params):
        return self._pool.share(params)

    def release(self, handle):
        handle.release()


class RolloutWorker:
    """A Ray actor running rollouts: one per worker, each on its own CPU, compiled once at
    start (as the Pool's initializer does), reused every iteration -- how Ray RL libraries run
    their rollout workers.

    In a session started with ``jaxtransport.ray.init`` the job's setup hook registered
    jaxtransport in this worker process; an actor of a ``"stock"`` run undoes that first
    (``unregister()`` restores Ray's own serializers exactly), so its results travel the way
    they do without jaxtransport."""

    def __init__(self, env: dict[str, str], warm: tuple | None, transport: str = "jaxtransport"):
        # ``warm`` names this actor's slot for Atari (``_for_slot``): its environments are
        # built here, at start, and live in this actor for the whole run.
        if transport == "stock":
            jt_ray = sys.modules.get("jaxtransport.ray")
            if jt_ray is not None and jt_ray.is_registered():
                jt_ray.unregister()
        _warm_up(env, warm)

    def ready(self) -> worker.ActorInfo:
        return _ACTOR or worker.actor_info()

    def rollout(self, params, *task):
        return worker.run_task(params, *task)


class RaySession:
    """One Ray connection for a whole demo: both transports of ``--compare`` run on it.

    Start it before this process initializes JAX: starting a local Ray forks its services
    from this process (``subprocess`` with a ``preexec_fn``), and forking a process whose JAX
    runtime threads are running is what JAX warns about ("os.fork() was called ... will likely
    lead to a deadlock"). Ray is therefore started once, by ``main`` before any JAX work, and
    not again for the second transport.

    With ``"jaxtransport"`` among ``transports`` Ray is started with ``jaxtransport.ray.init``:
    the job's setup hook registers jaxtransport in every worker, and :meth:`use` registers or
    unregisters it in this driver for each run (stock actors unregister themselves, see
    :class:`RolloutWorker`). Otherwise ``ray.init`` as is. ``address=None`` starts a local Ray
    with ``num_cpus=workers``; :meth:`close` shuts the connection (and a local Ray) down.
    """

    def __init__(
        self,
        workers: int,
        address: str | None = None,
        transports: Sequence[str] = ("jaxtransport",),
        cpu_wait_s: float = 120.0,
    ):
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                "--backend ray needs Ray: pip install 'jaxtransport[ray]' (or use --backend pool)"
            ) from exc
        self._ray = ray
        if ray.is_initialized():
            raise RuntimeError(
                "the rollouts demo starts its own Ray connection, but ray.init() was already "
                "called in this process: call ray.shutdown() first, or pass the cluster "
                "address to the demo (--address) instead"
            )
        kwargs: dict[str, Any] = {
            "runtime_env": {"env_vars": worker_env(workers)},
            "logging_level": "ERROR",
            "log_to_driver": False,
        }
        if address is not None:
            kwargs["address"] = address
        else:
            kwargs.update(num_cpus=workers, include_dashboard=False)
        self._jt_ray = None
        if "jaxtransport" in transports:
            from .. import ray as jt_ray

            self._jt_ray = jt_ray
            jt_ray.init(**kwargs)
        else:
            ray.init(**kwargs)
        try:
            if address is not None:
                _wait_for_cpus(ray, workers, timeout=cpu_wait_s)
        except BaseException:
            self.close()
            raise

    def use(self, transport: str) -> None:
        """Set this driver's serializers for a run with ``transport``."""
        if transport == "jaxtransport":
            if self._jt_ray is None:
                raise ValueError(
                    "this RaySession was started without jaxtransport: pass transports=('jaxtransport', ...)"
                )
            self._jt_ray.register()
        elif self._jt_ray is not None:
            self._jt_ray.unregister()

    def close(self) -> None:
        try:
            self._ray.shutdown()
        finally:
            if self._jt_ray is not None:
                self._jt_ray.unregister()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RayBackend(Backend):
    """Ray actors (:class:`RolloutWorker`); the parameters ``ray.put`` once per iteration and
    passed by reference to every actor.

    Runs on ``session`` (a :class:`RaySession`) when given, else starts its own for this
    transport, which ``close()`` shuts down again; ``close()`` always kills this run's actors.
    """

    def __init__(
        self,
        workers: int,
        transport: str,
        address: str | None,
        timeout: float,
        warm: tuple | None = None,
        cpu_wait_s: float = 120.0,
        session: RaySession | None = None,
        learner_platform: str | None = None,
    ):
        self.timeout = timeout
        self.name = f"ray/{transport}"
        self._own = session is None
        self._session = session or RaySession(workers, address, (transport,), cpu_wait_s)
        self._ray = self._session._ray
        self._actors: list = []
        try:
            self._session.use(transport)
            actor = self._ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(RolloutWorker)
            env = worker_env(workers, learner_platform=learner_platform)
            self._actors = [actor.remote(env, _for_slot(warm, i), transport) for i in range(workers)]
        except BaseException:
            self.close()
            raise

    def wait_ready(self):
        refs = [a.ready.remote() for a in self._actors]
        try:
            self.actors = self._ray.get(refs, timeout=self.timeout)
        except self._ray.exceptions.GetTimeoutError:
            raise _timeout_error(self.name, self.timeout) from None

    def broadcast(self, params):
        return self._ray.put(params)

    def map(self, handle, tasks):
        if len(tasks) > len(self._actors):
            raise ValueError(f"{len(tasks)} tasks for {len(self._actors)} rollout actors")
        refs = [a.rollout.remote(handle, *t) for a, t in zip(self._actors, tasks)]
        try:
            return self._ray.get(refs, timeout=self.timeout)
        except self._ray.exceptions.GetTimeoutError:
            for a in self._actors:
                self._ray.kill(a)
            raise _timeout_error(self.name, self.timeout) from None

    def close(self):
        try:
            if self._ray.is_initialized():
                for a in self._actors:
                    self._ray.kill(a)
        finally:
            self._actors = []
            if self._own:
                self._session.close()


class _Ready(NamedTuple):
    """A streaming actor's first message: started and compiled; where it runs."""

    info: worker.ActorInfo


def _take_from(traj_q, n: int, ready: bool, *, name: str, timeout: float, poll_s: float, check) -> list:
    """The next ``n`` items of a streaming backend's trajectory queue: with ``ready``, the
    actors' ``_Ready`` messages (a trajectory then is an error); else trajectories (a late
    ``_Ready`` is skipped). ``check()`` raises when an actor died or failed; past ``timeout``
    seconds without ``n`` items, a timeout error."""
    import queue as _queue

    deadline = time.monotonic() + timeout
    out: list = []
    while len(out) < n:
        try:
            item = traj_q.get(timeout=poll_s)
        except _queue.Empty:
            check()
            if time.monotonic() > deadline:
                raise _timeout_error(name, timeout) from None
            continue
        if isinstance(item, _Ready):
            if ready:
                out.append(item)
            continue
        if ready:
            raise RuntimeError(f"{name}: a trajectory arrived before every actor was ready")
        out.append(item)
    return out


class _ActorItem(NamedTuple):
    """A streaming actor's message on the trajectory queue (after its ``_READY``)."""

    traj: Any
    carry: Any
    compute_s: float
    act_s: float | None
    version: int  # the parameter version that acted
    actor: int  # the actor's index
    cpu_s: float | None = None  # its process's CPU seconds in the rollout (_worker.take_cpu_s)


def actor_loop(
    index: int,
    params_q,
    traj_q,
    warm: tuple | None,
    seed: int,
    shape: tuple,
    max_lag: int = 1,
    inference: tuple | None = None,
) -> None:
    """A streaming actor (``--backend queue`` in a process, ``--backend threads`` in a
    thread): steps its environments continuously, puts each trajectory on ``traj_q`` with the
    version of the parameters that produced it, and picks up the newest parameters the learner
    published (``params_q``) before each rollout. It stays at most ``max_lag`` rollouts ahead
    of the learner's updates (rollouts so far <= newest version + max_lag, versions counting
    the learner's updates from 1), then waits for a newer version: with ``max_lag=1`` each
    actor steps while the learner updates, and the learner's data is one update old. ``None``
    on ``params_q`` stops it. ``shape``: CartPole's ``(envs, frame_size, steps)``; an Atari
    run's ``warm`` (an ``_atari.Warm``) says everything instead. ``inference``: Atari's
    ``(requests, replies)`` queues of :class:`CentralInference`, which then chooses the
    actions (``--inference learner``)."""
    import jax

    base = jax.random.fold_in(jax.random.key(seed), 7919 + index)
    if isinstance(warm, atari.Warm):
        # This loop's own environments (not the process's registry, which a Pool worker
        # shares between tasks): a run in a thread starts from its seed whatever ran before
        # in this process, and closes them when it ends.
        envs_of_actor = atari.make_actor(warm.spec, index)
        remote = None if inference is None else CentralInference.client(index, *inference)
        try:
            if remote is None:
                atari.compile_act(warm)
            _stream(
                index,
                params_q,
                traj_q,
                base,
                max_lag,
                lambda params, key: envs_of_actor.rollout(params, key, warm.steps, act=remote),
            )
        finally:
            envs_of_actor.close()
    else:
        _warm(warm)
        envs, frame_size, steps = shape
        carry = [worker.initial_carry(jax.random.fold_in(base, 0), envs)]

        def step(params, key):
            traj, carry[0], compute = worker.rollout(params, carry[0], key, frame_size, steps)
            return traj, carry[0], compute, None

        _stream(index, params_q, traj_q, base, max_lag, step)


def _stream(index: int, params_q, traj_q, base, max_lag: int, step) -> None:
    """:func:`actor_loop` once started: ``step(params, key)`` makes one rollout."""
    import queue as _queue

    import jax

    traj_q.put(_Ready(worker.actor_info()))  # started and compiled: the learner's start-up waits for every actor
    item = params_q.get()
    n = 0
    while item is not None:
        version, params = item
        while True:  # the newest parameters published so far; older ones are dropped
            try:
                newer = params_q.get_nowait()
            except _queue.Empty:
                if n < version + max_lag:
                    break
                newer = params_q.get()  # far enough ahead of the learner: wait for it
            if newer is None:
                return
            version, params = newer
        traj, carry_out, compute, act = step(params, jax.random.fold_in(base, n + 1))
        n += 1
        traj_q.put(_ActorItem(traj, carry_out, compute, act, version, index, worker.take_cpu_s()))
        del traj
        item = (version, params)


def actor_main(
    index: int,
    params_q,
    traj_q,
    env: dict[str, str],
    warm: tuple | None,
    seed: int,
    shape: tuple,
    max_lag: int = 1,
    cpus: Sequence[int] | None = None,
    inference: tuple | None = None,
) -> None:
    """A streaming actor process: pins itself to ``cpus`` (its CPU budget), sets the worker
    environment and runs CPU computations inline (:func:`_enter_actor`), all before JAX
    initialises here, then runs :func:`actor_loop`."""
    _enter_actor(env, cpus)
    actor_loop(index, params_q, traj_q, warm, seed, shape, max_lag, inference)


def _shape(warm: tuple | None, shape: tuple | None) -> tuple:
    if shape is not None or isinstance(warm, atari.Warm):
        return shape or ()
    if warm is None:
        raise ValueError("a streaming backend needs the rollout shapes (envs, frame_size, steps)")
    return tuple(warm[2:5])


def _rollouts(items: list, version: int) -> list:
    """Taken actor messages as ``_worker.Rollout`` records, in actor order (then production
    order): which actor's trajectory arrived first varies from run to run, the learner's
    batch then does not (with ``--max-lag 0`` it is the same, bit for bit, every run)."""
    items = sorted(enumerate(items), key=lambda p: (p[1].actor, p[0]))
    return [
        worker.Rollout(it.traj, it.carry, it.compute_s, it.act_s, version - it.version, it.cpu_s) for _, it in items
    ]


#: The request queue's ``shm_threshold`` under ``--inference learner`` on jaxtransport's queues:
#: one actor's observations of a step (4 stacked 84x84 frames: 28 KB an environment) travel in
#: shared memory from two environments up.
OBSERVATIONS_SHM = 48 << 10


class CentralInference:
    """``--inference learner``, SEED RL's design: the actors step their environments and send
    each step's observations to the learner's process, which runs the policy on its device
    (the accelerator) for every actor whose request is waiting, in one batch, and sends each
    its actions back.

    Requests go through one queue of the backend's transport (``jaxtransport.multiprocessing``
    or ``multiprocessing``), each actor's replies through its own. A thread of the learner's
    process serves them: it takes one request, then every other one already there, pads the
    batch to every actor's environments (one compiled shape), acts with the newest parameters
    the learner published (a copy: the learner's update donates its own), samples with its own
    key (runs are not repeatable bit for bit), and replies with numpy arrays. An actor measures
    the round trip of each step (its rollout's ``act_s``)."""

    def __init__(self, ctx, workers: int, seed: int, **request_options: Any):
        self.workers = workers
        self.requests = ctx.Queue(**request_options)
        self.replies = [ctx.Queue() for _ in range(workers)]
        self._seed = seed
        self._params: Any = None
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._serve, name="jaxtransport-rollouts-inference", daemon=True)
        self._thread.start()

    def queues(self, index: int) -> tuple:
        """What actor ``index`` needs (:meth:`client`'s arguments after the index)."""
        return (self.requests, self.replies[index])

    @staticmethod
    def client(index: int, requests, replies):
        """Actor ``index``'s ``act(obs, t)``: one round trip to the learner's process."""

        def act(obs, t):
            requests.put((index, obs))
            return replies.get()

        return act

    def publish(self, params) -> None:
        import jax
        import jax.numpy as jnp

        self._params = jax.tree.map(jnp.copy, params)
        self._ready.set()

    def check(self) -> None:
        if self._error:
            raise RuntimeError(f"central inference failed: {self._error[0]!r}") from self._error[0]

    def _serve(self) -> None:
        import queue as _queue

        import jax
        import numpy as np

        from . import _conv as conv

        try:
            key = jax.random.fold_in(jax.random.key(self._seed), 104_729)
            calls = 0
            frames = None
            while not self._stopping.is_set():
                try:
                    batch = [self.requests.get(timeout=0.2)]
                except _queue.Empty:
                    continue
                while len(batch) < self.workers:
                    try:
                        batch.append(self.requests.get_nowait())
                    except _queue.Empty:
                        break
                self._ready.wait()
                obs = [np.asarray(o) for _, o in batch]
                envs = obs[0].shape[0]
                shape = (self.workers * envs, *obs[0].shape[1:])
                if frames is None or frames.shape != shape or frames.dtype != obs[0].dtype:
                    # One compiled shape for every batch; the rows past a batch's actors are
                    # not answered (zeros, or an earlier batch's frames).
                    frames = _copies.aligned_empty(shape, obs[0].dtype)
                    frames[...] = 0
                np.concatenate(obs, out=frames[: len(obs) * envs])
                a, lp = conv.act(self._params, frames, key, np.int32(calls))
                calls += 1
                a, lp = jax.device_get((a, lp))  # both transfers at once, one wait
                for j, (index, _) in enumerate(batch):
                    self.replies[index].put((a[j * envs : (j + 1) * envs], lp[j * envs : (j + 1) * envs]))
        except BaseException as e:  # noqa: BLE001 - raised by check() on the learner's thread
            self._error.append(e)

    def stop(self) -> list:
        """Stop serving; returns the queues for the backend to close."""
        self._stopping.set()
        self._thread.join(5.0)
        return [self.requests, *self.replies]


class QueueBackend(Backend):
    """Long-lived actor processes streaming trajectories through a queue (IMPALA/Sebulba style):
    actors use the newest parameters they have, and wait for an update only when they are
    ``max_lag`` rollouts ahead of it.

    ``broadcast(params)`` publishes a new parameter version to every actor's parameter queue;
    ``map(version, tasks)`` takes the next ``len(tasks)`` trajectories from the shared
    trajectory queue, whichever actors made them, and returns ``(trajectory, carry, compute_s,
    lag)`` with ``lag`` = versions between the parameters that produced it and ``version``
    (the off-policy lag). Each actor stays at most ``max_lag`` rollouts ahead of the learner's
    updates (0: on-policy, actors wait for each update; 1, the default: actors step while the
    learner updates, on data one update old). The trajectory queue is bounded (one per actor).
    ``transport="jaxtransport"`` uses ``jaxtransport.multiprocessing``, ``"stock"`` the same
    code on ``multiprocessing`` (spawn).

    Publishing costs one copy of the parameters per actor: a publisher thread makes them while
    the learner waits for trajectories, and ``map`` returns only once they are made, so the
    learner's next update (which donates the parameters' buffers and updates them in place)
    never runs under a copy. ``jaxtransport.multiprocessing``'s ``put()`` copies into shared
    memory before it returns; the stock ``multiprocessing.Queue.put()`` returns at once and
    pickles later, in its feeder thread, so on the stock transport the publisher first takes
    one host copy of the parameters for all actors (a torn or deleted read otherwise).
    """

    def __init__(
        self,
        workers: int,
        transport: str,
        warm: tuple | None,
        timeout: float,
        seed: int = 0,
        shape: tuple | None = None,
        max_lag: int = 1,
        budget: cpus_budget.Budget | None = None,
        learner_platform: str | None = None,
        inference: str = "actor",
    ):
        if transport == "jaxtransport":
            from .. import multiprocessing as jmp

            ctx: Any = jmp.get_context("spawn")
        else:
            ctx = multiprocessing.get_context("spawn")
        if inference not in INFERENCE:
            raise ValueError(f"inference must be one of {INFERENCE}, got {inference!r}")
        if inference == "learner" and not isinstance(warm, atari.Warm):
            raise ValueError("--inference learner runs the Atari policy: use it with an ALE game (--env pong)")
        shape = _shape(warm, shape)
        self.name = f"queue/{transport}"
        self.timeout = timeout
        self._stock = transport == "stock"
        self._version = 0
        self._publishing: threading.Thread | None = None
        self._publish_error: list[BaseException] = []
        env = worker_env(workers, budget, learner_platform)
        per_actor = budget.actor_cpus if budget is not None and budget.on else [None] * workers
        self._traj = ctx.Queue(workers)
        self._params = [ctx.Queue() for _ in range(workers)]
        self._procs = []
        # A step's observations (8 environments: 226 KB) go into shared memory on the
        # jaxtransport queue, one copy, read in place by the learner's batching; pickled into
        # the message they cost four copies (Note [a message with no arrays]).
        options = {"shm_threshold": OBSERVATIONS_SHM} if transport == "jaxtransport" else {}
        self._inference = CentralInference(ctx, workers, seed, **options) if inference == "learner" else None
        if self._inference is not None:
            self.name += "+central-inference"
        try:
            with environ_overlay(env):
                for i in range(workers):
                    central = None if self._inference is None else self._inference.queues(i)
                    p = ctx.Process(
                        target=actor_main,
                        args=(i, self._params[i], self._traj, env, warm, seed, shape, max_lag, per_actor[i], central),
                        daemon=True,
                        name=f"jaxtransport-rollouts-actor-{i}",
                    )
                    p.start()
                    self._procs.append(p)
        except BaseException:
            self.terminate()
            raise

    def broadcast(self, params):
        self._published()
        self._version += 1
        if self._inference is not None:  # before any actor can act with this version
            self._inference.publish(params)
        # Each version goes first to a different actor, so that none always waits longest.
        first = self._version % len(self._params)
        queues = self._params[first:] + self._params[:first]
        self._publishing = threading.Thread(
            target=self._publish,
            args=(queues, (self._version, params)),
            name="jaxtransport-rollouts-publisher",
            daemon=True,
        )
        self._publishing.start()
        return self._version

    def _publish(self, queues, item) -> None:
        try:
            if self._stock:  # see the class docstring
                import jax
                import numpy as np

                item = (item[0], jax.tree.map(np.array, item[1]))
            for q in queues:
                q.put(item)
        except BaseException as e:  # noqa: BLE001 - raised again by _published()
            self._publish_error.append(e)

    def _published(self) -> None:
        """Wait for the publisher thread; raise what it raised."""
        t, self._publishing = self._publishing, None
        if t is not None:
            t.join()
        if self._publish_error:
            raise self._publish_error.pop()

    def wait_ready(self):
        self.actors = [r.info for r in self._take(len(self._procs), ready=True)]

    def map(self, handle, tasks):
        out = _rollouts(self._take(len(tasks), ready=False), handle)
        self._published()
        return out

    def _take(self, n: int, ready: bool) -> list:
        """The next ``n`` trajectories (``ready``: the actors' ready messages) from the shared
        queue, raising when an actor died or the task timeout passes."""
        return _take_from(
            self._traj, n, ready, name=self.name, timeout=self.timeout, poll_s=1.0, check=self._check_actors
        )

    def _check_actors(self) -> None:
        if self._inference is not None:
            self._inference.check()
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            raise RuntimeError(
                f"{self.name}: rollout actor {dead[0].name} (pid {dead[0].pid}) exited with code "
                f"{dead[0].exitcode}: check its output above"
            ) from None

    def _stop(self, grace: float) -> None:
        t = self._publishing
        if t is not None:  # a put blocked on capacity gives up on its own (ShmCapacityError)
            t.join(grace or 1.0)
        for q in self._params:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        import queue as _queue
        import time

        deadline = time.monotonic() + grace
        while any(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
            try:  # actors waiting to put a trajectory must get through to see the stop
                self._traj.get(timeout=0.1)
            except (_queue.Empty, Exception):  # noqa: BLE001
                pass
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        extra = []
        if self._inference is not None:
            extra = self._inference.stop()
        for q in self._params + [self._traj] + extra:
            q.cancel_join_thread()
            q.close()

    def close(self):
        self._stop(30.0)

    def terminate(self):
        self._stop(0.0)


class ThreadsBackend(Backend):
    """The threaded actor-learner design of cleanba and Sebulba, as the baseline: ``workers``
    actor threads in this process run :func:`actor_loop` (the streaming actors' loop), with a
    ``queue.Queue`` of parameters per actor and one bounded ``queue.Queue`` of trajectories;
    nothing is serialized, arrays pass by reference.

    ``broadcast`` publishes one copy of the parameters for all actors (the learner's next
    update donates its buffers; cleanba's actors ``device_put`` theirs for the same reason).
    ``map`` is the queue backend's. The actors share this process's GIL with each other and
    with the learner: JAX releases it while XLA runs (the learner's update, the policy's
    forward pass), an environment written in Python or holding the GIL in C++ (ALE through
    gymnasium) does not, so only one actor steps its environments at a time.

    Threads cannot be killed: ``close``/``terminate`` ask the actors to stop and wait for each
    up to the end of its current rollout (bounded: ``timeout``), then leave a stuck one behind
    as a daemon thread, with a warning.
    """

    def __init__(
        self,
        workers: int,
        warm: tuple | None,
        timeout: float,
        seed: int = 0,
        shape: tuple | None = None,
        max_lag: int = 1,
    ):
        import queue as _queue

        shape = _shape(warm, shape)
        self.name = "threads"
        self.timeout = timeout
        self._version = 0
        self._errors: list[tuple[str, BaseException]] = []
        self._traj: _queue.Queue = _queue.Queue(workers)
        self._params: list[_queue.Queue] = [_queue.Queue() for _ in range(workers)]
        self._threads = []
        for i in range(workers):
            t = threading.Thread(
                target=self._run,
                name=f"jaxtransport-rollouts-actor-{i}",
                args=(i, warm, seed, shape, max_lag),
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def _run(self, index, warm, seed, shape, max_lag) -> None:
        try:
            actor_loop(index, self._params[index], self._traj, warm, seed, shape, max_lag)
        except BaseException as e:  # noqa: BLE001 - reported by _take() on the learner's thread
            self._errors.append((threading.current_thread().name, e))

    def broadcast(self, params):
        import jax
        import jax.numpy as jnp

        self._version += 1
        item = (self._version, jax.tree.map(jnp.copy, params))
        for q in self._params:
            q.put(item)
        return self._version

    def wait_ready(self):
        self.actors = [r.info for r in self._take(len(self._threads), ready=True)]

    def map(self, handle, tasks):
        # An actor thread's process is the learner's: its CPU time says nothing of the actor.
        return [r._replace(cpu_s=None) for r in _rollouts(self._take(len(tasks), ready=False), handle)]

    def _take(self, n: int, ready: bool) -> list:
        return _take_from(
            self._traj, n, ready, name=self.name, timeout=self.timeout, poll_s=0.5, check=self._check_actors
        )

    def _check_actors(self) -> None:
        if self._errors:
            name, exc = self._errors[0]
            raise RuntimeError(f"{self.name}: rollout actor thread {name} failed: {type(exc).__name__}: {exc}") from exc

    def _stop(self, grace: float) -> None:
        import queue as _queue

        for q in self._params:
            q.put(None)
        deadline = time.monotonic() + grace
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            try:  # actors waiting to put a trajectory must get through to see the stop
                self._traj.get(timeout=0.1)
            except _queue.Empty:
                pass
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            print(
                f"warning: {self.name}: actor threads {', '.join(stuck)} did not stop within "
                f"{grace:g}s (a thread cannot be killed); left running as daemon threads",
                file=sys.stderr,
                flush=True,
            )

    def close(self):
        self._stop(self.timeout)

    def terminate(self):
        # A thread cannot be stopped mid-rollout: wait for the current one (bounded).
        self._stop(min(self.timeout, 60.0))


def _wait_for_cpus(ray, workers: int, timeout: float) -> None:
    """On an existing cluster, wait (up to ``timeout`` s) until it offers ``workers`` CPUs:
    worker nodes that are still joining (``docker compose up``) would otherwise leave the tasks
    pending. Fewer CPUs after the wait: run anyway (tasks queue), with a note; none: an error."""
    deadline = time.monotonic() + timeout
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < workers:
        print(
            f"waiting up to {timeout:.0f}s for the cluster to offer {workers} CPUs (it has {cpus:g})...",
            file=sys.stderr,
            flush=True,
        )
    while cpus < workers and time.monotonic() < deadline:
        time.sleep(1.0)
        cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < 1:
        raise RuntimeError(
            f"the Ray cluster has no CPUs for the rollout tasks after {timeout:.0f}s: start "
            "worker nodes with CPUs (ray start --address=<head> --num-cpus=N), or run without "
            "--address to use a local Ray"
        )
    if cpus < workers:
        print(
            f"note: the cluster offers {cpus:g} CPUs for {workers} workers: tasks will queue",
            file=sys.stderr,
            flush=True,
        )


def make(
    backend: str,
    transport: str,
    workers: int,
    *,
    address: str | None = None,
    warm: tuple | None = None,
    timeout: float = 600.0,
    session: RaySession | None = None,
    seed: int = 0,
    max_lag: int = 1,
    budget: cpus_budget.Budget | None = None,
    learner_platform: str | None = None,
    inference: str = "actor",
) -> Backend:
    """Start a backend. ``warm`` (the arguments of ``_worker.warm_up``) lets the workers
    compile the rollout while they start. ``timeout``: seconds one iteration's tasks may take
    before ``map`` raises ``TimeoutError`` instead of waiting forever. ``session``: the Ray
    connection to run on (``--backend ray``; default: the backend starts its own). ``seed``:
    the streaming actors' environment seeds, ``max_lag``: how many rollouts each may run ahead
    of the learner's updates (``--backend queue``). ``budget``: the actors' cores (``_cpus``;
    the Pool and queue backends), ``learner_platform``: this process's JAX platform (the actors
    run on the CPU when it is an accelerator's). ``inference="learner"``: the queue backend's
    actors send observations to this process, which chooses their actions
    (:class:`CentralInference`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "threads" and transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    if address is not None and backend != "ray":
        raise ValueError("--address names a Ray cluster: use it with --backend ray")
    if inference != "actor" and backend != "queue":
        raise ValueError("--inference learner is the queue backend's: use it with --backend queue")
    if backend == "ray":
        return RayBackend(
            workers, transport, address, timeout, warm, session=session, learner_platform=learner_platform
        )
    if backend == "queue":
        return QueueBackend(
            workers,
            transport,
            warm,
            timeout,
            seed,
            max_lag=max_lag,
            budget=budget,
            learner_platform=learner_platform,
            inference=inference,
        )
    if backend == "threads":
        return ThreadsBackend(workers, warm, timeout, seed, max_lag=max_lag)
    if transport == "stock":
        return StockPool(workers, warm, timeout, budget, learner_platform)
    return JaxtransportPool(workers, warm, timeout, budget, learner_platform)
