"""Input pipelines (issue 51): batches of decoded JPEGs fed to a training step on the device, by
``jaxtransport.data.Loader`` against Grain's ``mp_prefetch``, torch's ``DataLoader`` and one process.

The data: real JPEGs, generated once with Pillow (``--files``, default 384, from 256x256 to
500x375, smooth random content with fine noise, quality 90) into the git-ignored
``benchmarks/results/scratch/pipeline-jpegs/``. Each example: read the file, decode it (Pillow),
a random 224x224 crop and a random horizontal flip (from the example's own generator), as
``{"image": uint8[224, 224, 3], "label": int32}``; batches of 256 (``--batch``). The records are
the files over and over (the source is long enough for the whole run), in order: every loader
makes the same work.

Rows, each in a fresh interpreter, the loaders' runs alternated (``--reps`` rounds, medians):
- ``jaxtransport.data.Loader`` (``workers=N``): batches land on the device in the loader's thread;
- Grain ``mp_prefetch`` (``MultiprocessingOptions(num_workers=N)``, the same function as a
  ``random_map``, ``batch`` in the workers) and ``jax.device_put`` of each batch in the loop;
- torch ``DataLoader`` (``num_workers=N``, ``multiprocessing_context="spawn"``: a JAX process
  may not fork, ``persistent_workers``), ``jax.device_put`` of each batch's numpy view; skipped
  (a row that says so) where torch does not import;
- one process: the same function in the loop itself, then ``jax.device_put``.

The step: a jitted reduction over the batch (``jnp.sum``), waited for. Per row: batches/s over
``--batches`` batches after a warm-up; ``limit``: N times one process's rate of making a batch
(measured first, alone) or the host-to-device rate of a batch, whichever is lower; ``wait_share``:
the share of the time the loop spent waiting for the next batch on the device (its ``next()``,
and the ``device_put`` where the loop does it); ``cores_busy``: the CPU seconds of the loop's
process and every process below it over the timed phase's wall time (on a shared machine, how
much of it the loader got) and ``batches_per_core_s`` (batches per CPU-second it got);
``cores_idle``: the machine's idle cores over the same time; ``batches_per_s_late``: the rate
over the second half of the timed batches alone; ``wait_share_balanced``: the same with the step
made to last as long as the pipeline takes to make a batch at its limit (``1 / limit``; the
reduction, then a sleep: a step on the chip leaves the host's cores to the workers); peak RSS of
the loop's process and of the whole process tree (sampled every 0.2 s, shared memory counted in
every process that maps it); ``/dev/shm`` entries left after the loader is closed, and the
resource tracker's "leaked shared_memory" warnings.

``python -m benchmarks.pipeline [--workers 2,6,12] [--batches 90] [--reps 3] [--no-grain]
[--no-torch] [--out DIR]`` writes ``pipeline.{md,json,png}`` (default: the scratch folder). Run the
module itself on an accelerator host: ``python -m benchmarks`` starts JAX in its own process,
which then holds the chip. Targets (issue 51): at 12 workers on the accelerator, >= 90% of the
limit and >= 1.5x Grain; waits <= 5% with the balanced step; at 2 workers here, >= Grain;
nothing left in /dev/shm by any loader.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from . import _common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FILES_DIR = os.path.join(HERE, "results", "scratch", "pipeline-jpegs")
CROP = 224
BATCH = 256
SEED = 0
JT, GRAIN, TORCH, ONE = "jaxtransport.data.Loader", "grain mp_prefetch", "torch DataLoader", "one process"
GRAIN1 = "grain mp_prefetch, 1 thread a worker"  # --grain-one-thread: ReadOptions(num_threads=1)
LOADERS = (JT, GRAIN, TORCH)
PLOT_X = "workers"
PLOT_XLABEL = "worker processes"
PLOT_XFORMAT = "{:g}"
PLOT_Y = "batches_per_s"
PLOT_YLABEL = "batches of 256 decoded JPEGs per second (higher is better)"
LIMIT_TRANSPORTS = ("limit",)
FOUND: dict = {}  # what the calibration found: the backend and the device the runs used
PLOT_TITLES = {"pipeline": "batches on the device, a jitted reduction as the step"}


# ------------------------------------------------------------------------------------------
# the data and the work (module level: the workers of every loader import them)


def make_files(count: int, folder: str = FILES_DIR, seed: int = 1) -> list[str]:
    """``count`` JPEGs in ``folder`` (made once; kept while the count and the seed match)."""
    from PIL import Image

    stamp = os.path.join(folder, f".made-{count}-{seed}")
    paths = [os.path.join(folder, f"{i:05d}.jpg") for i in range(count)]
    if os.path.exists(stamp):
        return paths
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for path in paths:
        w, h = int(rng.integers(256, 501)), int(rng.integers(256, 376))
        coarse = rng.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), np.int16)
        img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(path, quality=90)
    open(stamp, "w").close()
    return paths


class Cycled:
    """``length`` records: the files over and over (a sequence: ``len`` and ``[i]``)."""

    def __init__(self, paths: list[str], length: int):
        self.paths, self.length = list(paths), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[str, int]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        return self.paths[i % len(self.paths)], i


def example(record: tuple[str, int], rng: np.random.Generator) -> dict:
    """Read, decode, random crop to 224x224 and random horizontal flip."""
    from PIL import Image

    path, index = record
    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        x, y = int(rng.integers(0, w - CROP + 1)), int(rng.integers(0, h - CROP + 1))
        img = np.asarray(im.crop((x, y, x + CROP, y + CROP)))
    if rng.random() < 0.5:
        img = np.ascontiguousarray(img[:, ::-1])
    return {"image": img, "label": np.int32(index % 1000)}


def example_of_index(source: Cycled, seed: int, i: int) -> dict:
    return example(source[i], np.random.default_rng([seed, i]))


def make_batch(source: Cycled, start: int, seed: int = SEED) -> dict:
    items = [example_of_index(source, seed, i) for i in range(start, start + BATCH)]
    return {k: np.stack([e[k] for e in items]) for k in items[0]}


class TorchSet:
    """The records as a torch map-style dataset (``__getitem__``/``__len__``)."""

    def __init__(self, source: Cycled, seed: int):
        self.source, self.seed = source, seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return example_of_index(self.source, self.seed, i)


# ------------------------------------------------------------------------------------------
# one run, in its own interpreter


def _shm() -> set[str]:
    try:
        return {e for e in os.listdir("/dev/shm") if not e.startswith(("sem.", "."))}
    except FileNotFoundError:
        return set()


def _tree_rss() -> int:
    """RSS bytes of this process and every process below it (``/proc/PID/status``)."""
    status: dict[int, dict[str, str]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                status[int(entry)] = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
    below: dict[int, list[int]] = {}
    for pid, fields in status.items():
        below.setdefault(int(fields.get("PPid", "0")), []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        rss = status.get(pid, {}).get("VmRSS", "0 kB").split()[0]
        total += int(rss) * 1024
        todo += below.get(pid, [])
    return total


def _own_peak_rss() -> int | None:
    """This process's peak RSS in bytes since it started: ``VmHWM``, which exec resets (getrusage's
    ``ru_maxrss`` keeps the parent's peak from before the exec: 543 MiB for every run, the
    runner's memcpy buffers). None where the kernel gives no figure (the TPU host's gave 0)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 or None
    return None


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and every live process below it."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    mine, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        mine += cpu.get(pid, 0.0)
        todo += [p for p, up in parent.items() if up == pid]
    return mine


def _idle_s() -> float:
    """Seconds the machine's cores have been idle (``/proc/stat``: idle + iowait), all cores
    together: over a timed phase, the cores the loader left unused (or, when low while the
    loader's ``cores_busy`` is low too, the cores other work took)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


class _Peak(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.peak = max(self.peak, _tree_rss())


def _batches(kind: str, workers: int, source: Cycled) -> tuple[Any, Any, bool]:
    """(iterator of batches, close(), whether they arrive on the device already)."""
    if kind == JT:
        from jaxtransport.data import Loader

        loader = Loader(source, example, batch_size=BATCH, seed=SEED, workers=workers)
        return iter(loader), loader.close, True
    if kind in (GRAIN, GRAIN1):
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # with JAX installed, mp_prefetch reads absl flags
        import grain

        ds = grain.MapDataset.source(source).random_map(example, seed=SEED).batch(BATCH, drop_remainder=True)
        read = grain.ReadOptions(num_threads=1) if kind == GRAIN1 else None  # None: Grain's default, 16
        it = iter(ds.to_iter_dataset(read).mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)))
        return it, getattr(it, "close", lambda: None), False
    if kind == TORCH:
        import torch.utils.data

        dl = torch.utils.data.DataLoader(TorchSet(source, SEED), batch_size=BATCH, num_workers=workers,
                                         multiprocessing_context="spawn", persistent_workers=True, drop_last=True)
        it = iter(dl)
        numpy_batches = ({k: v.numpy() for k, v in b.items()} for b in it)

        def close() -> None:
            it._shutdown_workers()

        return numpy_batches, close, False
    starts = iter(range(0, len(source) - BATCH + 1, BATCH))
    return (make_batch(source, s) for s in starts), lambda: None, False


# Note [steady state]
# A loader may make many batches ahead while its workers start and the step compiles: Grain's
# workers each run the dataset on 16 threads (``ReadOptions``' default), so its first batch came
# after 13 s here, with dozens more nearly done behind it, and 8 batches timed right after the
# warm-up ran at 18 batches/s on 2 cores, against 3.9 once those were gone. So after the warm-up
# each run takes batches until the loop has waited for 3 in a row (each wait at least 0.3 of
# the time a batch takes at the limit) and it has taken at least 16 per worker (as many as
# Grain's threads may have had under way), whichever comes later: what was made ahead is gone,
# the loader runs at its own pace (at most ``40 * workers + 40`` batches; ``drained`` says how
# many), and then the timed phases start. The same rule for every loader.
#
# The timed phases are long (90 batches by default, not 30) for the same reason: each of Grain's
# 16 threads a worker makes a whole batch (the ``batch`` is inside the threads' dataset), so
# about 32 batches are under way at once at 2 workers, each finished in bursts, and a window of
# 30 batches starts and ends at arbitrary points of that backlog: the CPU seconds spent in the
# window are not those of the batches delivered in it. Measured here (each batch's arrival
# time, 200-250 batches a run, 25-batch windows): Grain's windows ran at 2.7 to 6.9 batches/s
# and 2.0 to 4.1 batches per CPU-second within one run, its whole runs at 4.0 to 5.8
# batches/s and 2.7 to 3.3 batches per CPU-second, against one process's 3.5 to 3.8 and the
# Loader's 3.6 to 3.9 (the published 30-batch windows had Grain at 3.79 to 8.35 batches/s and
# 4.12 batches per CPU-second, above the limit). ``batches_per_s_late``: the rate over the
# window's second half alone, a check that the window is long enough (it should match the
# whole window's); ``cores_idle``: the machine's idle cores over the window (/proc/stat), which
# tells a loader that left cores unused from one whose cores other work took.


def child(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp

    paths = make_files(spec["files"])
    drain_max = 40 * spec["workers"] + 40
    total = spec["warmup"] + drain_max + 2 * spec["batches"] + 2 * spec["workers"] + 8
    source = Cycled(paths, total * BATCH)
    step = jax.jit(lambda b: jnp.sum(b["image"], dtype=jnp.float32) + jnp.sum(b["label"]))
    shm_before = _shm()
    peak = _Peak()
    peak.start()
    t_start = time.perf_counter()

    def progress(what: str) -> None:  # stderr: where a run that timed out had got to
        print(f"[{spec['loader']} x{spec['workers']}] {what} at {time.perf_counter() - t_start:.1f} s",
              file=sys.stderr, flush=True)

    it, close, on_device = _batches(spec["loader"], spec["workers"], source)
    progress("started")
    out: dict = {}
    try:
        for _ in range(spec["warmup"]):
            b = next(it)
            step(b if on_device else jax.device_put(b)).block_until_ready()
        progress(f"{spec['warmup']} warm-up batches")
        # Drain what the loader made ahead while it started (Note [steady state]).
        drained, waits_in_a_row = 0, 0
        while (waits_in_a_row < 3 or drained < 16 * spec["workers"]) and drained < drain_max:
            t = time.perf_counter()
            b = next(it)
            waits_in_a_row = waits_in_a_row + 1 if time.perf_counter() - t >= 0.3 * spec["step_s"] else 0
            step(b if on_device else jax.device_put(b)).block_until_ready()
            drained += 1
            if drained % 50 == 0:
                progress(f"{drained} batches drained")
        out["drained"] = drained
        progress(f"drained {drained}")
        for phase, pad in (("", 0.0), ("_balanced", spec.get("step_s") or 0.0)):
            if phase and not pad:
                continue
            waited = 0.0
            cpu, idle = _tree_cpu_s(), _idle_s()
            start = time.perf_counter()
            arrived = []
            for _ in range(spec["batches"]):
                t = time.perf_counter()
                b = next(it)
                if not on_device:
                    b = jax.device_put(b)
                t_step = time.perf_counter()
                arrived.append(t_step)
                waited += t_step - t
                step(b).block_until_ready()
                del b
                left = pad - (time.perf_counter() - t_step)
                if left > 0:
                    time.sleep(left)
            elapsed = time.perf_counter() - start
            out[f"batches_per_s{phase}"] = spec["batches"] / elapsed
            out[f"wait_share{phase}"] = waited / elapsed
            out[f"cores_busy{phase}"] = (_tree_cpu_s() - cpu) / elapsed
            out[f"cores_idle{phase}"] = (_idle_s() - idle) / elapsed
            half = len(arrived) // 2
            if half >= 2:  # the rate over the window's second half alone (Note [steady state])
                out[f"batches_per_s_late{phase}"] = (len(arrived) - 1 - half) / (arrived[-1] - arrived[half])
            progress(f"timed phase{phase or ' (free-running)'} done")
    finally:
        del it
        close()
    time.sleep(2.0)  # the loaders' processes exit; what stays in /dev/shm then is left
    peak.stop.set()
    left = sorted(_shm() - shm_before)
    own = _own_peak_rss()
    out.update(peak_rss_mib=None if own is None else own / (1 << 20),
               peak_rss_tree_mib=peak.peak / (1 << 20), shm_left=len(left), shm_left_names=" ".join(left[:4]))
    return out


#: Batches one process makes, timed, for the limit (after one untimed): 3 gave 0.250 s a batch
#: here in a run whose one-process row made 3.57 batches a second (a spread of 85%).
CALIBRATE_REPS = 8
#: The calibration runs again after the rounds; a batch made this much slower or faster than at the
#: start means the machine's speed changed during the run (on a shared host: other jobs). The limit
#: and the balanced step were sized from the start's, so a wait verdict then does not hold: here, in
#: one run the start's batch took 0.249 s and the one-process row then ran at 0.33 s a batch (its
#: Loader waited 21.5% with the balanced step, against 5.3% in a run without that drift).
DRIFT_WARN = 0.10


def calibrate(files: int, reps: int = CALIBRATE_REPS) -> dict:
    """One process's seconds to make a batch, and a batch's host-to-device time (the faster of
    two puts of a fresh host copy, waited for: H2D_PIECES below), medians."""
    import jax

    paths = make_files(files)
    source = Cycled(paths, (reps + 1) * BATCH)
    make_batch(source, 0)  # warm: the files in the page cache, Pillow's imports
    made = []
    for k in range(reps):
        t = time.perf_counter()
        batch = make_batch(source, (k + 1) * BATCH)
        made.append(time.perf_counter() - t)
    whole, pieces = _h2d_times(batch, lambda host: jax.device_put(host)), _h2d_times(batch, _put_in_pieces)
    h2d, method = min((statistics.median(whole), "jax.device_put of the batch"),
                      (statistics.median(pieces), f"each array in {H2D_PIECES} pieces put at once, joined"))
    return {"make_s": statistics.median(made), "make_min": min(made), "make_max": max(made),
            "h2d_s": h2d, "h2d_method": method, "h2d_whole_s": statistics.median(whole),
            "backend": jax.default_backend(), "reps": reps,
            "device_kind": jax.devices()[0].device_kind, "devices": len(jax.devices())}


#: The host-to-device limit of a batch is the faster of two puts (each of a fresh host copy,
#: waited for, median of 5 after one untimed): ``jax.device_put`` of the batch, and each of its
#: arrays as H2D_PIECES pieces along its first axis put at once and joined on the device, the
#: way the device's limit is measured in benchmarks/device.py. On the TPU v5e a whole put of a
#: batch took 47 ms, and the Loader, which puts large arrays in pieces, ran past a limit made
#: from it (102%).
H2D_PIECES = 8


def _h2d_times(batch: dict, put) -> list[float]:
    import jax

    jax.block_until_ready(put({k: v.copy() for k, v in batch.items()}))  # warm: the first call
    times = []
    for _ in range(5):
        host = {k: v.copy() for k, v in batch.items()}
        t = time.perf_counter()
        jax.block_until_ready(put(host))
        times.append(time.perf_counter() - t)
    return times


def _put_in_pieces(host: dict) -> dict:
    import jax

    return {k: jax.device_put(v) if v.ndim == 0 or len(v) < H2D_PIECES else _common.put_in_pieces(v, H2D_PIECES)
            for k, v in host.items()}


def _spawn(args: list[str], timeout: float) -> tuple[dict | None, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.pipeline", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return None, f"timed out after {timeout:.0f} s: {(e.stderr or b'')[-400:]!r}"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), proc.stderr
    return None, f"exit {proc.returncode}: {proc.stderr[-1500:]}"


def _importable(name: str) -> bool:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True).returncode == 0


def run(quick: bool = False, workers: tuple[int, ...] = (2,), batches: int | None = None, reps: int | None = None,
        files: int = 384, grain: bool = True, torch: bool = True, timeout: float = 600,
        grain_one_thread: bool = False, one_process: bool = True) -> list[dict]:
    batches = batches or (10 if quick else 90)
    reps = reps or (1 if quick else 3)
    warmup = 3
    make_files(files)
    cal, err = _spawn(["--calibrate", str(files)], timeout)
    if cal is None:
        raise RuntimeError(f"calibration failed: {err}")
    h2d_rate = 1 / cal["h2d_s"] if cal["h2d_s"] > 0 else float("inf")
    FOUND.update(jax_backend=cal["backend"], device_kind=cal["device_kind"], devices=cal["devices"])
    print(f"# pipeline: one process makes a batch in {cal['make_s']:.3f} s; H2D of a batch {cal['h2d_s'] * 1e3:.1f} ms "
          f"({cal['h2d_method']}; whole {cal['h2d_whole_s'] * 1e3:.1f} ms) "
          f"({cal['backend']}, {cal['device_kind']}); {_common.usable_cores()} cores", flush=True)
    kinds = [JT] + ([GRAIN] if grain else []) + ([GRAIN1] if grain and grain_one_thread else [])
    kinds += [TORCH] if torch else []
    missing = {k: why for k, why in ((GRAIN, "grain"), (GRAIN1, "grain"), (TORCH, "torch"))
               if k in kinds and not _importable(why)}
    rows: list[dict] = []
    for n in workers:
        limit = min(n / cal["make_s"], h2d_rate)
        plan = [(k, n) for k in kinds if k not in missing] + ([(ONE, 1)] if n == workers[0] and one_process else [])
        found: dict[str, list[dict]] = {k: [] for k, _ in plan}
        errors: dict[str, str] = {}
        for r in range(reps):
            for kind, w in plan:  # the loaders alternate: each round runs every one once
                spec = {"loader": kind, "workers": w, "batches": batches, "warmup": warmup, "files": files,
                        "step_s": 1 / min(w / cal["make_s"], h2d_rate)}
                res, err = _spawn(["--child", json.dumps(spec)], timeout)
                if res is None:
                    errors[kind] = err
                    print(f"!! {kind} x{w} round {r}: {err}", file=sys.stderr, flush=True)
                    continue
                res["leak_warnings"] = sum(int(word) for line in err.splitlines() if "leaked shared_memory" in line
                                           for word in line.split() if word.isdigit())
                found[kind].append(res)
                print(f"  {kind} x{w} round {r}: {res['batches_per_s']:.2f} batches/s, waits "
                      f"{res['wait_share'] * 100:.0f}% ({res.get('wait_share_balanced', 0) * 100:.0f}% balanced), "
                      f"/dev/shm left {res['shm_left']}", flush=True)
        for kind, w in plan:
            rows.append(_row(kind, w, found[kind], min(w / cal["make_s"], h2d_rate), cal, errors.get(kind)))
        for kind in missing:
            rows.append({"name": "pipeline", "transport": kind, "workers": n, "size_bytes": 0,
                         "error": f"skipped: {missing[kind]} does not import here"})
        rows.append({"name": "pipeline", "transport": "limit", "workers": n, "size_bytes": 0, "batches_per_s": limit,
                     "seconds": 1 / limit, "min": min(cal["make_min"] / n, cal["h2d_s"]),
                     "max": max(cal["make_max"] / n, cal["h2d_s"]), "runs": cal["reps"], "make_s": cal["make_s"],
                     "h2d_s": cal["h2d_s"], "h2d_method": cal["h2d_method"]})
    cal_end, err = _spawn(["--calibrate", str(files)], timeout)
    if cal_end is None:
        print(f"!! the calibration after the runs failed: {err}", file=sys.stderr, flush=True)
    else:
        drift = cal_end["make_s"] / cal["make_s"] - 1
        for r in rows:
            if r["transport"] == "limit":
                r.update(make_s_end=cal_end["make_s"], calibration_drift=drift)
        if abs(drift) > DRIFT_WARN:
            print(f"!! one process made a batch in {cal_end['make_s']:.3f} s after the runs, {cal['make_s']:.3f} s "
                  f"before ({drift * 100:+.0f}%): the machine's speed changed during the run, so its limits and "
                  "the balanced step sized from them are off", file=sys.stderr, flush=True)
    grain_bps = {r["workers"]: r.get("batches_per_s") for r in rows if r["transport"] == GRAIN}
    for r in rows:
        if r["transport"] == JT and grain_bps.get(r["workers"]):
            r["vs_grain"] = r["batches_per_s"] / grain_bps[r["workers"]]
    return rows


def _row(kind: str, workers: int, runs: list[dict], limit: float, cal: dict, error: str | None) -> dict:
    row: dict[str, Any] = {"name": "pipeline", "transport": kind, "workers": workers, "size_bytes": 0}
    if not runs:
        row["error"] = error or "no run"
        return row
    bps = [r["batches_per_s"] for r in runs]
    med = statistics.median(bps)

    def median(key: str) -> float | None:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    row.update(seconds=1 / med, min=1 / max(bps), max=1 / min(bps), runs=len(runs), batches_per_s=med,
               batches_per_s_runs=" ".join(f"{v:.2f}" for v in bps), limit=limit, vs_limit=med / limit,
               wait_share=median("wait_share"), cores_busy=median("cores_busy"),
               batches_per_core_s=statistics.median(r["batches_per_s"] / r["cores_busy"] for r in runs
                                                    if r.get("cores_busy")) if any(r.get("cores_busy") for r in runs)
               else None,
               batches_per_s_late=median("batches_per_s_late"),
               batches_per_s_late_runs=" ".join(f"{r['batches_per_s_late']:.2f}" for r in runs
                                                if r.get("batches_per_s_late") is not None),
               cores_idle=median("cores_idle"),
               batches_per_s_balanced=median("batches_per_s_balanced"),
               wait_share_balanced=median("wait_share_balanced"), peak_rss_mib=median("peak_rss_mib"),
               peak_rss_tree_mib=median("peak_rss_tree_mib"), shm_left=max(r["shm_left"] for r in runs),
               shm_left_names=next((r["shm_left_names"] for r in runs if r["shm_left"]), ""),
               leak_warnings=max(r["leak_warnings"] for r in runs), drained=median("drained"), backend=cal["backend"])
    if error:
        row["error"] = f"{len(runs)} runs ok, one failed: {error[-300:]}"
    return row


def check_targets(rows: list[dict]) -> list[str]:
    out = []
    by = {(r["transport"], r["workers"]): r for r in rows}
    for (kind, n), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if kind == "limit" or r.get("batches_per_s") is None:
            continue
        if kind == JT:
            g = by.get((GRAIN, n), {}).get("batches_per_s")
            if g:
                want = 1.5 if n >= 12 else 1.0
                ok = r["batches_per_s"] >= want * g
                out.append(f"{'PASS' if ok else 'MISS'} {n} workers: jaxtransport {r['batches_per_s']:.2f} batches/s = "
                           f"{r['batches_per_s'] / g:.2f}x Grain's {g:.2f} (>= {want}x)")
            if n >= 12:
                ok = r["vs_limit"] >= 0.9
                out.append(f"{'PASS' if ok else 'MISS'} {n} workers: {r['vs_limit'] * 100:.0f}% of the limit (>= 90%)")
            wb = r.get("wait_share_balanced")
            # The drift of this worker count's own run (a merged file holds one run per count).
            drift = by.get(("limit", n), {}).get("calibration_drift")
            moved = (f" (but the calibration moved {drift * 100:+.0f}% during the run: the step was sized for "
                     "another machine speed)") if drift is not None and abs(drift) > DRIFT_WARN else ""
            if wb is not None:
                out.append(f"{'PASS' if wb <= 0.05 else 'MISS'} {n} workers, step as long as a batch at the limit: "
                           f"the loop waits {wb * 100:.1f}% of the time (<= 5%){moved}")
        ok = not r.get("shm_left") and not r.get("leak_warnings")
        out.append(f"{'PASS' if ok else 'MISS'} {kind} x{n}: /dev/shm entries left {r.get('shm_left')}, "
                   f"leak warnings {r.get('leak_warnings')}")
    return out


def main(argv: list[str] | None = None) -> list[dict] | None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--workers", default="2", help="comma-separated worker counts (default 2; the issue: 2,6,12)")
    p.add_argument("--batches", type=int, help="timed batches per phase of a run (default 90; --quick 10): "
                   "Note [steady state]")
    p.add_argument("--reps", type=int, help="rounds; each runs every loader once (default 3; --quick 1)")
    p.add_argument("--files", type=int, default=384, help="JPEGs to generate and cycle through (default 384)")
    p.add_argument("--no-grain", action="store_true", help="leave out Grain's row")
    p.add_argument("--no-torch", action="store_true", help="leave out torch's row")
    p.add_argument("--grain-one-thread", action="store_true", help="a row more: Grain with one thread in each "
                   "worker (ReadOptions(num_threads=1); its default is 16)")
    p.add_argument("--no-one-process", action="store_true", help="leave out the one-process row (measured "
                   "with the first worker count otherwise)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    p.add_argument("--out", help="write NAME.{md,json,png} here (default: benchmarks/results/scratch)")
    p.add_argument("--name", default="pipeline", help="the results' name (default pipeline; on an accelerator "
                   "host: pipeline_device)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="measure nothing: the rows of these results files "
                   "(one per worker count, from separate runs) as one, written to --out as --name")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--calibrate", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return None
    if args.calibrate:
        print("RESULT " + json.dumps(calibrate(args.calibrate)), flush=True)
        return None
    from . import run as runner

    if args.merge:
        return _merge(args.merge, args.out or runner.SCRATCH, args.name)
    workers = tuple(int(w) for w in args.workers.split(","))
    start = time.perf_counter()
    before = runner.conditions()
    rows = run(args.quick, workers, args.batches, args.reps, args.files, not args.no_grain, not args.no_torch,
               args.timeout, args.grain_one_thread, not args.no_one_process)
    info = _environment()
    runner.write_outputs(args.name, sys.modules[__name__], rows, args.out or runner.SCRATCH,
                         time.perf_counter() - start, args.quick, info=info, before=before, after=runner.conditions())
    return rows


def _merge(paths: list[str], out: str, name: str) -> list[dict]:
    """One results file from several runs' (the device's 10-minute limit per command: one worker
    count per run). The environment, date and conditions are the first file's; every row keeps
    its runs; the worker counts must not overlap."""
    from . import run as runner

    files = []
    for path in paths:
        with open(path) as f:
            files.append(json.load(f))
    rows: list[dict] = []
    for path, data in zip(paths, files):
        counts = {r["workers"] for r in data["rows"]}
        if counts & {r["workers"] for r in rows}:
            raise SystemExit(f"{path}: worker counts {sorted(counts)} are already in an earlier file")
        rows += data["rows"]
    grain_bps = {r["workers"]: r.get("batches_per_s") for r in rows if r["transport"] == GRAIN}
    for r in rows:
        if r["transport"] == JT and grain_bps.get(r["workers"]) and r.get("batches_per_s"):
            r["vs_grain"] = r["batches_per_s"] / grain_bps[r["workers"]]
    first = files[0]
    cond = first.get("conditions") or {}
    runner.write_outputs(name, sys.modules[__name__], rows, out, sum(d["seconds"] for d in files), first["quick"],
                         info=first["environment"], generated=first["generated"],
                         before={"loadavg": cond.get("loadavg_before"), "memcpy_gbps": cond.get("memcpy_gbps"),
                                 "usable_cores": cond.get("usable_cores")},
                         after={"loadavg": cond.get("loadavg_after")})
    return rows


def _environment() -> dict:
    """This machine, without starting JAX in this process (the runs hold the accelerator), with
    the loaders' versions and what the calibration found."""
    info = _common.env_info(backend=False)
    for mod in ("grain", "torch", "PIL"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent: not in the environment line
            pass
    info.update(FOUND)
    return info


def environment_info() -> dict:
    return _environment()


if __name__ == "__main__":
    _common.main_of_module("benchmarks.pipeline")
