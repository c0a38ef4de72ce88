"""One source per figure: every measured number the README and ``docs/`` show, where it comes from,
and the code that writes it into the pages.

A figure is one value of one row of one published results file (``benchmarks/results/NAME.json``),
named in :data:`FIGURES` (``"pool.arg.1g.ratio"``: the ``ratio`` of the row ``name=argument,
transport=jaxtransport.Pool, size_bytes=1 GiB`` of ``pool.json``), or a value derived from such
figures (:class:`Derived`). Pages never type a measured number; they hold one of two things:

- a **generated table** between ``<!-- figures:TABLE begin -->`` and ``<!-- figures:TABLE end -->``
  (:data:`TABLES`): each row names its figures, and the last column says which results file,
  measured when, in how many runs and with what spread; under the table, each results file's
  machine and conditions. The README's table (``readme``) leaves that provenance out: each of
  its rows links (:data:`LINKED`) to its own section of docs/benchmarks.md (``headline``, one
  heading per row, :data:`SECTIONS`), which gives it in full;
- an **inline figure** ``<!--fig KEY-->51x (pool, 2026-12-03)<!--/fig-->``: the text between the
  markers is the figure's value with its results file and date; the comments are not rendered.

``python -m benchmarks.publish`` (also the last step of ``python -m benchmarks --publish``)
rewrites both from the results files; ``--check`` only says whether a page is stale. The test
``tests/test_figures.py`` fails when a page differs from what the results files say, when a
figure names a row that no results file holds, and when a page quotes a measured-looking number
(a ratio such as ``3.5x``, a GB/s, env steps/s, a decimal time such as ``0.45 s``, an ``~``
estimate) outside a figure.

Runs and spread of a row (:func:`runs_of`, :func:`spread_of`): the number of timed repetitions
(``reps``, ``runs`` or ``rounds``), and ``(max - min) / median`` of them, from whichever form the
benchmark stored (``min``/``max`` seconds, ``spread`` as half the range in seconds, the per-round
ratios ``round_ratios``, or ``spread_pct``, which the runner now writes on every row).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import itertools
import json
import os
import re
import statistics
import sys
from typing import Any, Callable

from ._device_rows import D2H, D2H_AGAIN, H2D, H2D_AGAIN, QUESTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

MiB, GiB = 1 << 20, 1 << 30


class FigureError(LookupError):
    """A figure names a results file, row or field that is not there (or not exactly one row)."""


class RowFailed(FigureError):
    """The figure's row is there but its benchmark recorded that measuring it failed (``error``)."""


class RowAbsent(RowFailed):
    """An accelerator's results file (:data:`ON_DEVICE`) has no row for the figure: the published
    run did not measure that case (a worker count, say: one device command each)."""


#: Results files that may be absent: benchmarks that run only on an accelerator (``device``).
#: Until such a file exists, its figures are not checked and a table that needs it says so
#: instead of its rows; once it exists, it is checked like every other.
OPTIONAL = ("device", "pipeline_device")


#: How each optional results file is made (on an accelerator host).
MEASURED_BY = {
    "device": "`python -m benchmarks.device --publish`",
    "pipeline_device": "`bash benchmarks/device_pipeline.sh N` for 2, 6 and 12 workers, merged by "
                       "`python -m benchmarks.pipeline --merge ... --name pipeline_device --out benchmarks/results`",
}


def absent(fig: Fig | Derived, results: str = RESULTS) -> bool:
    """Whether ``fig`` needs an optional results file (:data:`OPTIONAL`) that is not there."""
    return any(f in OPTIONAL and not os.path.exists(os.path.join(results, f"{f}.json")) for f in fig.files())


# ------------------------------------------------------------------------------------------
# results files


@dataclasses.dataclass
class Result:
    name: str
    generated: str
    environment: dict
    conditions: dict
    quick: bool
    rows: list[dict]

    @property
    def date(self) -> str:
        return self.generated.split(" ")[0] if self.generated else "undated"


_LOADED: dict[tuple[str, int], Result] = {}  # (path, mtime): a file rewritten is read again


def load(name: str, results: str = RESULTS) -> Result:
    """The results file ``results/{name}.json``; its date from the file, else from its ``.md``."""
    path = os.path.join(results, f"{name}.json")
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError as exc:
        raise FigureError(f"no results file {path}") from exc
    key = (path, stamp)
    if key not in _LOADED:
        with open(path) as f:
            data = json.load(f)
        generated = data.get("generated") or _generated_in(os.path.join(results, f"{name}.md")) or ""
        _LOADED[key] = Result(name, generated, data.get("environment", {}), data.get("conditions", {}),
                             bool(data.get("quick")), data["rows"])
    return _LOADED[key]


def _generated_in(md_path: str) -> str | None:
    try:
        with open(md_path) as f:
            for line in f:
                if line.startswith("Generated by"):
                    return line.split(" on ", 1)[1].split(" (", 1)[0]
    except (OSError, IndexError):
        pass
    return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def runs_of(row: dict) -> int | None:
    """How many timed repetitions (or rounds) the row's value is the median of."""
    for key in ("runs", "reps", "rounds"):
        v = row.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def spread_of(row: dict) -> float | None:
    """``(max - min) / median`` of the row's repetitions, as a fraction; None when the row did not
    keep them (or was measured once)."""
    if _num(row.get("spread_pct")) is not None:
        return row["spread_pct"] / 100
    med = _num(row.get("seconds"))
    for lo, hi, center in (("min", "max", "seconds"), ("min_s", "max_s", "seconds"),
                           ("ms_min", "ms_max", "ms_per_task")):
        a, b, c = _num(row.get(lo)), _num(row.get(hi)), _num(row.get(center))
        if a is not None and b is not None and c:
            return (b - a) / c
    ratios = [float(x) for x in str(row.get("round_ratios") or "").split()]
    if len(ratios) > 1:
        return (max(ratios) - min(ratios)) / statistics.median(ratios)
    if _num(row.get("spread")) is not None and med:  # pool, queue: half the range, in seconds
        return 2 * row["spread"] / med
    return None


# ------------------------------------------------------------------------------------------
# figures


def _x(v: float) -> str:
    return f"{v:,.0f}x" if v >= 10 else f"{v:.1f}x" if v >= 2 else f"{v:.2f}x"


def _s(v: float) -> str:
    if v < 0.01:
        return f"{v * 1e3:.2g} ms"
    return f"{v:.3g} s" if v < 100 else f"{v:.0f} s"


def _ms(v: float) -> str:
    return f"{v * 1e3:.3g} ms"


def _steps(v: float) -> str:
    return f"{v:,.0f} env steps/s"


def _gbps(v: float) -> str:
    return f"{v:.2g} GB/s"


def _pct(v: float) -> str:
    return f"{v * 100:.0f}%"


FORMATS: dict[str, Callable[[float], str]] = {
    "x": _x, "s": _s, "ms": _ms, "steps": _steps, "gbps": _gbps, "pct": _pct,
    "x2": lambda v: f"{v:.2f}x", "n": lambda v: f"{v:,.0f}", "raw": str,
    "us": lambda v: f"{v * 1e6:.0f} us" if v >= 1e-5 else f"{v * 1e6:.1f} us",
    "mib": lambda v: f"{v / MiB:g} MiB",
    "bps": lambda v: f"{v:.3g} batches/s", "rss": lambda v: f"{v:,.0f} MiB",
    "cores": lambda v: f"{v:.2f} cores", "per_core": lambda v: f"{v:.3g} batches per CPU-second",
    "ret": lambda v: f"{v:.2f}",
}


@dataclasses.dataclass(frozen=True)
class Fig:
    """``field`` of the one row of ``benchmarks/results/{file}.json`` whose keys match ``where``."""

    file: str
    where: tuple[tuple[str, Any], ...]
    field: str = "ratio"
    fmt: str = "x"

    def row(self, results: str = RESULTS) -> dict:
        res = load(self.file, results)
        found = [r for r in res.rows if all(r.get(k) == v for k, v in self.where)]
        if not found and self.file in ON_DEVICE:
            raise RowAbsent(f"{self.file}.json: no row matches {dict(self.where)}: not measured in this run")
        if len(found) != 1:
            raise FigureError(f"{self.file}.json: {len(found)} rows match {dict(self.where)} (want 1)")
        return found[0]

    def value(self, results: str = RESULTS) -> Any:
        row = self.row(results)
        raw = row.get(self.field)
        if self.fmt == "raw" and raw not in (None, ""):
            return raw
        v = _num(raw)
        if v is None and row.get("error"):
            raise RowFailed(f"{self.file}.json {dict(self.where)}: the run failed to measure it: {row['error']}")
        if v is None:
            raise FigureError(f"{self.file}.json {dict(self.where)}: no number in {self.field!r}")
        return v

    def files(self) -> tuple[str, ...]:
        return (self.file,)

    def rows(self, results: str = RESULTS) -> list[tuple[str, dict]]:
        return [(self.file, self.row(results))]


@dataclasses.dataclass(frozen=True)
class Derived:
    """A value computed from other figures (e.g. one row's env steps/s over another's)."""

    parts: tuple[str, ...]
    fn: Callable[..., float]
    fmt: str = "x"

    def value(self, results: str = RESULTS) -> float:
        return self.fn(*(FIGURES[p].value(results) for p in self.parts))

    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for p in self.parts for f in FIGURES[p].files()))

    def rows(self, results: str = RESULTS) -> list[tuple[str, dict]]:
        return [fr for p in self.parts for fr in FIGURES[p].rows(results)]


def F(file: str, field: str, fmt: str, **where: Any) -> Fig:
    if "size" in where:
        where["size_bytes"] = where.pop("size")
    return Fig(file, tuple(sorted(where.items())), field, fmt)


FIGURES: dict[str, Fig | Derived] = {}


def _pool() -> None:
    for tag, size in (("1k", 1024), ("256k", 256 * 1024), ("1m", MiB), ("64m", 64 * MiB), ("256m", 256 * MiB),
                      ("1g", GiB)):
        for q, name in (("arg", "argument"), ("res", "result")):
            FIGURES[f"pool.{q}.{tag}.mp.s"] = F("pool", "seconds", "s", name=name, size=size,
                                                 transport="multiprocessing.Pool")
            FIGURES[f"pool.{q}.{tag}.jt.s"] = F("pool", "seconds", "s", name=name, size=size,
                                                 transport="jaxtransport.Pool")
            FIGURES[f"pool.{q}.{tag}.ratio"] = F("pool", "ratio", "x", name=name, size=size,
                                                  transport="jaxtransport.Pool")
            FIGURES[f"pool.{q}.{tag}.memcpy"] = F("pool", "vs_memcpy", "x", name=name, size=size,
                                                   transport="jaxtransport.Pool")
    for q, name in (("beside", "beside_long"),):
        FIGURES[f"pool.{q}.mp.s"] = F("pool", "seconds", "s", name=name, transport="multiprocessing.Pool")
        FIGURES[f"pool.{q}.jt.s"] = F("pool", "seconds", "s", name=name, transport="jaxtransport.Pool")
        FIGURES[f"pool.{q}.ratio"] = F("pool", "ratio", "x", name=name, transport="jaxtransport.Pool")
    FIGURES["pool.broadcast.x4"] = F("pool", "vs_one_worker", "x", name="broadcast",
                                     transport="jaxtransport.Pool x4")
    for tag, size in (("64m", 64 * MiB), ("256m", 256 * MiB)):
        FIGURES[f"pool.steady_arg.{tag}.memcpy"] = F("pool", "vs_memcpy", "x", name="steady_argument",
                                                    size=size, transport="jaxtransport.Pool")
        FIGURES[f"pool.steady_res.{tag}.memcpy"] = F("pool", "vs_memcpy", "x", name="steady_result",
                                                    size=size, transport="jaxtransport.Pool")


def _codec() -> None:
    for t, tag in (("jax-default", "jax"), ("jt-one-copy", "jt"), ("memcpy", "memcpy"),
                   ("jt-registered-inband", "inband")):
        for sz, size in (("256m", 256 * MiB), ("1g", GiB)):
            FIGURES[f"codec.{sz}.{tag}.s"] = F("codec", "seconds", "s", name="codec", size=size, transport=t)
    FIGURES["codec.1g.ratio"] = F("codec", "speedup_vs_default", "x", name="codec", size=GiB,
                                  transport="jt-one-copy")
    FIGURES["codec.256m.jax.gbps"] = F("codec", "gbps", "gbps", name="codec", size=256 * MiB,
                                       transport="jax-default")


def _first_call() -> None:
    for tag, size in (("64m", 64 * MiB), ("256m", 256 * MiB), ("1g", GiB)):
        for q, name in (("arg", "first_argument"), ("res", "first_result")):
            for t, ttag in (("jaxtransport.Pool", "jt"), ("jaxtransport.Pool shm_reserve", "reserve"),
                            ("ray (numpy)", "ray"), ("multiprocessing.Pool", "mp"),
                            ("multiprocessing.Pool + jt.register()", "mpreg")):
                FIGURES[f"first.{q}.{tag}.{ttag}.s"] = F("first_call", "seconds", "s", name=name,
                                                         size=size, transport=t)
                FIGURES[f"first.{q}.{tag}.{ttag}.ratio"] = F("first_call", "ratio", "x", name=name,
                                                             size=size, transport=t)
    for q in ("arg", "res"):
        FIGURES[f"first.{q}.1g.vs_mp"] = Derived((f"first.{q}.1g.mp.s", f"first.{q}.1g.jt.s"),
                                                 lambda a, b: a / b)


def _startup() -> None:
    for name in ("startup_numpy", "startup_numpy_jax_parent", "startup_jax"):
        for t, tag in (("jaxtransport.Pool", "jt"), ("jaxtransport.Pool preload_jax=False", "nopreload"),
                       ("multiprocessing.Pool", "mp")):
            FIGURES[f"startup.{name}.{tag}.s"] = F("startup", "seconds", "s", name=name, transport=t)
            if name == "startup_numpy" and tag == "nopreload":
                del FIGURES[f"startup.{name}.{tag}.s"]
            elif tag != "mp":
                FIGURES[f"startup.{name}.{tag}.slower"] = F("startup", "vs_baseline", "x2", name=name,
                                                            transport=t)
    for name in ("first_jax_argument_now", "first_jax_argument_2s"):
        for t, tag in (("jaxtransport.Pool", "jt"), ("jaxtransport.Pool preload_jax=False", "nopreload"),
                       ("jaxtransport.Pool: steady state (same pool)", "steady")):
            FIGURES[f"startup.{name}.{tag}.s"] = F("startup", "seconds", "s", name=name, size=256 * MiB,
                                                   transport=t)


def _forward() -> None:
    """``forward.json``: arrays already in shared memory, sent on by handle (256 MiB)."""
    size = 256 * MiB
    for name, t, tag in (
        ("relay", "jaxtransport (relay forwards by handle)", "relay"),
        ("relay", "jaxtransport (fresh array, copied)", "relay.fresh"),
        ("chain", "jaxtransport (3 relays by handle)", "chain"),
        ("fanout", "jaxtransport (one array to 4 queues)", "fanout"),
        ("fanout", "jaxtransport (4 arrays, 4 copies)", "fanout.copies"),
        ("resend", "jaxtransport (same array, by handle)", "resend"),
        ("resend", "torch.multiprocessing (shared tensor)", "resend.torch"),
        ("memcpy", "memcpy", "memcpy"),
    ):
        FIGURES[f"forward.{tag}.ms"] = F("forward", "seconds", "ms", name=name, size=size, transport=t)
        if name != "memcpy":
            FIGURES[f"forward.{tag}.memcpy"] = F("forward", "vs_memcpy", "x2", name=name, size=size, transport=t)
    pool = ("map_after_map", "jaxtransport.Pool (a result, by handle)")
    FIGURES["forward.pool.ms"] = F("forward", "seconds", "ms", name=pool[0], size=size, transport=pool[1])
    FIGURES["forward.pool.transfer.ms"] = F("forward", "transfer_s", "ms", name=pool[0], size=size, transport=pool[1])
    FIGURES["forward.pool.fresh.ms"] = F("forward", "seconds", "ms", name=pool[0], size=size,
                                         transport="jaxtransport.Pool (fresh array, copied)")
    FIGURES["forward.pool.tiny.ms"] = F("forward", "seconds", "ms", name=pool[0], size=size,
                                        transport="jaxtransport.Pool (4 elements, no transfer)")
    FIGURES["forward.pool.ratio"] = F("forward", "ratio", "x", name=pool[0], size=size, transport=pool[1])
    FIGURES["forward.resend.vs_torch"] = F("forward", "vs_torch", "x2", name="resend", size=size,
                                           transport="jaxtransport (same array, by handle)")
    FIGURES["forward.torch.version"] = F("forward", "torch_version", "raw", name="resend", size=size,
                                         transport="torch.multiprocessing (shared tensor)")


def _others() -> None:
    FIGURES["usercode.mp.ms"] = F("usercode", "seconds", "ms", name="__main__ jitted task",
                                  transport="multiprocessing.Pool")
    FIGURES["usercode.jt.ms"] = F("usercode", "seconds", "ms", name="__main__ jitted task",
                                  transport="jaxtransport.Pool")
    FIGURES["usercode.speedup"] = Derived(("usercode.mp.ms", "usercode.jt.ms"), lambda a, b: a / b, "x2")
    for name, tag in (("64 MiB round trip", "64m"), ("256 MiB round trip", "256m"), ("tiny task", "tiny")):
        FIGURES[f"executor.{tag}.pool.s"] = F("executor", "seconds", "s", name=name, transport="jaxtransport.Pool")
        FIGURES[f"executor.{tag}.ex.s"] = F("executor", "seconds", "s", name=name,
                                            transport="jaxtransport.Executor")
        FIGURES[f"executor.{tag}.ratio"] = F("executor", "ratio", "x2", name=name,
                                             transport="jaxtransport.Executor")
    for q in ("queue", "pipe"):
        for tag, size in (("64m", 64 * MiB), ("1g", GiB)):
            for t, ttag in (("multiprocessing", "mp"), ("jaxtransport.multiprocessing", "jt"),
                            ("torch.multiprocessing", "torch")):
                FIGURES[f"{q}.{tag}.{ttag}.s"] = F("queue", "seconds", "s", name=q, size=size, transport=t)
            FIGURES[f"{q}.{tag}.ratio"] = F("queue", "ratio", "x", name=q, size=size,
                                            transport="jaxtransport.multiprocessing")
            FIGURES[f"{q}.{tag}.vs_torch"] = F("queue", "vs_torch", "x", name=q, size=size,
                                               transport="jaxtransport.multiprocessing")
            FIGURES[f"{q}.{tag}.memcpy"] = F("queue", "vs_memcpy", "x", name=q, size=size,
                                             transport="jaxtransport.multiprocessing")
    _forward()
    FIGURES["queue.64m.torch.version"] = F("queue", "torch_version", "raw", name="queue", size=64 * MiB,
                                           transport="torch.multiprocessing")
    FIGURES["queue.64m.jt.gbps"] = F("queue", "gbps", "gbps", name="queue", size=64 * MiB,
                                     transport="jaxtransport.multiprocessing")
    FIGURES["queue.64m.mp.gbps"] = F("queue", "gbps", "gbps", name="queue", size=64 * MiB,
                                     transport="multiprocessing")
    for tag, size in (("1k", 1024), ("1m", MiB), ("64m", 64 * MiB), ("1g", GiB)):
        for q in ("argument", "result"):
            for t, ttag in (("ray-default", "stock"), ("jaxtransport", "jt"), ("numpy", "numpy")):
                FIGURES[f"ray.{q}.{tag}.{ttag}.s"] = F("ray", "seconds", "s", name=q, size=size, transport=t)
            FIGURES[f"ray.{q}.{tag}.ratio"] = F("ray", "ratio", "x", name=q, size=size, transport="jaxtransport")
    for backend in ("pool", "queue", "ray"):
        for t, ttag in (("stock", "stock"), ("jaxtransport", "jt")):
            FIGURES[f"rollouts.{backend}.{ttag}.steps"] = F(
                "rollouts", "env_steps_per_s", "steps", name=f"rollouts-{backend}", param_mb=32.0, transport=t)
        FIGURES[f"rollouts.{backend}.ratio"] = F("rollouts", "ratio", "x", name=f"rollouts-{backend}",
                                                 param_mb=32.0, transport="jaxtransport")
        FIGURES[f"rollouts.{backend}.128.ratio"] = F("rollouts", "ratio", "x", name=f"rollouts-{backend}",
                                                     param_mb=128.0, transport="jaxtransport")
        FIGURES[f"rollouts.{backend}.8.ratio"] = F("rollouts", "ratio", "x", name=f"rollouts-{backend}",
                                                   param_mb=8.0, transport="jaxtransport")
    FIGURES["rollouts.queue.pool.steps"] = F("rollouts", "env_steps_per_s", "steps", name="rollouts-queue",
                                             param_mb=32.0, transport="pool/jaxtransport")
    FIGURES["rollouts.queue.vs_pool"] = Derived(("rollouts.queue.jt.steps", "rollouts.queue.pool.steps"),
                                                lambda a, b: a / b, "x2")
    FIGURES["rollouts.pool.stock.transport_s"] = F("rollouts", "transport_s", "s", name="rollouts-pool",
                                                   param_mb=32.0, transport="stock")
    FIGURES["rollouts.pool.stock.wall_s"] = F("rollouts", "seconds", "s", name="rollouts-pool",
                                              param_mb=32.0, transport="stock")
    FIGURES["rollouts.pool.jt.transport_s"] = F("rollouts", "transport_s", "s", name="rollouts-pool",
                                                param_mb=32.0, transport="jaxtransport")
    for t, ttag in (("threads", "threads"), ("queue/stock", "queue_stock"), ("queue/jaxtransport", "queue_jt"),
                    ("pool/stock", "pool_stock"), ("pool/jaxtransport", "pool_jt"), ("ray/jaxtransport", "ray_jt")):
        for actors in (1, 2):
            FIGURES[f"atari.{actors}.{ttag}.steps"] = F("rollouts_atari", "env_steps_per_s", "n",
                                                        name="rollouts-atari-pong", actors=actors, transport=t)
            FIGURES[f"atari.{actors}.{ttag}.ratio"] = F("rollouts_atari", "ratio", "x2",
                                                        name="rollouts-atari-pong", actors=actors, transport=t)
            FIGURES[f"atari.{actors}.{ttag}.load"] = F("rollouts_atari", "load", "raw",
                                                       name="rollouts-atari-pong", actors=actors, transport=t)
            FIGURES[f"atari.{actors}.{ttag}.vs_stock"] = F("rollouts_atari", "vs_stock_queue", "x2",
                                                           name="rollouts-atari-pong", actors=actors, transport=t)
    for q in ("argument", "result"):
        for tag, size in (("64m", 64 * MiB), ("256m", 256 * MiB)):
            for rev in ("7895fec", "2edeb3f"):
                FIGURES[f"revisions.{q}.{tag}.{rev}.memcpy"] = F(
                    "revisions", "vs_memcpy", "x2", name=q, size=size, transport=f"jaxtransport.Pool @ {rev}")


def _tasks() -> None:
    # benchmarks/tasks.py: one small task sent one by one; per task seconds, ratio against the
    # stock pool of the call (multiprocessing.Pool or concurrent.futures), and loky's row.
    # The "_main" calls: the same 0 s cells with a task defined in the user's script (__main__).
    every = (("0 s", "0"), ("100 us", "100us"), ("1 ms", "1ms"))
    main = ((("0 s", "0"),), ", a function of the main script")
    calls = (("apply", "Pool.apply_async", (every, "")), ("map", "Pool.map(chunksize=1)", (every, "")),
             ("imap", "Pool.imap(chunksize=1)", (every, "")), ("submit", "Executor.submit", (every, "")),
             ("exmap", "Executor.map", (every, "")), ("apply_main", "Pool.apply_async", main),
             ("submit_main", "Executor.submit", main))
    for q, label, (tasks, suffix) in calls:
        stock = "multiprocessing.Pool" if label.startswith("Pool") else "concurrent.futures"
        jt = "jaxtransport.Pool" if label.startswith("Pool") else "jaxtransport.Executor"
        for task, ttag in tasks:
            for w in (2, 8, 16):
                name = f"{label}, {task} tasks{suffix}"
                key = f"tasks.{q}.{ttag}.{w}"
                FIGURES[f"{key}.mp.us"] = F("tasks", "seconds", "us", name=name, workers=w, transport=stock)
                FIGURES[f"{key}.jt.us"] = F("tasks", "seconds", "us", name=name, workers=w, transport=jt)
                FIGURES[f"{key}.ratio"] = F("tasks", "ratio", "x2", name=name, workers=w, transport=jt)
                if ttag != "0":  # tasks that sleep: a perfect pool's time per task, and what a pool adds
                    FIGURES[f"{key}.ideal.us"] = F("tasks", "ideal_seconds", "us", name=name, workers=w, transport=jt)
                    FIGURES[f"{key}.jt.added.us"] = Derived((f"{key}.jt.us", f"{key}.ideal.us"), lambda a, b: a - b, "us")
                if not label.startswith("Pool"):
                    FIGURES[f"{key}.loky.us"] = F("tasks", "seconds", "us", name=name, workers=w, transport="loky")
                    FIGURES[f"{key}.vs_loky"] = Derived((f"{key}.loky.us", f"{key}.jt.us"), lambda a, b: a / b, "x2")
                    if ttag != "0":
                        # the most any pool could reach against loky (its time over ours at no
                        # cost beyond the tasks'), and loky's added time over ours
                        FIGURES[f"{key}.loky_ceiling"] = Derived(
                            (f"{key}.loky.us", f"{key}.ideal.us"), lambda a, b: a / b, "x2")
                        FIGURES[f"{key}.loky.added.us"] = Derived(
                            (f"{key}.loky.us", f"{key}.ideal.us"), lambda a, b: a - b, "us")
                        FIGURES[f"{key}.added_vs_loky"] = Derived(
                            (f"{key}.loky.added.us", f"{key}.jt.added.us"), lambda a, b: a / b, "x2")


def _joblib() -> None:
    # benchmarks/joblib.py: joblib.Parallel on the jaxtransport backend against loky (and the
    # backend against jaxtransport.Pool.map); cache keys against joblib.hash of numpy.
    for q, prefix in (("args", "8 jax.Array arguments of "), ("results", "8 jax.Array results of "),
                      ("numpy", "8 numpy arguments of ")):
        FIGURES[f"joblib.{q}.loky.s"] = F("joblib", "seconds", "s", name=f"{prefix}64 MiB", transport="loky")
        FIGURES[f"joblib.{q}.jt.s"] = F("joblib", "seconds", "s", name=f"{prefix}64 MiB",
                                        transport="jaxtransport backend")
        FIGURES[f"joblib.{q}.ratio"] = F("joblib", "ratio", "x2", name=f"{prefix}64 MiB",
                                         transport="jaxtransport backend")
    FIGURES["joblib.tiny.loky.s"] = F("joblib", "seconds", "s", name="10,000 tiny tasks", transport="loky")
    FIGURES["joblib.tiny.jt.s"] = F("joblib", "seconds", "s", name="10,000 tiny tasks",
                                    transport="jaxtransport backend")
    FIGURES["joblib.tiny.ratio"] = F("joblib", "ratio", "x2", name="10,000 tiny tasks",
                                     transport="jaxtransport backend")
    FIGURES["joblib.vs_pool.pool.s"] = F("joblib", "seconds", "s", name="backend vs Pool.map, 8 x 64 MiB",
                                         transport="jaxtransport.Pool.map")
    FIGURES["joblib.vs_pool.jt.s"] = F("joblib", "seconds", "s", name="backend vs Pool.map, 8 x 64 MiB",
                                       transport="jaxtransport backend")
    FIGURES["joblib.vs_pool.ratio"] = F("joblib", "ratio", "x2", name="backend vs Pool.map, 8 x 64 MiB",
                                        transport="jaxtransport backend")
    FIGURES["joblib.hash.np.s"] = F("joblib", "seconds", "s", name="hash a 1024 MiB array",
                                    transport="joblib.hash (numpy)")
    FIGURES["joblib.hash.jt.s"] = F("joblib", "seconds", "s", name="hash a 1024 MiB array",
                                    transport="jaxtransport.joblib.hash (jax.Array)")
    FIGURES["joblib.hash.ratio"] = F("joblib", "ratio", "x2", name="hash a 1024 MiB array",
                                     transport="jaxtransport.joblib.hash (jax.Array)")


def _platforms() -> None:
    # benchmarks/platforms.py: each platform mode in its own interpreter, one run.
    for m, tag in (("auto", "memfd"), ("portable", "portable")):
        FIGURES[f"platforms.steady.{tag}.ms"] = F("platforms", "seconds", "ms", name="steady_64MiB_arg_result",
                                                  transport=m)
        FIGURES[f"platforms.first.{tag}.s"] = F("platforms", "seconds", "s", name="first_transfer", transport=m)
        FIGURES[f"platforms.first.{tag}.gbps"] = F("platforms", "gbps", "gbps", name="first_transfer", transport=m)
    FIGURES["platforms.steady.portable.slower"] = Derived(
        ("platforms.steady.portable.ms", "platforms.steady.memfd.ms"), lambda a, b: a / b, "x2")
    for prefix, tag in (("inband", ""), ("winsim", "winsim.")):
        for q, row in (("arg64m", "arg_64MiB"), ("tiny_map", "tiny_map"), ("tiny_apply", "tiny_apply_async")):
            name = f"{prefix}_{row}"
            FIGURES[f"platforms.{tag}{q}.inband.ms"] = F("platforms", "seconds", "ms", name=name, transport="inband")
            FIGURES[f"platforms.{tag}{q}.mp.ms"] = F("platforms", "seconds", "ms", name=name,
                                                     transport="multiprocessing.Pool")
            FIGURES[f"platforms.{tag}{q}.ratio"] = F("platforms", "ratio", "x2", name=name, transport="inband")
    FIGURES["platforms.tiny_map.tasks"] = F("platforms", "tasks", "n", name="inband_tiny_map", transport="inband")
    FIGURES["platforms.tiny_apply.tasks"] = F("platforms", "tasks", "n", name="inband_tiny_apply_async",
                                              transport="inband")


def _previous() -> None:
    # The run before the last re-measurement (results/previous/NAME.json, kept as published then):
    # "prev." + the key of the same figure in the current files, for the re-measure table.
    for key, fig in list(FIGURES.items()):
        if isinstance(fig, Fig) and fig.file in PREVIOUS and fig.field != "torch_version":  # not kept then
            FIGURES[f"prev.{key}"] = dataclasses.replace(fig, file=f"previous/{fig.file}")
    for key, fig in list(FIGURES.items()):
        if isinstance(fig, Derived) and all(f"prev.{p}" in FIGURES for p in fig.parts):
            FIGURES[f"prev.{key}"] = dataclasses.replace(fig, parts=tuple(f"prev.{p}" for p in fig.parts))


def _device() -> None:
    # benchmarks/device.py: a device array (256 MiB; 64 MiB with --quick) moved by jaxtransport
    # against the device's own copies (D2H, H2D) and the stock routes. One size per run: the
    # rows are found by question and transport only.
    FIGURES["device.size"] = F("device", "size_bytes", "mib", name=D2H[0], transport=D2H[1])
    FIGURES["device.d2h.s"] = F("device", "seconds", "s", name=D2H[0], transport=D2H[1])
    FIGURES["device.h2d.s"] = F("device", "seconds", "s", name=H2D[0], transport=H2D[1])
    FIGURES["device.d2h.last.s"] = F("device", "seconds", "s", name=D2H[0], transport=D2H_AGAIN)
    FIGURES["device.h2d.last.s"] = F("device", "seconds", "s", name=H2D[0], transport=H2D_AGAIN)
    # Each limit: the fastest copy of the run, whole or in pieces (issue 49).
    FIGURES["device.d2h.limit.s"] = F("device", "seconds", "s", name="D2H limit", transport="fastest copy measured")
    FIGURES["device.h2d.limit.s"] = F("device", "seconds", "s", name="H2D limit", transport="fastest copy measured")
    for name, tag, transport in (("Ray serialize", "ray_ser", "jaxtransport.ray serializer (in process)"),
                                 ("Ray deserialize", "ray_de", "jaxtransport.ray deserializer (in process)")):
        FIGURES[f"device.{tag}.jt.s"] = F("device", "seconds", "s", name=name, transport=transport)
        FIGURES[f"device.{tag}.vs_limit"] = F("device", "vs_limit", "x2", name=name, transport=transport)
    tags = {"dumps": "dumps", "loads": "loads", "codec round trip": "codec", "Pool argument": "pool_arg",
            "Pool production": "pool_prod", "Pool result": "pool_res", "Queue": "queue"}
    for name, jt, stock in QUESTIONS:
        tag = f"device.{tags[name]}"
        FIGURES[f"{tag}.jt.s"] = F("device", "seconds", "s", name=name, transport=jt)
        if name == "Pool production":
            continue
        FIGURES[f"{tag}.vs_limit"] = F("device", "vs_limit", "x2", name=name, transport=jt)
        if stock:
            FIGURES[f"{tag}.stock.s"] = F("device", "seconds", "s", name=name, transport=stock)
            FIGURES[f"{tag}.speedup"] = F("device", "speedup", "x", name=name, transport=jt)
    # The demo with the learner on the device and the actors on the CPU (--rollouts).
    for t, ttag in (("jaxtransport", "jt"), ("stock", "stock")):
        FIGURES[f"device.rollouts.{ttag}.steps"] = F("device", "env_steps_per_s", "steps", name="rollouts", transport=t)
        FIGURES[f"device.rollouts.{ttag}.s"] = F("device", "seconds", "s", name="rollouts", transport=t)
        FIGURES[f"device.rollouts.{ttag}.transport_s"] = F("device", "transport_s", "s", name="rollouts", transport=t)
    FIGURES["device.rollouts.ratio"] = F("device", "ratio", "x", name="rollouts", transport="jaxtransport")


def _rollouts_scale() -> None:
    # benchmarks/rollouts_scale.py: env steps/s with more actors, learner on the CPU or the device.
    measured = [(b, lrn, n) for b in ("queue", "pool") for lrn in ("tpu", "cpu") for n in (2, 4, 8, 12)]
    measured += [("queue", "tpu", 1)]
    for backend, learner, actors in measured:
        where = {"name": "rollouts-scale", "backend": backend, "learner": learner, "actors": actors}
        tag = f"scale.{backend}.{learner}.{actors}"
        FIGURES[f"{tag}.steps"] = F("rollouts_scale", "env_steps_per_s", "steps", **where)
        FIGURES[f"{tag}.vs_2"] = F("rollouts_scale", "ratio_vs_2", "x", **where)
        FIGURES[f"{tag}.compute_vs_2"] = F("rollouts_scale", "compute_vs_fewest", "x", **where)
        for field in ("actor_compute_s", "actor_compute_mean_s", "learner_s", "transport_s", "wall_s",
                      "transport_share"):
            FIGURES[f"{tag}.{field}"] = F("rollouts_scale", field, "s" if field != "transport_share" else "pct",
                                          **where)
    for backend, learner in [(b, lrn) for b in ("queue", "pool") for lrn in ("tpu", "cpu")]:
        # (d): the budget turned the other way at 12 actors
        where = {"name": "rollouts-scale-budget", "backend": backend, "learner": learner, "actors": 12}
        tag = f"scale.{backend}.{learner}.12.other_budget"
        FIGURES[f"{tag}.steps"] = F("rollouts_scale", "env_steps_per_s", "steps", **where)
        FIGURES[f"{tag}.compute_vs_2"] = F("rollouts_scale", "compute_vs_fewest", "x", **where)


def _engines() -> None:
    # benchmarks/rollouts_engines.py: Pong by engine (gymnasium, envpool) and design, per actor
    # count; "ratio" is against threads over envpool (cleanba's stack), "limit_share" against
    # the row's own engine's stepping limit. Actor counts: those of the published run.
    backends = (("threads", "threads"), ("queue/jaxtransport", "queue_jt"), ("pool/jaxtransport", "pool_jt"),
                ("queue/stock", "queue_stock"), ("queue/jaxtransport+central-inference", "central"), ("limit", "limit"))
    for actors in (1, 2):
        for engine in ("gymnasium", "envpool"):
            for backend, tag in backends:
                where = {"name": "rollouts-engines-pong", "actors": actors, "engine": engine, "backend": backend}
                key = f"engines.{actors}.{engine}.{tag}"
                FIGURES[f"{key}.steps"] = F("rollouts_engines", "env_steps_per_s", "steps", **where)
                FIGURES[f"{key}.load"] = F("rollouts_engines", "load", "raw", **where)
                if backend != "limit":
                    FIGURES[f"{key}.ratio"] = F("rollouts_engines", "ratio", "x2", **where)
                    FIGURES[f"{key}.of_limit"] = F("rollouts_engines", "limit_share", "pct", **where)
                    FIGURES[f"{key}.acting"] = F("rollouts_engines", "acting_share", "pct", **where)
    # rollouts_engines_tpu.json: the TPU v5e host (13 cores, the learner on the chip), 1 to 12
    # actors, one run each. envpool: 12 actors 24 iterations with the actors acting inline, the
    # others 8. gymnasium: 8 iterations, acting inline, in runs of their own (OpenCV from that
    # host's package index), so its rows' ratio is to gymnasium's own threads (vs_threads).
    for actors, engine in itertools.product((1, 2, 4, 8, 12), ("envpool", "gymnasium")):
        for backend, tag in backends:
            where = {"name": "rollouts-engines-pong", "actors": actors, "engine": engine, "backend": backend}
            key = f"tpu_engines.{actors}.{engine}.{tag}"
            FIGURES[f"{key}.steps"] = F("rollouts_engines_tpu", "env_steps_per_s", "steps", **where)
            if backend != "limit":
                suffix, field = ("ratio", "ratio") if engine == "envpool" else ("vs_threads", "vs_threads_same_engine")
                FIGURES[f"{key}.{suffix}"] = F("rollouts_engines_tpu", field, "x2", **where)
                FIGURES[f"{key}.of_limit"] = F("rollouts_engines_tpu", "limit_share", "pct", **where)
                FIGURES[f"{key}.acting"] = F("rollouts_engines_tpu", "acting_share", "pct", **where)
                FIGURES[f"{key}.waiting"] = F("rollouts_engines_tpu", "waiting_share", "pct", **where)
                FIGURES[f"{key}.stepping"] = F("rollouts_engines_tpu", "stepping_share", "pct", **where)
    # 12 actors only: the jaxtransport queue with --max-lag 2 (a second rollout of slack);
    # rollouts_engines_tpu_runs.json, two more runs on one machine (--repeat 2: each row names
    # its run) of the queue's row, the stock queue's and the limit.
    lag2 = ("queue/jaxtransport --max-lag 2", "queue_jt_lag2")
    queue_jt, queue_stock = ("queue/jaxtransport", "queue_jt"), ("queue/stock", "queue_stock")
    limit = ("limit", "limit")
    sets = [("rollouts_engines_tpu", "tpu_engines", (lag2,), {})]
    sets += [("rollouts_engines_tpu_runs", f"tpu_engines_runs.{k}", (queue_jt, queue_stock, limit), {"run": k})
             for k in (1, 2)]
    for file, prefix, rows, run in sets:
        for backend, tag in rows:
            where = {"name": "rollouts-engines-pong", "actors": 12, "engine": "envpool", "backend": backend, **run}
            FIGURES[f"{prefix}.12.envpool.{tag}.steps"] = F(file, "env_steps_per_s", "steps", **where)
            if backend != "limit":
                FIGURES[f"{prefix}.12.envpool.{tag}.of_limit"] = F(file, "limit_share", "pct", **where)
    # The time one actor's step of its 8 environments took at 12 actors: in the queue's rollouts
    # (its stepping share of the time per step) and in the limit's loop.
    per_step = 12 * 8  # actors x environments
    FIGURES["tpu_engines.12.envpool.queue_jt.step_ms"] = Derived(
        ("tpu_engines.12.envpool.queue_jt.stepping", "tpu_engines.12.envpool.queue_jt.steps"),
        lambda share, steps: share * per_step / steps, "ms")
    FIGURES["tpu_engines.12.envpool.limit.step_ms"] = Derived(
        ("tpu_engines.12.envpool.limit.steps",), lambda steps: per_step / steps, "ms")
    # The slowest queue actor's acting time per step at 12 actors (the row's act_ms_per_step).
    where = {"name": "rollouts-engines-pong", "actors": 12, "engine": "envpool", "backend": "queue/jaxtransport"}
    FIGURES["tpu_engines.12.envpool.queue_jt.act_ms_raw"] = F("rollouts_engines_tpu", "act_ms_per_step", "raw", **where)
    FIGURES["tpu_engines.12.envpool.queue_jt.act_ms"] = Derived(
        ("tpu_engines.12.envpool.queue_jt.act_ms_raw",), lambda ms: ms / 1e3, "ms")


def _learning() -> None:
    # rollouts_learning_tpu.json: Breakout through envpool, 12 actors on the TPU v5e host, the PPO
    # learner on the chip, every backend from the same seed: the mean return of the episodes that
    # ended in the first and last of 8 windows, and how many ended there.
    for transport, tag in (("threads", "threads"), ("queue/jaxtransport", "queue_jt"),
                           ("pool/jaxtransport", "pool_jt"), ("queue/stock", "queue_stock")):
        for window, at in ((1, "first"), (8, "last")):
            where = {"name": "rollouts-learning-breakout", "transport": transport, "window": window}
            FIGURES[f"tpu_learning.{tag}.{at}"] = F("rollouts_learning_tpu", "mean_return", "ret", **where)
            FIGURES[f"tpu_learning.{tag}.{at}_episodes"] = F("rollouts_learning_tpu", "episodes", "n", **where)
        where = {"name": "rollouts-learning-breakout", "transport": transport, "window": 8}
        FIGURES[f"tpu_learning.{tag}.steps"] = F("rollouts_learning_tpu", "env_steps", "n", **where)


def _pipeline() -> None:
    # benchmarks/pipeline.py: batches of decoded JPEGs onto the device. ``pipeline.json``: here, 2
    # workers; ``pipeline_device.json``: the accelerator host, 2, 6 and 12 workers (optional).
    loaders = (("jt", "jaxtransport.data.Loader"), ("grain", "grain mp_prefetch"), ("torch", "torch DataLoader"),
               ("grain1", "grain mp_prefetch, 1 thread a worker"))
    for file, prefix, counts in (("pipeline", "pipeline", (2,)), ("pipeline_device", "pdev", (2, 6, 12))):
        for n in counts:
            tag = f"{prefix}.{n}"
            FIGURES[f"{tag}.limit.bps"] = F(file, "batches_per_s", "bps", name="pipeline", transport="limit", workers=n)
            FIGURES[f"{tag}.limit.make_s"] = F(file, "make_s", "s", name="pipeline", transport="limit", workers=n)
            for short, t in loaders + ((("one", "one process"),) if n == 2 else ()):
                if file == "pipeline_device" and short in ("torch", "grain1"):
                    continue  # torch is not carried to the accelerator host; one Grain row there
                w = 1 if short == "one" else n
                where = {"name": "pipeline", "transport": t, "workers": w}
                FIGURES[f"{tag}.{short}.bps"] = F(file, "batches_per_s", "bps", **where)
                FIGURES[f"{tag}.{short}.vs_limit"] = F(file, "vs_limit", "pct", **where)
                FIGURES[f"{tag}.{short}.wait"] = F(file, "wait_share", "pct", **where)
                FIGURES[f"{tag}.{short}.wait_balanced"] = F(file, "wait_share_balanced", "pct", **where)
                if file != "pipeline_device":  # the TPU host's kernel reports no VmHWM: not read there
                    FIGURES[f"{tag}.{short}.rss"] = F(file, "peak_rss_mib", "rss", **where)
                FIGURES[f"{tag}.{short}.rss_tree"] = F(file, "peak_rss_tree_mib", "rss", **where)
                FIGURES[f"{tag}.{short}.shm"] = F(file, "shm_left", "n", **where)
                FIGURES[f"{tag}.{short}.leaks"] = F(file, "leak_warnings", "n", **where)
                FIGURES[f"{tag}.{short}.cores"] = F(file, "cores_busy", "cores", **where)
                FIGURES[f"{tag}.{short}.per_core"] = F(file, "batches_per_core_s", "per_core", **where)
                if file == "pipeline":  # measured since the 90-batch windows (Note [steady state])
                    FIGURES[f"{tag}.{short}.bps_late"] = F(file, "batches_per_s_late", "bps", **where)
                    FIGURES[f"{tag}.{short}.idle"] = F(file, "cores_idle", "cores", **where)
            FIGURES[f"{tag}.jt.vs_grain"] = F(file, "vs_grain", "x2", name="pipeline", transport=loaders[0][1], workers=n)
    # ``pipeline_shared.json``: an earlier run here while other jobs used the machine (load 7 to 12): what
    # each loader got of the cores. Its peak RSS of the loop's process was read wrongly (getrusage) and
    # is not kept; its runs drained the batches made ahead by the first rule of Note [steady state]
    # (3 waits in a row, without the 16 batches per worker).
    for short, t in loaders + (("one", "one process"),):
        where = {"name": "pipeline", "transport": t, "workers": 1 if short == "one" else 2}
        FIGURES[f"pshared.2.{short}.bps"] = F("pipeline_shared", "batches_per_s", "bps", **where)
        FIGURES[f"pshared.2.{short}.cores"] = F("pipeline_shared", "cores_busy", "cores", **where)
        FIGURES[f"pshared.2.{short}.per_core"] = F("pipeline_shared", "batches_per_core_s", "per_core", **where)
    FIGURES["pshared.2.jt.vs_grain"] = F("pipeline_shared", "vs_grain", "x2", name="pipeline",
                                         transport=loaders[0][1], workers=2)


def _messages() -> None:
    """Small messages' round trips (benchmarks/messages.py): ``messages.{queue,pipe}.{payload}``."""
    for kind in ("queue", "pipe"):
        for tag, payload in (("int", "int"), ("8b", "8 B array"), ("10k", "10 KB array"),
                             ("obs", "observations 113 KB")):
            key, name = f"messages.{kind}.{tag}", f"{kind} round trip"
            FIGURES[f"{key}.mp.us"] = F("messages", "seconds", "us", name=name, payload=payload,
                                        transport="multiprocessing")
            FIGURES[f"{key}.jt.us"] = F("messages", "seconds", "us", name=name, payload=payload,
                                        transport="jaxtransport.multiprocessing")
            FIGURES[f"{key}.ratio"] = F("messages", "ratio", "x2", name=name, payload=payload,
                                        transport="jaxtransport.multiprocessing")


#: Results files whose previous run is kept in results/previous/ (see :func:`_previous`).
PREVIOUS = ("pool", "executor", "queue", "rollouts_atari")

_pool()
_codec()
_first_call()
_startup()
_others()
_tasks()
_messages()
_joblib()
_platforms()
_device()
_rollouts_scale()
_engines()
_learning()
_pipeline()
_previous()


def value_text(key: str, results: str = RESULTS) -> str:
    fig = FIGURES.get(key)
    if fig is None:
        raise FigureError(f"no figure named {key!r} in benchmarks/figures.py FIGURES")
    return FORMATS[fig.fmt](fig.value(results))


def inline_text(key: str, results: str = RESULTS) -> str:
    """What a page shows for ``<!--fig KEY-->``: the value, its results file(s) and date."""
    fig = FIGURES[key] if key in FIGURES else None
    if fig is None:
        raise FigureError(f"no figure named {key!r} in benchmarks/figures.py FIGURES")
    where = ", ".join(f"{f}, {load(f, results).date}" for f in fig.files())
    return f"{value_text(key, results)} ({where})"


# ------------------------------------------------------------------------------------------
# tables


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row; each cell is text with ``{figure key}`` placeholders. ``title``: the heading
    of the row's section where a table's rows link to their provenance (:data:`LINKED`)."""

    question: str
    stock: str
    jaxtransport: str
    speedup: str
    title: str = ""


def slug(title: str) -> str:
    """The anchor of a heading, as GitHub and MyST (``myst_heading_anchors``, its GitHub-style
    slugs) both make it: lower case, each space a hyphen, other punctuation dropped."""
    return re.sub(r"[^\w\- ]", "", title.lower().replace(" ", "-"))


_PLACEHOLDER = re.compile(r"\{([a-z0-9_.]+)\}")


def _fill(text: str, results: str, used: list[str]) -> str:
    def sub(m: re.Match) -> str:
        used.append(m.group(1))
        return value_text(m.group(1), results)

    return _PLACEHOLDER.sub(sub, text)


def _spread_text(row: dict) -> str:
    n, s = runs_of(row), spread_of(row)
    if n is None:
        return "runs not recorded" + (f", spread {s * 100:.0f}%" if s is not None else "")
    if n == 1:
        return "1 run"
    return f"{n} runs, spread {s * 100:.0f}%" if s is not None else f"{n} runs, spread not recorded"


def _source_cell(keys: list[str], results: str) -> str:
    by_file: dict[str, list[str]] = {}
    seen: set[int] = set()
    for key in keys:
        for file, row in FIGURES[key].rows(results):
            if id(row) in seen:
                continue
            seen.add(id(row))
            by_file.setdefault(file, []).append(_spread_text(row))
    parts = []
    for file, spreads in by_file.items():
        res = load(file, results)
        quick = " (--quick)" if res.quick else ""
        parts.append(f"`{file}.json`, {res.generated}{quick}; " + " / ".join(spreads))
    return "; ".join(parts)


def _environment_line(file: str, results: str) -> str:
    res = load(file, results)
    env, cond = res.environment, res.conditions
    kernel = env.get("platform", "?")
    bits = [f"{env.get('cpus', '?')} cores", f"{env.get('mem_total_gib', '?')} GiB",
            f"{env.get('jax_backend', '?').upper()} JAX {env.get('jax', '?')}",
            f"Python {env.get('python', '?')}"]
    if env.get("device_kind"):
        bits.insert(2, f"{env['device_kind']} ({env.get('devices', '?')} device)")
    if env.get("ray"):
        bits.append(f"Ray {env['ray']}")
    bits.append(kernel)
    if env.get("mode"):  # device --allow-cpu: a smoke run
        bits.append(env["mode"])
    if cond.get("loadavg_before") is not None:
        bits.append(f"load {cond['loadavg_before']:.1f} before, {cond.get('loadavg_after', 0):.1f} after")
    else:
        bits.append("load not recorded")
    if cond.get("memcpy_gbps") is not None:
        bits.append(f"warm memcpy {cond['memcpy_gbps']:.1f} GB/s")
    return f"- `{file}.json` ({res.generated}): " + ", ".join(bits)


HEADER = ("| question | stock | jaxtransport | speedup | source: results file, date, and for each figure its "
          "runs and spread ((max - min) / median of the runs; of the per-round speedups where only those were kept) |")


#: Tables whose columns are not stock / jaxtransport / speedup.
HEADERS = {
    "device": "| question | stock | jaxtransport | against the limit (lower is better; 1.00x = the device's own copy) "
              "/ speedup over stock | source: results file, date, and for each figure its runs and spread "
              "((max - min) / median of the runs) |",
    "remeasure": "| figure | previous run | this run | what changed | source: results files, dates, runs and spread |",
    "pipeline": "| question | Grain, torch, one process | `jaxtransport.data.Loader` | against Grain | source: results "
                "file, date, and for each figure its runs and spread ((max - min) / median of the runs) |",
}
HEADERS["pipeline_device"] = HEADERS["pipeline"]


#: Tables shown without their provenance: each row's question links to the heading (its title's
#: slug) of its section in the page named here, where the block named here gives its results file,
#: date, runs, spread and machine. The README's rows link to docs/benchmarks.md.
LINKED = {"readme": ("docs/benchmarks.md", "headline")}
#: Blocks rendered as one section per row (a heading, the figures, their provenance), not a table.
SECTIONS = {"headline"}


def _cells(name: str, row: Row, results: str, used: list[str]) -> list[str]:
    cells = [_fill(c, results, used) for c in (row.question, row.stock, row.jaxtransport, row.speedup)]
    left = [m.group(0) for c in cells for m in re.finditer(r"\{[^{}]*\}", c)]
    if left:  # a placeholder whose key is not [a-z0-9_.]+ would be printed as it is
        raise FigureError(f"table {name!r}: placeholders not filled: {left} (keys are [a-z0-9_.]+)")
    return cells


def _files_of(used: list[str]) -> list[str]:
    return list(dict.fromkeys(f for key in used for f in FIGURES[key].files()))


def render_sections(name: str, results: str = RESULTS) -> str:
    """One section per row: its title as a heading (the anchor a linked table points to), the
    question, the figures, and where they come from: results file, date, runs and spread of each
    figure, and each results file's machine and conditions."""
    out: list[str] = []
    for row in TABLES[name]:
        if not row.title:
            raise FigureError(f"table {name!r}: a row without a title: {row.question!r}")
        used: list[str] = []
        question, stock, jt, speedup = _cells(name, row, results, used)
        out += [f"### {row.title}", "", question, "", f"- stock: {stock or 'none'}", f"- jaxtransport: {jt}"]
        if speedup:
            out.append(f"- speedup: {speedup}")
        out.append(f"- results file, date, and runs and spread of each figure in order: {_source_cell(used, results)}")
        out += [f"- machine of {_environment_line(f, results)[2:]}" for f in _files_of(used)]
        out.append("")
    return "\n".join(out).rstrip("\n")


#: Tables whose figures were measured on an accelerator: their footer names the machine so.
ON_DEVICE = ("device", "pipeline_device")


def _table_keys(name: str) -> list[str]:
    return [m.group(1) for row in TABLES[name] for c in (row.question, row.stock, row.jaxtransport, row.speedup)
            for m in _PLACEHOLDER.finditer(c)]


def render_table(name: str, results: str = RESULTS) -> str:
    """The table's Markdown. A table that needs an optional results file that is not there yet
    (:data:`OPTIONAL`) renders as a line saying so; in such a table (:data:`ON_DEVICE`), a row
    whose run failed (:class:`RowFailed`) says that in its cells."""
    missing = sorted({f for k in _table_keys(name) if k in FIGURES and absent(FIGURES[k], results)
                      for f in FIGURES[k].files() if f in OPTIONAL})
    if missing:
        how = "; ".join(MEASURED_BY.get(f, MEASURED_BY["device"]) for f in missing)
        return ("Not measured yet: " + ", ".join(f"`benchmarks/results/{f}.json`" for f in missing)
                + f" is not there (it is measured only on an accelerator: {how}, then `python -m benchmarks.publish`).")
    if name in SECTIONS:
        return render_sections(name, results)
    linked = LINKED.get(name)
    if linked:
        lines = ["| question | stock | jaxtransport | speedup |", "|---|---|---|---|"]
        for row in TABLES[name]:
            if not row.title:
                raise FigureError(f"table {name!r}: a row without a title (its section's heading): {row.question!r}")
            cells = _cells(name, row, results, [])
            cells[0] = f"[{cells[0]}]({linked[0]}#{slug(row.title)})"
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)
    lines = [HEADERS.get(name, HEADER), "|---|---|---|---|---|"]
    files: list[str] = []
    for row in TABLES[name]:
        used: list[str] = []
        try:
            cells = _cells(name, row, results, used)
        except RowFailed as e:
            if name not in ON_DEVICE:
                raise
            why = ("not measured: the published runs did not run this case" if isinstance(e, RowAbsent) else
                   "not measured: the run failed to measure a figure of this row (its results file's `error` says why)")
            lines.append(f"| {_PLACEHOLDER.sub('-', row.question)} | {why} | | | |")
            continue
        source = _source_cell(used, results)
        for key in used:
            files.extend(f for f in FIGURES[key].files() if f not in files)
        lines.append("| " + " | ".join(cells + [source]) + " |")
    if name in ON_DEVICE:
        lines += ["", "Machine and conditions of this run (the accelerator and its JAX as the run found them):", ""]
    else:
        lines += ["", "Machines and conditions of these runs (every figure is CPU-only; none was measured "
                  "on a GPU):", ""]
    lines += [_environment_line(f, results) for f in files]
    return "\n".join(lines)


README_ROWS = [
    Row("`dumps`+`loads`, 1 GiB, plus one copy into warm receive memory",
        "{codec.1g.jax.s} (JAX's pickle)", "{codec.1g.jt.s} (memcpy: {codec.1g.memcpy.s})", "{codec.1g.ratio}",
        "Codec, 1 GiB"),
    Row("Pool, steady state: 64 MiB jax.Array argument / result",
        "{pool.arg.64m.mp.s} / {pool.res.64m.mp.s} (`multiprocessing.Pool`)",
        "{pool.arg.64m.jt.s} / {pool.res.64m.jt.s} ({pool.arg.64m.memcpy} / {pool.res.64m.memcpy} a warm memcpy)",
        "{pool.arg.64m.ratio} / {pool.res.64m.ratio}", "Pool, 64 MiB"),
    Row("Pool, steady state: 1 GiB jax.Array argument / result",
        "{pool.arg.1g.mp.s} / {pool.res.1g.mp.s} (`multiprocessing.Pool`)",
        "{pool.arg.1g.jt.s} / {pool.res.1g.jt.s} ({pool.arg.1g.memcpy} / {pool.res.1g.memcpy} a warm memcpy)",
        "{pool.arg.1g.ratio} / {pool.res.1g.ratio}", "Pool, 1 GiB"),
    Row("Tiny tasks sent one by one, 2 workers, per task: `Pool.apply_async` / `Executor.submit`",
        "{tasks.apply.0.2.mp.us} (`multiprocessing.Pool`) / {tasks.submit.0.2.mp.us} (`concurrent.futures`)",
        "{tasks.apply.0.2.jt.us} / {tasks.submit.0.2.jt.us}", "{tasks.apply.0.2.ratio} / {tasks.submit.0.2.ratio}",
        "Tiny tasks"),
    Row("Pool start-up to the first result, task importing JAX", "{startup.startup_jax.mp.s}",
        "{startup.startup_jax.jt.s}", "{startup.startup_jax.jt.slower} the time (slower)", "Pool start-up"),
    Row("`jaxtransport.multiprocessing.Queue`, steady state: 64 MiB / 1 GiB jax.Array",
        "{queue.64m.mp.s} / {queue.1g.mp.s} (`multiprocessing.Queue`)", "{queue.64m.jt.s} / {queue.1g.jt.s}",
        "{queue.64m.ratio} / {queue.1g.ratio}", "Queue, 64 MiB and 1 GiB"),
    Row("Ray, steady state: 1 GiB task argument / result", "{ray.argument.1g.stock.s} / {ray.result.1g.stock.s} "
        "(Ray default)", "{ray.argument.1g.jt.s} / {ray.result.1g.jt.s}",
        "{ray.argument.1g.ratio} / {ray.result.1g.ratio}", "Ray, 1 GiB"),
    Row("Rollouts, Pool, 2 workers, default sizes", "{rollouts.pool.stock.steps}", "{rollouts.pool.jt.steps}",
        "{rollouts.pool.ratio}", "Rollouts on the Pool"),
    Row("Rollouts, Ray, 2 workers, default sizes", "{rollouts.ray.stock.steps}", "{rollouts.ray.jt.steps}",
        "{rollouts.ray.ratio}", "Rollouts on Ray"),
]

BENCHMARKS_ROWS = [
    README_ROWS[0],
    Row("`dumps`+`loads`, 256 MiB: JAX's own pickle / `jt.register()` in-band (no out-of-band buffers)",
        "{codec.256m.jax.s}", "{codec.256m.inband.s}; out-of-band plus one copy: {codec.256m.jt.s}", ""),
    README_ROWS[1],
    Row("Pool, steady state: 256 MiB jax.Array argument / result",
        "{pool.arg.256m.mp.s} / {pool.res.256m.mp.s}",
        "{pool.arg.256m.jt.s} / {pool.res.256m.jt.s} ({pool.arg.256m.memcpy} / {pool.res.256m.memcpy} a warm memcpy)",
        "{pool.arg.256m.ratio} / {pool.res.256m.ratio}"),
    README_ROWS[2],
    Row("Pool, the same call repeated on a warm pool: 64 MiB argument / result", "",
        "{pool.steady_arg.64m.memcpy} / {pool.steady_res.64m.memcpy} a warm memcpy", ""),
    Row("Pool, the same call repeated on a warm pool: 256 MiB argument / result", "",
        "{pool.steady_arg.256m.memcpy} / {pool.steady_res.256m.memcpy} a warm memcpy", ""),
    Row("Pool before (7895fec) and after the engine's second design, in one run: steady 64 MiB argument / result",
        "7895fec: {revisions.argument.64m.7895fec.memcpy} / {revisions.result.64m.7895fec.memcpy} a warm memcpy",
        "{revisions.argument.64m.2edeb3f.memcpy} / {revisions.result.64m.2edeb3f.memcpy}", ""),
    Row("Pool, first call (a new pool each run), 64 MiB argument / result",
        "{first.arg.64m.ray.s} / {first.res.64m.ray.s} (Ray's first numpy transfer)",
        "{first.arg.64m.jt.s} / {first.res.64m.jt.s}; with `shm_reserve`: {first.arg.64m.reserve.s} / "
        "{first.res.64m.reserve.s}",
        "{first.arg.64m.jt.ratio} / {first.res.64m.jt.ratio}; reserved {first.arg.64m.reserve.ratio} / "
        "{first.res.64m.reserve.ratio}"),
    Row("Pool, first call, 1 GiB argument / result", "{first.arg.1g.ray.s} / {first.res.1g.ray.s}",
        "{first.arg.1g.jt.s} / {first.res.1g.jt.s}; with `shm_reserve`: {first.arg.1g.reserve.s} / "
        "{first.res.1g.reserve.s}",
        "{first.arg.1g.jt.ratio} / {first.res.1g.jt.ratio}; reserved {first.arg.1g.reserve.ratio} / "
        "{first.res.1g.reserve.ratio}"),
    Row("Pool, first call, 1 GiB argument / result, against `multiprocessing.Pool`",
        "{first.arg.1g.mp.s} / {first.res.1g.mp.s}", "{first.arg.1g.jt.s} / {first.res.1g.jt.s}",
        "{first.arg.1g.vs_mp} / {first.res.1g.vs_mp}"),
    Row("Pool start-up to the first result: numpy-only task / task importing JAX",
        "{startup.startup_numpy.mp.s} / {startup.startup_jax.mp.s} (`multiprocessing.Pool`)",
        "{startup.startup_numpy.jt.s} / {startup.startup_jax.jt.s}; `preload_jax=False`: "
        "{startup.startup_numpy_jax_parent.nopreload.s} (numpy task, JAX parent) / "
        "{startup.startup_jax.nopreload.s}",
        "{startup.startup_numpy.jt.slower} / {startup.startup_jax.jt.slower} the time (slower)"),
    Row("Pool, a 256 MiB argument sent 2 s after start-up: with the JAX preload / without / once warm", "",
        "{startup.first_jax_argument_2s.jt.s} / {startup.first_jax_argument_2s.nopreload.s} / "
        "{startup.first_jax_argument_2s.steady.s}", ""),
    Row("Tiny (0 s) tasks one by one, 2 workers, per task: `Pool.apply_async` / `map(chunksize=1)` / "
        "`imap(chunksize=1)`",
        "{tasks.apply.0.2.mp.us} / {tasks.map.0.2.mp.us} / {tasks.imap.0.2.mp.us} (`multiprocessing.Pool`)",
        "{tasks.apply.0.2.jt.us} / {tasks.map.0.2.jt.us} / {tasks.imap.0.2.jt.us}",
        "{tasks.apply.0.2.ratio} / {tasks.map.0.2.ratio} / {tasks.imap.0.2.ratio}"),
    Row("Tiny (0 s) tasks one by one, 16 workers, per task: `Pool.apply_async` / `map(chunksize=1)` / "
        "`imap(chunksize=1)`",
        "{tasks.apply.0.16.mp.us} / {tasks.map.0.16.mp.us} / {tasks.imap.0.16.mp.us} (`multiprocessing.Pool`)",
        "{tasks.apply.0.16.jt.us} / {tasks.map.0.16.jt.us} / {tasks.imap.0.16.jt.us}",
        "{tasks.apply.0.16.ratio} / {tasks.map.0.16.ratio} / {tasks.imap.0.16.ratio}"),
    Row("Executor, tiny (0 s) tasks, 2 workers, per task: `submit` / `map`",
        "{tasks.submit.0.2.mp.us} / {tasks.exmap.0.2.mp.us} (`concurrent.futures`); loky: "
        "{tasks.submit.0.2.loky.us} / {tasks.exmap.0.2.loky.us}",
        "{tasks.submit.0.2.jt.us} / {tasks.exmap.0.2.jt.us}",
        "{tasks.submit.0.2.ratio} / {tasks.exmap.0.2.ratio}; against loky {tasks.submit.0.2.vs_loky} / "
        "{tasks.exmap.0.2.vs_loky}"),
    Row("Executor, 1 ms tasks (`time.sleep`), `submit`, 2 / 8 workers, per task",
        "loky: {tasks.submit.1ms.2.loky.us} / {tasks.submit.1ms.8.loky.us}, of which "
        "{tasks.submit.1ms.2.loky.added.us} / {tasks.submit.1ms.8.loky.added.us} beyond the tasks' own "
        "time ({tasks.submit.1ms.2.ideal.us} / {tasks.submit.1ms.8.ideal.us} a task)",
        "{tasks.submit.1ms.2.jt.us} / {tasks.submit.1ms.8.jt.us}, of which {tasks.submit.1ms.2.jt.added.us} / "
        "{tasks.submit.1ms.8.jt.added.us} beyond the tasks' own",
        "{tasks.submit.1ms.2.vs_loky} / {tasks.submit.1ms.8.vs_loky} loky's speed (at most "
        "{tasks.submit.1ms.2.loky_ceiling} / {tasks.submit.1ms.8.loky_ceiling} for any pool); added time "
        "{tasks.submit.1ms.2.added_vs_loky} / {tasks.submit.1ms.8.added_vs_loky} less"),
    Row("Pool: 20 quick tasks beside one long task", "{pool.beside.mp.s}", "{pool.beside.jt.s}",
        "{pool.beside.ratio}"),
    Row("Pool: `share()` + one task per worker, 4 workers against 1 (2 cores)", "",
        "{pool.broadcast.x4} the time of 1 worker", ""),
    Row("Pool, a `__main__` jitted function per task", "{usercode.mp.ms} per task",
        "{usercode.jt.ms} per task, one compilation per worker", "{usercode.speedup}"),
    Row("Executor against Pool: 64 / 256 MiB round trip; tiny task",
        "Pool: {executor.64m.pool.s} / {executor.256m.pool.s}; {executor.tiny.pool.s}",
        "{executor.64m.ex.s} / {executor.256m.ex.s}; {executor.tiny.ex.s}",
        "{executor.64m.ratio} / {executor.256m.ratio}; {executor.tiny.ratio}"),
    Row("`jaxtransport.multiprocessing.Queue`, steady state: 64 MiB / 1 GiB jax.Array",
        "{queue.64m.mp.s} / {queue.1g.mp.s} (`multiprocessing.Queue`); `torch.multiprocessing` with a tensor: "
        "{queue.64m.torch.s} / {queue.1g.torch.s}",
        "{queue.64m.jt.s} / {queue.1g.jt.s} ({queue.64m.memcpy} / {queue.1g.memcpy} a warm memcpy)",
        "{queue.64m.ratio} / {queue.1g.ratio}; {queue.64m.vs_torch} / {queue.1g.vs_torch} torch"),
    Row("`jaxtransport.multiprocessing`, 256 MiB already in shared memory: a relay's put of what it received / "
        "one new array to 4 queues, to the 4th ack / the same array re-sent, to the ack",
        "a put that copies: {forward.relay.fresh.ms}; 4 arrays to 4 queues: {forward.fanout.copies.memcpy} a warm "
        "memcpy; `torch.multiprocessing` re-sending a shared tensor ({forward.torch.version}): {forward.resend.torch.ms}",
        "{forward.relay.ms} / {forward.fanout.memcpy} a warm memcpy / {forward.resend.ms}",
        "re-sent: {forward.resend.vs_torch} torch"),
    Row("Pool, 256 MiB: a worker's result fed into the next `map` (one item; the map of a 4-element array: "
        "{forward.pool.tiny.ms})",
        "the same map of a fresh array (copied): {forward.pool.fresh.ms}",
        "{forward.pool.ms} ({forward.pool.transfer.ms} more than the 4-element map)",
        "{forward.pool.ratio}"),
    Row("`jaxtransport.multiprocessing.Pipe`, steady state: 64 MiB / 1 GiB",
        "{pipe.64m.mp.s} / {pipe.1g.mp.s}; torch: {pipe.64m.torch.s} / {pipe.1g.torch.s}",
        "{pipe.64m.jt.s} / {pipe.1g.jt.s}",
        "{pipe.64m.ratio} / {pipe.1g.ratio}; {pipe.64m.vs_torch} / {pipe.1g.vs_torch} torch"),
    Row("`jaxtransport.multiprocessing`, small messages, a round trip to an echo process: Queue / Pipe, an "
        "int / one actor's observations (113 KB, pickled into the message)",
        "Queue: {messages.queue.int.mp.us} / {messages.queue.obs.mp.us}; Pipe: {messages.pipe.int.mp.us} / "
        "{messages.pipe.obs.mp.us} (`multiprocessing`)",
        "Queue: {messages.queue.int.jt.us} / {messages.queue.obs.jt.us}; Pipe: {messages.pipe.int.jt.us} / "
        "{messages.pipe.obs.jt.us}",
        "Queue: {messages.queue.int.ratio} / {messages.queue.obs.ratio}; Pipe: {messages.pipe.int.ratio} / "
        "{messages.pipe.obs.ratio} the stock speed"),
    Row("Ray, steady state: 1 MiB task argument / result", "{ray.argument.1m.stock.s} / {ray.result.1m.stock.s}",
        "{ray.argument.1m.jt.s} / {ray.result.1m.jt.s}", "{ray.argument.1m.ratio} / {ray.result.1m.ratio}"),
    Row("Ray, steady state: 1 GiB task argument / result",
        "{ray.argument.1g.stock.s} / {ray.result.1g.stock.s} (Ray default)",
        "{ray.argument.1g.jt.s} / {ray.result.1g.jt.s} (numpy: {ray.argument.1g.numpy.s} / {ray.result.1g.numpy.s})",
        "{ray.argument.1g.ratio} / {ray.result.1g.ratio}"),
    README_ROWS[7],
    README_ROWS[8],
    Row("Rollouts, streaming `--backend queue`, 2 actors, default sizes", "{rollouts.queue.stock.steps}",
        "{rollouts.queue.jt.steps}; the Pool backend in the same rounds: {rollouts.queue.pool.steps}",
        "{rollouts.queue.ratio}; {rollouts.queue.vs_pool} the Pool"),
    Row("Rollouts, Atari Pong, 2 actors (load {atari.2.queue_jt.load} during the run on 2 cores)",
        "threads: {atari.2.threads.steps} env steps/s; stock `multiprocessing.Queue`: {atari.2.queue_stock.steps}",
        "queue: {atari.2.queue_jt.steps}; Pool: {atari.2.pool_jt.steps}; Ray: {atari.2.ray_jt.steps}",
        "{atari.2.queue_jt.ratio} threads, {atari.2.queue_jt.vs_stock} stock"),
    Row("joblib.Parallel(n_jobs=2), 8 jax.Array arguments / results of 64 MiB (results: compute included)",
        "loky: {joblib.args.loky.s} / {joblib.results.loky.s}", "{joblib.args.jt.s} / {joblib.results.jt.s}",
        "{joblib.args.ratio} / {joblib.results.ratio}"),
    Row("joblib.Parallel(n_jobs=2), 8 numpy arguments of 64 MiB / 10,000 tiny tasks",
        "loky (memory-mapped): {joblib.numpy.loky.s} / {joblib.tiny.loky.s}",
        "{joblib.numpy.jt.s} / {joblib.tiny.jt.s}", "{joblib.numpy.ratio} / {joblib.tiny.ratio}"),
    Row("the joblib backend against `jt.Pool.map`, 8 jax.Array arguments of 64 MiB",
        "`jt.Pool.map`: {joblib.vs_pool.pool.s}", "{joblib.vs_pool.jt.s}", "{joblib.vs_pool.ratio}"),
    Row("cache key of a 1 GiB array: `jaxtransport.joblib.hash` (jax.Array) against `joblib.hash` (numpy)",
        "{joblib.hash.np.s}", "{joblib.hash.jt.s}", "{joblib.hash.ratio}"),
    Row("platforms: steady 64 MiB argument + result, `jt.Pool(1)`, memfd (Linux) / portable (the macOS path)",
        "", "{platforms.steady.memfd.ms} / {platforms.steady.portable.ms}",
        "portable takes {platforms.steady.portable.slower} memfd's time"),
    Row("platforms: in-band (the Windows path) against `multiprocessing.Pool`: 64 MiB argument / "
        "{platforms.tiny_map.tasks} tiny tasks (`map`) / {platforms.tiny_apply.tasks} one by one (`apply_async`)",
        "{platforms.arg64m.mp.ms} / {platforms.tiny_map.mp.ms} / {platforms.tiny_apply.mp.ms}",
        "{platforms.arg64m.inband.ms} / {platforms.tiny_map.inband.ms} / {platforms.tiny_apply.inband.ms}",
        "{platforms.arg64m.ratio} / {platforms.tiny_map.ratio} / {platforms.tiny_apply.ratio}"),
]

#: name -> rows: ``<!-- figures:NAME begin -->`` ... ``<!-- figures:NAME end -->`` in a page.
QUIET = "this run on a quiet machine: the stock transport gained less than jaxtransport"
NOISE = "within the runs' spread"
REMEASURE_ROWS = [
    Row("Pool, 64 MiB argument / result, speedup over `multiprocessing.Pool`",
        "{prev.pool.arg.64m.ratio} / {prev.pool.res.64m.ratio}", "{pool.arg.64m.ratio} / {pool.res.64m.ratio}",
        "faster: " + QUIET),
    Row("Pool, 1 GiB argument / result, speedup over `multiprocessing.Pool`",
        "{prev.pool.arg.1g.ratio} / {prev.pool.res.1g.ratio}", "{pool.arg.1g.ratio} / {pool.res.1g.ratio}",
        "faster: " + QUIET),
    Row("Pool, steady 64 MiB argument / result, against a warm memcpy (lower is better)",
        "{prev.pool.steady_arg.64m.memcpy} / {prev.pool.steady_res.64m.memcpy}",
        "{pool.steady_arg.64m.memcpy} / {pool.steady_res.64m.memcpy}", "the same: " + NOISE),
    Row("Pool, 1 KiB / 256 KiB argument, speedup over `multiprocessing.Pool`",
        "{prev.pool.arg.1k.ratio} / {prev.pool.arg.256k.ratio}", "{pool.arg.1k.ratio} / {pool.arg.256k.ratio}",
        "under the shared-memory threshold both pickle inline: " + NOISE),
    Row("Pool, 20 quick tasks beside a long one, speedup", "{prev.pool.beside.ratio}", "{pool.beside.ratio}",
        "the same: " + NOISE),
    Row("Executor against Pool: 64 / 256 MiB round trip; tiny task",
        "{prev.executor.64m.ratio} / {prev.executor.256m.ratio}; {prev.executor.tiny.ratio}",
        "{executor.64m.ratio} / {executor.256m.ratio}; {executor.tiny.ratio}", "the same: " + NOISE),
    Row("Queue, 64 MiB / 1 GiB, speedup over `multiprocessing.Queue`; over `torch.multiprocessing`",
        "{prev.queue.64m.ratio} / {prev.queue.1g.ratio}; {prev.queue.64m.vs_torch} / {prev.queue.1g.vs_torch}",
        "{queue.64m.ratio} / {queue.1g.ratio}; {queue.64m.vs_torch} / {queue.1g.vs_torch}",
        "faster against stock: " + QUIET + "; against torch, higher because torch.multiprocessing itself "
        "ran slower (this run: torch {queue.64m.torch.version}, PyPI's CUDA build, installed for it; the "
        "previous run's torch version was not recorded) and its runs spread widely"),
    Row("Pipe, 64 MiB / 1 GiB, speedup over the stock `Pipe`",
        "{prev.pipe.64m.ratio} / {prev.pipe.1g.ratio}", "{pipe.64m.ratio} / {pipe.1g.ratio}", "faster: " + QUIET),
    Row("Atari Pong, 2 actors, streaming queue: against threads / against stock multiprocessing",
        "{prev.atari.2.queue_jt.ratio} / {prev.atari.2.queue_jt.vs_stock}",
        "{atari.2.queue_jt.ratio} / {atari.2.queue_jt.vs_stock}",
        "against threads, higher: the previous run shared the cores with other jobs (load "
        "{prev.atari.2.queue_jt.load} against {atari.2.queue_jt.load}), which time-slices threads and "
        "processes alike; against stock, within the rounds' spread"),
    Row("Atari Pong, 2 actors, env steps/s: threads / streaming queue",
        "{prev.atari.2.threads.steps} / {prev.atari.2.queue_jt.steps}",
        "{atari.2.threads.steps} / {atari.2.queue_jt.steps}", "higher for every design: a quiet machine"),
]

#: ``benchmarks/device.py`` (``<!-- figures:device begin -->`` in docs/accelerators.md): one
#: device array through jaxtransport against the device's D2H / H2D copies and the stock routes.
DEVICE_ROWS = [
    Row("the device's copies, one {device.size} float32 array: whole, `np.asarray` of a device array "
        "(D2H) / `jax.device_put` of a host array (H2D), measured first / again last; and the fastest "
        "copy of the run, whole or in pieces (8, 16, 32 or 64 slices fetched at once; pieces put at "
        "once and joined on the device)", "",
        "whole: D2H {device.d2h.s} / {device.d2h.last.s}; H2D {device.h2d.s} / {device.h2d.last.s}",
        "the limits: D2H {device.d2h.limit.s}, H2D {device.h2d.limit.s} (the fastest copies)"),
    Row("`jt.dumps` of a device array", "{device.dumps.stock.s} (`pickle.dumps`, JAX's reducer)",
        "{device.dumps.jt.s}", "{device.dumps.vs_limit} D2H / {device.dumps.speedup}"),
    Row("`jt.loads` onto the device", "{device.loads.stock.s} (`pickle.loads`, JAX's reducer)",
        "{device.loads.jt.s}", "{device.loads.vs_limit} H2D / {device.loads.speedup}"),
    Row("`jt.dumps` + `jt.loads`, device to device", "{device.codec.stock.s} (JAX's pickle round trip)",
        "{device.codec.jt.s}", "{device.codec.vs_limit} D2H + H2D / {device.codec.speedup}"),
    Row("`jt.Pool` argument: a device array to a CPU worker (a checksum back)",
        "{device.pool_arg.stock.s} (`np.asarray` + `multiprocessing.Pool`)", "{device.pool_arg.jt.s}",
        "{device.pool_arg.vs_limit} D2H / {device.pool_arg.speedup}"),
    Row("`jt.Pool` result: a CPU worker's new array, ready on this process's device",
        "{device.pool_res.stock.s} (`multiprocessing.Pool` + `jax.device_put`)",
        "{device.pool_res.jt.s} (the worker's production alone: {device.pool_prod.jt.s})",
        "{device.pool_res.vs_limit} production + H2D / {device.pool_res.speedup}"),
    Row("`jaxtransport.ray`'s serializer / deserializer of a device array, in process (protocol-5 "
        "pickling, buffers out of band; Ray cannot start on the TPU host)", "",
        "{device.ray_ser.jt.s} / {device.ray_de.jt.s}",
        "{device.ray_ser.vs_limit} D2H / {device.ray_de.vs_limit} H2D"),
    Row("`jaxtransport.multiprocessing.Queue`: put of a device array, the child's get and ack",
        "{device.queue.stock.s} (`np.asarray` + `multiprocessing.Queue`)", "{device.queue.jt.s}",
        "{device.queue.vs_limit} D2H / {device.queue.speedup}"),
]

#: ``benchmarks/pipeline.py`` (``<!-- figures:pipeline begin -->`` in docs/guides/input-pipelines.md): here.
PIPELINE_ROWS = [
    Row("batches/s, 2 workers: the limit (2 x one process's rate of making a batch) {pipeline.2.limit.bps}; one "
        "process {pipeline.2.one.bps}",
        "Grain `mp_prefetch`: {pipeline.2.grain.bps} ({pipeline.2.grain.vs_limit} of the limit); torch "
        "`DataLoader`: {pipeline.2.torch.bps} ({pipeline.2.torch.vs_limit})",
        "{pipeline.2.jt.bps} ({pipeline.2.jt.vs_limit} of the limit)", "{pipeline.2.jt.vs_grain} Grain"),
    Row("share of the time the loop waits for the next batch: the step a jitted reduction / the step as long as "
        "a batch takes at the limit",
        "Grain: {pipeline.2.grain.wait} / {pipeline.2.grain.wait_balanced}; torch: {pipeline.2.torch.wait} / "
        "{pipeline.2.torch.wait_balanced}; one process: {pipeline.2.one.wait} / {pipeline.2.one.wait_balanced}",
        "{pipeline.2.jt.wait} / {pipeline.2.jt.wait_balanced}", ""),
    Row("peak RSS: the loop's process / the whole process tree (shared memory counted in each process mapping it)",
        "Grain: {pipeline.2.grain.rss} / {pipeline.2.grain.rss_tree}; torch: {pipeline.2.torch.rss} / "
        "{pipeline.2.torch.rss_tree}; one process: {pipeline.2.one.rss}",
        "{pipeline.2.jt.rss} / {pipeline.2.jt.rss_tree}", ""),
    Row("the cores each loader got (its processes' CPU seconds over the wall time) / "
        "batches per CPU-second it got",
        "Grain: {pipeline.2.grain.cores} / {pipeline.2.grain.per_core}; Grain, 1 thread a worker: "
        "{pipeline.2.grain1.cores} / {pipeline.2.grain1.per_core}; torch: {pipeline.2.torch.cores} / "
        "{pipeline.2.torch.per_core}; one process: {pipeline.2.one.cores} / {pipeline.2.one.per_core}",
        "{pipeline.2.jt.cores} / {pipeline.2.jt.per_core}", ""),
    Row("batches/s over the second half of the 90 timed batches alone (as the whole window: the window outlasts "
        "what a loader made ahead) / the machine's idle cores meanwhile",
        "Grain: {pipeline.2.grain.bps_late} / {pipeline.2.grain.idle}; Grain, 1 thread a worker: "
        "{pipeline.2.grain1.bps_late} / {pipeline.2.grain1.idle}; torch: {pipeline.2.torch.bps_late} / "
        "{pipeline.2.torch.idle}; one process: {pipeline.2.one.bps_late} / {pipeline.2.one.idle}",
        "{pipeline.2.jt.bps_late} / {pipeline.2.jt.idle}", ""),
    Row("Grain with one thread in each worker (`ReadOptions(num_threads=1)`; its default is 16)",
        "{pipeline.2.grain1.bps} ({pipeline.2.grain1.vs_limit} of the limit)", "{pipeline.2.jt.bps}", ""),
    Row("`/dev/shm` entries left once the loader is closed / the resource tracker's leaked shared_memory objects",
        "Grain: {pipeline.2.grain.shm} / {pipeline.2.grain.leaks}; torch: {pipeline.2.torch.shm} / "
        "{pipeline.2.torch.leaks}", "{pipeline.2.jt.shm} / {pipeline.2.jt.leaks}", ""),
]

#: The same on the accelerator host (``pipeline_device.json``, ``benchmarks/device_pipeline.sh``).
PIPELINE_DEVICE_ROWS = [
    Row(f"batches/s, {n} workers, batches on the chip: the limit {{pdev.{n}.limit.bps}}"
        + ("; one process {pdev.2.one.bps}" if n == 2 else ""),
        f"Grain `mp_prefetch`: {{pdev.{n}.grain.bps}} ({{pdev.{n}.grain.vs_limit}} of the limit)",
        f"{{pdev.{n}.jt.bps}} ({{pdev.{n}.jt.vs_limit}} of the limit)", f"{{pdev.{n}.jt.vs_grain}} Grain")
    for n in (2, 6, 12)
] + [
    Row("share of the time the loop waits, 12 workers: the step a jitted reduction / as long as a batch at the limit",
        "Grain: {pdev.12.grain.wait} / {pdev.12.grain.wait_balanced}", "{pdev.12.jt.wait} / {pdev.12.jt.wait_balanced}",
        ""),
    Row("12 workers: peak RSS of the process tree (shared memory counted in each process mapping it; the "
        "loop's own peak is not read there: that host's kernel reports none); `/dev/shm` entries left",
        "Grain: {pdev.12.grain.rss_tree}; {pdev.12.grain.shm}", "{pdev.12.jt.rss_tree}; {pdev.12.jt.shm}", ""),
]

TABLES: dict[str, list[Row]] = {"readme": README_ROWS, "headline": README_ROWS, "benchmarks": BENCHMARKS_ROWS,
                                "remeasure": REMEASURE_ROWS, "device": DEVICE_ROWS,
                                "pipeline": PIPELINE_ROWS, "pipeline_device": PIPELINE_DEVICE_ROWS}


# ------------------------------------------------------------------------------------------
# pages


def pages(root: str = ROOT) -> list[str]:
    """README.md and every docs/**/*.md (built output aside), relative to ``root``."""
    found = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "**", "*.md"),
                                                                recursive=True))
    return ["README.md"] + [p for p in found if "_build" not in p.split(os.sep)]


_BLOCK = re.compile(r"(<!-- figures:([a-z_]+) begin -->\n)(.*?)(<!-- figures:\2 end -->)", re.S)
_INLINE = re.compile(r"(<!--fig ([a-z0-9_.]+)-->)(.*?)(<!--/fig-->)", re.S)


def render_text(text: str, results: str = RESULTS) -> str:
    """The page with every generated table and inline figure rewritten from the results files."""

    def block(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise FigureError(f"no table {m.group(2)!r} in benchmarks/figures.py TABLES")
        return m.group(1) + render_table(m.group(2), results) + "\n" + m.group(4)

    text = _BLOCK.sub(block, text)
    return _INLINE.sub(lambda m: m.group(1) + inline_text(m.group(2), results) + m.group(4), text)


# A measured-looking number: a ratio (3.5x, 51x), a rate (GB/s, env steps/s), a decimal time
# (0.45 s, 1.2 ms), a percentage with a decimal, or an estimate (~1.1).
_MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?x(?![\w])"
    r"|\d[\d,]*(?:\.\d+)?\s*(?:GB/s|MB/s|env steps/s)"
    r"|(?<![\w.])\d+\.\d+\s?(?:s|ms|µs)\b"
    r"|~\s?\d"
)
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def untraced(text: str) -> list[str]:
    """Measured-looking numbers in ``text`` outside figures, generated tables and code."""
    def blank(m: re.Match) -> str:  # keep the line numbers
        return "\n" * m.group(0).count("\n")

    out = []
    for i, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("<!--fig"):  # CommonMark: a line that starts with <!-- is raw HTML
            out.append(f"line {i}: a line starts with an inline figure, which makes the whole line raw "
                       "HTML (its Markdown unrendered): move a word of the line before onto it")

    text = _BLOCK.sub(blank, text)
    text = _INLINE.sub(blank, text)
    for m in re.finditer(r"<!--/?fig\b[^>]*-->", text):  # a marker the renderer cannot read (a key
        line = text.count("\n", 0, m.start()) + 1  # not in [a-z0-9_.], an unpaired end) stays stale
        out.append(f"line {line}: {m.group(0)!r} is not a figure the renderer reads (keys are [a-z0-9_.]+, "
                   "each <!--fig KEY--> closed by <!--/fig-->)")
    text = _CODE.sub(blank, text)
    for m in _MEASURED.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        context = text[max(0, m.start() - 40): m.end() + 20].replace("\n", " ")
        out.append(f"line {line}: {m.group(0)!r} in ...{context}...")
    return out


def render_pages(root: str = ROOT, results: str = RESULTS, write: bool = True) -> dict[str, str]:
    """``{page: unified diff}`` for every page that rendering changes (written unless ``write`` is
    False)."""
    changed = {}
    for page in pages(root):
        path = os.path.join(root, page)
        with open(path) as f:
            old = f.read()
        new = render_text(old, results)
        if new != old:
            changed[page] = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                         page, page + " (rendered)", n=0))
            if write:
                with open(path, "w") as f:
                    f.write(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.publish",
        description="Rewrite the README's figure table, docs/benchmarks.md's table and every inline "
        "figure (<!--fig KEY-->) from the results files in benchmarks/results/, measuring nothing.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    p.add_argument("--results", default=RESULTS, help="results folder (default: %(default)s)")
    args = p.parse_args(argv)
    changed = render_pages(ROOT, args.results, write=not args.check)
    for page, diff in changed.items():
        print(diff if args.check else f"rewrote {page}")
    bad = {page: untraced(open(os.path.join(ROOT, page)).read()) for page in pages(ROOT)}
    for page, found in bad.items():
        for line in found:
            print(f"{page}: a figure with no source: {line}", file=sys.stderr)
    if args.check and changed:
        print("stale pages: run `python -m benchmarks.publish`", file=sys.stderr)
    return 1 if (args.check and changed) or any(bad.values()) else 0
