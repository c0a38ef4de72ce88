"""Who holds which device: the one place that decides which accelerators a process that
jaxtransport starts may open.

Every part that starts processes (the Pool and so the Executor and the joblib backend,
``jaxtransport.multiprocessing``'s processes) asks :func:`plan` for a :class:`Plan` and starts
worker ``i`` with ``plan.env(i)``; none of them branches on a kind of accelerator. (The rollouts
demo chooses for itself, through ``worker_env``: its actors act on the CPU whenever its learner
is on an accelerator.) The rule, by what the host and this process's JAX show (:mod:`._kinds` says how
each kind is seen):

- A device that several processes can share (a GPU): workers share this process's devices, one
  each round-robin on a multi-device host (``devices_per_worker`` each when given).
- A device that one process alone can open (a TPU chip), which this process holds or will hold
  (its JAX may use that platform): workers run JAX on the CPU (``JAX_PLATFORMS=cpu``), and what
  they send back lands on this process's device under the default placement. Said once per
  process, as a log line. ``devices_per_worker=N`` gives each worker ``N`` chips of its own from
  those this process does not hold (its ``TPU_VISIBLE_CHIPS``, when set, says which it holds);
  too few left is an error at once, naming the fix.
- ``JAX_PLATFORMS`` in ``worker_env`` wins over all of this: the user decides.

docs/accelerators.md gives the user-facing account.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._kinds import KINDS, Gpu, Kind, Tpu

__all__ = ["KINDS", "Gpu", "Kind", "Plan", "Tpu", "explain", "plan", "process_platforms"]

_log = logging.getLogger("jaxtransport")
_NOTICE_LOCK = threading.Lock()
_noticed: set[str] = set()


def process_platforms(environ: Mapping[str, str] | None = None) -> str | None:
    """This process's JAX platforms: ``jax.config.jax_platforms`` when JAX is imported and it is
    set, else ``JAX_PLATFORMS``; None when neither says (JAX then picks an accelerator if the
    host has one). Never imports JAX or starts a backend."""
    environ = os.environ if environ is None else environ
    value = environ.get("JAX_PLATFORMS") or None
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            configured = jax.config.jax_platforms
            if configured:
                value = configured
        except AttributeError:
            pass
    return value


def _initialized_platforms() -> set[str] | None:
    """The platforms of the JAX backends this process has started (None: none started yet)."""
    if "jax" not in sys.modules:
        return None
    from .. import _compat

    return _compat.initialized_platforms()


def _uses(kind: Kind, platforms: str | None, started: set[str] | None) -> bool:
    """Whether this process holds (or, its backends not yet started, may take) ``kind``'s devices."""
    if started:
        return any(p in started for p in kind.platforms)
    if platforms:
        wanted = {p.strip().lower() for p in platforms.split(",") if p.strip()}
        return any(p in wanted for p in kind.platforms)
    return True  # JAX takes an accelerator by default


@dataclass(frozen=True)
class Plan:
    """What worker ``i`` of a group gets (:meth:`env`): ``common`` for all, ``per_worker`` cycled
    (empty: nothing per worker). ``notice``: the line logged once when the plan is used."""

    common: dict[str, str | None] = field(default_factory=dict)
    per_worker: tuple[dict[str, str | None], ...] = ()
    notice: str | None = None

    def env(self, index: int) -> dict[str, str | None]:
        env = dict(self.common)
        if self.per_worker:
            env.update(self.per_worker[index % len(self.per_worker)])
        return env

    def announce(self) -> None:
        """Log :attr:`notice` (once per process and text)."""
        if not self.notice:
            return
        with _NOTICE_LOCK:
            if self.notice in _noticed:
                return
            _noticed.add(self.notice)
        _log.warning(self.notice)


def _positive(devices_per_worker: int | None) -> None:
    if devices_per_worker is not None and (not isinstance(devices_per_worker, int) or devices_per_worker < 1):
        raise ValueError(f"devices_per_worker must be an int >= 1, got {devices_per_worker!r}")


def plan(
    workers: int | None,
    *,
    devices_per_worker: int | None = None,
    overrides: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    kinds: tuple[Kind, ...] = KINDS,
) -> Plan:
    """The devices of ``workers`` processes about to start from this one (None: not known yet,
    as for a process started on its own): see the module docstring. Raises ValueError when
    ``devices_per_worker`` cannot be met (the message names what is free and the fix)."""
    _positive(devices_per_worker)
    environ = os.environ if environ is None else environ
    platforms = process_platforms(environ)
    user_platforms = overrides is not None and "JAX_PLATFORMS" in overrides
    common: dict[str, str | None] = {}
    if platforms:
        common["JAX_PLATFORMS"] = platforms
    if user_platforms:
        return Plan(common)
    started = _initialized_platforms()
    for kind in kinds:
        ids = kind.host_ids(environ)
        if not ids and not (started and any(p in started for p in kind.platforms)):
            continue  # (a backend of this kind started where the OS shows no device: trust JAX)
        host_count = kind.host_count()
        uses = _uses(kind, platforms, started)
        if kind.exclusive:
            return _exclusive_plan(kind, ids, host_count, uses, workers, devices_per_worker, common)
        if not uses or workers is None:  # (a process started on its own sees what this one sees)
            continue
        if len(ids) > 1:  # round-robin, ``devices_per_worker`` (default 1) each
            per = min(devices_per_worker or 1, len(ids))
            period = len(ids) // math.gcd(per, len(ids))
            groups = tuple(
                kind.visible_env([ids[(i * per + k) % len(ids)] for k in range(per)], host_count) for i in range(period)
            )
            return Plan(common, groups)
        return Plan(common)
    return Plan(common)


def _exclusive_plan(
    kind: Kind,
    ids: list[str],
    host_count: int,
    uses: bool,
    workers: int | None,
    devices_per_worker: int | None,
    common: dict[str, str | None],
) -> Plan:
    held = ids if uses else []
    free = [i for i in (str(n) for n in range(host_count)) if i not in held]
    if devices_per_worker is None:
        if not uses:  # this process keeps off them too: the workers do as it does
            return Plan({**common, **kind.off_env()})
        notice = (
            f"jaxtransport: this process holds or may take the host's {kind.platforms[0].upper()} "
            f"{kind.noun}s ({len(ids)}; a {kind.noun} is open to one process only), so the worker "
            "processes it starts run JAX on the CPU "
            "(JAX_PLATFORMS=cpu); arrays they return land on this process's default device. "
            f"To give each worker {kind.noun}s of its own, pass devices_per_worker=N; to choose "
            "yourself, pass worker_env={'JAX_PLATFORMS': ...}."
        )
        return Plan({**common, **kind.off_env()}, (), notice)
    count = workers or 1
    need = count * devices_per_worker
    if need > len(free):
        holder = (
            f"this process holds {len(held)} of them ({kind.visibility_var}={','.join(held)})"
            if held
            else "none is held by this process"
        )
        raise ValueError(
            f"devices_per_worker={devices_per_worker} for {count} worker(s) needs {need} "
            f"{kind.platforms[0].upper()} {kind.noun}s of their own; the host has {host_count} and "
            f"{holder}, leaving {len(free)}. A {kind.noun} can be opened by one process only. Fix: "
            f"fewer workers or devices_per_worker, or start this process with {kind.visibility_var} "
            "naming fewer chips (or JAX_PLATFORMS=cpu) before JAX starts, or leave "
            "devices_per_worker unset to run the workers on the CPU."
        )
    groups = tuple(
        {
            **kind.visible_env(free[i * devices_per_worker : (i + 1) * devices_per_worker], host_count),
            "JAX_PLATFORMS": None,
        }
        for i in range(count)
    )
    child_common = {k: v for k, v in common.items() if k != "JAX_PLATFORMS"}
    return Plan(child_common, groups)


# -- a worker that cannot open its device

_BUSY_MARKERS = (
    "libtpu multi-process lockfile",
    "TPU is already in use",
    "Unable to initialize backend 'tpu'",
)


def explain(e: BaseException) -> BaseException:
    """``e`` itself, or when it says a device could not be opened because another process holds
    it, a :class:`~jaxtransport._errors.DeviceUnavailableError` that names the cause and the fix
    (``e`` as its ``__cause__``). The runtime's own advice (deleting a lock file as root) is
    wrong when another process simply holds the chip."""
    from .._errors import DeviceUnavailableError

    if isinstance(e, DeviceUnavailableError):
        return e
    try:
        text = str(e)
    except Exception:  # noqa: BLE001
        return e
    if not any(m in text for m in _BUSY_MARKERS):
        return e
    err = DeviceUnavailableError(
        f"This process (pid {os.getpid()}) could not open the accelerator: another process holds it "
        "(one process per TPU chip; usually the parent that started this worker). jaxtransport "
        "starts its workers with JAX_PLATFORMS=cpu on such hosts unless told otherwise: check "
        "worker_env (a JAX_PLATFORMS there wins), or give each worker chips of its own with "
        "devices_per_worker=N. Do not delete libtpu's lock file while its holder runs. "
        f"The runtime said: {text.strip().splitlines()[-1] if text.strip() else text}"
    )
    err.__cause__ = e
    return err
