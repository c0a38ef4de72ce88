"""Text output of the rollouts demo: a progress bar on stderr, a line per iteration, tables."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import TextIO

from ._config import Config, IterationStats, RunResult, run_label

MiB = 1 << 20


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def worker_noun(backend: str) -> str:
    return {"ray": "Ray actors", "queue": "streaming actor processes", "threads": "actor threads"}.get(
        backend, "worker processes"
    )


class ProgressBar:
    """A plain-text bar on ``stream``, redrawn in place, or nothing at all.

    ``enabled`` (default: ``stream`` is a terminal) should be false whenever the per-iteration
    lines go anywhere but a terminal too: in a log or a pipe, a bar's frames would repeat every
    iteration line, so there the iteration lines alone report progress."""

    def __init__(self, total: int, stream: TextIO, label: str, width: int = 30, enabled: bool | None = None):
        self.total, self.stream, self.label, self.width = total, stream, label, width
        self.tty = is_terminal(stream) if enabled is None else bool(enabled)
        self._drawn = False

    def update(self, n: int, stats: IterationStats) -> None:
        if not self.tty:
            return
        filled = round(self.width * n / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        rate = stats.env_steps / max(stats.wall_s, 1e-12)
        text = f"{self.label} [{bar}] {n}/{self.total} return {stats.mean_return:6.1f}  {rate / 1e3:7.1f}k steps/s"
        self.stream.write("\r\x1b[2K" + text)
        self._drawn = True
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._drawn = False

    def finish(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


def iteration_line(s: IterationStats, cfg: Config, warmup: bool) -> str:
    if s.episodes:
        ret = f"{s.mean_return:6.1f}"
    elif getattr(cfg, "atari", False):  # running episodes' returns so far: no bound either way
        ret = f"~{s.mean_return:5.1f}"
    else:  # CartPole: the running episodes' returns so far are a lower bound
        ret = f">={s.mean_return:4.0f}"
    return (
        f"iter {s.iteration:3d}/{cfg.iterations}  return {ret} ({s.episodes:3d} episodes)  "
        f"{s.env_steps / max(s.wall_s, 1e-12) / 1e3:7.1f}k steps/s  "
        f"transport {s.transport_s:6.3f}s  compute {s.compute_s:6.3f}s  "
        f"learner {s.learner_s:6.3f}s"
        + (f"  (acting {s.act_s:.3f}s)" if getattr(s, "act_s", None) is not None else "")
        + (f"  lag {s.lag:.1f}" if getattr(s, "lag", None) is not None else "")
        + ("  (warm-up)" if warmup else "")
    )


def describe_device(platform_name: str, device_kind: str) -> str:
    """``"TPU v5 lite (tpu)"``; a CPU device is just ``"cpu"``."""
    if device_kind.lower() == platform_name.lower() or not device_kind:
        return platform_name
    return f"{device_kind} ({platform_name})"


def device_of(device) -> str:
    """:func:`describe_device` of a ``jax.Device``."""
    return describe_device(device.platform, device.device_kind)


def actor_devices(infos: Sequence, backend: str) -> str:
    """Where the actors run, from each actor's own report (``_worker.ActorInfo``): ``"cpu (2
    processes)"``, one entry per distinct device. Empty when there are no reports."""
    if not infos:
        return ""
    counts: dict[str, int] = {}
    for info in infos:
        key = describe_device(info.platform, info.device_kind)
        counts[key] = counts.get(key, 0) + 1
    one, many = {"ray": ("Ray actor", "Ray actors"), "threads": ("thread", "threads")}.get(
        backend, ("process", "processes")
    )
    return ", ".join(f"{dev} ({n} {one if n == 1 else many})" for dev, n in counts.items())


def devices_line(learner: str, actors: str) -> str:
    """``"learner: TPU v5 lite (tpu); actors: cpu (2 processes)"``."""
    parts = [f"learner: {learner}"] if learner else []
    if actors:
        parts.append(f"actors: {actors}")
    return "; ".join(parts)


def environment(learner: str = "", actors: str = "") -> str:
    """Versions and the machine; with ``learner``/``actors`` (:func:`device_of`,
    :func:`actor_devices`), the devices the run used."""
    import jax

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = "not installed"
    devices = devices_line(learner, actors)
    return (
        f"python {platform.python_version()}, jax {jax.__version__}, ray {ray_version}, "
        f"{os.cpu_count()} cores, {platform.machine()} {platform.system()}" + (f"; {devices}" if devices else "")
    )


COLUMNS = (
    "run",
    "env steps/s",
    "MiB moved/iter",
    "transport s/iter",
    "compute s/iter",
    "learner s/iter",
    "transport share",
    "speedup vs stock",
    "final return",
)


def table_rows(runs: Sequence[RunResult]) -> list[list[str]]:
    """One row per run; the speedup is against the stock run of the same backend, if any."""
    stock = {r.backend: r.steps_per_s for r in runs if r.transport == "stock"}
    # Threads move nothing: their speedup column compares with stock multiprocessing's
    # streaming queue, the same actors as processes, when it ran too.
    if "queue" in stock:
        stock["threads"] = stock["queue"]
    rows = []
    for r in runs:
        n = len(r.timed)
        wall = r.total("wall_s")
        base = stock.get(r.backend)
        speedup = f"{r.steps_per_s / base:.2f}x" if base else "n/a (use --compare)"
        tail = r.returns[-3:]
        rows.append(
            [
                run_label(r.backend, r.transport),
                f"{r.steps_per_s:,.0f}",
                f"{r.total('bytes_moved') / n / MiB:.1f}",
                f"{r.total('transport_s') / n:.3f}",
                f"{r.total('compute_s') / n:.3f}",
                f"{r.total('learner_s') / n:.3f}",
                f"{100 * r.total('transport_s') / max(wall, 1e-12):.0f}%",
                speedup,
                f"{sum(tail) / len(tail):.1f}",
            ]
        )
    return rows


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def summary_table(runs: Sequence[RunResult]) -> str:
    """The end-of-run report: configuration, environment, a markdown table per run."""
    cfg = runs[0].config
    steps = cfg.workers * cfg.envs * cfg.steps
    timed = len(runs[0].timed)
    env = cfg.env if getattr(cfg, "atari", False) else "CartPole"
    if getattr(cfg, "engine", "gymnasium") != "gymnasium":
        env = f"{env} through {cfg.engine}"
    frames = (
        f"{cfg.frame_size}x{cfg.frame_size} uint8 frames, 4 stacked"
        if getattr(cfg, "atari", False)
        else f"{cfg.frame_size}x{cfg.frame_size} uint8 frames"
    )
    head = [
        f"## Rollouts: {env}, {cfg.backend} backend, {cfg.workers} workers",
        "",
        f"{steps:,} env steps per iteration ({cfg.workers} workers x {cfg.envs} envs x "
        f"{cfg.steps} steps, {frames}); policy "
        f"{runs[0].param_bytes / MiB:.1f} MiB; figures over {timed} iterations after "
        f"{min(cfg.warmup, len(runs[0].iterations) - timed)} warm-up.",
        f"Environment: {environment(runs[0].learner_device, runs[0].actor_devices)}.",
    ]
    if runs[0].trajectories_on or runs[0].params_on:
        head.append(
            f"Trajectories arrived on: {runs[0].trajectories_on or '?'}; parameters broadcast from: "
            f"{runs[0].params_on or '?'}."
        )
    if runs[0].cpu_budget:
        head.append(f"CPU budget: {runs[0].cpu_budget}.")
    head.append("transport = iteration wall time - slowest worker's compute - learner update.")
    if cfg.backend in ("queue", "threads"):
        head.append(
            f"Streaming actors (--max-lag {cfg.max_lag}): actors compute while the learner updates, "
            "so compute + learner can exceed the wall time (transport then reads 0)."
        )
    head.append("")
    text = "\n".join(head) + markdown_table(COLUMNS, table_rows(runs))
    by_transport = {r.transport: r for r in runs}
    if "stock" in by_transport and "jaxtransport" in by_transport:
        a, b = by_transport["stock"], by_transport["jaxtransport"]
        same = a.returns == b.returns
        text += (
            f"\n\nspeedup (env steps/s, jaxtransport over stock): "
            f"{b.steps_per_s / a.steps_per_s:.2f}x\n"
            f"learning curves identical across transports: {'yes' if same else 'NO'}"
        )
        if a.params_sha256 and b.params_sha256:
            same_params = a.params_sha256 == b.params_sha256
            text += (
                "\nlearner's final parameters identical across transports (SHA-256, every "
                f"update bit for bit): {'yes' if same_params else 'NO'}"
            )
        if cfg.backend == "queue" and not same:
            text += (
                " (expected when streaming: which actor's trajectory arrives first, and "
                "with which parameters, varies from run to run)"
            )
    for r in runs:
        acts = [it.act_s for it in r.timed if it.act_s is not None]
        if acts:
            compute = sum(it.compute_s for it in r.timed if it.act_s is not None)
            per_step = sum(acts) / len(acts) / cfg.steps
            what = (
                "the round trip to the learner's process, which acts for every actor (--inference learner)"
                if getattr(cfg, "inference", "actor") == "learner"
                else "the policy's forward pass and sampling"
            )
            text += (
                f"\n{table_rows([r])[0][0]}: acting ({what}, "
                f"in the slowest actor) {per_step * 1e3:.2f} ms per step of {cfg.envs} "
                f"envs, {100 * sum(acts) / max(compute, 1e-12):.0f}% of the actors' compute"
            )
        lags = [it.lag for it in r.timed if it.lag is not None]
        if lags:
            text += (
                f"\n{table_rows([r])[0][0]}: off-policy lag per update: "
                f"{sum(lags) / len(lags):.2f} parameter versions on average, at most "
                f"{max(lags):g}"
            )
    return text
