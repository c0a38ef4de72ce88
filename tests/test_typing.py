"""The annotations ship (PEP 561) and the public API is annotated in full."""

from __future__ import annotations

import inspect
import os

import pytest

from .conftest import ROOT


def test_py_typed_ships_as_package_data():
    assert os.path.isfile(os.path.join(ROOT, "jaxtransport", "py.typed"))
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["jaxtransport"]


def _public_callables():
    import jaxtransport
    import jaxtransport.multiprocessing
    import jaxtransport.pool

    for module in (jaxtransport, jaxtransport.pool, jaxtransport.multiprocessing):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                for attr, member in vars(obj).items():
                    if inspect.isfunction(member) and (not attr.startswith("_") or attr == "__init__"):
                        yield f"{module.__name__}.{name}.{attr}", member


@pytest.mark.parametrize(("name", "fn"), list(_public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_api_is_annotated(name, fn):
    sig = inspect.signature(fn)
    missing = [p.name for p in sig.parameters.values() if p.name not in ("self", "cls") and p.annotation is p.empty]
    assert not missing, f"{name}: parameters without annotations: {missing}"
    if fn.__name__ != "__init__":
        assert sig.return_annotation is not sig.empty, f"{name}: no return annotation"
