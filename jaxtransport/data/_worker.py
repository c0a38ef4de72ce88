"""A Loader's worker side: the plan each worker gets once (``install``, the Pool's initializer)
and ``make_batch``, the task. Numpy only: a worker whose functions use no JAX never imports it.

Note [a batch is a tree of arrays]
A per-example ``transform`` returns a tree of dicts, lists and tuples (namedtuples too) whose
leaves are arrays: numpy arrays, numpy scalars, Python numbers, or anything with ``__array__``,
``shape`` and ``dtype`` (a ``jax.Array``). The examples of a batch are stacked leaf by leaf into
one array each, of shape ``(len(batch), *leaf.shape)``, written in place (one copy), so every
example must give the same structure, shapes and dtypes. Anything else (a string, a PIL image,
None, a class JAX would flatten but this module cannot see without importing JAX) raises
TypeError in the worker naming the function, where it was defined, the path in the tree, the
source index and the fix; the Pool raises it in the loop with the worker's traceback. A
``batch_transform`` returns the batch itself, checked the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._order import BATCH, EXAMPLE, generator


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every worker of a Loader holds for the Loader's life."""

    source: Any
    transform: Callable[[Any, np.random.Generator], Any] | None
    batch_transform: Callable[[list, np.random.Generator], Any] | None
    seed: int


_PLAN: Plan | None = None


def install(plan: Plan) -> None:
    """The Pool's initializer: keep the plan for every task of this worker."""
    global _PLAN
    _PLAN = plan


def make_batch(epoch: int, number: int, indices: Sequence[int]) -> Any:
    """Batch ``number`` of epoch ``epoch``: ``source[i]`` for each of ``indices``, transformed
    and stacked (Note [a batch is a tree of arrays])."""
    plan = _PLAN
    if plan is None:  # pragma: no cover - the initializer runs before any task
        raise RuntimeError("jaxtransport.data: this worker has no plan (its initializer did not run)")
    if plan.batch_transform is not None:
        records = [plan.source[i] for i in indices]
        out = plan.batch_transform(records, generator(plan.seed, BATCH, epoch, number))
        return as_arrays(out, plan.batch_transform, f"batch {number} of epoch {epoch}")
    fn = plan.transform
    first: tuple | None = None
    leaves_out: list[np.ndarray] = []
    for k, i in enumerate(indices):
        example = plan.source[i]
        if fn is not None:
            example = fn(example, generator(plan.seed, EXAMPLE, epoch, i))
        where = f"source[{i}] (epoch {epoch})"
        paths: list[str] = []
        leaves: list[np.ndarray] = []
        spec = _flatten(example, "", paths, leaves, fn, where)
        if first is None:
            first = (spec, paths, leaves)
            leaves_out = [np.empty((len(indices), *a.shape), a.dtype) for a in leaves]
        elif spec != first[0]:
            raise ValueError(
                f"{_what(fn)} returned trees of different structures within one batch: {where} "
                f"gave {_brief(spec)}, source[{indices[0]}] gave {_brief(first[0])}. The examples of a "
                "batch are stacked leaf by leaf: return the same dict keys and lengths for every "
                "example (or build the batch yourself with batch_transform=)."
            )
        for path, a, out in zip(paths, leaves, leaves_out):
            if a.shape != out.shape[1:] or a.dtype != out.dtype:
                raise ValueError(
                    f"{_what(fn)} returned {a.dtype}{list(a.shape)} at {path or 'the top'} for {where}, but "
                    f"{out.dtype}{list(out.shape[1:])} for source[{indices[0]}] of the same batch. The examples "
                    "of a batch are stacked: return one shape and dtype per leaf for every example "
                    "(crop or pad to a fixed size), or build the batch yourself with batch_transform=."
                )
            out[k] = a
    if first is None:  # pragma: no cover - the parent never sends an empty batch
        raise ValueError("jaxtransport.data: an empty batch")
    return _unflatten(first[0], iter(leaves_out))


def as_arrays(tree: Any, fn: Callable | None, where: str) -> Any:
    """``tree`` with every leaf a numpy array (Note [a batch is a tree of arrays])."""
    paths: list[str] = []
    leaves: list[np.ndarray] = []
    spec = _flatten(tree, "", paths, leaves, fn, where)
    return _unflatten(spec, iter(leaves))


# A tree's structure, comparable with ==: ("leaf",), ("dict", keys, children), ("list", n,
# children), ("tuple", type, children).


def _flatten(x: Any, path: str, paths: list[str], leaves: list[np.ndarray], fn: Callable | None, where: str) -> tuple:
    if isinstance(x, dict):
        keys = tuple(x)
        return ("dict", keys, tuple(_flatten(x[k], f"{path}[{k!r}]", paths, leaves, fn, where) for k in keys))
    if isinstance(x, list):
        return ("list", len(x), tuple(_flatten(v, f"{path}[{j}]", paths, leaves, fn, where) for j, v in enumerate(x)))
    if isinstance(x, tuple):
        fields = getattr(type(x), "_fields", None)
        names = [f".{f}" for f in fields] if fields is not None else [f"[{j}]" for j in range(len(x))]
        return ("tuple", type(x), tuple(_flatten(v, path + n, paths, leaves, fn, where) for n, v in zip(names, x)))
    a = _leaf(x)
    if a is None:
        raise TypeError(
            f"{_what(fn)} returned {_type_name(x)} at {path or 'the top'} for {where}. A Loader batch is a "
            "tree (dicts, lists, tuples) of arrays: numpy or JAX arrays, or numbers. Return an array "
            "there (np.asarray(image) for an image; drop strings and None, or encode them as numbers)."
        )
    paths.append(path)
    leaves.append(a)
    return ("leaf",)


def _leaf(x: Any) -> np.ndarray | None:
    if isinstance(x, np.ndarray):
        return x if x.dtype != object else None
    if isinstance(x, (np.generic, bool, int, float, complex)):
        return np.asarray(x)
    if hasattr(x, "__array__") and hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (str, bytes)):
        a = np.asarray(x)
        return a if a.dtype != object else None
    return None


def _unflatten(spec: tuple, leaves: Any) -> Any:
    kind = spec[0]
    if kind == "leaf":
        return next(leaves)
    if kind == "dict":
        return {k: _unflatten(s, leaves) for k, s in zip(spec[1], spec[2])}
    if kind == "list":
        return [_unflatten(s, leaves) for s in spec[2]]
    values = [_unflatten(s, leaves) for s in spec[2]]
    cls = spec[1]
    return cls(*values) if hasattr(cls, "_fields") else cls(values)


def _brief(spec: tuple) -> str:
    kind = spec[0]
    if kind == "leaf":
        return "an array"
    if kind == "dict":
        return "a dict with keys " + repr(list(spec[1]))
    if kind == "list":
        return f"a list of {spec[1]}"
    return f"a {spec[1].__name__} of {len(spec[2])}"


def _type_name(x: Any) -> str:
    t = type(x)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return "None" if x is None else f"a {name}"


def _what(fn: Callable | None) -> str:
    """The function, where it was defined: ``transform decode (train.py:12)``."""
    if fn is None:
        return "the source (no transform)"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        file = inspect.getsourcefile(fn) or "?"
        line = inspect.getsourcelines(fn)[1]
        return f"the function {name} ({file}:{line})"
    except (OSError, TypeError):
        return f"the function {name}"
