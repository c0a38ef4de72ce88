"""benchmarks/device.py: registered with the runner, skipped cleanly without an accelerator, every
row measured on CPU with --allow-cpu (a smoke run), and its figures table rendered from a
device.json when there is one and a "not measured yet" line when there is none."""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks import device
from benchmarks import figures
from benchmarks import run as runner

LIMITS = {device.D2H, device.H2D, (device.D2H[0], device.D2H_AGAIN), (device.H2D[0], device.H2D_AGAIN)}
LIMITS |= {(device.D2H[0], device.d2h_pieces(k)) for k in device.PIECE_COUNTS}
LIMITS |= {(device.D2H[0], device.d2h_pieces(k, device.LANES)) for k in device.LANE_PIECE_COUNTS}
LIMITS |= {(device.D2H[0], device.D2H_CODEC)}
LIMITS |= {(device.D2H[0], device.d2h_pieces(k, 0, device.THREADS)) for k in device.LANE_PIECE_COUNTS}
LIMITS |= {(device.H2D[0], device.h2d_pieces(k)) for k in device.PIECE_COUNTS}
MEASURED = (LIMITS | {(q, t) for q, t, _ in device.QUESTIONS} | {(q, s) for q, _, s in device.QUESTIONS if s}
            | {(q, t) for q, t, _ in device.RAY_QUESTIONS})
EVERY_ROW = MEASURED | {(name, device.FASTEST) for name in device.LIMIT.values()}  # finish() adds the limits


def test_registered_with_the_runner():
    assert ("device", "benchmarks.device") in runner.BENCHMARKS
    assert device.NEEDS_ACCELERATOR


def test_without_an_accelerator_run_returns_no_rows_and_says_skipped(monkeypatch, capsys):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # no accelerator, whatever this machine has
    assert device.run(quick=True) == []
    assert "skipped: no accelerator" in capsys.readouterr().out
    assert device.LAST["skipped"]


def test_the_probe_child_skips_on_cpu_without_measuring(monkeypatch):
    """The child that would measure: on CPU (no --allow-cpu) it answers "skipped" at once."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    res = device._probe("transfers", ["--size-mib", "1"], timeout=120)
    assert res["skipped"].startswith("no accelerator"), res
    assert "rows" not in res and res["environment"]["jax_backend"] == "cpu"


def test_the_runner_writes_nothing_and_succeeds_when_skipped(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert runner.main(["--only", "device", "--out", str(tmp_path)]) == 0
    assert list(tmp_path.iterdir()) == []
    assert "device: no rows (skipped); nothing written" in capsys.readouterr().out
    # --replot with no device.json: no saved rows of a benchmark that needs an accelerator
    assert runner.main(["--only", "device", "--replot", "--out", str(tmp_path)]) == 0


def test_allow_cpu_measures_every_row(tmp_path):
    """A smoke run: every row on CPU with finite seconds (the figures mean nothing), the files
    written with the environment line and the PASS/MISS lines."""
    assert device.main(["--allow-cpu", "--size-mib", "4", "--runs", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "device.json").read_text())
    rows = data["rows"]
    assert not [r for r in rows if r.get("error")], [r for r in rows if r.get("error")]
    assert {(r["name"], r["transport"]) for r in rows} == EVERY_ROW
    for r in rows:
        assert r["size_bytes"] == 4 << 20 and r["runs"] == 2
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0, r
    ours = {q: t for q, t, _ in device.QUESTIONS} | {q: t for q, t, _ in device.RAY_QUESTIONS}
    for name, *_ in device.TARGETS:
        r = next(r for r in rows if (r["name"], r["transport"]) == (name, ours[name]))
        assert r["vs_limit"] > 0 and r["limit"] and r["target"].startswith("<= 1.1x ") and "pass" in r, r
        assert r["limit_method"].split(": ")[0] in ("D2H", "H2D", "production + H2D"), r
    for kind, name in device.LIMIT.items():  # each limit: the fastest copy of its kind, named
        limit = next(r for r in rows if r["name"] == name)
        copies = [r for r in rows if r["name"] == kind]
        assert limit["seconds"] == min(r["seconds"] for r in copies)
        (best,) = [r for r in copies if r["fastest"]]
        assert limit["method"] == f"{kind}: {best['transport']}" and best["seconds"] == limit["seconds"]
    env = data["environment"]
    assert env["device_kind"] and env["device_platform"] == "cpu" and "smoke run" in env["mode"]
    md = (tmp_path / "device.md").read_text()
    assert f"| line | JAX {env['jax']}, " in md and " cores, Python " in md
    assert md.count("\n- PASS ") + md.count("\n- MISS ") == len(device.TARGETS)
    assert md.count("\n- LIMIT ") == 2
    assert "| Pool result | 4 MiB | jaxtransport.Pool (placement=device) |" in md


def _synthetic_rows(failed: str | None = None, rollouts: bool = False) -> list[dict]:
    rows = []
    for i, (name, transport) in enumerate(sorted(MEASURED)):
        if (name, transport) == failed:
            rows.append(device._row(name, 256 << 20, transport, error="RuntimeError: boom"))
        else:
            rows.append(device._row(name, 256 << 20, transport, [0.1 + i / 100, 0.2 + i / 100, 0.3 + i / 100]))
    rows = device.finish(rows)
    if rollouts:  # the demo's two rows (--rollouts)
        for transport, steps, seconds in (("stock", 10_000.0, 0.4), ("jaxtransport", 25_000.0, 0.16)):
            rows.append({"name": "rollouts", "size_bytes": 0, "transport": transport, "seconds": seconds, "runs": 3,
                         "min": seconds, "max": seconds, "env_steps_per_s": steps, "ratio": steps / 10_000.0,
                         "transport_s": seconds / 2})
    return rows


def _results(tmp_path, rows) -> str:
    results = tmp_path / "results"
    results.mkdir()
    env = {"cpus": 13, "mem_total_gib": 40.0, "jax_backend": "tpu", "jax": "0.10.2", "python": "3.11.9",
           "platform": "Linux", "device_kind": "TPU v5 lite", "devices": 1}
    (results / "device.json").write_text(json.dumps({"environment": env, "conditions": {}, "quick": False,
                                                     "generated": "2026-12-06 10:00 UTC", "rows": rows}))
    return str(results)


PAGE = "Intro.\n\n<!-- figures:device begin -->\nstale\n<!-- figures:device end -->\n\nEnd.\n"


def test_the_device_table_renders_from_a_device_json(tmp_path):
    results = _results(tmp_path, _synthetic_rows(rollouts=True))
    page = figures.render_text(PAGE, results)
    table = page.split("<!-- figures:device begin -->\n", 1)[1].split("<!-- figures:device end -->", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(figures.DEVICE_ROWS)  # the header, then one per row
    assert "the device's copies, one 256 MiB float32 array" in table and "the limits: D2H " in table
    assert "`device.json`, 2026-12-06 10:00 UTC; 3 runs, spread " in table
    assert "TPU v5 lite (1 device), TPU JAX 0.10.2" in table and "CPU-only" not in table
    assert figures.render_text(page, results) == page  # rendering is stable: --check passes
    assert not figures.untraced(page)
    for key, fig in figures.FIGURES.items():  # once the file is there, every figure is checked
        if key.startswith("device."):
            assert not figures.absent(fig, results)
            figures.value_text(key, results)
    stock = figures.FIGURES["device.pool_arg.stock.s"].value(results)
    ours = figures.FIGURES["device.pool_arg.jt.s"].value(results)
    assert figures.FIGURES["device.pool_arg.speedup"].value(results) == pytest.approx(stock / ours)


def test_without_device_json_the_table_says_not_measured_yet(tmp_path):
    results = tmp_path / "empty"
    results.mkdir()
    page = figures.render_text(PAGE, str(results))
    assert "Not measured yet: `benchmarks/results/device.json` is not there" in page
    assert figures.render_text(page, str(results)) == page
    assert all(figures.absent(f, str(results)) for k, f in figures.FIGURES.items() if k.startswith("device."))
    assert not figures.absent(figures.FIGURES["pool.arg.1g.ratio"], str(results))
    if not os.path.exists(os.path.join(figures.RESULTS, "device.json")):  # the published state today
        assert "Not measured yet" in figures.render_table("device")


def test_a_row_the_run_failed_to_measure_says_so(tmp_path):
    results = _results(tmp_path, _synthetic_rows(failed=("Queue", "jaxtransport.multiprocessing.Queue")))
    table = figures.render_table("device", results)
    row = "| `jaxtransport.multiprocessing.Queue`: put of a device array, the child's get and ack | not measured: "
    assert row in table
    with pytest.raises(figures.RowFailed, match="boom"):
        figures.FIGURES["device.queue.jt.s"].value(results)
    lines = device.check_targets(json.loads(open(os.path.join(results, "device.json")).read())["rows"])
    assert any(line.startswith("MISS Queue: not measured (RuntimeError: boom)") for line in lines)


def test_rollouts_rows_from_the_probe_output(monkeypatch):
    """The hook for the rollouts demo's row: a child's JSON becomes a row per transport with the
    speedup and whether the learning curves are identical; a failed child, one error row."""
    run = {"seconds": 0.5, "min": 0.4, "max": 0.6, "runs": 4, "returns": [1.0, 2.0], "params_sha256": "ab" * 32,
           "transport_s": 0.1, "param_mb": 32.0, "total_s": 9.0}
    seen = {}

    def probe(kind, args, timeout):
        seen["call"] = (kind, args)
        return {"environment": {}, "runs": {"stock": dict(run, env_steps_per_s=1000.0),
                                            "jaxtransport": dict(run, env_steps_per_s=4000.0)}}

    monkeypatch.setattr(device, "_probe", probe)
    rows = device.rollouts_rows(True, iterations=3)
    assert seen["call"] == ("rollouts", ["--iterations", "3", "--workers", "2"])
    by = {r["transport"]: r for r in rows}
    assert by["jaxtransport"]["ratio"] == 4.0 and by["jaxtransport"]["curves_identical"] is True
    assert any(line.startswith("PASS rollouts: 4,000 env steps/s = 4.00x stock") for line in device.check_targets(rows))
    monkeypatch.setattr(device, "_probe", lambda kind, args, timeout: {"error": "the rollouts probe timed out"})
    assert device.rollouts_rows(True)[0]["error"] == "the rollouts probe timed out"


def test_a_process_that_already_holds_the_device_measures_in_process(monkeypatch):
    """``python -m benchmarks`` may have started JAX on the accelerator before this benchmark:
    no child could open it then, so the probes run in this process."""
    monkeypatch.setattr(device, "_jax_holds_accelerator", lambda: "tpu")
    monkeypatch.setattr(device, "_probe", lambda *a: pytest.fail("a child cannot open a held device"))
    monkeypatch.setattr(device, "probe_transfers", lambda size, runs, allow_cpu: {
        "environment": {"jax": "x"}, "rows": _synthetic_rows()})
    rows = device.run(quick=True)
    assert len(rows) == len(EVERY_ROW)
    assert device.environment_info()["probe"].startswith("in-process")
