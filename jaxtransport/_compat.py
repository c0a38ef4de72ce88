"""The one place jaxtransport touches private JAX (and Ray) APIs.

Every use of something that is not public API lives here, organised by library, each with:

- the *probe* that decides whether this JAX has it (``hasattr``, a try-import, or a tiny call
  whose result is checked and cached; the JAX version only where behaviour changed without an API
  change),
- the *fallback* when it does not (a public API, the way an older JAX did it, or a
  :class:`~jaxtransport.TransportError` naming the JAX version and the missing thing; never a
  bare ``AttributeError`` from deep inside JAX),
- the *upstream reference*: the JAX (or Ray) source the workaround follows.

An upgrade of JAX or Ray is audited here and nowhere else. Versions checked: jax/jaxlib 0.4.30
(the declared floor), 0.10.2 and 0.12.0.1 (README, "Tested range").

Other modules import the helpers below, never ``jax._src`` themselves.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._errors import UnsupportedArrayError

__all__ = [
    "collect_jax_garbage",
    "concrete_array_types",
    "fast_put_available",
    "import_tracer_modules",
    "is_committed",
    "jax_version",
    "prng_impl_name",
    "put_on_default_device",
    "putter_on_default_device",
    "tracer_aval_str",
    "tracer_base",
    "tracer_trace_info",
    "with_weak_type",
    "wrap_key_data",
]


def jax_version() -> str:
    return f"jax {jax.__version__} (jaxlib {getattr(jax.lib, '__version__', '?')})"


def _unsupported(what: str, fix: str = "") -> UnsupportedArrayError:
    fix = fix or "Use a JAX release in the range the README lists as tested, or report the version."
    return UnsupportedArrayError(
        f"jaxtransport cannot {what} on {jax_version()}: the JAX internals it relies on for this "
        f"differ in this release. {fix}"
    )


# ============================================================================================
# JAX
# ============================================================================================

# --------------------------------------------------------------------------------------------
# Concrete array classes.
# Probe: import. Upstream: jax/_src/array.py (ArrayImpl, a C++ class since jaxlib 0.4.x) and
# jax/_src/prng.py (PRNGKeyArray; jax/_src/random/prng.py in some layouts). ``jax.Array`` is an
# abstract base that Tracers also pass, so pickling dispatch needs the exact classes.
# Fallback: none needed (present from 0.4.30 to 0.12); a missing one raises at registration.


@functools.cache
def concrete_array_types() -> tuple[type, ...]:
    """The exact classes of concrete JAX arrays (``jax.Array`` itself is abstract)."""
    from jax._src.array import ArrayImpl

    try:
        from jax._src.prng import PRNGKeyArray
    except ImportError:  # pragma: no cover - other layouts
        from jax._src.random.prng import PRNGKeyArray  # type: ignore[import-not-found,no-redef,unused-ignore]
    return (ArrayImpl, PRNGKeyArray)


# --------------------------------------------------------------------------------------------
# Committed-ness of an array.
# Probe: ``hasattr(x, "committed")`` (public property since jax 0.4.31); fallback: the
# ``_committed`` attribute it reads (jax/_src/array.py, jax 0.4.30).


def is_committed(x: Any) -> bool:
    committed = getattr(x, "committed", None)
    if committed is None:
        committed = x._committed
    return bool(committed)


# --------------------------------------------------------------------------------------------
# Note [weak types]
# A weak-typed array (``jnp.asarray(1.5)``: dtype float32 but "from a Python scalar", so that
# ``x + bf16`` stays bf16) carries the flag in its abstract value (``x.aval.weak_type``). There is
# no public API that makes a weak-typed array from host data or from another array. JAX's own
# unpickler (jax/_src/array.py, ``_reconstruct_array``) is the reference, and it changed:
#
# - jax <= 0.11: ``device_put(np_value)`` then ``x.aval = x.aval.update(weak_type=True)``.
# - jax 0.12 (jaxlib 0.12 made ``ArrayImpl.aval`` read-only): it wraps the host value in
#   ``jax._src.literals.TypedNdArray(np_value, aval=ShapedArray(..., weak_type=True))`` and
#   ``device_put``s that; the weak aval travels with the host value.
#
# jaxtransport never assigns ``aval`` (the setter is gone in jaxlib 0.12 and may go from any
# other internal object the same way). It builds a weak array from host data as the 0.12
# unpickler does where ``TypedNdArray`` exists, or hands the weak aval straight to
# ``batched_device_put`` (``put_on_default_device``, the fast path, which takes the aval as an
# argument); an array already on devices (how "preserve" assembles sharded arrays, and the
# fallback for JAX without either) is rebuilt the way ``jax.make_array_from_single_device_arrays``
# builds arrays: the ``ArrayImpl`` constructor, given the weak aval over the same device buffers
# (``with_weak_type``). Each is probed; when none works the error names the JAX version.


def _weak_aval(x: Any) -> Any:
    return x.aval.update(weak_type=True)


def _rewrap_weak(x: Any) -> Any:
    """``ArrayImpl(weak aval, sharding, per-device buffers)``: what
    ``make_array_from_single_device_arrays`` does (jax/_src/array.py), with ``weak_type=True``.
    Same device buffers: no copy."""
    from jax._src.array import ArrayImpl

    shards = [s.data for s in x.addressable_shards]
    return ArrayImpl(_weak_aval(x), x.sharding, shards, committed=is_committed(x))


def _check_weak(out: Any, x: Any) -> bool:
    return (
        out.weak_type
        and out.shape == x.shape
        and out.dtype == x.dtype
        and out.sharding == x.sharding
        and is_committed(out) == is_committed(x)
        and np.array_equal(np.asarray(out), np.asarray(x))
    )


_weak_ok: bool | None = None  # None: not probed yet


def with_weak_type(x: Any) -> Any:
    """``x`` (a concrete ArrayImpl) with ``weak_type=True``; the same device buffers, no copy.

    Probe (first use): the rebuilt array must be weak with the probe's shape, dtype, sharding,
    committed-ness and value. When it is not (a JAX whose ``ArrayImpl`` constructor changed),
    raises ``UnsupportedArrayError`` naming this JAX version.
    """
    global _weak_ok
    if x.weak_type:
        return x
    if _weak_ok is None:
        probe = jax.device_put(np.zeros((1,), np.float32))
        try:
            _weak_ok = _check_weak(_rewrap_weak(probe), probe)
        except Exception:
            _weak_ok = False
    if not _weak_ok:
        raise _unsupported("rebuild a weak-typed array (weak_type=True, e.g. jnp.asarray(1.5))")
    return _rewrap_weak(x)


# --------------------------------------------------------------------------------------------
# Host ndarray -> the default device, uncommitted (what ``jax.device_put(ndarray)`` does).
#
# Fast path. Probe: ``jax._src.interpreters.pxla.batched_device_put``, the default-device
# getter (``pxla.get_default_device``; ``pxla._get_default_device`` in 0.4.30) and
# ``shaped_abstractify`` (``jax._src.core``; ``jax._src.api_util`` in 0.4.30),
# then one call on a probe array whose result must equal ``jax.device_put``'s (sharding, dtype,
# weak type, committed-ness, value), weak and not. Upstream: jax/_src/dispatch.py
# ``_device_put_sharding_impl``, which ends in ``batched_device_put`` for a host array. It skips
# the layers above, which on a cold cache (right after a large copy: the moment every transfer
# decodes) cost ~250 us where this costs ~40 us. It takes the aval as an argument, so a weak
# aval is built directly (Note [weak types]). ``putter_on_default_device`` splits it for putting
# the same host array many times (a Pool's shared tree): the aval once, the rest per call.
# Fallback: ``jax.device_put`` (plus ``with_weak_type``, or jax 0.12's ``TypedNdArray``), the
# same result, slower; ``fast_put_available()`` says which one this JAX gets (the codec
# benchmark prints it).


def _make_fast_put() -> tuple[Callable[[np.ndarray, bool], Any], Callable[[np.ndarray, bool], Callable[[], Any]]]:
    """(put, putter): ``put(x, weak)`` is one device_put; ``putter(x, weak)`` computes the
    abstract value once and returns a function doing the rest (for putting ``x`` again)."""
    from jax._src import core
    from jax._src.interpreters import pxla
    from jax.sharding import SingleDeviceSharding

    get_device = getattr(pxla, "get_default_device", None) or pxla._get_default_device  # type: ignore[attr-defined]
    batched_device_put = pxla.batched_device_put
    shaped_abstractify = getattr(core, "shaped_abstractify", None)
    if shaped_abstractify is None:  # jax 0.4.30: jax/_src/api_util.py
        from jax._src.api_util import shaped_abstractify  # type: ignore[attr-defined,no-redef]
    shardings: dict = {}

    def aval_of(x: np.ndarray, weak_type: bool):
        aval = shaped_abstractify(x)  # type: ignore[misc]
        return aval.update(weak_type=True) if weak_type else aval

    def put_aval(aval, x: np.ndarray):
        device = get_device()  # each time: the default device is configurable
        sharding = shardings.get(device)
        if sharding is None:
            sharding = shardings[device] = SingleDeviceSharding(device)
        return batched_device_put(aval, sharding, [x], [device], committed=False)

    def put(x: np.ndarray, weak_type: bool):
        return put_aval(aval_of(x, weak_type), x)

    def putter(x: np.ndarray, weak_type: bool):
        aval = aval_of(x, weak_type)

        def put_again():
            try:
                return put_aval(aval, x)
            except Exception:  # pragma: no cover - as put_on_default_device: jax's own path
                return _slow_put(x, weak_type)

        return put_again

    return put, putter


def _typed_ndarray() -> Any:
    """jax 0.12's host value that carries a weak aval (jax/_src/literals.py), or None."""
    try:
        from jax._src.core import ShapedArray
        from jax._src.literals import TypedNdArray
    except ImportError:
        return None

    def weak_host(x: np.ndarray):
        return TypedNdArray(x, aval=ShapedArray(x.shape, x.dtype, weak_type=True))

    return weak_host


def _slow_put(x: np.ndarray, weak_type: bool) -> Any:
    if weak_type:
        weak_host = _weak_host()
        if weak_host is not None:
            out = jax.device_put(weak_host(x))  # jax 0.12's _reconstruct_array
            if out.weak_type:
                return out
            return with_weak_type(out)
        return with_weak_type(jax.device_put(x))
    return jax.device_put(x)


_weak_host_fn: Any = None


def _weak_host():
    global _weak_host_fn
    if _weak_host_fn is None:
        _weak_host_fn = _typed_ndarray() or False
    return _weak_host_fn or None


_FAST_PUT: Any = None  # None: not probed yet; False: unavailable in this jax; else the function
_FLOAT0 = np.dtype(jax.dtypes.float0)  # jax.device_put turns these into bools: left to it
_fast_put_failure: str = ""


def _same(out: Any, ref: Any, value: np.ndarray) -> bool:
    return (
        isinstance(out, jax.Array)
        and out.sharding == ref.sharding
        and out.dtype == ref.dtype
        and out.weak_type == ref.weak_type
        and is_committed(out) == is_committed(ref)
        and np.array_equal(np.asarray(out), value)
    )


def _probe_fast_put() -> Any:
    global _fast_put_failure
    try:
        fast = _make_fast_put()
        probe = np.arange(4, dtype=np.int32)
        for weak in (False, True):
            ref = _slow_put(probe, weak)
            if not (_same(fast[0](probe, weak), ref, probe) and _same(fast[1](probe, weak)(), ref, probe)):
                _fast_put_failure = f"its result differs from jax.device_put's (weak_type={weak})"
                return False
    except Exception as e:
        _fast_put_failure = f"{type(e).__name__}: {e}"
        return False
    return fast


def fast_put_available() -> tuple[bool, str]:
    """(whether this JAX gets the fast host->device path, why not when it does not)."""
    return _fast_put() is not False, _fast_put_failure


def _fast_put() -> Any:
    """The (put, putter) pair of ``_make_fast_put``, or False when this JAX does not get it
    (probed once)."""
    global _FAST_PUT
    if _FAST_PUT is None:
        _FAST_PUT = _probe_fast_put()
    return _FAST_PUT


def put_on_default_device(x: np.ndarray, weak_type: bool = False) -> Any:
    """``jax.device_put(x)`` for a host ndarray (default device, uncommitted), with ``weak_type``.

    On CPU the result aliases ``x`` when it is 64-byte aligned (no copy), as ``device_put`` does.
    """
    fast = _fast_put()
    if fast is not False and x.dtype != _FLOAT0:
        try:
            return fast[0](x, weak_type)
        except Exception:  # pragma: no cover - jax's own path raises what it raises
            pass
    return _slow_put(x, weak_type)


def putter_on_default_device(x: np.ndarray, weak_type: bool = False) -> Callable[[], Any]:
    """A function that returns ``put_on_default_device(x, weak_type)`` at each call: a new
    jax.Array each time (on CPU over ``x`` itself, no copy), for putting the same host array
    many times. The fast path computes the abstract value once (about half of the cost)."""
    fast = _fast_put()
    if fast is not False and x.dtype != _FLOAT0:
        try:
            return fast[1](x, weak_type)
        except Exception:  # pragma: no cover - jax's own path raises what it raises
            pass
    return functools.partial(_slow_put, x, weak_type)


# --------------------------------------------------------------------------------------------
# PRNG implementation names.
# ``str(jax.random.key_impl(k))`` is the canonical name ("threefry2x32") from jax 0.4.36 on;
# before, ``key_impl`` returns a ``PRNGSpec`` whose ``str`` is a short tag ("fry", "rbg",
# "urbg") that ``wrap_key_data`` does not accept, and whose ``_impl.name`` is the name.
# Probe: ``_impl.name`` on the spec (jax/_src/random.py ``PRNGSpec``, jax/_src/prng.py
# ``PRNGImpl``); fallback: ``str()``. Names are what travels; tags from older jaxtransport
# senders on such JAX are mapped to names when received.

_TAG_TO_NAME = {"fry": "threefry2x32", "rbg": "rbg", "urbg": "unsafe_rbg"}


def prng_impl_name(key: Any) -> str:
    spec = jax.random.key_impl(key)
    name = getattr(getattr(spec, "_impl", None), "name", None)
    if isinstance(name, str) and name and not name.startswith("<"):
        return name
    return str(spec)


def wrap_key_data(data: Any, impl_name: str) -> Any:
    """``jax.random.wrap_key_data(data, impl=impl_name)``; an unknown name raises
    ``UnsupportedArrayError`` naming it and this JAX version."""
    try:
        return jax.random.wrap_key_data(data, impl=impl_name)
    except (ValueError, TypeError, KeyError) as e:
        name = _TAG_TO_NAME.get(impl_name)
        if name is not None and name != impl_name:
            return wrap_key_data(data, name)
        raise UnsupportedArrayError(
            f"Received a typed PRNG key array with implementation {impl_name!r}, which "
            f"{jax_version()} does not know ({e}). Register the same PRNG implementation in "
            "this process, or send jax.random.key_data(key) and wrap it on arrival."
        ) from e


# --------------------------------------------------------------------------------------------
# Tracers.
# Probe: ``jax.core.Tracer`` (public); fallback: ``jax._src.core.Tracer``. The modules below
# define Tracer subclasses lazily (jax/_src/interpreters/*.py, ...): importing them makes a walk
# over ``Tracer.__subclasses__()`` complete; a module missing in some JAX is skipped (its class
# lives elsewhere then).


def tracer_base() -> type:
    try:
        return jax.core.Tracer
    except AttributeError:  # pragma: no cover - layouts without jax.core.Tracer
        from jax._src.core import Tracer

        return Tracer


_TRACER_MODULES = (
    "jax._src.interpreters.partial_eval",
    "jax._src.interpreters.ad",
    "jax._src.interpreters.batching",
    "jax._src.interpreters.remat",
    "jax._src.shard_map",
    "jax._src.checkify",
    "jax._src.custom_derivatives",
)


def import_tracer_modules() -> None:
    for name in _TRACER_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # a module that moved in this JAX version: its class is elsewhere
            pass


def tracer_aval_str(aval: Any) -> str:
    """``'f32[3,4]'`` for a tracer's aval. Before jax 0.4.36 a tracer under ``grad`` has a
    ``ConcreteArray`` aval whose ``str_short`` shows the value: it is raised to its shaped
    aval first (jax/_src/core.py ``raise_to_shaped``, removed with ConcreteArray in 0.4.36)."""
    if type(aval).__name__ == "ConcreteArray":
        try:
            from jax._src.core import raise_to_shaped  # type: ignore[attr-defined]

            aval = raise_to_shaped(aval)
        except Exception:  # pragma: no cover
            pass
    return aval.str_short(short_dtypes=True)


def tracer_trace_info(tracer: Any) -> tuple[str, str | None, str | None]:
    """(trace class name, ``traced_for``, ``func_src_info``) of a tracer, as far as this JAX
    exposes them: ``tracer._trace`` and, for jit-like staging, ``trace.frame.debug_info``
    (jax/_src/interpreters/partial_eval.py ``DynamicJaxprTrace``). Descriptive only: both are
    None when the debug info is not where this looks."""
    trace = getattr(tracer, "_trace", None)
    name = type(trace).__name__ if trace is not None else type(tracer).__name__
    traced_for = src = None
    if name == "DynamicJaxprTrace":
        try:
            dbg = trace.frame.debug_info  # type: ignore[union-attr]
            traced_for = getattr(dbg, "traced_for", None) or "jit"
            src = getattr(dbg, "func_src_info", None)
        except Exception:
            pass
    return name, traced_for, src


# --------------------------------------------------------------------------------------------
# jaxlib's deferred Python decrefs.
# ``device_put`` drops its reference to an aliased host buffer from a runtime thread; jaxlib
# queues that decref until the next JAX call or ``collect_garbage()``. Probe:
# ``jax._src.lib._jax.collect_garbage`` (jaxlib >= 0.5), ``jax._src.lib.xla_extension``
# (jaxlib 0.4.x). Fallback: ``gc.collect(0)``, which also runs the queue (later).


@functools.cache
def _collect_garbage_fn() -> Callable[[], Any]:
    from jax._src import lib

    for module in ("_jax", "xla_extension"):
        fn = getattr(getattr(lib, module, None), "collect_garbage", None)
        if fn is not None:
            return fn
    import gc

    return lambda: gc.collect(0)


def collect_jax_garbage() -> None:
    """Run jaxlib's deferred Python decrefs now (cheap)."""
    try:
        _collect_garbage_fn()()
    except Exception:  # pragma: no cover - a gc pass does the same
        import gc

        gc.collect(0)


# --------------------------------------------------------------------------------------------
# JAX's own pickling of a jax.Array (read by jaxtransport.ray's default-path warning).
# Probe: ``ArrayImpl.__reduce__`` names ``jax._src.array._reconstruct_array`` (jax 0.4.30-0.12,
# jax/_src/array.py); fallback: None (the warning is off on a JAX that rebuilds otherwise).


def jax_default_array_rebuild() -> tuple[str, str] | None:
    """(module, name) of the global JAX's own unpickling of a jax.Array looks up, or None."""
    try:
        from jax._src import array as jax_array

        name = "_reconstruct_array"
        if callable(getattr(jax_array, name, None)) and name in jax_array.ArrayImpl.__reduce__.__code__.co_names:
            return (jax_array.__name__, name)
    except Exception:  # pragma: no cover - another layout
        pass
    return None


def initialized_platforms() -> set[str] | None:
    """The platforms of the JAX backends this process has started, None when none has started
    (so JAX may still take an accelerator). Reads ``jax._src.xla_bridge._backends`` (the dict
    ``backends()`` fills; present from jax 0.4.x to 0.10 at least) without starting anything;
    where it is missing, asks ``backends_are_initialized()`` and, only when they are, the
    default backend."""
    try:
        from jax._src import xla_bridge
    except Exception:  # noqa: BLE001 - no JAX internals: say nothing is known
        return None
    backends = getattr(xla_bridge, "_backends", None)
    if isinstance(backends, dict):
        return {str(p).lower() for p in backends} or None
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    if probe is not None and probe():
        import jax

        return {jax.default_backend()}
    return None


def cached_host_copy(x: Any) -> np.ndarray | None:
    """The host copy JAX keeps of a one-device array once ``np.asarray`` fetched it
    (``ArrayImpl._npy_value``, jax 0.4 to 0.10 at least), or None."""
    value = getattr(x, "_npy_value", None)
    return value if isinstance(value, np.ndarray) else None
