"""One source per figure: the README's figure table, docs/benchmarks.md's table and every inline
figure agree with the published results files, and no page quotes a measured number that no
results file holds (benchmarks/figures.py). Fast: reads JSON and Markdown only."""

from __future__ import annotations

import json
import os
import re
import shutil
import types

import pytest

from benchmarks import figures
from benchmarks import run as runner

from .conftest import ROOT


def test_every_named_figure_is_exactly_one_row_of_a_published_results_file():
    for key, fig in figures.FIGURES.items():
        if figures.absent(fig):  # an accelerator's results (device.json) not measured yet
            continue
        try:
            figures.value_text(key)  # raises FigureError naming the file and the row
        except figures.RowAbsent:  # a case an accelerator's published runs left out: its table says so
            assert fig.file in figures.ON_DEVICE


@pytest.mark.parametrize("page", figures.pages(ROOT))
def test_page_agrees_with_the_results_files(page):
    text = open(os.path.join(ROOT, page)).read()
    rendered = figures.render_text(text)
    assert rendered == text, (
        f"{page} quotes figures that differ from benchmarks/results/: run `python -m benchmarks.publish`"
    )


@pytest.mark.parametrize("page", figures.pages(ROOT))
def test_page_quotes_no_figure_without_a_source(page):
    found = figures.untraced(open(os.path.join(ROOT, page)).read())
    assert not found, (
        f"{page}: measured-looking numbers outside a figure (tag them <!--fig KEY--> with a key of "
        "benchmarks/figures.py FIGURES, or remove them):\n" + "\n".join(found)
    )


def _block(text: str, name: str) -> str:
    return text.split(f"<!-- figures:{name} begin -->", 1)[1].split(f"<!-- figures:{name} end -->", 1)[0]


def _sections(markdown: str) -> dict[str, str]:
    """``{anchor: text up to the next heading}`` for every heading of a page, anchors as GitHub
    and MyST make them."""
    parts = re.split(r"^(#{1,6} .*)$", markdown, flags=re.M)
    return {figures.slug(h.lstrip("#").strip()): body for h, body in zip(parts[1::2], parts[2::2])}


def test_the_readme_table_is_short_and_links_every_row_to_its_provenance():
    """The README's table has four columns; each row's question links to a heading of
    docs/benchmarks.md whose section gives the row's results file, date, runs, spread and machine."""
    page, block_name = figures.LINKED["readme"]
    assert figures.TABLES[block_name] is figures.TABLES["readme"]
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = _block(readme, "readme")
    lines = [line for line in block.splitlines() if line.startswith("|")]
    assert lines[0] == "| question | stock | jaxtransport | speedup |"
    rows = lines[2:]
    assert len(rows) == len(figures.README_ROWS)
    assert "Machines and conditions" not in block and ".json`" not in block
    target = open(os.path.join(ROOT, page)).read()
    sections = _sections(target)
    headline = _block(target, block_name)
    for line, row in zip(rows, figures.README_ROWS):
        assert line.count(" | ") == 3, line
        link = re.match(r"\| \[.*\]\(" + re.escape(page) + r"#([a-z0-9_-]+)\) \|", line)
        assert link, f"a README row without a link to its provenance on {page}: {line}"
        anchor = link.group(1)
        assert anchor == figures.slug(row.title) and anchor in sections, (anchor, sorted(sections))
        assert f"### {row.title}\n" in headline
        source = sections[anchor]
        assert ".json`, 20" in source and "run" in source and "machine of `" in source, source


def test_the_anchors_are_the_ones_myst_makes():
    """docs/conf.py sets myst_heading_anchors = 3 and no slug function: MyST's GitHub-style slugs."""
    slugs = pytest.importorskip("myst_parser.slugs")
    for row in figures.README_ROWS:
        assert figures.slug(row.title) == slugs.github_slugify(row.title), row.title
    conf = open(os.path.join(ROOT, "docs", "conf.py")).read()
    assert "myst_heading_anchors = 3" in conf and "myst_heading_slug_func" not in conf


def test_a_changed_result_makes_the_pages_stale(tmp_path):
    """The check can fail: change one published value and the README no longer agrees."""
    results = tmp_path / "results"
    shutil.copytree(figures.RESULTS, results, ignore=shutil.ignore_patterns("*.png", "scratch"))
    data = json.loads((results / "pool.json").read_text())
    for row in data["rows"]:
        if row["name"] == "argument" and row["size_bytes"] == 1 << 30 and row["transport"] == "jaxtransport.Pool":
            row["ratio"] *= 2
    (results / "pool.json").write_text(json.dumps(data))
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert figures.render_text(readme, str(results)) != readme
    assert figures.render_text(readme) == readme


def test_untraced_numbers_are_found_outside_figures_and_code():
    text = (
        "It is 3.5x faster, moves 1.2 GB/s and takes 0.45 s (~2 ms).\n"
        "`9.9x in code` and <!--fig pool.arg.1g.ratio-->51x (pool, 2026-12-03)<!--/fig--> are fine; "
        "84x84 frames, threefry2x32, 50 ms and 25% are not measurements.\n"
    )
    found = " ".join(figures.untraced(text))
    for quoted in ("'3.5x'", "'1.2 GB/s'", "'0.45 s'", "'~2'"):
        assert quoted in found
    for fine in ("9.9x", "51x", "84x", "2x32", "50 ms", "25%"):
        assert f"'{fine}'" not in found


def test_an_inline_figure_never_starts_a_line():
    """A line that starts with ``<!--`` is an HTML block in CommonMark (GitHub, MyST): the rest of
    the line would show its Markdown unrendered."""
    found = figures.untraced("some text\n<!--fig pool.arg.1g.ratio-->51x (pool, 2026-12-03)<!--/fig--> `code`\n")
    assert len(found) == 1 and "starts with an inline figure" in found[0]


def test_a_figure_marker_the_renderer_cannot_read_is_found():
    """A key outside [a-z0-9_.] (an upper-case letter) would never be rendered: the page would keep
    whatever text it has, unchecked."""
    found = figures.untraced("a <!--fig platforms.arg_64MiB.ratio-->2x<!--/fig--> b\n")
    assert any("not a figure the renderer reads" in f and "arg_64MiB" in f for f in found), found
    assert not figures.untraced("a <!--fig pool.arg.1g.ratio-->51x (pool, 2026-12-03)<!--/fig--> b\n")


def test_a_missing_row_or_figure_is_an_error_that_names_it():
    with pytest.raises(figures.FigureError, match="no figure named"):
        figures.render_text("<!--fig no.such.figure-->1x<!--/fig-->")
    bad = figures.F("pool", "ratio", "x", name="argument", size=3, transport="jaxtransport.Pool")
    with pytest.raises(figures.FigureError, match="0 rows match"):
        bad.value()


def test_runs_and_spread_are_read_from_every_form_the_benchmarks_store():
    assert figures.spread_of({"seconds": 2.0, "min": 1.0, "max": 3.0}) == 1.0
    assert figures.spread_of({"seconds": 2.0, "spread": 0.5}) == 0.5  # half the range, in seconds
    assert figures.spread_of({"round_ratios": "1.0 2.0 3.0"}) == 1.0
    assert figures.spread_of({"seconds": 1.0}) is None
    assert figures.runs_of({"reps": 7}) == 7 and figures.runs_of({"rounds": 3}) == 3
    assert figures.runs_of({}) is None


def test_the_runner_records_date_conditions_runs_and_spread(tmp_path):
    pytest.importorskip("matplotlib")
    mod = types.ModuleType("fake")
    mod.__doc__ = "fake: a question?"
    rows = [{"name": "a", "size_bytes": 8, "transport": "t", "seconds": 2.0, "min": 1.0, "max": 3.0, "reps": 5}]
    before, after = {"loadavg": 0.5, "memcpy_gbps": 10.0, "usable_cores": 2}, {"loadavg": 0.7}
    runner.write_outputs("fake", mod, rows, str(tmp_path), 1.0, False, before=before, after=after)
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["generated"].endswith("UTC")
    assert data["conditions"] == {"loadavg_before": 0.5, "loadavg_after": 0.7, "memcpy_gbps": 10.0,
                                  "usable_cores": 2}
    assert data["rows"][0]["spread_pct"] == 100.0 and data["rows"][0]["reps"] == 5
    cond = runner.conditions()
    assert set(cond) == {"usable_cores", "loadavg", "memcpy_gbps"}
