"""The package's shape: no import circles (in the package, the benchmarks and the tests), and the
shared layers import nothing above them.

The import graph is read from the source: every ``import``, function-level ones and those under
``if TYPE_CHECKING:`` included. An import made for annotations only runs nowhere, but it still
says that the module knows the other one: a lower part that names the type of the part driving
it is in a circle with it, as structure tools and readers count it. A circle makes the import
order matter and hides which module is the lower layer: ``_engine`` and ``_manager`` once
imported each other (later, the manager named the ``Engine`` for its annotations only); the
manager now takes a ``Books`` protocol of its own. The benchmarks are held to the same rule:
``benchmarks/device.py``, ``run.py`` and ``figures.py`` once imported each other (inside
functions), the figures reading the device rows' names from the benchmark that the runner drives;
the names now live in ``benchmarks/_device_rows.py``, below both.
"""

from __future__ import annotations

import ast
import pathlib

import jaxtransport

from .conftest import ROOT

PKG = pathlib.Path(jaxtransport.__file__).parent

# The packages whose modules may be in no circle: all of them (the OS facilities; shared memory;
# the top level: the codec, the wire encoder; the Pool; the multiprocessing drop-in; the demo).
CHECKED = (
    "jaxtransport",
    "jaxtransport._os",
    "jaxtransport._shm",
    "jaxtransport.pool",
    "jaxtransport.multiprocessing",
    "jaxtransport.rollouts",
    "jaxtransport.joblib",
    "jaxtransport.data",
)
# The layers below the top level, which the top-level modules may import (through each
# package's ``__init__``, its interface): the OS facilities, one interface per facility
# (Note [platforms]), and the shared memory built on them.
LOWER = ("jaxtransport._os", "jaxtransport._shm", "jaxtransport._devices")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p, PKG.parent): p for p in sorted(PKG.rglob("*.py"))}
# Every module of the repository's Python packages, for the circle check: the package, the
# benchmarks (``python -m benchmarks``) and the tests, each importable from the checkout's root.
REPO_PACKAGES = ("benchmarks", "tests")
REPO_MODULES = dict(MODULES)
for _package in REPO_PACKAGES:
    REPO_MODULES.update(
        (_module_name(p, pathlib.Path(ROOT)), p) for p in sorted((pathlib.Path(ROOT) / _package).rglob("*.py"))
    )


def _package_of(name: str, modules: dict[str, pathlib.Path] = MODULES) -> str:
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(tree: ast.AST):
    """Every import node: module level, in functions, and under ``if TYPE_CHECKING:``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def imports_of(name: str, modules: dict[str, pathlib.Path] = MODULES) -> set[str]:
    """The modules of ``modules`` (by default the package's) that ``name`` imports, at run time
    or for annotations only."""
    out: set[str] = set()
    tree = ast.parse(modules[name].read_text(), str(modules[name]))
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = _package_of(name, modules).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = []
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in modules else base)
        out.update(t for t in targets if t in modules and t != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}
REPO_GRAPH = {name: imports_of(name, REPO_MODULES) for name in REPO_MODULES}


def test_the_graph_reader_sees_function_level_and_annotation_only_imports():
    # pool/_worker imports _wire inside a function; the package's __init__ imports its public
    # names' modules only under TYPE_CHECKING (they load lazily).
    assert "jaxtransport._wire" in GRAPH["jaxtransport.pool._worker"]
    assert "jaxtransport.pool._facade" in GRAPH["jaxtransport.pool"]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._engine import Engine\n"
    assert [n.module for n in _imports(ast.parse(source))] == ["typing", "_engine"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # The benchmarks and tests are read too: relative imports inside functions (the runner's
    # page rendering imports the figures when asked), absolute ones from the tests.
    assert "benchmarks.figures" in REPO_GRAPH["benchmarks.run"]
    assert "benchmarks._common" in REPO_GRAPH["benchmarks.device"]
    assert {"benchmarks.run", "tests.conftest"} <= REPO_GRAPH["tests.test_bench_runner"]


def test_the_manager_does_not_know_the_engine():
    """The engine builds the manager; the manager is given what it needs (``Books``), so it
    imports the engine in no form, for annotations neither."""
    assert "jaxtransport.pool._engine" not in GRAPH["jaxtransport.pool._manager"]
    assert "jaxtransport.pool._manager" in GRAPH["jaxtransport.pool._engine"]


def test_no_import_circles():
    circles = [c for c in _cycles(GRAPH) if any(_package_of(m) in CHECKED for m in c)]
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_import_circles_in_the_benchmarks_or_the_tests():
    """The rule of the package holds for the repository's other Python: a benchmark, the runner
    and the page figures, or two test modules, may not import each other (inside functions
    neither); what two of them share lives in a module below both (``benchmarks/_common.py``,
    ``benchmarks/_device_rows.py``, ``tests/conftest.py``)."""
    assert any(m.startswith("benchmarks.") for m in REPO_GRAPH)
    circles = _cycles(REPO_GRAPH)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_shared_layer_imports_nothing_above_it():
    """The top-level modules (codec, the wire encoder the Pool and jaxtransport.multiprocessing
    share) import no subpackage but the lower layers (the OS facilities and shared memory); the
    package's ``__init__`` (whose names load lazily) and the Ray face are the top, not the
    shared layer."""
    top = ("jaxtransport", "jaxtransport.ray")
    upward = {
        (m, t)
        for m in MODULES
        if _package_of(m) == "jaxtransport" and m not in top
        for t in GRAPH[m]
        if _package_of(t) not in ("jaxtransport",) + LOWER
    }
    assert not upward, sorted(upward)


def test_the_lower_layers_import_nothing_above_them():
    """``_os`` (the OS facilities) imports only the error types and itself; ``_shm`` (shared
    memory) only ``_os``, the leaf modules below the codec (``_copies`` for the boundary arrays
    start on, which the codec needs without shared memory), and itself; ``_devices`` (who holds
    which accelerator) only ``_os``, the errors and the JAX compatibility module. So a
    platform's path, and a worker's devices, are chosen below everything that uses them."""
    allowed = {
        "jaxtransport._devices": {"jaxtransport._errors", "jaxtransport._compat", "jaxtransport._os"},
        "jaxtransport._os": {"jaxtransport._errors"},
        "jaxtransport._shm": {
            "jaxtransport._errors",
            "jaxtransport._lockorder",
            "jaxtransport._nojax",
            "jaxtransport._compat",
            "jaxtransport._copies",
            "jaxtransport._os",
        },
    }
    bad = {
        (m, t)
        for m in MODULES
        for pkg, ok in allowed.items()
        if m == pkg or m.startswith(pkg + ".")
        for t in GRAPH[m]
        if not (t == pkg or t.startswith(pkg + ".")) and t not in ok
    }
    assert not bad, sorted(bad)


def test_no_module_outside_os_names_a_platform():
    """Note [platforms]: the OS facilities are chosen by feature detection inside ``_os``;
    no other module tests ``sys.platform`` or reads ``/proc``."""
    offenders = []
    for name, path in MODULES.items():
        if name == "jaxtransport._os" or name.startswith("jaxtransport._os."):
            continue
        text = path.read_text()
        for needle in (
            "sys.platform",
            "/proc/",
            "sched_getaffinity",
            "socket.SOCK_SEQPACKET",
            "memfd_create(",
            "pidfd_open",
        ):
            if needle in text:
                offenders.append((name, needle))
    assert not offenders, offenders


def test_no_package_reaches_into_a_siblings_private_modules():
    """The Pool and jaxtransport.multiprocessing (and the rollouts demo) share code only through
    the layer below them; one may use another's public names (``jaxtransport.multiprocessing``
    builds its ``Pool`` on ``jaxtransport.pool.Pool``), never its private modules."""
    reaches = {
        (m, t)
        for m in MODULES
        for t in GRAPH[m]
        if _package_of(t) not in ("jaxtransport", _package_of(m))
        and t.rpartition(".")[2].startswith("_")
        and MODULES[t].name != "__init__.py"  # a private subpackage's interface (_os, _shm)
    }
    assert not reaches, sorted(reaches)


def test_every_name_a_package_loads_on_first_access_is_defined_where_it_says():
    """The interfaces that import their modules on first access (PEP 562: the top level, the
    Pool, the OS facilities, shared memory) name, for each public name, the module defining it;
    a name in ``__all__`` is either in that table or defined by the interface itself. (Some
    are themselves made on first access: ``_errors``' pool errors.)"""
    import importlib

    tables = {
        "jaxtransport": "_PUBLIC",
        "jaxtransport.pool": "_PUBLIC",
        "jaxtransport._os": "_NAMES",
        "jaxtransport._shm": "_LAZY",
    }
    for package, table in tables.items():
        pkg = importlib.import_module(package)
        lazy = getattr(pkg, table)
        for name, module in lazy.items():
            mod = importlib.import_module(module if module.startswith(".") else f".{module}", package)
            assert hasattr(mod, name), (package, name, module)
        for name in pkg.__all__:
            assert name in lazy or name in vars(pkg), (package, name)
