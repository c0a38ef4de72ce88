"""benchmarks/run.py: tables and plots from any module's rows; a broken module never stops it."""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("matplotlib")

from benchmarks import run as runner  # noqa: E402


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__doc__ = f"{name}: what does it cost?\n\nMore words."
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def _rows(quick: bool = False) -> list[dict]:
    rows = []
    for size in (1 << 10, 1 << 20, 1 << 26):
        for transport, gbps in (("stock", 0.1), ("jaxtransport", 5.0)):
            rows.append({"name": "argument", "size_bytes": size, "transport": transport,
                         "seconds": size / gbps / 1e9, "gbps": gbps, "ratio": gbps / 0.1,
                         "note": "a|b"})
    rows.append({"name": "tiny", "size_bytes": 8, "transport": "stock", "seconds": 1e-4})
    return rows


def _fail(quick: bool = False):
    raise RuntimeError("benchmark exploded")


@pytest.fixture
def fake_benchmarks(monkeypatch):
    mods = {
        "fakebench_good": _module("fakebench_good", run=_rows,
                                  check_targets=lambda rows: ["PASS argument: 50x stock"]),
        "fakebench_raises": _module("fakebench_raises", run=_fail),
        "fakebench_norun": _module("fakebench_norun"),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(runner, "BENCHMARKS", (
        ("good", "fakebench_good"),
        ("raises", "fakebench_raises"),
        ("norun", "fakebench_norun"),
        ("missing", "fakebench_does_not_exist"),
    ))


def test_runner_writes_tables_and_plots_and_survives_broken_modules(
        fake_benchmarks, tmp_path, capsys):
    assert runner.main(["--quick", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "benchmark exploded" in err
    assert "has no run(quick)" in err
    assert "cannot import fakebench_does_not_exist" in err
    assert "failed or skipped: raises, norun, missing" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json", "good.md", "good.png"]
    md = (tmp_path / "good.md").read_text()
    assert "fakebench_good: what does it cost?" in md
    assert "| cpus |" in md and "| jax |" in md  # the environment
    assert "- PASS argument: 50x stock" in md
    assert "![good](good.png)" in md
    assert "| name | size_bytes | transport | seconds | gbps | ratio | note |" in md
    assert "| argument | 64 MiB | jaxtransport |" in md
    assert "a\\|b" in md  # cells cannot break the table
    assert (tmp_path / "good.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_selects_and_replot_rewrites_from_saved_rows(fake_benchmarks, tmp_path):
    assert runner.main(["--only", "good", "--out", str(tmp_path)]) == 0
    md = tmp_path / "good.md"
    first = md.read_text()
    md.unlink()
    (tmp_path / "good.png").unlink()
    sys.modules["fakebench_good"].run = _fail  # --replot measures nothing
    assert runner.main(["--only", "good", "--replot", "--out", str(tmp_path)]) == 0
    assert md.read_text().split("## Environment")[1] == first.split("## Environment")[1]
    assert (tmp_path / "good.png").exists()


def test_limit_only_group_is_drawn_in_the_other_panels(tmp_path, monkeypatch):
    drawn = []
    import matplotlib.axes

    orig = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((self.get_title(), kwargs.get("label")))
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    rows = _rows() + [{"name": "memcpy", "size_bytes": s, "transport": "memcpy", "gbps": 10.0}
                      for s in (1 << 10, 1 << 20, 1 << 26)]
    assert runner.plot("m", _module("m"), rows, str(tmp_path / "m.png"))
    labels = [label for _, label in drawn]
    assert labels.count("warm memcpy (limit)") == 1  # in the "argument" panel, measured once
    assert sorted(labels) == ["jaxtransport", "stock", "warm memcpy (limit)"]


def test_plot_skips_rows_without_a_size_sweep(tmp_path):
    mod = _module("m")
    rows = [{"name": "broadcast", "size_bytes": 1 << 20, "transport": t, "gbps": 1.0}
            for t in ("a", "b")]
    assert not runner.plot("m", mod, rows, str(tmp_path / "m.png"))
    assert not (tmp_path / "m.png").exists()
