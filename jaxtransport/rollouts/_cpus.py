"""The rollouts' CPU budget (``--cpus-per-actor``): each actor process pinned to cores of its own.

Each actor's XLA runtime sizes its thread pools to the cores it may run on (TSL reads the
process's affinity mask; ``PJRT_NPROC`` overrides the count), so N actors on a machine of C
cores start N x C compute threads that compete for C cores. Ray's answer is to set
``OMP_NUM_THREADS`` from each task's ``num_cpus``; here each actor gets a disjoint set of
cores, applied with ``sched_setaffinity`` in the actor *before* JAX initialises there, and
``PJRT_NPROC`` / ``OMP_NUM_THREADS`` equal to its share, so its pools are sized to it. The
learner (this process) keeps the cores no actor gets, and is itself left unpinned.

:func:`plan` decides (a pure function of the actor count, the flag and the cores this process
may use), :class:`Budget` carries the decision to the backends, :func:`apply` runs in an actor.
Pool workers do not know their index: each claims the first free slot of the pool's claim
folder (:class:`PoolCpus`). Only where the OS has affinity masks (Linux), off elsewhere.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Collection, Sequence

from .. import _os

__all__ = ["Budget", "PoolCpus", "apply", "available", "plan"]

# Backends whose actors are processes this machine starts: Ray schedules its own actors (on
# other nodes, too), actor threads share the learner's process.
PINNED_BACKENDS = ("pool", "queue")


@dataclasses.dataclass(frozen=True)
class Budget:
    """Which cores each actor runs on. ``per_actor`` 0: no budget (``why`` says why)."""

    per_actor: int = 0
    actor_cpus: tuple[tuple[int, ...], ...] = ()
    learner_cpus: tuple[int, ...] = ()
    shared: bool = False  # fewer cores than actors x per_actor: actors share cores, round-robin
    why: str = ""

    @property
    def on(self) -> bool:
        return self.per_actor > 0 and bool(self.actor_cpus)

    def env(self) -> dict[str, str]:
        """The variables every actor starts with under this budget: its XLA thread pools
        (``PJRT_NPROC``) and OpenMP's (``OMP_NUM_THREADS``) sized to its share."""
        if not self.on:
            return {}
        n = str(max(len(c) for c in self.actor_cpus))
        return {"PJRT_NPROC": n, "OMP_NUM_THREADS": n}

    def describe(self) -> str:
        """One line for the report: what each actor got, or why there is no budget."""
        if not self.on:
            return f"off ({self.why})" if self.why else "off"
        cores = "core" if self.per_actor == 1 else "cores"
        actors = _cpuset(sorted(set().union(*self.actor_cpus)))
        text = f"{self.per_actor} {cores} per actor ({self.why}): actors on {actors}, the learner keeps "
        text += _cpuset(self.learner_cpus)
        if self.shared:
            text += f"; {len(self.actor_cpus)} actors x {self.per_actor} > the cores left: actors share cores"
        return text

    def unapplied(self, reported: Sequence[Sequence[int] | None]) -> str:
        """A note when the actors' own reports of their cores (``_worker.ActorInfo.cpus``) show
        the budget did not take (an OS that accepts no affinity masks: the thread counts it
        sets still apply); empty when every actor runs on one of the assigned sets."""
        if not self.on:
            return ""
        assigned = {tuple(c) for c in self.actor_cpus}
        wrong = [tuple(sorted(c)) for c in reported if c is not None and tuple(sorted(c)) not in assigned]
        if not wrong:
            return ""
        return f"not applied in {len(wrong)} of {len(reported)} actors (one reports {_cpuset(wrong[0])})"

    def for_backend(self, backend: str) -> Budget:
        """This budget where ``backend`` pins its actors, else none (with the reason)."""
        if backend in PINNED_BACKENDS or not self.on:
            return self
        where = "Ray places its own actors" if backend == "ray" else "actor threads share the learner's process"
        return Budget(why=f"--backend {backend}: {where}")


def _cpuset(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"cores 0-2,5"``."""
    cpus = sorted(cpus)
    if not cpus:
        return "no core"
    parts, start, prev = [], cpus[0], cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ("core " if len(cpus) == 1 else "cores ") + ",".join(parts)


def available() -> frozenset[int] | None:
    """The cores this process may run on, or None where processes cannot be pinned."""
    return _os.cpu_affinity()


def plan(actors: int, per_actor: int | None, cores: Collection[int] | None) -> Budget:
    """The budget for ``actors`` actor processes on ``cores`` (this process's, :func:`available`;
    None: no pinning on this host). ``per_actor``: cores per actor, 0 for none, None for the
    default: ``floor((cores - 1) / actors)`` each whenever there are at least two actors and a
    core for each beside the learner's; otherwise none. Measured on a 13-core TPU host (issue
    42, learner on the chip, queue backend): with no budget an actor's rollout took 1.44x its
    2-actor time at 4 actors and 3.2x at 8 (every actor's XLA runtime sizes its thread pools to
    all the cores), and 4.6x at 12, against 1.04x at 12 with one core each. Not by default for
    one actor (pinning it only takes cores from it) nor for more actors than cores beside the
    learner's: round-robin, some cores get two actors and others one, and the slowest actor
    sets the iteration's pace, while the learner's core idles whenever the learner waits.

    The learner keeps the lowest core(s): every core no actor gets, at least one. Actors get
    consecutive, disjoint blocks of the others; when those are fewer than ``actors x
    per_actor``, the actors share them round-robin (``shared``)."""
    if actors < 1:
        raise ValueError(f"actors must be >= 1, got {actors!r}")
    if per_actor is not None and per_actor < 0:
        raise ValueError(f"--cpus-per-actor must be >= 0, got {per_actor!r}")
    if cores is None:
        return Budget(why="this host cannot pin a process to cores")
    ordered = sorted(cores)
    n = len(ordered)
    if per_actor == 0:
        return Budget(why="--cpus-per-actor 0")
    if n < 2:
        return Budget(why=f"{n} core: none to give the actors apart from the learner's")
    if per_actor is None:
        if actors < 2:
            return Budget(why="automatic: one actor competes with nothing for the cores")
        if actors > n - 1:
            beside = f"{n - 1} {'core' if n == 2 else 'cores'}"
            return Budget(
                why=f"automatic: {actors} actors outnumber the {beside} beside the learner's "
                "(--cpus-per-actor N shares cores between actors)"
            )
        per_actor = max(1, (n - 1) // actors)
        how = f"automatic: {actors} actors and the learner on {n} cores"
    else:
        how = "--cpus-per-actor"
    need = actors * per_actor
    if need <= n - 1:
        learner = ordered[: n - need]
        rest = ordered[n - need :]
        sets = tuple(tuple(rest[i * per_actor : (i + 1) * per_actor]) for i in range(actors))
        return Budget(per_actor, sets, tuple(learner), False, how)
    learner, rest = ordered[:1], ordered[1:]
    k = min(per_actor, len(rest))
    sets = tuple(tuple(sorted({rest[(i * per_actor + j) % len(rest)] for j in range(k)})) for i in range(actors))
    return Budget(per_actor, sets, tuple(learner), True, how)


def apply(cpus: Sequence[int] | None) -> bool:
    """In an actor, before JAX initialises there: run on ``cpus`` from now on."""
    if not cpus:
        return False
    return _os.set_cpu_affinity(cpus)


@dataclasses.dataclass(frozen=True)
class PoolCpus:
    """A Pool's budget as its workers see it: ``sets`` (one per worker) and the ``claims``
    folder in which each worker claims the first free slot (a file made with ``O_EXCL``). A
    worker that finds no free slot (one started in place of a dead one) runs on the union of
    the sets."""

    sets: tuple[tuple[int, ...], ...]
    claims: str

    @classmethod
    def make(cls, budget: Budget) -> PoolCpus | None:
        if not budget.on:
            return None
        return cls(budget.actor_cpus, tempfile.mkdtemp(prefix="jaxtransport-rollouts-cpus-"))

    def claim(self) -> tuple[int, ...]:
        for i, cpus in enumerate(self.sets):
            try:
                fd = os.open(os.path.join(self.claims, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                continue
            except OSError:
                break
            os.close(fd)
            return cpus
        return tuple(sorted(set().union(*self.sets)))

    def remove(self) -> None:
        shutil.rmtree(self.claims, ignore_errors=True)
