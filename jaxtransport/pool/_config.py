"""A pool worker's configuration (:class:`WorkerConfig`)."""

from __future__ import annotations

from typing import NamedTuple


class WorkerConfig(NamedTuple):
    """What a worker starts with, built by the parent (``_launch.Spec.config``) and pickled into
    the worker ``Process``'s arguments. In a module of its own, not in ``_protocol`` nor in
    ``_worker``: the worker unpickles it before it applies ``env``, so its module must import
    nothing that reads the environment (numpy, JAX), and the parent builds it without importing
    the worker's code (Note [launch first] in ``_launch``)."""

    parent_pid: int  # the worker exits when this process is gone
    threshold: int | None  # arrays of at least this many bytes go back through shared memory
    placement: str  # where received arrays go ("device", "host", "preserve")
    capacity: int  # the worker's own arena (its results), in bytes
    futures: bool  # an Executor's worker: concurrent.futures' error reporting
    maxtasks: int | None  # chunks before it leaves (maxtasksperchild)
    grace: float  # how long a result waits for the parent to release memory
    reserve: int  # bytes of result segments made while it starts (Pool(shm_reserve=...))
    preload_jax: bool  # import JAX in the background once ready
    env: dict  # the environment variables it applies first (``_procenv.worker_env``)
