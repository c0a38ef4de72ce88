"""What does a small message's round trip cost through jaxtransport.multiprocessing, against stock
multiprocessing, in the same run?

The request-and-reply loops of distributed rollouts send mostly small messages: a step's
observations to a central policy and its actions back (``--inference learner``), an
acknowledgement, a control word. A drop-in must not be slower on them than the module it
replaces, whatever it gains on large arrays (``benchmarks/queue.py``).

One round: this process puts a payload on a Queue (or sends it on a Pipe), an echo process
(spawn, started once per transport and kind) gets it and answers with a small int, which this
process waits for. Payloads: an ``int``; numpy ``uint8`` arrays of 8 bytes and 10 KB; one
actor's observations for a central policy (4 environments x 4 stacked 84x84 frames, 113 KB),
all under the default ``shm_threshold`` (1 MiB), so both transports pickle them into the
message. Both transports' echo processes run at once; the rounds alternate between them run
by run (``RUNS`` runs of ``ROUNDS`` rounds after a warm-up), and each row is the median run.

Per row: ``seconds`` (wall time per round), ``cpu_us`` (CPU time of this process, every thread,
per round: ``time.process_time``), ``ratio`` = stock seconds / this row's (higher is better;
1.0 is the stock module's speed), and ``floor_us``: the same round trip of 8 bytes over a raw
Unix socket pair between two processes (``send``/``recv``, no pickling), the wake-ups alone.
Run ``python -m benchmarks.messages [--quick]`` (about half a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time

import numpy as np

from . import _common

JT, STOCK = "jaxtransport.multiprocessing", "multiprocessing"
RUNS, ROUNDS, WARMUP = 7, 400, 50
#: payload name -> (its size in bytes, a maker); the observations are a Pong-like batch (few
#: distinct grey levels), as a central policy receives them.
PAYLOADS = {
    "int": (8, lambda: 5),
    "8 B array": (8, lambda: np.full(8, 87, np.uint8)),
    "10 KB array": (10_000, lambda: np.full(10_000, 87, np.uint8)),
    "observations 113 KB": (
        4 * 4 * 84 * 84,
        lambda: np.random.default_rng(0).choice(np.array([0, 87, 92, 144, 236], np.uint8), (4, 4, 84, 84)),
    ),
}


# -- the echo processes (module level: spawned children import them)
def echo_queue(q, r) -> None:
    while True:
        x = q.get()
        if x is None:
            return
        r.put(1)


def echo_pipe(conn) -> None:
    while True:
        x = conn.recv()
        if x is None:
            return
        conn.send(1)


def echo_socket(sock) -> None:
    while True:
        m = sock.recv(64)
        if m == b"q":
            return
        sock.send(m)


class _Echo:
    """An echo process and this process's end of one queue pair or pipe."""

    def __init__(self, transport: str, kind: str):
        if transport == JT:
            import jaxtransport.multiprocessing as jmp

            ctx = jmp.get_context("spawn")
        else:
            ctx = multiprocessing.get_context("spawn")
        self.kind = kind
        if kind == "queue":
            self.q, self.r = ctx.Queue(), ctx.Queue()
            self.proc = ctx.Process(target=echo_queue, args=(self.q, self.r), daemon=True)
        else:
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=echo_pipe, args=(child,), daemon=True)
        self.proc.start()
        if kind == "pipe":
            child.close()

    def rounds(self, x, n: int) -> None:
        if self.kind == "queue":
            put, get = self.q.put, self.r.get
            for _ in range(n):
                put(x)
                get()
        else:
            send, recv = self.conn.send, self.conn.recv
            for _ in range(n):
                send(x)
                recv()

    def close(self) -> None:
        try:
            if self.kind == "queue":
                self.q.put(None)
            else:
                self.conn.send(None)
            self.proc.join(30)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


def _floor(runs: int, rounds: int) -> float:
    """Seconds per round trip of 8 bytes over a raw Unix socket pair (median run)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = multiprocessing.get_context("spawn").Process(target=echo_socket, args=(b,), daemon=True)
    proc.start()
    try:
        for _ in range(WARMUP):
            a.send(b"12345678")
            a.recv(64)
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(rounds):
                a.send(b"12345678")
                a.recv(64)
            ts.append((time.perf_counter() - t0) / rounds)
        a.send(b"q")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        a.close()
        b.close()
    return statistics.median(ts)


def run(quick: bool = False) -> list[dict]:
    runs, rounds = (3, 150) if quick else (RUNS, ROUNDS)
    floor = _floor(runs, rounds)
    rows: list[dict] = []
    for kind in ("queue", "pipe"):
        echoes = {t: _Echo(t, kind) for t in (JT, STOCK)}
        try:
            for payload, (nbytes, make) in PAYLOADS.items():
                x = make()
                for e in echoes.values():
                    e.rounds(x, WARMUP)
                wall: dict[str, list[float]] = {t: [] for t in echoes}
                cpu: dict[str, list[float]] = {t: [] for t in echoes}
                for i in range(runs):
                    order = list(echoes) if i % 2 == 0 else list(echoes)[::-1]
                    for t in order:
                        t0, c0 = time.perf_counter(), time.process_time()
                        echoes[t].rounds(x, rounds)
                        wall[t].append((time.perf_counter() - t0) / rounds)
                        cpu[t].append((time.process_time() - c0) / rounds)
                sec = {t: statistics.median(wall[t]) for t in echoes}
                for t in echoes:
                    row = {
                        "name": f"{kind} round trip",
                        "payload": payload,
                        "size_bytes": nbytes,
                        "transport": t,
                        "seconds": sec[t],
                        "min": min(wall[t]),
                        "max": max(wall[t]),
                        "cpu_us": statistics.median(cpu[t]) * 1e6,
                        "runs": runs,
                        "rounds": rounds,
                        "floor_us": floor * 1e6,
                    }
                    if t != STOCK:
                        row["ratio"] = sec[STOCK] / sec[t]
                    rows.append(row)
                    _print(row)
        finally:
            for e in echoes.values():
                e.close()
    return rows


def _print(r: dict) -> None:
    ratio = f"  {r['ratio']:.2f}x stock" if r.get("ratio") else ""
    print(
        f"{r['name']:<17} {r['payload']:<20} {r['transport']:<30} {r['seconds'] * 1e6:8.0f} us "
        f"(cpu {r['cpu_us']:.0f} us){ratio}",
        flush=True,
    )


BASELINE = None  # no size sweep: the table is the result


def check_targets(rows: list[dict]) -> list[str]:
    """PASS/MISS: each small message's round trip through jaxtransport.multiprocessing no slower
    than the stock module's (ratio >= 1.0)."""
    out = []
    for r in rows:
        if r["transport"] == JT and r.get("ratio"):
            ok = r["ratio"] >= 1.0
            out.append(
                f"{'PASS' if ok else 'MISS'} {r['name']}, {r['payload']}: {r['ratio']:.2f}x stock "
                f"multiprocessing (>= 1.0x)"
            )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 runs of 150 rounds")
    args = ap.parse_args(argv)
    rows = run(quick=args.quick)
    _common.print_targets(check_targets(rows))


if __name__ == "__main__":
    sys.exit(_common.main_of_module("benchmarks.messages"))
