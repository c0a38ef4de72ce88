"""Starting a worker process: what every worker of one pool starts with, and the start itself.

Note [launch first]
~~~~~~~~~~~~~~~~~~~
A new pool's first result waits on two things in a row: the parent's own start (importing the
pool's machinery) and the worker's (a fresh interpreter, the main script run as
``__mp_main__``, the worker's imports). Where Python compiles jaxtransport's source on every
import (no ``.pyc`` written: ``PYTHONDONTWRITEBYTECODE``, a read-only install, an editable
install under such a setting), the parent's imports alone cost as much as the worker's
interpreter start. So ``Pool()`` starts its workers first, with only this module and the few
light ones it needs (the worker's configuration, the shared cells, the OS's pipes; the worker's
own code, ``_worker``, is imported by the worker alone: :func:`run_worker`), and imports
the engine, the manager, the scheduler and the encoder while the workers boot, on another core.
The engine then adopts the started workers (``_processes.adopt``); workers started later (a
replacement, ``maxtasksperchild``) go through the same :meth:`Spec.launch`. Whatever was
started but not adopted, because building the engine failed, is killed and closed
(:func:`abandon`): the pool owns its processes from the moment they exist.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, NamedTuple

from .. import _os, _procenv
from . import _claim
from ._config import WorkerConfig

# How long an allocation waits for releases when no task is in flight (the parent's arena, and
# each worker's through WorkerConfig.grace); read from this module at each use (tests patch it).
CAPACITY_GRACE_S = 5.0


def run_worker(conn, fdsock, config: bytes, block=None, init=None) -> None:
    """A worker process's entry point (its ``Process`` target): ``_worker.worker_main``,
    imported here, in the worker: the parent never imports the worker's code."""
    from ._worker import worker_main

    worker_main(conn, fdsock, config, block, init)


class Launched(NamedTuple):
    """A started worker process and the parent's ends of its pipes, not yet in an engine."""

    proc: Any
    conn: Any  # the parent's end of the message pipe
    fdsock: Any  # the parent's end of the socket that passes segment fds
    block: Any  # its shared cells (``_claim.new_block``)


class Spec:
    """What every worker of one pool starts with: all of its :class:`WorkerConfig` but the
    environment, which depends on the worker's place (its GPUs)."""

    def __init__(
        self,
        ctx,
        *,
        processes: int,
        start_method: str,
        threshold: int | None,
        placement: str,
        capacity: int,
        futures: bool,
        maxtasks: int | None,
        reserve: int,
        preload_jax: bool,
        worker_env: dict | None,
        devices_per_worker: int | None,
    ):
        self.ctx = ctx
        self.start_method = start_method
        self.threshold = threshold
        self.placement = placement
        self.capacity = capacity  # each worker's cap (the facade splits the default)
        self.futures = futures  # an Executor's pool: concurrent.futures' error contract in workers
        self.maxtasks = maxtasks
        self.reserve = reserve  # bytes each worker reserves at start (shm_reserve)
        self.preload_jax = preload_jax  # workers import JAX in the background once ready
        self.env_overrides = dict(worker_env or {})
        # Who holds which device (raises here, before any worker starts, when devices_per_worker
        # cannot be met). Imported here: a worker imports this module (``run_worker``), not it.
        from .. import _devices

        self.devices = _devices.plan(processes, devices_per_worker=devices_per_worker, overrides=worker_env)

    def environ(self, index: int) -> dict:
        """The variables worker ``index`` starts with (``_procenv.worker_env``)."""
        self.devices.announce()
        return _procenv.worker_env(index, devices=self.devices, overrides=self.env_overrides)

    def config(self, index: int) -> WorkerConfig:
        return WorkerConfig(
            parent_pid=os.getpid(),
            threshold=self.threshold,
            placement=self.placement,
            capacity=self.capacity,
            futures=self.futures,
            maxtasks=self.maxtasks,
            grace=CAPACITY_GRACE_S,
            reserve=self.reserve,
            preload_jax=self.preload_jax,
            env=self.environ(index),
        )

    def launch(self, index: int, init=None) -> Launched:
        """Start worker ``index`` (spawn/forkserver) with its configuration; ``init`` (the
        pool's ``InitCall``, or None) is pickled while the process spawns (Note [initargs])."""
        config = self.config(index)
        cfg = pickle.dumps(config)
        conn, child_conn = _os.worker_pipe(self.ctx)
        try:
            fdsock, child_sock = _os.message_socketpair()  # segment fds (``_shm.fd_socketpair``)
        except BaseException:
            conn.close()
            child_conn.close()
            raise
        try:
            block = _claim.new_block(self.ctx)  # multiprocessing's heap: an unlinked file, gone with its users
            proc = self.ctx.Process(
                target=run_worker,
                args=(child_conn, child_sock, cfg, block, init),
                daemon=True,
                name=f"jaxtransport-pool-worker-{index}",
            )
            if self.start_method == "spawn":
                # The child's environment is os.environ at exec time: set it there so that even
                # code JAX runs while re-importing __main__ sees it (forkserver: set in the child).
                with _procenv.environ_overlay(config.env):
                    proc.start()
            else:
                proc.start()
        except BaseException:
            conn.close()
            fdsock.close()
            raise
        finally:
            child_conn.close()
            child_sock.close()
        return Launched(proc, conn, fdsock, block)


def abandon(started: list) -> None:
    """Kill and close every worker in ``started`` (:class:`Launched`, never adopted by an
    engine), emptying the list."""
    while started:
        w = started.pop()
        try:
            w.proc.kill()
            w.proc.join(5)
        except Exception:  # noqa: BLE001 - release the rest regardless
            pass
        for close in (w.conn.close, w.fdsock.close, w.proc.close):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
