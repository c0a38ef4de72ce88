"""Sphinx configuration of the jaxtransport documentation (``make docs``).

Why Sphinx with MyST: the pages stay Markdown (the README's dialect, readable on GitHub), the API
reference comes from the docstrings through autodoc, and nitpicky mode with ``-W`` turns a broken
link or a missing reference into a failed build. JAX, flax and optax build their sites the same
way, so the reference looks like the ones jaxtransport's users already read.

The build is offline: no intersphinx (it downloads inventories). References into other projects
(``numpy.ndarray``, ``jax.Array``, ``concurrent.futures.Future``) therefore cannot resolve and are
listed in ``nitpick_ignore_regex``; every reference to jaxtransport's own objects must resolve.

Every ```python`` example in these pages (and in the README) runs in the test suite as a script
of its own (tests/test_docs.py). One that cannot run there says why on the line before its
fence: ``<!-- not run: it joins an existing Ray cluster -->`` (an HTML comment: not rendered).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the checkout's jaxtransport, installed or not

project = "jaxtransport"
author = "jaxtransport contributors"
copyright = "2026, jaxtransport contributors"
# The version lives in jaxtransport/__init__.py only (importing jaxtransport imports no JAX).
release = version = importlib.import_module("jaxtransport").__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "jaxtransport"
html_static_path: list[str] = []

nitpicky = True
autodoc_member_order = "bysource"
add_module_names = False
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Names from other projects (not resolvable offline) and the builtins' own docs.
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(jax|jaxlib|numpy|np|ray|cloudpickle|concurrent|collections|typing|types|multiprocessing|"
        r"socket|threading|queue|pickle|io|os|asyncio|weakref|mmap|ctypes|ml_dtypes|joblib|diskcache)(\..*)?",
    ),
    (
        r"py:.*",
        r"(Any|Callable|Iterable|Iterator|Sequence|Mapping|MutableMapping|Hashable|SupportsIndex|"
        r"TracebackType|FrameType|Future|SyncManager|BaseContext|BaseProcess)",
    ),
    (
        r"py:.*",
        r"(int|float|str|bytes|bytearray|memoryview|bool|dict|list|tuple|set|frozenset|type|object|"
        r"None|NoneType|Exception|BaseException|ValueError|TypeError|RuntimeError|MemoryError|OSError|"
        r"EOFError|TimeoutError|UserWarning|Warning|ImportError)",
    ),
    (r"py:.*", r"(optional|callable|iterable|ellipsis)"),
]


# Names a module imports a public object under (``from ..pool import Pool as _JtPool``).
_ALIASES = {"_JtPool": "Pool"}


def _public_target(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve ``jaxtransport.pool._results.AsyncResult`` (how a type hint names a class) to the
    documented public name (``jaxtransport.pool.AsyncResult``) when exactly one matches."""
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target.startswith(("jaxtransport", "_")) and "." in target:
        return None
    name = target.rsplit(".", 1)[-1]
    name = _ALIASES.get(name, name)
    domain = env.get_domain("py")
    kinds = {"class": {"class", "exception"}, "exc": {"exception", "class"}, "func": {"function", "method"}}
    wanted = kinds.get(node["reftype"])
    found = [
        full
        for full, entry in domain.objects.items()
        if full.startswith("jaxtransport")
        and full.rsplit(".", 1)[-1] == name
        and (wanted is None or entry.objtype in wanted)
    ]
    if len(found) > 1:  # an object documented under its public name and also under its module
        found = [full for full in found if "._" not in full]
    if len(found) != 1:
        return None
    node["reftarget"] = found[0]
    resolved = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], found[0], node, contnode)
    return resolved


# Private names that appear in signatures (a default value, an alias in a return annotation),
# shown as what a user writes instead.
_SIGNATURE_NAMES = {
    "_shm.DEFAULT_SHM_THRESHOLD": "1 << 20",
    "DEFAULT_SHM_THRESHOLD": "1 << 20",
    "_JtPool": "jaxtransport.Pool",
}


def _public_signature(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: str | None, return_annotation: str | None
) -> tuple[str | None, str | None]:
    def public(text: str | None) -> str | None:
        if text:
            for private, shown in _SIGNATURE_NAMES.items():
                text = text.replace(private, shown)
        return text

    return public(signature), public(return_annotation)


def setup(app: Any) -> None:
    app.connect("missing-reference", _public_target)
    app.connect("autodoc-process-signature", _public_signature)
