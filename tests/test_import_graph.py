"""No import circles among the modules of ``jaxtransport.multiprocessing``, ``jaxtransport.rollouts``
and the top-level ``jaxtransport/*.py``.

The graph is read from the source (``ast``), not from an import: every ``import`` counts, at
module level, inside a function (a lazy import) or under ``if TYPE_CHECKING:`` (a circle through
annotations is still a circle a reader has to untangle). ``from package import name`` is an edge
to the submodule ``package.name`` when there is one, else to ``package`` itself; a module's
implicit import of its own parent packages is not an edge.

A circle is a strongly connected component of more than one module. One that contains any module
of the folders above fails; ``jaxtransport/pool/`` has its own check.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from .conftest import ROOT

PACKAGE = "jaxtransport"
CHECKED = ("jaxtransport.multiprocessing", "jaxtransport.rollouts")


def modules(root: pathlib.Path, package: str) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's ``__init__``), for every module of ``package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its source."""
    mods = modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in mods.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in mods]
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(target)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def checked(module: str) -> bool:
    """The package itself, its top-level modules, and everything under CHECKED."""
    if module.count(".") <= 1 and module != "jaxtransport.pool":
        return True
    return any(module == c or module.startswith(c + ".") for c in CHECKED)


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    return "\n".join(f"  {m} imports {sorted(graph[m] & members)}" for m in component)


def test_no_import_circle_outside_pool():
    graph = import_graph(pathlib.Path(ROOT), PACKAGE)
    bad = [c for c in circles(graph) if any(checked(m) for m in c)]
    assert not bad, "import circles (move what both sides need into a module both import from below):\n" + "\n".join(
        describe(graph, c) for c in bad
    )


def test_the_graph_sees_lazy_and_type_checking_imports():
    # Guards the reader above: _cli imports _atari only inside functions, and _context imports
    # the Pool's package only inside JaxContext.Pool and under TYPE_CHECKING.
    graph = import_graph(pathlib.Path(ROOT), PACKAGE)
    assert "jaxtransport.rollouts._atari" in graph["jaxtransport.rollouts._cli"]
    assert "jaxtransport.pool" in graph["jaxtransport.multiprocessing._context"]
    assert "jaxtransport._nojax" in graph["jaxtransport.multiprocessing._sockets"]


@pytest.mark.parametrize(
    "where",
    ["module level", "in a function", "under TYPE_CHECKING"],
)
def test_a_circle_is_found(tmp_path, where):
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from ._a import A\n")
    importer = {
        "module level": "from . import _a\n",
        "in a function": "def f():\n    from ._a import A\n    return A\n",
        "under TYPE_CHECKING": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import _a\n",
    }[where]
    (pkg / "sub" / "_b.py").write_text(importer)
    (pkg / "sub" / "_a.py").write_text("from demo.sub._b import f\nA = 1\n")
    assert circles(import_graph(tmp_path, "demo")) == [["demo.sub._a", "demo.sub._b"]]


def test_a_package_and_its_parents_are_no_circle(tmp_path):
    # A submodule reading a sibling through its package's name, and the package importing
    # its submodules, is Python's ordinary package layout.
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._a import A as A\nfrom ._b import B as B\n")
    (pkg / "_a.py").write_text("A = 1\n")
    (pkg / "_b.py").write_text("from . import _a\nB = _a.A\n")
    assert circles(import_graph(tmp_path, "demo")) == []
