"""Release check of what the built distributions carry: run by ``.ci/release-check``.

    python .ci/release_contents.py DIST_DIR

DIST_DIR holds the one sdist and the one wheel that ``python -m build`` made (the wheel built from
the unpacked sdist, so the sdist holds what building needs). Checks, each failure listed:

- the version: the wheel's name and METADATA, the sdist's name and PKG-INFO all say
  ``jaxtransport.__version__`` (read from jaxtransport/__init__.py without importing it);
- the wheel: ``jaxtransport/py.typed``; the licence (``.dist-info/licenses/LICENSE``, the
  repository's bytes, ``License-Expression: Apache-2.0``); every tracked ``jaxtransport/`` file;
  nothing but ``jaxtransport/`` and its ``.dist-info`` (no tests/, benchmarks/, docs/, .venv);
  the README as its long description;
- the sdist: pyproject.toml, README.md, LICENSE, CHANGELOG.md, PKG-INFO and every tracked
  ``jaxtransport/`` file; no tests/, benchmarks/, docs/, .ci/, .venv or build output;
- CHANGELOG.md has a section for this version.
Stdlib only.
"""

from __future__ import annotations

import ast
import email.parser
import glob
import os
import re
import subprocess
import sys
import tarfile
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "jaxtransport"
FORBIDDEN = ("tests/", "benchmarks/", "docs/", ".venv", ".ci/", "build/", "docker/", ".git/")


def source_version() -> str:
    """``__version__`` of jaxtransport/__init__.py, a string literal, read without importing."""
    tree = ast.parse(open(os.path.join(REPO, PACKAGE, "__init__.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("no __version__ literal in jaxtransport/__init__.py")


def tracked_package_files() -> list[str]:
    """The package's files as git tracks them (else as the tree has them), py.typed included."""
    try:
        out = subprocess.run(["git", "ls-files", PACKAGE], cwd=REPO, capture_output=True, text=True, check=True)
        files = out.stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        for base, dirs, names in os.walk(os.path.join(REPO, PACKAGE)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            files += [os.path.relpath(os.path.join(base, n), REPO) for n in names]
    return sorted(f.replace(os.sep, "/") for f in files if f.endswith((".py", "py.typed")))


def main(dist: str) -> int:
    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    version = source_version()
    wheels = glob.glob(os.path.join(dist, "*.whl"))
    sdists = glob.glob(os.path.join(dist, "*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"want one wheel and one sdist in {dist}: {os.listdir(dist)}")
        return 1
    wheel, sdist = wheels[0], sdists[0]
    package_files = tracked_package_files()
    license_bytes = open(os.path.join(REPO, "LICENSE"), "rb").read()
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()

    # the wheel
    check(os.path.basename(wheel).startswith(f"{PACKAGE}-{version}-py3-none-any"), f"wheel name {wheel}")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = f"{PACKAGE}-{version}.dist-info"
        meta_text = zf.read(f"{info}/METADATA").decode() if f"{info}/METADATA" in names else ""
        meta = email.parser.Parser().parsestr(meta_text)
        check(meta["Version"] == version, f"wheel METADATA Version {meta['Version']} != __version__ {version}")
        check(meta["License-Expression"] == "Apache-2.0", f"wheel License-Expression {meta['License-Expression']}")
        check("LICENSE" in (meta.get_all("License-File") or []), "wheel METADATA names no License-File: LICENSE")
        lic = f"{info}/licenses/LICENSE"
        check(lic in names and zf.read(lic) == license_bytes, f"wheel: {lic} missing or not the repository's LICENSE")
        check(f"{PACKAGE}/py.typed" in names, "wheel: jaxtransport/py.typed missing (PEP 561)")
        for f in package_files:
            check(f in names, f"wheel: {f} missing")
        for n in names:
            check(n.startswith((f"{PACKAGE}/", f"{info}/")), f"wheel: {n} is neither the package nor its metadata")
            check(not any(part in n for part in FORBIDDEN) and "__pycache__" not in n, f"wheel: {n} must not ship")
        check(
            meta["Description-Content-Type"] == "text/markdown",
            f"wheel: Description-Content-Type {meta['Description-Content-Type']}",
        )
        check(meta.get_payload().strip() == readme.strip(), "wheel: the long description is not README.md")
    print(f"wheel {os.path.basename(wheel)}: {len(names)} files")

    # the sdist
    top = f"{PACKAGE}-{version}"
    check(os.path.basename(sdist) == f"{top}.tar.gz", f"sdist name {sdist}")
    with tarfile.open(sdist) as tf:
        members = [m.name for m in tf.getmembers() if m.isfile()]
        rel = [m[len(top) + 1 :] for m in members if m.startswith(top + "/")]
        check(all(m.startswith(top + "/") for m in members), "sdist: not everything under " + top)
        for f in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "PKG-INFO", *package_files):
            check(f in rel, f"sdist: {f} missing")
        pkg_info = tf.extractfile(f"{top}/PKG-INFO") if "PKG-INFO" in rel else None
        sdist_version = email.parser.Parser().parsestr(pkg_info.read().decode())["Version"] if pkg_info else None
        check(sdist_version == version, f"sdist PKG-INFO Version {sdist_version} != __version__ {version}")
        if "LICENSE" in rel:
            check(tf.extractfile(f"{top}/LICENSE").read() == license_bytes, "sdist: LICENSE differs")
        for f in rel:
            check(not f.startswith(FORBIDDEN) and "__pycache__" not in f, f"sdist: {f} must not ship")
    print(f"sdist {os.path.basename(sdist)}: {len(members)} files")

    # the changelog
    changelog = open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8").read()
    check(
        re.search(rf"^## \[{re.escape(version)}\]", changelog, re.M) is not None,
        f"CHANGELOG.md has no section for {version}",
    )

    for p in problems:
        print(f"release check: {p}")
    print(
        f"release contents: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'OK'} (version {version})"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIST_DIR")
    sys.exit(main(sys.argv[1]))
