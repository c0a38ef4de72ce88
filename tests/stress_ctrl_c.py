"""Ctrl-C at random moments of every wait a user's main thread makes: none may hang or leave a
lock held (issue 49, item 4).

    python -m tests.stress_ctrl_c --count 300000            # the full run (tens of minutes)
    python -m tests.stress_ctrl_c --count 2000 --jobs 1     # a quick look

Each child interpreter starts a ``jaxtransport.Pool`` (2 workers), a ``jaxtransport.Executor``
(2 workers) and a ``jaxtransport.multiprocessing.Queue`` fed by a thread of its own, then, round
after round, arms a SIGINT for a random moment (``signal.pthread_kill`` of the main thread, as a
terminal's Ctrl-C reaches it) and repeats one kind of wait until the KeyboardInterrupt lands:

- ``apply``: ``pool.apply_async(f, (i,)).get()``
- ``map``: ``pool.map_async(f, range(4)).get()`` (``pool.map``)
- ``imap``: ``list(pool.imap(f, range(4)))``
- ``submit``: ``executor.submit(f, i).result()``
- ``queue``: ``queue.get()`` of an item the feeding thread puts once asked

After each KeyboardInterrupt, before anything else, it checks that

- no lock of the pool, the executor, the queue, or of the result, iterator or future the
  interrupted wait was on, is held by this thread, or by any thread for more than
  ``--lock-bound`` seconds (a *leaked lock*); and
- the same kind of call completes within ``--bound`` seconds (else a *hang*: every thread's
  stack is printed and the child stops; the parent starts another).

The random moment is uniform over about one and a half of that kind's calls (measured at the
start of each child), so the interrupts land everywhere in a call: submitting, waiting, waking,
taking the value. Where each landed (the innermost frame: jaxtransport, threading,
concurrent.futures, this script) is counted too. A queue item that a KeyboardInterrupt took
from the queue after it was received but before ``get()`` returned it is lost, as it would be at
the caller's assignment; the run counts those (``queue_lost``) and goes on.

The children run with the debug lock-order checker off (its Python-level acquire is not safe
against an interrupt: ``jaxtransport/_lockorder.py``). The summary is one JSON line per child and
a total. ``tests/test_ctrl_c.py`` runs a few hundred of these in the ``slow`` suite.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

KINDS = ("apply", "map", "imap", "submit", "queue")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "@@stress "


# -- the child -------------------------------------------------------------------------------


def _inc(x: int) -> int:
    return x + 1


def _locks_in(obj, found: dict, path: str, depth: int, seen: set) -> None:
    """Every ``_thread`` lock reachable from ``obj`` through the attributes of jaxtransport's,
    threading's and concurrent.futures' objects (not through a Thread, and not through the
    parked waiters of a condition, whose locks are held by design until they are woken)."""
    import _thread
    import threading

    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, (_thread.LockType, _thread.RLock)):
        found[path] = obj
    if isinstance(obj, (_thread.LockType, threading.Thread, type, str, bytes, int, float)):
        return
    if isinstance(obj, (list, tuple, collections.deque)):
        for i, v in enumerate(list(obj)[:16]):
            _locks_in(v, found, f"{path}[{i}]", depth - 1, seen)
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:16]:
            _locks_in(v, found, f"{path}[{k!r}]", depth - 1, seen)
        return
    module = type(obj).__module__ or ""
    if not module.startswith(("jaxtransport", "threading", "concurrent.futures", "_thread", "queue")):
        return
    names = list(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        names += [s for s in getattr(klass, "__slots__", ()) if isinstance(s, str)]
    for name in names:
        if name in ("_waiters", "_parked", "_wakers", "__weakref__", "__dict__"):
            continue
        try:
            value = getattr(obj, name)
        except AttributeError:
            continue
        _locks_in(value, found, f"{path}.{name}", depth - 1, seen)


def _module_locks() -> dict:
    """The module-level locks of jaxtransport's modules."""
    found: dict = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("jaxtransport"):
            for attr, value in list(vars(module).items()):
                _locks_in(value, found, f"{name}.{attr}", 0, set())
    return found


def _leaked(locks: dict, bound: float) -> list[str]:
    """The paths of ``locks`` this thread holds, or that nobody released within ``bound``."""
    import _thread

    out = []
    for path, lock in locks.items():
        if isinstance(lock, _thread.RLock) and lock._is_owned():
            out.append(f"{path} (held by this thread)")
            continue
        if lock.acquire(True, bound):
            lock.release()
        else:
            out.append(f"{path} (held for more than {bound} s)")
    return out


def _where(tb) -> str:
    """Which code the KeyboardInterrupt was raised in: its innermost frame's file."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
    if "/jaxtransport/" in name:
        return "jaxtransport/" + name.rsplit("/jaxtransport/", 1)[1]
    if name.endswith("/threading.py"):
        return "threading"
    if "/concurrent/futures/" in name:
        return "concurrent.futures"
    if name.endswith("stress_ctrl_c.py"):
        return "this script"
    return os.path.basename(name)


def child(count: int, kinds: tuple[str, ...], bound: float, lock_bound: float, seed: int, go_on: bool = False) -> dict:
    import faulthandler
    import queue as stdqueue
    import random
    import signal
    import threading

    import jaxtransport as jt
    import jaxtransport.multiprocessing as jmp

    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background run inherits SIG_IGN
    rng = random.Random(seed)
    main = threading.get_ident()
    arms: stdqueue.SimpleQueue = stdqueue.SimpleQueue()
    asks: stdqueue.SimpleQueue = stdqueue.SimpleQueue()

    def killer() -> None:
        while True:
            delay = arms.get()
            if delay is None:
                return
            time.sleep(delay)
            signal.pthread_kill(main, signal.SIGINT)

    pool = jt.Pool(2)
    ex = jt.Executor(2)
    q = jmp.Queue()

    def feeder() -> None:
        while True:
            seq = asks.get()
            if seq is None:
                return
            q.put(seq)

    threads = [threading.Thread(target=killer, daemon=True), threading.Thread(target=feeder, daemon=True)]
    for t in threads:
        t.start()
    seq = [0]
    holder: list = [None]

    def ask() -> int:
        seq[0] += 1
        asks.put(seq[0])
        return seq[0]

    def take(want: int, timeout: float | None) -> None:
        """Queue items until ``want`` (older ones, asked for by an interrupted round, skipped)."""
        while True:
            got = q.get(timeout=timeout)
            stats["queue_taken"] += 1
            if got == want:
                return

    def op(kind: str, i: int, timeout: float | None = None):
        if kind == "apply":
            r = holder[0] = pool.apply_async(_inc, (i,))
            assert r.get(timeout) == i + 1
        elif kind == "map":
            r = holder[0] = pool.map_async(_inc, range(4))
            assert r.get(timeout) == [1, 2, 3, 4]
        elif kind == "imap":
            it = holder[0] = pool.imap(_inc, range(4))
            assert [it.next(timeout) for _ in range(4)] == [1, 2, 3, 4]
        elif kind == "submit":
            f = holder[0] = ex.submit(_inc, i)
            assert f.result(timeout) == i + 1
        else:
            holder[0] = None
            take(ask(), timeout)

    stats: collections.Counter = collections.Counter()
    where: collections.Counter = collections.Counter()
    # Each kind's call time: the interrupt's moment is drawn over about one and a half calls.
    span = {}
    for kind in kinds:
        for i in range(20):
            op(kind, i)
        t0 = time.perf_counter()
        for i in range(100):
            op(kind, i)
        span[kind] = 1.5 * (time.perf_counter() - t0) / 100
    print(f"# call times (ms): { {k: round(v / 1.5 * 1e3, 3) for k, v in span.items()} }", file=sys.stderr, flush=True)
    lasting = _module_locks()
    _locks_in((pool, ex, q), lasting, "", 8, set())
    faulthandler.dump_traceback_later(max(120.0, 4 * bound), exit=True)
    report = {"python": sys.version.split()[0], "seed": seed, "hangs": 0, "leaked": [], "lost_work": []}
    base = (0, 0)  # the pool's and the executor's calls in flight once idle (grows with a loss)
    start = time.perf_counter()
    i = 0
    for n in range(count):
        kind = kinds[n % len(kinds)]
        if n % 1000 == 999:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.dump_traceback_later(max(120.0, 4 * bound), exit=True)
            _locks_in((pool, ex, q), lasting, "", 8, set())  # threads and objects made lazily
            print(f"# {n + 1} Ctrl-Cs, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        try:
            arms.put(rng.uniform(0.0, span[kind]))
            while True:
                i += 1
                op(kind, i)
        except KeyboardInterrupt as e:
            landed = _where(e.__traceback__)
            where[landed] += 1
            del e
        stats["ctrl_c"] += 1
        stats[f"ctrl_c_{kind}"] += 1
        mine: dict = {}
        _locks_in(holder[0], mine, f"<{kind}>", 4, set())
        held = _leaked({**lasting, **mine}, lock_bound)
        if held:
            report["leaked"].append({"round": n, "kind": kind, "locks": held})
        try:
            i += 1
            op(kind, i, bound)
        except (jt.TimeoutError, TimeoutError, stdqueue.Empty):
            report["hangs"] += 1
            report["hang"] = {"round": n, "kind": kind}
            faulthandler.dump_traceback(all_threads=True)
            break
        if held:
            break  # the pool works, but a lock is held: stop here with what is known
        # The books: every call sent before the interrupt finishes (none lost in between).
        books = _idle(pool, ex, base, lock_bound)
        if books != base:
            # Calls that never finish: the pool's join() would wait for them for ever, and imap's
            # backpressure counts them. Recorded; this child ends here (terminate, not join).
            report["lost_work"].append({"round": n, "kind": kind, "landed_in": landed, "in_flight": books})
            if not go_on:
                break
            base = books
    report["seconds"] = round(time.perf_counter() - start, 1)
    report.update(stats)
    report["landed_in"] = dict(where.most_common())
    faulthandler.cancel_dump_traceback_later()
    if report["hangs"] or report["leaked"]:
        return report  # the pool may be stuck: do not wait for it at exit (the caller exits)
    arms.put(None)
    asks.put(None)
    for t in threads:
        t.join()
    report["queue_lost"] = _count_lost(q, seq[0], stats["queue_taken"])
    # Shutting down waits for every call sent: bounded too (a pool that lost calls is
    # terminated: its join() would wait for them).
    if report["lost_work"]:
        closer = threading.Thread(target=lambda: (ex.shutdown(), pool.terminate()), daemon=True)
    else:
        closer = threading.Thread(target=lambda: (ex.shutdown(), pool.close(), pool.join()), daemon=True)
    closer.start()
    closer.join(4 * bound)
    if closer.is_alive():
        report["hangs"] += 1
        report["hang"] = {"round": "shutdown", "kind": "Executor.shutdown, Pool.close and join"}
        faulthandler.dump_traceback(all_threads=True)
    return report


def _idle(pool, ex, base: tuple[int, int], bound: float) -> tuple[int, int]:
    """The pool's and the executor's calls in flight, once back to ``base`` or ``bound``
    seconds passed (more than ``base`` then: calls that a KeyboardInterrupt lost)."""
    deadline = time.monotonic() + bound
    while True:
        now = (pool._state.in_flight(), ex._in_flight + len(ex._pending))
        if (now[0] <= base[0] and now[1] <= base[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.0005)


def _count_lost(q, asked: int, taken: int) -> int:
    """Queue items asked for and never counted as taken: those still queued are drained here;
    the rest a KeyboardInterrupt took between the socket and the count (inside ``get()``, or
    in this script's own frame once ``get()`` returned: lost at the caller's assignment)."""
    import queue as stdqueue

    left = 0
    while True:
        try:
            q.get(timeout=0.5)
        except stdqueue.Empty:
            break
        left += 1
    return max(0, asked - taken - left)


# -- the parent ------------------------------------------------------------------------------


def _run_child(count: int, kinds: tuple[str, ...], args, seed: int) -> dict:
    code = (
        "import json, sys; from tests import stress_ctrl_c as s; "
        f"r = s.child({count}, {kinds!r}, {args.bound!r}, {args.lock_bound!r}, {seed}, {args.go_on!r}); "
        f"print({MARK!r} + json.dumps(r), flush=True); sys.stdout.flush(); "
        "import os; os._exit(0) if r['hangs'] or r['leaked'] else None"
    )
    env = dict(
        os.environ, JAXTRANSPORT_CHECK_LOCKS="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    env.setdefault("JAX_PLATFORMS", "cpu")
    budget = 600 + count * 0.05
    try:
        out = subprocess.run([args.python, "-c", code], env=env, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired as e:
        return {
            "seed": seed,
            "hangs": 1,
            "leaked": [],
            "error": f"child ran past {budget:.0f} s",
            "stderr": (e.stderr or b"")[-4000:].decode(errors="replace") if isinstance(e.stderr, bytes) else "",
        }
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            r = json.loads(line[len(MARK) :])
            if r["hangs"] or r["leaked"]:
                r["stderr"] = out.stderr[-200_000:]
            return r
    # No summary: the watchdog (faulthandler) ended a child stuck past its bound, or it failed.
    return {
        "seed": seed,
        "hangs": 1,
        "leaked": [],
        "error": f"child exited {out.returncode} without a summary",
        "stderr": _stuck(out.stderr),
    }


def _stuck(stderr: str) -> str:
    """What a child's stack dump says about where it was stuck: the main thread's stack (the one
    in this script's ``child``), the last progress line, and the dump's end."""
    blocks = stderr.replace("Current thread", "Thread").split("Thread 0x")
    main = [b for b in blocks if "stress_ctrl_c.py" in b]
    progress = [line for line in stderr.splitlines() if line.startswith("# ")][-1:]
    return "\n".join(progress + ["main thread: Thread 0x" + b for b in main]) + "\n...\n" + stderr[-4000:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.stress_ctrl_c", description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=300_000, help="Ctrl-Cs in all (default 300000)")
    p.add_argument("--per-child", type=int, default=20_000, help="Ctrl-Cs per child interpreter")
    p.add_argument("--jobs", type=int, default=2, help="children at once")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"which waits (default {','.join(KINDS)})")
    p.add_argument("--bound", type=float, default=20.0, help="seconds the call after an interrupt may take")
    p.add_argument("--lock-bound", type=float, default=2.0, help="seconds a lock may stay held by another thread")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the children")
    p.add_argument("--go-on", action="store_true",
                   help="a child that lost calls goes on (counting them anew) instead of ending there")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the summary here")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = set(kinds) - set(KINDS)
    if bad:
        p.error(f"unknown kinds: {sorted(bad)}")
    import concurrent.futures
    import random

    seed0 = args.seed if args.seed is not None else random.randrange(1 << 30)
    total: collections.Counter = collections.Counter()
    where: collections.Counter = collections.Counter()
    problems: list = []
    results: list = []
    version = subprocess.run(
        [args.python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True
    ).stdout.strip()
    print(f"# {args.count} Ctrl-Cs on Python {version}, {args.jobs} children at once, kinds {kinds}", flush=True)
    start = time.perf_counter()
    # Children take up to --per-child Ctrl-Cs each; one that ends early (lost calls, a hang)
    # leaves the rest to the next.
    left = args.count
    seeds = iter(range(seed0, seed0 + 10**9))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        running: dict = {}

        def spawn() -> None:
            nonlocal left
            n = min(args.per_child, left)
            left -= n
            running[pool.submit(_run_child, n, kinds, args, next(seeds))] = n

        while left > 0 and len(running) < args.jobs:
            spawn()
        while running:
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                asked = running.pop(f)
                r = f.result()
                results.append(r)
                left += max(0, asked - r.get("ctrl_c", 0))
                for key, value in r.items():
                    if isinstance(value, int) and not isinstance(value, bool) and key != "seed":
                        total[key] += value
                where.update(r.get("landed_in", {}))
                line = {k: r.get(k) for k in ("seed", "ctrl_c", "hangs", "seconds", "queue_lost", "error")}
                line["leaked"] = len(r.get("leaked", []))
                line["lost_work"] = r.get("lost_work", [])
                line["done"] = total["ctrl_c"]
                print(json.dumps(line), flush=True)
                if r.get("hangs") or r.get("leaked") or r.get("error"):
                    problems.append(r)
                    print(json.dumps(r, indent=1)[:12000], file=sys.stderr, flush=True)
                if r.get("error") and not r.get("ctrl_c"):
                    left = 0  # a child that could not start: stop
            while left > 0 and len(running) < args.jobs:
                spawn()
    summary = {
        "python": version,
        "ctrl_c": total["ctrl_c"],
        "by_kind": {k: total[f"ctrl_c_{k}"] for k in kinds},
        "hangs": total["hangs"],
        "leaked_locks": sum(len(r.get("leaked", [])) for r in problems),
        "queue_lost": total["queue_lost"],
        "lost_work": [w for r in results for w in r.get("lost_work", [])],
        "children": len(results),
        "children_failed": len(problems),
        "landed_in": dict(where.most_common()),
        "minutes": round((time.perf_counter() - start) / 60, 1),
        "seed": seed0,
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "problems": problems}, fh, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
