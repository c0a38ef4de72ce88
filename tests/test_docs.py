"""The documentation a clone ships: every relative link resolves to a file inside the repository,
nothing points outside it (a clone has no ../shared or other sibling folders), the site builds
with warnings as errors (``make docs``), and every Python example in it runs."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

# Slow (make test-slow): each example runs in a fresh interpreter; the site is built with Sphinx.
pytestmark = pytest.mark.slow

DOCS = ["README.md"] + sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    if "_build" not in os.path.relpath(p, ROOT).split(os.sep)
)
# [text](target) and ![alt](target), target up to whitespace or ')'; code spans removed first.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def links(text: str) -> list[str]:
    return _LINK.findall(_CODE.sub("", text))


def test_the_docs_exist():
    assert "docs/architecture.md" in DOCS
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "docs/architecture.md" in links(readme)


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve_inside_the_repository(doc):
    text = open(os.path.join(ROOT, doc)).read()
    found = links(text)
    assert found or doc != "README.md"
    root = os.path.realpath(ROOT)
    for target in found:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, in-page anchors
        path = os.path.realpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
        assert os.path.commonpath([root, path]) == root, f"{doc}: {target} leaves the repository"
        assert os.path.exists(path), f"{doc}: {target} does not exist"


@pytest.mark.parametrize("doc", DOCS)
def test_nothing_points_outside_the_repository(doc):
    text = open(os.path.join(ROOT, doc)).read()
    assert "../shared" not in text and "DESIGN.md" not in text, doc
    root = os.path.realpath(ROOT)
    for target in re.findall(r"\]\(\s*(\.\./[^)\s]*)", text):  # ../ links, in code spans too
        path = os.path.realpath(os.path.join(ROOT, os.path.dirname(doc), target.split("#")[0]))
        assert os.path.commonpath([root, path]) == root, f"{doc}: {target} links above the repository root"


def test_link_parser_sees_what_a_renderer_sees():
    text = "a [x](docs/a.md) ![p](b.png) `[no](c.md)` [web](https://e.org) [t](d.md \"title\")"
    assert links(text) == ["docs/a.md", "b.png", "https://e.org", "d.md"]


# --------------------------------------------------------------------------------------------
# the site builds, and its examples run

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
# An example that cannot run here says so, and why, on the line before its fence.
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$")


def examples() -> list:
    found = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = _NOT_RUN.search(before)
            found.append(pytest.param(doc, m.group(1), skip.group(1) if skip else None, id=f"{doc}:{line}"))
    return found


EXAMPLES = examples()


def test_the_site_has_examples_and_every_skip_says_why():
    assert len(EXAMPLES) >= 6
    for p in EXAMPLES:
        reason = p.values[2]
        assert reason is None or len(reason) > 10, p.id


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("doc", "code", "not_run"), EXAMPLES)
def test_example_runs(doc, code, not_run, tmp_path):
    """Each example as a script of its own in a fresh interpreter (spawned workers import it as
    ``__mp_main__``, as they would import the reader's file)."""
    if not_run:
        pytest.skip(f"not runnable here: {not_run}")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, f"{doc}: the example failed\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


_SPHINX = all(importlib.util.find_spec(m) for m in ("sphinx", "myst_parser", "furo"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _SPHINX, reason="sphinx, myst-parser or furo missing: pip install -e '.[docs]'")
def test_the_site_builds_with_warnings_as_errors(tmp_path):
    """What ``make docs`` runs: nitpicky (a missing reference warns), -W (a warning fails)."""
    out = tmp_path / "html"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "-n", "--keep-going", "-q", "docs", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for page in ("index", "getting-started", "api", "guides/pool", "benchmarks"):
        assert (out / f"{page}.html").exists(), page
    api = (out / "api.html").read_text()
    for name in ("jaxtransport.Pool", "jaxtransport.dumps", "jaxtransport.ray.init", "jaxtransport.multiprocessing.Queue"):
        assert f'id="{name}"' in api, name


def test_makefile_builds_the_site_offline_with_warnings_as_errors():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    rule = makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "-W" in rule and "-n" in rule and "docs/_build" in rule, rule
    assert "/docs/_build/" in open(os.path.join(ROOT, ".gitignore")).read()
