"""Every ``make`` target that the README and docs/getting-started.md name works as the first
command on a fresh clone: what it imports is installed by the extras its stamp installs
(issue #43).

One virtualenv serves every target, each filling it with its own extras (Makefile: ``STAMP``,
``DEMO_STAMP``, ``BENCH_STAMP``, ``LINT_STAMP``, ``DOCS_STAMP``, and the range venvs' install).
A target run after another finds that one's packages too, so a missing extra shows only on a
fresh clone: ``make docs`` first failed with ``No module named 'joblib'`` while CI, which runs
``make lint`` first in the same ``.venv``, never saw it. This test reads the Makefile and
pyproject.toml and checks, without installing anything:

- which extras each target's prerequisites install (``pip install -e '.[a,b]'``);
- what the target runs (its recipe): ``-m sphinx`` loads docs/conf.py, its extensions and theme,
  and the module of every object the pages autodoc; ``-m pytest`` the test files (the range
  targets: ``RANGE_TESTS``); ``-m benchmarks`` every file in benchmarks/ (every benchmark runs,
  function bodies included); ``-m jaxtransport.rollouts`` the demo's modules; ``$(VENV)/bin/X``
  the tool ``X``;
- the third-party modules those import when they run: module-level imports, followed through
  the repository's own modules (function bodies only for benchmarks/), leaving out imports under
  ``if TYPE_CHECKING:`` and optional ones (``try: import x`` / ``except ImportError:`` that does
  not raise again);
- that each such module's distribution is among the target's requirements (the project's
  dependencies and the extras, with what they require in turn, read from the installed
  packages' metadata).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import inspect
import os
import re
import sys
from functools import cache

import pytest

from .conftest import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the main venv)
requirements = pytest.importorskip("packaging.requirements")
utils = pytest.importorskip("packaging.utils")

PAGES = ("README.md", os.path.join("docs", "getting-started.md"))
FIRST_PARTY = ("jaxtransport", "benchmarks", "tests")


# -- the Makefile


@cache
def makefile() -> tuple[dict, dict]:
    """``(variables, rules)``: ``rules[target] = (prerequisites, recipe lines)``, with ``$(VAR)``
    expanded and the range venvs' ``$(eval $(call range_venv,...))`` rules made."""
    text = open(os.path.join(ROOT, "Makefile")).read().replace("\\\n", " ")
    variables: dict[str, str] = {}
    rules: dict[str, tuple[list[str], list[str]]] = {}
    defines: dict[str, list[str]] = {}
    lines = text.splitlines()
    i = 0
    current: list[str] | None = None
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("define "):
            name, body = line.split()[1], []
            while not lines[i].startswith("endef"):
                body.append(lines[i])
                i += 1
            i += 1
            defines[name] = body
            current = None
            continue
        if line.startswith("\t"):
            if current is not None:
                current.append(line.strip())
            continue
        current = None
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(:=|\?=|=)\s*(.*)$", line)
        if m:
            variables.setdefault(m.group(1), m.group(3).strip())
            continue
        m = re.match(r"^\$\(eval \$\(call (\w+),([^)]*\)?[^,]*),", line)
        if m and m.group(1) in defines:
            body = defines[m.group(1)]
            target = body[0].split(":", 1)[0].replace("$(1)", m.group(2))
            prereqs = body[0].split(":", 1)[1].split()
            rules[target] = (prereqs, [b.strip().replace("$(1)", m.group(2)) for b in body[1:]])
            continue
        m = re.match(r"^([^\s:=#][^:=]*):(?!=)\s*([^|]*)(?:\|\s*(.*))?$", line)
        if m:
            prereqs = m.group(2).split() + (m.group(3) or "").split()
            for target in m.group(1).split():
                current = []
                rules[target] = (prereqs, current)

    def expand(s: str, depth: int = 0) -> str:
        if depth > 10:
            return s
        out = re.sub(r"\$\((\w+)\)", lambda v: expand(variables.get(v.group(1), v.group(0)), depth + 1), s)
        return out

    expanded = {
        expand(t): ([expand(p) for p in pre], [expand(r) for r in recipe]) for t, (pre, recipe) in rules.items()
    }
    return {k: expand(v) for k, v in variables.items()}, expanded


def named_targets() -> list[str]:
    """The targets the README and docs/getting-started.md tell a reader to run."""
    _, rules = makefile()
    named = set()
    for page in PAGES:
        named.update(re.findall(r"\bmake ([a-z][a-z-]*)\b", open(os.path.join(ROOT, page)).read()))
    return sorted(t for t in named if t in rules)


def installed_extras(target: str) -> set[str] | None:
    """The extras the project is installed with before ``target`` runs (its prerequisites,
    recursively); None when none of them installs the project."""
    _, rules = makefile()
    extras: set[str] | None = None
    todo, seen = [target], set()
    while todo:
        t = todo.pop()
        if t in seen or t not in rules:
            continue
        seen.add(t)
        prereqs, recipe = rules[t]
        todo.extend(prereqs)
        for line in recipe:
            m = re.search(r"-e\s+'?\.(?:\[([^\]]*)\])?'?(?:\s|$)", line)
            if m:
                extras = (extras or set()) | {e.strip() for e in (m.group(1) or "").split(",") if e.strip()}
    return extras


# -- what a target runs


def _test_files(recipe_line: str) -> list[str]:
    variables, _ = makefile()
    if "tests/" in recipe_line:  # RANGE_TESTS and PLATFORM_TESTS arrive expanded
        files = [w for w in recipe_line.split() if w.startswith("tests/") and w.endswith(".py")]
    else:
        files = sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_"))
    return files + ["tests/conftest.py", "tests/__init__.py"]


def _docs_modules() -> list[str]:
    """docs/conf.py and the module of every object the pages document with autodoc."""
    modules = ["docs.conf"]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for f in files:
            if f.endswith(".md"):
                text = open(os.path.join(folder, f)).read()
                for name in re.findall(r"^\.\. auto\w+:: ([\w.]+)", text, re.M):
                    modules.append(_defining_module(name))
    return modules


def _defining_module(name: str) -> str:
    """The module that defines ``name`` (what autodoc imports), resolved as autodoc does."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        holder = obj.__name__
        for attr in parts[i:]:
            obj = getattr(obj, attr)
            if inspect.ismodule(obj):
                holder = obj.__name__
        if inspect.isclass(obj) or inspect.isroutine(obj):
            return obj.__module__
        return holder  # data: the module that holds it
    raise AssertionError(f"{name} cannot be imported")


def _conf_loads() -> set[str]:
    """What Sphinx imports for docs/conf.py: its extensions and its HTML theme."""
    tree = ast.parse(open(os.path.join(ROOT, "docs", "conf.py")).read())
    out = {"sphinx"}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if names & {"extensions", "html_theme"} and node.value is not None:
                value = ast.literal_eval(node.value)
                out.update([value] if isinstance(value, str) else value)
    return out


def what_runs(target: str) -> tuple[list[tuple[str, bool]], set[str]]:
    """``(modules, third-party modules)``: the repository's modules ``target`` runs, each with
    whether its function bodies run too, and what it loads by name (tools, Sphinx's extensions)."""
    _, rules = makefile()
    modules: list[tuple[str, bool]] = []
    loads: set[str] = set()
    for line in rules[target][1]:
        for tool in re.findall(r"/bin/([A-Za-z]\w*)\b", line):
            if tool != "python":
                loads.add(tool)
        m = re.search(r"/bin/python\S*\s+-m\s+([\w.]+)", line)
        if not m:
            continue
        entry = m.group(1)
        if entry == "sphinx":
            loads |= _conf_loads()
            modules += [(mod, False) for mod in _docs_modules()]
        elif entry == "pytest":
            loads.add("pytest")
            modules += [(f[:-3].replace("/", "."), False) for f in _test_files(line)]
        elif entry == "benchmarks":  # every benchmark runs: their function bodies too
            files = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))
            modules += [(f"benchmarks.{f[:-3]}", True) for f in files]
        elif entry.split(".")[0] in FIRST_PARTY:
            modules.append((entry + (".__main__" if _is_package(entry) else ""), False))
        else:
            loads.add(entry)
    return modules, loads


# -- imports, statically


def _file(module: str) -> str | None:
    base = os.path.join(ROOT, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def _is_package(module: str) -> bool:
    return os.path.exists(os.path.join(ROOT, *module.split("."), "__init__.py"))


def _optional(node: ast.Try) -> bool:
    """A ``try`` whose ImportError handler does not raise again: its imports are optional."""
    for handler in node.handlers:
        caught = handler.type
        names = (
            {n.id for n in caught.elts if isinstance(n, ast.Name)}
            if isinstance(caught, ast.Tuple)
            else {caught.id}
            if isinstance(caught, ast.Name)
            else set()
        )
        if names & {"ImportError", "ModuleNotFoundError", "Exception"}:
            return not any(isinstance(n, ast.Raise) for n in ast.walk(handler))
    return False


def imports_of(module: str, functions: bool) -> set[str]:
    """The absolute module names ``module``'s file imports when it runs (see the docstring)."""
    path = _file(module)
    if path is None:
        return set()
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if functions:
                    visit(node.body if isinstance(node.body, list) else [node.body])
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Try) and _optional(node):
                visit(node.orelse + node.finalbody)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    name = f"{base}.{node.module}" if node.module else base
                else:
                    name = node.module or ""
                found.add(name)
                found.update(f"{name}.{alias.name}" for alias in node.names if _file(f"{name}.{alias.name}"))
            visit(list(ast.iter_child_nodes(node)))

    visit(ast.parse(open(path).read()).body)
    return found


def third_party_imports(modules: list[tuple[str, bool]]) -> dict[str, str]:
    """``{top-level third-party module: a repository module that imports it}`` for ``modules``
    and the repository modules they import (module level), followed to the end."""
    out: dict[str, str] = {}
    todo = list(modules)
    seen: set[str] = set()
    while todo:
        module, functions = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [(".".join(parts[:i]), False) for i in range(1, len(parts))]  # its packages run first
        for name in imports_of(module, functions):
            top = name.split(".")[0]
            if top in FIRST_PARTY or top == "docs":
                todo.append((name, False))
            elif top not in sys.stdlib_module_names and top != "__future__":
                out.setdefault(top, module)
    return out


# -- requirements


def _canon(name: str) -> str:
    return utils.canonicalize_name(name)


@cache
def distributions_of(module: str) -> frozenset[str]:
    """The distributions that provide top-level ``module`` (its own name where none installed
    here does)."""
    return frozenset(_canon(d) for d in md.packages_distributions().get(module, [module]))


def covered(extras: set[str]) -> set[str]:
    """The distributions installing the project with ``extras`` brings: its dependencies, the
    extras' requirements, and theirs in turn (from the installed packages' metadata)."""
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    out: set[str] = set()
    todo = [requirements.Requirement(r) for r in reqs]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req = todo.pop()
        key = (_canon(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        out.add(key[0])
        try:
            requires = md.distribution(req.name).requires or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            sub = requirements.Requirement(line)
            wanted = sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (req.extras or {""}))
            if wanted:
                todo.append(sub)
    return out


# -- the tests


def test_the_pages_name_the_targets_a_reader_runs_first():
    assert {"demo", "test", "test-slow", "docs", "lint", "bench"} <= set(named_targets()), named_targets()


@pytest.mark.parametrize("target", named_targets())
def test_each_named_target_installs_what_it_imports(target):
    extras = installed_extras(target)
    modules, loads = what_runs(target)
    if not modules and not loads:
        return  # it runs nothing of its own (``make venv``: it only installs)
    assert extras is not None, f"make {target} runs {modules or loads} but installs no jaxtransport"
    have = covered(extras)
    needed = {top: f"{module} imports it" for top, module in third_party_imports(modules).items()}
    needed.update({name: f"{target} runs it" for name in loads if name.split(".")[0] not in sys.stdlib_module_names})
    missing = {
        top: why for top, why in needed.items() if not distributions_of(top.split(".")[0]) & have
    }
    assert not missing, (
        f"make {target} installs jaxtransport with extras {sorted(extras)}, which do not bring "
        + "; ".join(f"{top!r} ({why})" for top, why in sorted(missing.items()))
        + f". Add the extra that provides it to the pip install of make {target}'s stamp in the "
        "Makefile (or to that extra in pyproject.toml), so that it works as the first command on a "
        "fresh clone."
    )
