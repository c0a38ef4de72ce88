"""Rollouts with more actors: how do env steps/s grow from 2 to 12 actors, and what bounds them?

The loop of ``python -m jaxtransport.rollouts`` (pixel CartPole at the demo's default sizes,
jaxtransport's transport) with 2, 4, 8 and 12 actors (at most the usable cores - 1; ``--quick``: 1
and 2), on the Pool and the streaming queue backends, with the learner on the CPU and, where
the machine has one, on the accelerator (JAX's default device; the actors then run on the CPU).
Each configuration runs in a fresh interpreter of its own, one at a time: a learner-on-CPU run
has ``JAX_PLATFORMS=cpu`` and never touches the accelerator, and only one process can hold a
TPU. This process does not initialise JAX before the runs.

Per run, medians over the iterations after the warm-up: env steps/s, the iteration's wall time,
the actors' compute (the slowest actor's, the critical path, and the mean), the learner's
update, transport (the rest of the wall time; 0 when the queue's actors compute while the
learner updates) and its share, and the CPU seconds the actors' processes spent in their
rollouts (``actor_cores_busy``: over the slowest rollout's wall time, how many cores the actors
kept busy together). What bounds the throughput is read from these, not assumed:

- (a) ``compute_vs_fewest``: the mean actor's compute at N actors over its compute at the
  fewest actors measured (the work per actor is the same at every N), and, for the queue
  backend with the learner on the accelerator, one actor alone (1 actor);
- (b) ``transport_share``; (c) ``learner_s``;
- (d) at the largest N, the same configuration with the CPU budget (``--cpus-per-actor``) off
  when it was on by default, or on (1 core each) when it was off: rows ``budget_check``.

``cpu_budget`` is the cores each actor was pinned to (0: none); ``ratio_vs_2`` the env steps/s
over the same configuration's at 2 actors. Target (issue 42): the queue backend with the learner
on the accelerator reaches, at 12 actors, at least twice its own 2-actor env steps/s; a MISS
says which component bounds it.

``python -m benchmarks.rollouts_scale [--quick] [--configs queue/tpu,pool] [--max-actors 8]
[--time-limit 360] [--out DIR]`` writes ``rollouts_scale.{md,json,png}`` (default: the scratch
folder); ``python -m benchmarks --only rollouts_scale`` runs it too, but that runner's banner
initialises JAX in its own process, which then holds a TPU: there the accelerator runs are
skipped (rows say so), so run the module itself on an accelerator host.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

from . import _common

PLOT_X = "actors"
PLOT_XLABEL = "actors (processes), 16 CartPole envs x 128 steps each per iteration"
PLOT_XFORMAT = "{:g}"
PLOT_Y = "env_steps_per_s"
PLOT_YLABEL = "env steps/s (higher is better)"
LIMIT_TRANSPORTS = ()
PLOT_TITLES = {"rollouts-scale": "jaxtransport's transport, default CPU budget"}
PLOT_NOTE = ("Each point is one run in a fresh interpreter, the median iteration after the warm-up; "
             "'learner cpu' runs have JAX_PLATFORMS=cpu, the others put the learner on the accelerator "
             "and the actors on the CPU.")

NAME = "rollouts-scale"
FOUND: dict = {}  # what the last run() found: "accelerator" (its device) or None
BUDGET_CHECK = "rollouts-scale-budget"  # (d): the other budget at the largest N (one point: no panel)
BACKENDS = ("pool", "queue")
FULL_ACTORS = (2, 4, 8, 12)
QUICK_ACTORS = (1, 2)
TARGET = 2.0  # queue, learner on the accelerator: 12 actors >= 2x its 2-actor env steps/s
TARGET_ACTORS = 12
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each figure: the median over the timed iterations of a run.
FIELDS = ("wall_s", "compute_s", "compute_mean_s", "learner_s", "transport_s", "actor_cpu_s", "bytes_moved")


# ------------------------------------------------------------------------------------------
# one configuration, in its own interpreter


def child(spec: dict) -> dict:
    """Run one configuration in this process (``spec``: backend, actors, budget, iterations,
    warmup) and return its measurements."""
    import jax

    from jaxtransport import rollouts as demo

    cfg = demo.Config(backend=spec["backend"], workers=spec["actors"], iterations=spec["iterations"],
                      warmup=spec["warmup"], cpus_per_actor=spec["budget"])
    out = io.StringIO()
    started = time.perf_counter()
    res = demo.train(cfg, "jaxtransport", out=out, err=io.StringIO())
    m = re.search(r"start-up: done in ([0-9.]+)s", out.getvalue())
    timed = res.timed
    per_it = {f: [getattr(it, f) for it in timed] for f in FIELDS}
    return {
        "platform": jax.devices()[0].platform,
        "learner_device": res.learner_device,
        "actor_devices": res.actor_devices,
        "trajectories_on": res.trajectories_on,
        "cpus_per_actor": res.cpus_per_actor,
        "cpu_budget": res.cpu_budget,
        "env_steps": cfg.workers * cfg.envs * cfg.steps,
        "iterations": per_it,
        "lag": [it.lag for it in timed if it.lag is not None],
        "startup_s": float(m.group(1)) if m else None,
        "run_s": time.perf_counter() - started,
        "final_return": statistics.mean(res.returns[-3:]),
        "cores": _common.usable_cores(),
    }


def _child_env(learner: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if learner == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _run_child(spec: dict, learner: str, timeout: float) -> dict:
    """``child(spec)`` in a fresh interpreter; ``{"error": ...}`` when it fails or times out."""
    cmd = [sys.executable, "-m", "benchmarks.rollouts_scale", "--child", json.dumps(spec)]
    # A session of its own: on a timeout the run and every actor it started are killed together
    # (an orphaned actor would take cores from the runs after it).
    proc = subprocess.Popen(cmd, env=_child_env(learner), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        stdout, stderr = proc.communicate()
        return {"error": f"timed out after {timeout:.0f}s: {(stderr or '')[-600:].strip()}"}
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {proc.returncode}: {(stderr or stdout)[-800:].strip()}"}


def probe_accelerator(timeout: float = 180.0) -> dict | None:
    """The default JAX device of a fresh interpreter, if it is not a CPU (``platform``,
    ``device``); None otherwise. The probe holds the accelerator only while it runs."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return None
    code = ("import json, jax; d = jax.devices()[0]; "
            "print('PROBE ' + json.dumps({'platform': d.platform, 'device': d.device_kind}))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=_child_env("default"), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print("# accelerator probe timed out: learner-on-CPU runs only", flush=True)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            found = json.loads(line[len("PROBE "):])
            return None if found["platform"] == "cpu" else found
    print(f"# accelerator probe failed: {proc.stderr[-400:]}", flush=True)
    return None


def _holds_accelerator() -> bool:
    """Whether this process has already initialised a JAX backend other than the CPU (it then
    holds a TPU, which no child could take)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized()) and sys.modules["jax"].default_backend() != "cpu"
    except Exception:  # noqa: BLE001 - an older or newer JAX: assume not
        return False


# ------------------------------------------------------------------------------------------
# the sweep


def _counts(quick: bool, max_actors: int | None, actors: list[int] | None) -> list[int]:
    cores = _common.usable_cores() or 1
    if actors:
        counts = sorted(set(actors))
    elif quick:
        counts = list(QUICK_ACTORS)
    else:
        cap = max(2, cores - 1)
        counts = [n for n in FULL_ACTORS if n <= cap] or [2]
    if max_actors is not None:
        counts = [n for n in counts if n <= max_actors] or [min(counts)]
    return counts


def _keep(config: str, accel_platform: str | None, configs: list[str] | None) -> bool:
    """``config`` ("queue/accel", ...) passes the ``--configs`` filter: a token matches a
    backend, a learner ("cpu", "accel" or the platform's name, e.g. "tpu") or both ("queue/tpu")."""
    if not configs:
        return True
    backend, learner = config.split("/")
    names = {learner} | ({"accel", accel_platform} if learner == "accel" and accel_platform else set())
    for token in configs:
        b, _, lrn = token.strip().lower().partition("/")
        if (b in ("", "*") or b == backend or (not lrn and b in names)) and (not lrn or lrn in names):
            return True
    return False


def plan_runs(counts: list[int], accel: str | None, configs: list[str] | None = None) -> list[dict]:
    """The runs, most important first (a time limit drops the last): every configuration's
    fewest and most actors (the target's configuration, queue with the learner on the
    accelerator, first, then its budget check (d)); then the accelerator's middle counts and one
    actor alone (a); then the rest of the budget checks and the learner-on-CPU middle counts."""
    from jaxtransport.rollouts import _cpus

    cores = _cpus.available()
    learners = (["accel"] if accel else []) + ["cpu"]
    configs_kept = [(b, lrn) for lrn in learners for b in ("queue", "pool") if _keep(f"{b}/{lrn}", accel, configs)]
    ends = sorted({min(counts), max(counts)})
    middle = [n for n in counts if n not in ends]

    def sweep(backend: str, learner: str, ns: list[int]) -> list[dict]:
        return [{"backend": backend, "learner": learner, "actors": n, "budget": None, "name": NAME} for n in ns]

    def check(backend: str, learner: str) -> list[dict]:
        n = max(counts)
        if cores is None or len(cores) < 2:
            return []
        on = _cpus.plan(n, None, cores).on  # the budget turned the other way
        return [{"backend": backend, "learner": learner, "actors": n, "budget": 0 if on else 1, "name": BUDGET_CHECK}]

    first, second, third = [], [], []
    for k, (backend, learner) in enumerate(configs_kept):
        first += sweep(backend, learner, ends)
        if k == 0:
            first += check(backend, learner)
        else:
            third += check(backend, learner)
        (second if learner == "accel" else third).extend(sweep(backend, learner, middle))
        if k == 0 and backend == "queue" and min(counts) > 1:
            second += sweep(backend, learner, [1])  # one actor alone
    return first + second + third


def run(quick: bool = False, configs: list[str] | None = None, max_actors: int | None = None,
        actors: list[int] | None = None, iterations: int | None = None, timeout: float | None = None,
        time_limit: float | None = None) -> list[dict]:
    """Every run of :func:`plan_runs`, one after another, each in its own interpreter with a
    ``timeout`` (default 180 s; quick 400 s); none starts once ``time_limit`` seconds have
    passed (default: 360 s in full, none with ``quick``), those left get a row saying so."""
    timed = iterations or (4 if quick else 6)
    timeout = timeout or (400.0 if quick else 180.0)
    time_limit = time_limit if time_limit is not None else (None if quick else 360.0)
    counts = _counts(quick, max_actors, actors)
    held = _holds_accelerator()
    accel = None if held else probe_accelerator()
    if held:
        print("# this process already holds an accelerator (JAX initialised here): learner-on-CPU runs "
              "only; run `python -m benchmarks.rollouts_scale` for the accelerator's", flush=True)
    label = accel["platform"] if accel else None
    FOUND["accelerator"] = f"{accel['device']} ({accel['platform']})" if accel else None
    print(f"# rollouts_scale: actors {counts}, {_common.usable_cores()} usable cores, learner on "
          f"{'cpu and ' + label + ' (' + accel['device'] + ')' if accel else 'cpu only (no accelerator found)'}",
          flush=True)
    specs = plan_runs(counts, label, configs)
    start = time.perf_counter()
    results: list[tuple[dict, dict]] = []
    last = 0.0
    for k, spec in enumerate(specs):
        elapsed = time.perf_counter() - start
        learner = label if spec["learner"] == "accel" else "cpu"
        budget = "auto" if spec["budget"] is None else spec["budget"]
        what = f"{spec['backend']}, learner {learner}, {spec['actors']} actors, budget {budget}"
        if time_limit is not None and elapsed + max(last, 10.0) > time_limit:
            print(f"# skipped ({elapsed:.0f}s of --time-limit {time_limit:.0f}s used): {what}", flush=True)
            results.append((spec, {"error": f"skipped: --time-limit {time_limit:.0f}s reached"}))
            continue
        left = timeout if time_limit is None else min(timeout, max(30.0, time_limit - elapsed + 30.0))
        print(f"# run {k + 1}/{len(specs)} ({elapsed:.0f}s): {what}", flush=True)
        child_spec = {"backend": spec["backend"], "actors": spec["actors"], "budget": spec["budget"],
                      "iterations": timed + 1, "warmup": 1}
        t = time.perf_counter()
        got = _run_child(child_spec, spec["learner"], left)
        last = time.perf_counter() - t
        results.append((spec, got))
        _print_result(got, last)
    rows = _rows(results, label)
    print(f"# rollouts_scale: {len(specs)} runs in {time.perf_counter() - start:.0f}s", flush=True)
    return rows


def _median(got: dict, field: str) -> float | None:
    vals = [v for v in got["iterations"].get(field, []) if v is not None]
    return statistics.median(vals) if vals else None


def _print_result(got: dict, seconds: float) -> None:
    if "error" in got:
        print(f"  FAILED after {seconds:.0f}s: {got['error'][-300:]}", flush=True)
        return
    wall = _median(got, "wall_s")
    print(f"  {got['env_steps'] / wall:10,.0f} env steps/s  wall {wall:.3f}s  actor compute "
          f"{_median(got, 'compute_s'):.3f}s (mean {_median(got, 'compute_mean_s'):.3f}s)  learner "
          f"{_median(got, 'learner_s'):.3f}s  transport {_median(got, 'transport_s'):.3f}s  "
          f"[{got['learner_device']} / {got['actor_devices']}; budget {got['cpus_per_actor']}; "
          f"start-up {got['startup_s']}s, run {seconds:.0f}s]", flush=True)


def _rows(results: list[tuple[dict, dict]], accel: str | None) -> list[dict]:
    rows: list[dict] = []
    for spec, got in results:
        learner = accel if spec["learner"] == "accel" and accel else "cpu"
        row: dict = {"name": spec["name"], "transport": f"{spec['backend']}, learner {learner}",
                     "actors": spec["actors"], "backend": spec["backend"], "learner": learner,
                     "budget_asked": "auto" if spec["budget"] is None else spec["budget"]}
        if "error" in got:
            row["error"] = got["error"][-500:]
            rows.append(row)
            continue
        iters = got["iterations"]
        wall = _median(got, "wall_s")
        walls = iters["wall_s"]
        compute, mean = _median(got, "compute_s"), _median(got, "compute_mean_s")
        cpu = _median(got, "actor_cpu_s")
        transport = sum(iters["transport_s"]) / max(sum(walls), 1e-12)
        row.update({
            "size_bytes": int(_median(got, "bytes_moved") or 0),
            "seconds": wall,
            "cpu_budget": got["cpus_per_actor"],
            "env_steps_per_s": got["env_steps"] / wall,
            "wall_s": wall,
            "min": min(walls),
            "max": max(walls),
            "actor_compute_s": compute,
            "actor_compute_mean_s": mean,
            "learner_s": _median(got, "learner_s"),
            "transport_s": _median(got, "transport_s"),
            "transport_share": transport,
            "actor_cores_busy": cpu / compute if cpu and compute else None,
            "lag": statistics.mean(got["lag"]) if got["lag"] else None,
            "learner_device": got["learner_device"],
            "actor_devices": got["actor_devices"],
            "trajectories_on": got["trajectories_on"],
            "budget_note": got["cpu_budget"],
            "usable_cores": got["cores"],
            "startup_s": got["startup_s"],
            "run_s": round(got["run_s"], 1),
            "reps": len(walls),
            "final_return": got["final_return"],
        })
        rows.append(row)
    # ratio_vs_2 and compute_vs_fewest: against the same configuration's default-budget runs.
    for row in rows:
        if "env_steps_per_s" not in row:
            continue
        same = [r for r in rows if r["name"] == NAME and r["transport"] == row["transport"]
                and "env_steps_per_s" in r]
        two = next((r for r in same if r["actors"] == 2), None)
        row["ratio_vs_2"] = row["env_steps_per_s"] / two["env_steps_per_s"] if two else None
        fewest = min((r for r in same if r["actors"] > 1), key=lambda r: r["actors"], default=None)
        if fewest and fewest["actor_compute_mean_s"] and row["actor_compute_mean_s"]:
            row["compute_vs_fewest"] = row["actor_compute_mean_s"] / fewest["actor_compute_mean_s"]
            row["fewest_actors"] = fewest["actors"]
    return rows


# ------------------------------------------------------------------------------------------
# targets


def _bound(r: dict) -> str:
    """Which component of the iteration is largest at this point, with the evidence."""
    parts = {"actor compute": r["actor_compute_s"], "learner": r["learner_s"] or 0.0,
             "transport": r["transport_s"] or 0.0}
    name = max(parts, key=lambda k: parts[k])
    text = (f"bound: {name} ({parts[name]:.3f}s of a {r['wall_s']:.3f}s iteration; actor compute "
            f"{r['actor_compute_s']:.3f}s, learner {r['learner_s']:.3f}s, transport share "
            f"{100 * r['transport_share']:.0f}%)")
    if name == "actor compute":
        if r.get("compute_vs_fewest") and r.get("fewest_actors") != r["actors"]:
            text += (f"; each actor's rollout took {r['compute_vs_fewest']:.2f}x its time at "
                     f"{r['fewest_actors']} actors for the same work")
        if r.get("actor_cores_busy"):
            text += (f"; the actors kept {r['actor_cores_busy']:.1f} of {r['usable_cores']} cores busy "
                     "during the rollouts")
    return text


def check_targets(rows: list[dict]) -> list[str]:
    out: list[str] = []
    ok = [r for r in rows if "env_steps_per_s" in r]
    main = [r for r in ok if r["name"] == NAME]
    accel = [r for r in main if r["learner"] != "cpu"]
    q = sorted((r for r in accel if r["backend"] == "queue"), key=lambda r: r["actors"])
    two = next((r for r in q if r["actors"] == 2), None)
    if not accel:
        out.append("SKIP queue, learner on the accelerator: no accelerator run here (target not checked)")
    elif two is None or q[-1]["actors"] <= 2:
        out.append("MISS queue, learner on the accelerator: no 2-actor run and larger one to compare")
    else:
        top = q[-1]
        ratio = top["env_steps_per_s"] / two["env_steps_per_s"]
        short = "" if top["actors"] >= TARGET_ACTORS else f" (largest run: {top['actors']} actors, not {TARGET_ACTORS})"
        line = (f"{'PASS' if ratio >= TARGET and top['actors'] >= TARGET_ACTORS else 'MISS'} queue, learner "
                f"{top['learner']}: {top['actors']} actors {top['env_steps_per_s']:,.0f} env steps/s = {ratio:.2f}x "
                f"its 2-actor {two['env_steps_per_s']:,.0f} (target >= {TARGET:g}x at {TARGET_ACTORS}){short}")
        if ratio < TARGET:
            line += "; " + _bound(top)
        out.append(line)
    for r in sorted(main, key=lambda r: (r["transport"], r["actors"])):
        if r["actors"] == max(x["actors"] for x in main if x["transport"] == r["transport"]):
            out.append(f"INFO {r['transport']}, {r['actors']} actors: {r['env_steps_per_s']:,.0f} env steps/s"
                       + (f" = {r['ratio_vs_2']:.2f}x 2 actors" if r.get("ratio_vs_2") else "") + "; " + _bound(r))
    for c in (r for r in ok if r["name"] == BUDGET_CHECK):
        base = next((r for r in main if r["transport"] == c["transport"] and r["actors"] == c["actors"]), None)
        if base is None:
            continue
        on, off = (base, c) if base["cpu_budget"] else (c, base)
        out.append(f"INFO CPU budget, {c['transport']}, {c['actors']} actors: {on['cpu_budget']} core(s) per actor "
                   f"{on['env_steps_per_s']:,.0f} env steps/s (actor compute {on['actor_compute_s']:.3f}s) against "
                   f"none {off['env_steps_per_s']:,.0f} ({off['actor_compute_s']:.3f}s): "
                   f"{on['env_steps_per_s'] / off['env_steps_per_s']:.2f}x")
    alone = [r for r in ok if r["actors"] == 1 and r.get("actor_compute_mean_s")]
    for a in alone:
        others = [r for r in main if r["transport"] == a["transport"] and r["actors"] > 1]
        if others:
            top = max(others, key=lambda r: r["actors"])
            slower = top["actor_compute_mean_s"] / a["actor_compute_mean_s"]
            out.append(f"INFO one actor alone ({a['transport']}): rollout {a['actor_compute_mean_s']:.3f}s on "
                       f"{a['actor_cores_busy'] or 0:.1f} cores; with {top['actors'] - 1} others "
                       f"{top['actor_compute_mean_s']:.3f}s ({slower:.2f}x)")
    for r in rows:
        if "error" in r:
            word = "SKIPPED" if r["error"].startswith("skipped") else "FAILED"
            out.append(f"{word} {r['transport']}, {r['actors']} actors, budget {r['budget_asked']}: {r['error'][:200]}")
    return out


# ------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 and 2 actors, 4 timed iterations, no time limit")
    p.add_argument("--configs", help="comma-separated: keep only these configurations, each a backend "
                   "(pool, queue), a learner (cpu, accel or the platform: tpu) or backend/learner (queue/tpu)")
    p.add_argument("--max-actors", type=int, help="no run with more actors than this")
    p.add_argument("--actors", type=int, action="append", help="actor count (repeatable; default 2 4 8 12)")
    p.add_argument("--iterations", type=int, help="timed iterations per run after 1 warm-up (default 6, quick 4)")
    p.add_argument("--timeout", type=float, help="seconds per run before it is recorded as failed (default 180)")
    p.add_argument("--time-limit", type=float, help="start no run after this many seconds (default 360; quick: none)")
    p.add_argument("--out", help="write rollouts_scale.{md,json,png} here (default: benchmarks/results/scratch)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return []
    from . import run as runner

    started = time.perf_counter()
    before = runner.conditions()
    rows = run(args.quick, configs=args.configs.split(",") if args.configs else None, max_actors=args.max_actors,
               actors=args.actors, iterations=args.iterations, timeout=args.timeout, time_limit=args.time_limit)
    seconds = time.perf_counter() - started
    measured = [r for r in rows if "env_steps_per_s" in r]
    if measured:
        _common.print_table(measured, ["transport", "actors", "cpu_budget", "env_steps_per_s", "ratio_vs_2",
                                       "wall_s", "actor_compute_s", "actor_compute_mean_s", "actor_cores_busy",
                                       "learner_s", "transport_s", "transport_share"])
    module = sys.modules[__name__]
    # The banner's JAX backend: this process's JAX on the CPU (initialising it on a TPU would take
    # seconds and the chip), the accelerator as the probe found it.
    if not _holds_accelerator():
        try:
            import jax

            jax.config.update("jax_platforms", "cpu")
        except Exception:  # noqa: BLE001 - already initialised: the banner says what it has
            pass
    info = _common.env_info()
    info["jax_backend"] = FOUND.get("accelerator") or info.get("jax_backend")
    info["learners"] = "cpu" + (f" and {FOUND['accelerator']}" if FOUND.get("accelerator") else "")
    runner.write_outputs("rollouts_scale", module, rows, args.out or runner.SCRATCH, seconds, args.quick,
                         info=info, before=before, after=runner.conditions())
    return rows


if __name__ == "__main__":
    _common.main_of_module("benchmarks.rollouts_scale")
