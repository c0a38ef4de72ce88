"""Does the Pool of this checkout keep the steady-state figures of an older revision, measured on the same machine in the same run (64 and 256 MiB jax.Array argument and result round trips, against a warm memcpy and against multiprocessing.Pool)?

``python -m benchmarks.revisions [REV] [--rounds N] [--publish | --out DIR]``

REV (default ``7895fec``, the last commit before the Pool engine's second design) is checked
out into a temporary git worktree (removed afterwards). Each round runs one child process per
revision, in alternating order; a child imports that revision's ``jaxtransport`` and times
each round trip right after a warm memcpy of the same bytes (the ratio is the median of those
pairs, as ``benchmarks.pool``'s steady rows), and ``multiprocessing.Pool`` doing the same call
every third pair. A row's figures are the medians over rounds; its ratio is against the
median of every ``multiprocessing.Pool`` time of the run (both revisions' children). Absolute times move with the
machine's memory speed from day to day; the two revisions' rows of one run compare directly.

Needs a git checkout (a clone, not an sdist). Not part of ``python -m benchmarks``: it takes
about 2 minutes a round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_REV = "7895fec"
SIZES = (64 << 20, 256 << 20)
PAIRS = 15

def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def _measure(checkout: str, tasks_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, tasks_dir]), JAX_PLATFORMS="cpu")
    code = f"import _revision_tasks; _revision_tasks.child({list(SIZES)!r}, {PAIRS})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tasks_dir, capture_output=True, text=True,
                          timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("REVISION-FIGURES "):
            got = json.loads(line.split(" ", 1)[1])
            if not os.path.realpath(got["file"]).startswith(os.path.realpath(checkout) + os.sep):
                raise RuntimeError(f"the child imported {got['file']}, not the checkout {checkout}")
            return got["figures"]
    raise RuntimeError(f"the child for {checkout} printed no figures (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run(rev: str = DEFAULT_REV, rounds: int = 3) -> list[dict]:
    from . import _common
    old = _git("rev-parse", "--short", rev)
    head = _git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else ""
    labels = {"old": f"jaxtransport.Pool @ {old}", "new": f"jaxtransport.Pool @ {head}{dirty}"}
    with tempfile.TemporaryDirectory(prefix="jt-revisions-") as tmp:
        worktree = os.path.join(tmp, "old")
        _git("worktree", "add", "--detach", worktree, old)
        try:
            # The child and its task functions, importable by both revisions' workers (a
            # function from a script's __main__ would travel by value on the old engine).
            shutil.copy(os.path.join(HERE, "_revision_tasks.py"), tmp)
            got: dict[str, list[dict]] = {"old": [], "new": []}
            for r in range(rounds):
                order = (("old", worktree), ("new", ROOT)) if r % 2 == 0 else (("new", ROOT), ("old", worktree))
                for key, checkout in order:
                    got[key].append(_measure(checkout, tmp))
                    print(f"round {r + 1}/{rounds}: {labels[key]} measured", flush=True)
        finally:
            _git("worktree", "remove", "--force", worktree)
    rows: list[dict] = []
    for name_size in got["old"][0]:
        name, size = name_size.split()
        mp = statistics.median(d[name_size]["mp"] for key in got for d in got[key])  # both children's
        rows.append(_common.row(name, int(size), "memcpy",
                                statistics.median(d[name_size]["memcpy"] for key in got for d in got[key])))
        rows.append(_common.row(name, int(size), "multiprocessing.Pool", mp))
        for key in ("old", "new"):
            per = [d[name_size] for d in got[key]]
            jt = statistics.median(p["jt"] for p in per)
            rows.append(_common.row(name, int(size), labels[key], jt, ratio=mp / jt, rounds=len(per),
                                    vs_memcpy=statistics.median(p["vs_memcpy"] for p in per),
                                    min=min(p["jt"] for p in per), max=max(p["jt"] for p in per)))
        _common.print_table(rows[-4:], ["name", "size_bytes", "transport", "seconds", "vs_memcpy", "ratio"])
    return rows


def check_targets(rows: list[dict]) -> list[str]:
    """The new revision's ratio against memcpy within 15% of the old one's, each row."""
    from . import _common
    out = []
    byname: dict = {}
    for r in rows:
        if r["transport"].startswith("jaxtransport.Pool"):
            byname.setdefault((r["name"], r["size_bytes"]), []).append(r)
    for (name, size), (old, new) in byname.items():
        ok = new["vs_memcpy"] <= old["vs_memcpy"] * 1.15
        out.append(f"{'PASS' if ok else 'MISS'} {name} {_common.fmt_size(size)}: {new['vs_memcpy']:.2f}x memcpy "
                   f"({new['transport']}) vs {old['vs_memcpy']:.2f}x ({old['transport']}); against "
                   f"multiprocessing.Pool {new['ratio']:.0f}x vs {old['ratio']:.0f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.revisions", description=__doc__.split("\n\n")[0])
    p.add_argument("rev", nargs="?", default=DEFAULT_REV, help=f"the older revision (default {DEFAULT_REV})")
    p.add_argument("--rounds", type=int, default=3)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--publish", action="store_true", help="write benchmarks/results/revisions.*")
    where.add_argument("--out", default=None, metavar="DIR")
    args = p.parse_args(argv)
    from . import run as _run
    start = time.perf_counter()
    rows = run(args.rev, args.rounds)
    out = args.out or (_run.RESULTS if args.publish else _run.SCRATCH)
    _run.write_outputs("revisions", sys.modules[__name__], rows, out, time.perf_counter() - start, False)
    md = os.path.join(out, "revisions.md")
    with open(md) as f:
        text = f.read()
    with open(md, "w") as f:
        f.write(text.replace("`python -m benchmarks`", f"`python -m benchmarks.revisions {args.rev} --rounds {args.rounds}`", 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
