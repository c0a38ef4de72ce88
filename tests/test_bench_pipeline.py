"""benchmarks/pipeline.py without measuring: the accelerator host's runs (one worker count per
command) merge into one results file that the device table of docs/guides/input-pipelines.md
renders from, and the merge refuses worker counts measured twice. Fast: JSON only."""

from __future__ import annotations

import json

import pytest

from benchmarks import figures, pipeline


def _run_file(path, workers: int, one: bool) -> str:
    def row(transport, w, bps):
        return {"name": "pipeline", "transport": transport, "workers": w, "size_bytes": 0, "seconds": 1 / bps,
                "min": 0.9 / bps, "max": 1.1 / bps, "runs": 3, "batches_per_s": bps, "limit": 10.0 * w,
                "vs_limit": bps / (10.0 * w), "wait_share": 0.01, "wait_share_balanced": 0.02, "cores_busy": 1.0,
                "batches_per_core_s": bps, "peak_rss_mib": 500.0, "peak_rss_tree_mib": 900.0, "shm_left": 0,
                "leak_warnings": 0}

    rows = [row(pipeline.JT, workers, 9.5 * workers), row(pipeline.GRAIN, workers, 5.0 * workers)]
    rows += [row(pipeline.ONE, 1, 10.0)] if one else []
    rows.append({"name": "pipeline", "transport": "limit", "workers": workers, "size_bytes": 0,
                 "batches_per_s": 10.0 * workers, "seconds": 0.1 / workers, "runs": 3})
    data = {"environment": {"cpus": 13, "jax_backend": "tpu", "device_kind": "TPU v5 lite", "devices": 1},
            "conditions": {}, "quick": False, "seconds": 60.0, "generated": "2026-12-06 14:00 UTC", "rows": rows}
    out = path / f"pipeline_device-{workers}.json"
    out.write_text(json.dumps(data))
    return str(out)


def test_the_runs_of_each_worker_count_merge_into_the_device_table(tmp_path):
    runs = [_run_file(tmp_path, 2, True), _run_file(tmp_path, 6, False), _run_file(tmp_path, 12, False)]
    results = tmp_path / "results"
    pipeline._merge(runs, str(results), "pipeline_device")
    merged = json.loads((results / "pipeline_device.json").read_text())["rows"]
    jt12 = next(r for r in merged if r["transport"] == pipeline.JT and r["workers"] == 12)
    assert jt12["vs_grain"] == pytest.approx(1.9)
    table = figures.render_table("pipeline_device", str(results))
    assert "Not measured yet" not in table and "1.90x Grain" in table, table
    assert "114 batches/s (95% of the limit)" in table, table  # 12 workers: 9.5 x 12 against 120
    with pytest.raises(SystemExit, match="already"):
        pipeline._merge(runs + [runs[1]], str(tmp_path / "again"), "pipeline_device")


def test_without_the_device_file_the_table_says_how_to_make_it(tmp_path):
    table = figures.render_table("pipeline_device", str(tmp_path))
    assert "Not measured yet" in table and "device_pipeline.sh" in table


def test_a_worker_count_the_published_runs_left_out_says_so_in_its_row(tmp_path):
    """Only 12 workers ran (one device command each; the session's time ran out before 2 and 6):
    those rows say they were not measured, the 12 workers' row has its figures."""
    results = tmp_path / "results"
    pipeline._merge([_run_file(tmp_path, 12, False)], str(results), "pipeline_device")
    table = figures.render_table("pipeline_device", str(results))
    lines = table.splitlines()
    for n in (2, 6):
        row = next(line for line in lines if line.startswith(f"| batches/s, {n} workers"))
        assert "not measured: the published runs did not run this case" in row, row
    assert "114 batches/s (95% of the limit)" in table, table


@pytest.mark.parametrize(("drift", "said"), [(0.02, False), (0.25, True), (-0.2, True), (None, False)])
def test_a_wait_verdict_says_when_the_machine_changed_speed_during_the_run(drift, said):
    """The calibration runs again after the rounds: when one process's batch took a tenth more or
    less time than at the start, the balanced step (sized from the start's) was not the batch
    time, and the wait verdict says so."""
    rows = [{"name": "pipeline", "transport": pipeline.JT, "workers": 2, "batches_per_s": 6.0, "vs_limit": 0.75,
             "wait_share_balanced": 0.2, "shm_left": 0, "leak_warnings": 0},
            {"name": "pipeline", "transport": "limit", "workers": 2, "batches_per_s": 8.0}]
    if drift is not None:
        rows[1]["calibration_drift"] = drift
    line = next(x for x in pipeline.check_targets(rows) if "balanced" in x or "as long as a batch" in x)
    assert line.startswith("MISS") and ("calibration moved" in line) == said, line


def test_a_merged_file_flags_only_the_run_whose_machine_changed_speed():
    """Each worker count of a merged file is its own run: its limit row's drift marks its verdict only."""
    rows = []
    for n, drift in ((2, 0.3), (6, 0.01)):
        rows += [{"name": "pipeline", "transport": pipeline.JT, "workers": n, "batches_per_s": 6.0, "vs_limit": 0.75,
                  "wait_share_balanced": 0.2, "shm_left": 0, "leak_warnings": 0},
                 {"name": "pipeline", "transport": "limit", "workers": n, "batches_per_s": 8.0,
                  "calibration_drift": drift}]
    lines = [x for x in pipeline.check_targets(rows) if "as long as a batch" in x]
    assert ["calibration moved" in x for x in lines] == [True, False], lines
