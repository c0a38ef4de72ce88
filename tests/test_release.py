"""Release hygiene (issue 43): the version lives in one place and every other place agrees, and
the release check (``make release-check``, .ci/release-check) finds a distribution that carries
the wrong things. The check itself (build, install into a clean virtualenv, smoke script) runs in
CI as its own step; here only its contents check, on distributions made up in a temporary folder.
Fast: no build, no JAX."""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import runpy
import subprocess
import tarfile
import zipfile

import pytest

import jaxtransport

from .conftest import ROOT


def _source_version() -> str:
    tree = ast.parse(open(os.path.join(ROOT, "jaxtransport", "__init__.py")).read())
    found = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets)
    ]
    assert len(found) == 1 and isinstance(found[0], ast.Constant), "__version__ must be one string literal"
    return found[0].value


VERSION = _source_version()


def test_the_version_is_a_literal_in_the_package_and_pyproject_reads_it_from_there():
    """setuptools reads ``attr:`` statically (ast) when the assignment is a literal: building
    needs no JAX."""
    tomllib = pytest.importorskip("tomllib")
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.dev\d+)?", VERSION), VERSION
    assert jaxtransport.__version__ == VERSION
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pyproject = tomllib.load(f)
    assert "version" not in pyproject["project"], "pyproject.toml must not copy the version"
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jaxtransport.__version__"}


def test_the_docs_and_the_changelog_agree_with_the_version():
    conf = runpy.run_path(os.path.join(ROOT, "docs", "conf.py"))
    assert conf["release"] == conf["version"] == VERSION
    changelog = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    releases = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert releases and releases[0] == VERSION, f"CHANGELOG.md's newest section is {releases[:1]}, not {VERSION}"
    top = changelog.split(f"## [{VERSION}]", 1)[1].split("\n## ", 1)[0]
    assert "FORMAT_VERSION" in top, "the release's section says which array format it writes and reads"


def _tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        pytest.skip("not a git checkout")
    suffixes = (".py", ".toml", ".cfg", ".txt", ".md", ".yaml", ".yml", ".in", ".ini")
    return [f for f in files if f.endswith(suffixes) or os.path.basename(f).startswith("Dockerfile")]


def test_no_other_file_copies_the_version():
    """A second ``version = "x.y.z"`` would drift: every other place reads ``__version__``."""
    assignment = re.compile(r"""version\s*[:=]\s*["']""" + re.escape(VERSION) + r"""["']""", re.I)
    copies = [
        f
        for f in _tracked_text_files()
        if f != "jaxtransport/__init__.py"
        and os.path.exists(os.path.join(ROOT, f))
        and assignment.search(open(os.path.join(ROOT, f), errors="replace").read())
    ]
    assert not copies, f"these files copy the version {VERSION}: {copies}"


# --------------------------------------------------------------------------------------------
# the contents check (.ci/release_contents.py) on made-up distributions


def _contents_module():
    spec = importlib.util.spec_from_file_location("release_contents", os.path.join(ROOT, ".ci", "release_contents.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _make_dist(path, *, version=VERSION, drop=(), extra=()):
    """A wheel and an sdist as ``python -m build`` lays them out, from the checkout's files."""
    rc = _contents_module()
    read = lambda rel: open(os.path.join(ROOT, rel), "rb").read()  # noqa: E731
    readme = read("README.md").decode()
    info = f"jaxtransport-{version}.dist-info"
    metadata = (
        f"Metadata-Version: 2.4\nName: jaxtransport\nVersion: {version}\nLicense-Expression: Apache-2.0\n"
        f"License-File: LICENSE\nDescription-Content-Type: text/markdown\n\n{readme}"
    )
    wheel = {f: read(f) for f in rc.tracked_package_files()}
    wheel[f"{info}/METADATA"] = metadata.encode()
    wheel[f"{info}/licenses/LICENSE"] = read("LICENSE")
    top = f"jaxtransport-{version}"
    sdist = {
        f: read(f) for f in (*rc.tracked_package_files(), "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md")
    }
    sdist["PKG-INFO"] = metadata.encode()
    for name in extra:
        (sdist if name.startswith("sdist:") else wheel)[name.split(":", 1)[-1]] = b""
    for name in drop:
        (sdist if name.startswith("sdist:") else wheel).pop(name.split(":", 1)[-1])
    path.mkdir()
    with zipfile.ZipFile(path / f"jaxtransport-{version}-py3-none-any.whl", "w") as zf:
        for name, data in wheel.items():
            zf.writestr(name, data)
    with tarfile.open(path / f"{top}.tar.gz", "w:gz") as tf:
        for name, data in sdist.items():
            member = tarfile.TarInfo(f"{top}/{name}")
            member.size = len(data)
            tf.addfile(member, io.BytesIO(data))
    return str(path)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({}, None),
        ({"drop": ["jaxtransport/py.typed"]}, "py.typed"),
        ({"drop": [f"jaxtransport-{VERSION}.dist-info/licenses/LICENSE"]}, "LICENSE"),
        ({"extra": ["tests/test_codec.py"]}, "tests/test_codec.py"),
        ({"extra": ["benchmarks/figures.py"]}, "benchmarks/figures.py"),
        ({"drop": ["jaxtransport/_codec.py"]}, "jaxtransport/_codec.py missing"),
        ({"drop": ["sdist:CHANGELOG.md"]}, "sdist: CHANGELOG.md missing"),
        ({"drop": ["sdist:LICENSE"]}, "sdist: LICENSE missing"),
        ({"extra": ["sdist:tests/conftest.py"]}, "sdist: tests/conftest.py"),
        ({"version": "9.9.9"}, "!= __version__"),
    ],
)
def test_the_contents_check_finds_what_a_release_must_or_must_not_carry(tmp_path, capsys, change, problem):
    dist = _make_dist(tmp_path / "dist", **change)
    status = _contents_module().main(dist)
    out = capsys.readouterr().out
    if problem is None:
        assert status == 0, out
    else:
        assert status == 1 and problem in out, out


def test_ci_runs_the_release_check_and_the_smoke_script_is_a_real_script():
    assert "make release-check" in open(os.path.join(ROOT, ".ci", "run")).read()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert "\nrelease-check:\n\tPYTHON=$(PYTHON) .ci/release-check\n" in makefile
    script = open(os.path.join(ROOT, ".ci", "release-check")).read()
    assert "python -m build" in script or "-m build" in script
    assert "mktemp" in script and 'cd "$work/run"' in script and "env -u PYTHONPATH" in script
    smoke = open(os.path.join(ROOT, ".ci", "release_smoke.py")).read()
    assert 'if __name__ == "__main__":' in smoke
    for needed in ("jt.register()", "jt.dumps", "pool.map", 'get_context("spawn")', "jaxtransport.joblib", "purelib"):
        assert needed in smoke, needed
