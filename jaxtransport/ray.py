"""Ray integration: jax.Array through Ray's object store without copies, in every worker.

    import jaxtransport.ray

    jaxtransport.ray.init(num_cpus=8)          # ray.init + worker setup hook + register()
    ref = f.remote(params)                     # params: a pytree of jax.Arrays

or, when you call ``ray.init`` yourself::

    ray.init(runtime_env=jaxtransport.ray.runtime_env({"pip": [...]}))
    jaxtransport.ray.register()

What changes (Note [zero-copy through Ray]): without jaxtransport, Ray pickles a jax.Array with
JAX's ``__reduce__``, which copies the data into the pickle stream as ``bytes`` (*in-band*: a copy
on the sender, the object-store copy, and more copies on the receiver, at ~0.2-0.5 GB/s here).
With it, Ray serializes each concrete array type (``ArrayImpl``, typed PRNG key arrays) with
:func:`jaxtransport._codec.encode`: the data travels as contiguous host views, which Ray's
protocol-5 pickler stores *out-of-band* in the object store exactly like a numpy array (one copy,
into shared memory); the receiver rebuilds the array with ``_codec.decode`` from the object-store
buffer, which on CPU the jax.Array *aliases* (no copy; Note [prompt release] in _raywire for when it is
unpinned). dtype (every one, bit-exact), 0-d and zero-size shapes, ``weak_type``, typed PRNG keys
and (with ``placement="preserve"``) shardings survive the trip.

Importing ``jaxtransport`` never imports this module or Ray; importing this module imports Ray
(and raises an ImportError naming the ``jaxtransport[ray]`` extra when it is missing) but
registers nothing and starts nothing.

Note [zero-copy through Ray]
    ``ray.util.register_serializer(cls, serializer=s, deserializer=d)`` makes Ray's pickler
    reduce ``cls`` instances to ``d, (s(obj),)``; Ray pickles that with protocol 5 and a
    ``buffer_callback`` (``SerializationContext._serialize_to_pickle5``), so every
    ``PickleBuffer`` inside ``s(obj)`` (our serializer wraps each host view of the array in
    one) leaves the pickle stream out-of-band and is written straight into the object store
    (64-byte aligned above 2 KiB). On the receiving side Ray unpickles with ``buffers=``
    read-only views of the plasma object; ``decode`` wraps them in numpy without copying and
    hands them to ``jax.device_put``, which on CPU aliases a 64-byte-aligned buffer and keeps
    the numpy array - hence Ray's buffer, hence the plasma object - pinned for as long as the
    jax.Array (or anything that aliases it) lives. Freeing the ObjectRef, or
    ``ray.internal.free``, does not free memory a live array still uses. Small buffers
    (< 2 KiB, 8-byte aligned) and sharded arrays received as ``"device"`` are copied once by
    ``device_put`` / assembly instead, as is a large array that a process sent from an
    accelerator, which travels as one out-of-band buffer per piece (``_codec``'s Note [pickled
    in pieces]) and is joined on a CPU receiver (one copy; a receiver on an accelerator puts the
    pieces as they are and joins them there). The registration is per process and by exact type
    (ray-project/ray#22984), which is why results coming back from workers need
    :func:`runtime_env`'s setup hook.

Note [tracer errors through Ray]
    Ray wraps any ``TypeError`` raised while serializing a ``ray.put`` value or a task/actor
    argument into its own ``TypeError("Could not serialize ...")`` after calling
    ``ray.util.inspect_serializability`` from inside its ``except`` block (which, for a bare
    Tracer, itself dies in ``inspect.getmembers`` with an unrelated ConcretizationTypeError).
    ``TracerTransportError`` is a ``ConcretizationTypeError`` and hence a ``TypeError``, so to
    surface it unchanged at the call site :func:`register` wraps
    ``ray.util.inspect_serializability``: when it is called while one of *our* errors (or
    JAX's own "tracer in ``__reduce__``" ConcretizationTypeError) is being handled, it re-raises
    that error instead - for tracers with the key path ``find_tracer`` locates in the value Ray
    was serializing (``value['params']['w']``; Ray serializes each argument separately, so the
    path starts at the argument, not at its position). Every other call goes to Ray's function
    unchanged; :func:`unregister` restores it. If a future Ray stops calling it, the caller gets
    Ray's TypeError with our error as ``__cause__``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections import ChainMap
from collections.abc import Callable, Mapping, MutableMapping
from types import FrameType
from typing import Any

try:
    import ray
    import ray.cloudpickle
    import ray.util
except ImportError as _e:  # pragma: no cover - exercised in a fresh interpreter by the tests
    raise ImportError(
        f"jaxtransport.ray needs Ray, which could not be imported ({_e}). Install it with "
        "`pip install 'jaxtransport[ray]'` (or `pip install 'ray[default]>=2.9'`), or use "
        "jaxtransport without Ray: jaxtransport.register() / dumps() / loads().",
        name="ray",
    ) from _e

import jax
import jax.errors

from . import _codec, _compat, _procenv, _raywire
from ._errors import TracerTransportError, TransportError
from ._registry import Registration
from ._tracers import find_tracer, tracer_error, tracer_types

__all__ = [
    "SETUP_HOOK",
    "RayDefaultSerializationWarning",
    "init",
    "is_registered",
    "register",
    "runtime_env",
    "unregister",
]

#: The import path Ray calls in every worker of a job started with :func:`runtime_env`.
SETUP_HOOK = "jaxtransport.ray._setup_worker"
# env_vars that runtime_env() passes to workers (read by _setup_worker).
_PLACEMENT_ENV = "JAXTRANSPORT_RAY_PLACEMENT"
_USER_HOOK_ENV = "JAXTRANSPORT_RAY_USER_HOOK"
_CHAINED = "_jaxtransport_chained_hook"
_WHERE = "passed to Ray as a task/actor argument or a ray.put value"


def _initial_placement() -> str:
    placement = os.environ.get(_PLACEMENT_ENV) or "device"
    return placement if placement in _codec.PLACEMENTS else "device"


# How this process materializes arrays it receives through Ray. Set by register(); before
# that (a worker whose job has no setup hook still receives our payloads) the env var or
# "device".
_placement = _initial_placement()


# --------------------------------------------------------------------------------------------
# serializer / deserializer (top-level functions: Ray pickles the deserializer by reference,
# so "jaxtransport.ray._deserialize" is part of the wire format: keep it stable)


def _serialize(x: Any) -> tuple:
    """(meta, raw buffers...) for Ray's pickler: :func:`jaxtransport._raywire.serialize`."""
    return _raywire.serialize(x)


def _deserialize(payload: tuple) -> Any:
    """Rebuild an array from :func:`_serialize`'s payload with this process's placement
    (:func:`jaxtransport._raywire.deserialize`)."""
    return _raywire.deserialize(payload, _placement)


def _refuse_tracer(t: Any) -> Any:
    raise tracer_error(t, where=_WHERE)


# --------------------------------------------------------------------------------------------
# Note [default-path warning]
#
# Registering only the driver (a plain ``ray.init()`` followed by :func:`register`) works, but
# results computed in workers then come back through Ray's default serialization: JAX's own
# ``__reduce__`` copies the data into the pickle stream (in-band), about half the speed of a
# registered round trip, silently. So while this process is registered, the first jax.Array that
# arrives here through Ray's default path raises a RayDefaultSerializationWarning naming the
# fix (once per process).
#
# Detection, without patching JAX or Ray: JAX's own pickle of an ArrayImpl (and of a typed key
# array, whose state holds one) names JAX's rebuild function (``_compat``); unpickling it looks
# that global up, which raises the ``pickle.find_class`` audit event (PEP 578; the C unpickler
# raises it too). An audit hook, installed by the first register() - audit hooks cannot be
# removed, so it does nothing unless this process is registered - watches for that name and
# checks that the unpickling runs inside Ray's deserializer
# (``ray._private.serialization.SerializationContext._deserialize_pickle5_data``, which calls
# ``pickle.loads`` directly: it is the Python frame right under the event). Both names are
# probed when the hook is installed; where either is missing (another JAX or Ray layout),
# detection is off and nothing is warned. Upstream: jax/_src/array.py (ArrayImpl.__reduce__),
# ray/_private/serialization.py (_deserialize_pickle5_data). Cost: one Python call per audit
# event in the process, returning at once unless the event is ``pickle.find_class``.

_JAX_DEFAULT_REBUILD: tuple[str, str] | None = None  # set by _default_path_detectable()
_RAY_DESERIALIZER = ("ray._private.serialization", "_deserialize_pickle5_data")
_audit_installed = False
_watch_default_path = False
_default_path_warned = False


class RayDefaultSerializationWarning(UserWarning):
    """A jax.Array reached this process through Ray's default (in-band, copying) serialization
    although jaxtransport is registered here: the process that sent it had not registered
    jaxtransport (typically workers of a job started with a plain ``ray.init()``). Start Ray with
    :func:`init`, or give the job :func:`runtime_env`. Shown once per process."""


def _default_path_detectable() -> bool:
    global _JAX_DEFAULT_REBUILD
    try:
        from ray._private import serialization as ray_serialization

        _JAX_DEFAULT_REBUILD = _compat.jax_default_array_rebuild()
        return _JAX_DEFAULT_REBUILD is not None and hasattr(
            ray_serialization.SerializationContext, _RAY_DESERIALIZER[1]
        )
    except Exception:  # pragma: no cover - another layout: no detection
        return False


def _inside_ray_deserializer(frame: Any) -> bool:
    for _ in range(16):
        if frame is None:
            return False
        if frame.f_code.co_name == _RAY_DESERIALIZER[1] and frame.f_globals.get("__name__") == _RAY_DESERIALIZER[0]:
            return True
        frame = frame.f_back
    return False


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, from the caller of this function, of the first frame
    outside Ray and jaxtransport (the user's ``ray.get``)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("ray", "jaxtransport"):
        frame, level = frame.f_back, level + 1
    return level


def _on_default_path() -> None:
    global _default_path_warned
    if _default_path_warned or not _watch_default_path or not _inside_ray_deserializer(sys._getframe(2)):
        return
    _default_path_warned = True
    warnings.warn(
        "jaxtransport.ray: a jax.Array reached this process through Ray's default serialization "
        "(JAX's own pickling: the data is copied into the pickle stream instead of travelling "
        "out-of-band, about half the speed) although jaxtransport is registered here. The "
        "process that sent it has not registered jaxtransport - typically a Ray worker of a "
        "job started with a plain ray.init(), where only this driver called "
        "jaxtransport.ray.register(). Fix: start Ray with jaxtransport.ray.init(...) instead of "
        "ray.init(...), or pass runtime_env=jaxtransport.ray.runtime_env(...) to ray.init (or "
        "to the job submission) so that every worker registers through the setup hook. "
        "(Shown once per process.)",
        RayDefaultSerializationWarning,
        stacklevel=_user_stacklevel(),
    )


def _audit(event: str, args: tuple) -> None:
    if event == "pickle.find_class" and _watch_default_path and args == _JAX_DEFAULT_REBUILD:
        _on_default_path()


def _watch_default_serialization(on: bool) -> None:
    global _audit_installed, _watch_default_path
    if on and not _audit_installed:
        if not _default_path_detectable():
            return
        sys.addaudithook(_audit)
        _audit_installed = True
    _watch_default_path = on and _audit_installed


# --------------------------------------------------------------------------------------------
# Note [tracer errors through Ray]


def _our_error(exc: BaseException | None, value: Any) -> BaseException | None:
    """The error the user should see instead of Ray's wrapper, or None to let Ray proceed."""
    if isinstance(exc, jax.errors.ConcretizationTypeError):
        found = find_tracer(value, "value")
        if found is not None:
            path, tracer = found
            return tracer_error(tracer, path, where=_WHERE)
        return exc if isinstance(exc, TracerTransportError) else None
    if isinstance(exc, TransportError):
        return exc
    return None


def _wrap_inspect(original: Callable) -> Callable:
    def inspect_serializability(base_obj: Any, *args: Any, **kwargs: Any) -> Any:
        err = _our_error(sys.exc_info()[1], base_obj)
        if err is not None:
            raise err from None
        return original(base_obj, *args, **kwargs)

    inspect_serializability.__wrapped__ = original  # type: ignore[attr-defined]
    inspect_serializability.__doc__ = original.__doc__
    inspect_serializability._jaxtransport = True  # type: ignore[attr-defined]
    return inspect_serializability


def _patch_inspect() -> None:
    current = ray.util.inspect_serializability
    if not getattr(current, "_jaxtransport", False):
        ray.util.inspect_serializability = _wrap_inspect(current)


def _unpatch_inspect() -> None:
    current = ray.util.inspect_serializability
    if getattr(current, "_jaxtransport", False):
        ray.util.inspect_serializability = current.__wrapped__  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# registration


def _ray_dispatch() -> MutableMapping:
    """The dict ``ray.util.register_serializer`` writes into (Ray's cloudpickle reducers)."""
    dispatch = ray.cloudpickle.CloudPickler.dispatch
    return dispatch.maps[0] if isinstance(dispatch, ChainMap) else dispatch


def _register_serializer(cls: type, serializer: Callable) -> None:
    ray.util.register_serializer(cls, serializer=serializer, deserializer=_deserialize)


# Our serializers in Ray's dispatch, and what they replaced (restored by unregister()). Ours go
# in through Ray's API; a type that had no serializer before is deregistered the same way.
_registration = Registration(
    _ray_dispatch, put=_register_serializer, drop=lambda cls: ray.util.deregister_serializer(cls)
)


def register(placement: str = "device") -> None:
    """Make Ray (in this process) move JAX arrays through jaxtransport.

    Calls ``ray.util.register_serializer`` for every concrete JAX array type (``ArrayImpl``,
    typed PRNG key arrays) and every Tracer type defined now; ``placement`` ("device", "host"
    or "preserve") is how this process materializes arrays it *receives* through Ray.
    Idempotent: calling it again only updates the placement. Works before or after
    ``ray.init``. Undo with :func:`unregister`.

    Guarantees: arrays this process sends are stored out-of-band in the object store (one copy,
    into shared memory; none on the sender's side on CPU); arrays it receives alias the
    object-store buffer on CPU (no copy; one for an array sent from an accelerator in pieces)
    and keep it pinned while they live. A Tracer in a
    ``ray.put`` value or a task/actor argument raises :class:`TracerTransportError` at the call
    site, naming its key path (Note [tracer errors through Ray]).

    Registration is per process: results computed in workers only come back this way when the
    workers registered too - start Ray with :func:`init` or :func:`runtime_env`. While this
    process is registered, the first jax.Array that still arrives through Ray's default
    (in-band, copying) serialization raises a :class:`RayDefaultSerializationWarning` naming
    that fix (Note [default-path warning]).
    """
    global _placement
    _codec.check_placement(placement)
    with _registration.lock:
        _placement = placement
        entries = [(t, _serialize) for t in _codec.concrete_array_types()]
        entries += [(t, _refuse_tracer) for t in tracer_types()]  # type: ignore[misc]
        _registration.install(entries)
        _patch_inspect()
        _watch_default_serialization(True)


def unregister() -> None:
    """Undo :func:`register` in this process: Ray's serializers for these types are restored to
    exactly what they were before (usually none: JAX's own pickling)."""
    global _placement
    with _registration.lock:
        _registration.restore()
        _unpatch_inspect()
        _watch_default_serialization(False)
        _placement = _initial_placement()


def is_registered() -> bool:
    """Whether :func:`register` is in effect in this process."""
    return _registration.active


# --------------------------------------------------------------------------------------------
# every worker: the setup hook


def _call_import_path(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"worker_process_setup_hook {path!r} is not a 'module.function' path")
    return getattr(importlib.import_module(module), attr)()


def _setup_worker() -> None:
    """Ray's ``worker_process_setup_hook`` (by import path, :data:`SETUP_HOOK`): registers
    jaxtransport in this worker with the job's placement, then runs the user's own hook when
    :func:`runtime_env` chained one given as an import path."""
    register(os.environ.get(_PLACEMENT_ENV) or "device")
    user_hook = os.environ.get(_USER_HOOK_ENV)
    if user_hook:
        _call_import_path(user_hook)


def _chain(user_hook: Callable[[], Any]) -> Callable[[], Any]:
    """A hook that registers jaxtransport and then calls ``user_hook`` (a callable). Ray
    pickles it with cloudpickle and runs it in every worker."""

    def jaxtransport_setup_hook() -> None:
        _setup_worker()
        return user_hook()

    setattr(jaxtransport_setup_hook, _CHAINED, user_hook)
    return jaxtransport_setup_hook


def runtime_env(
    base: Mapping[str, Any] | None = None, *, placement: str | None = None, huge_pages: bool = True
) -> dict:
    """A Ray runtime_env (a new dict) whose ``worker_process_setup_hook`` registers jaxtransport
    in every worker process of the job, merged with ``base``.

    - Everything in ``base`` (a dict or ``ray.runtime_env.RuntimeEnv``) is kept; ``base`` is
      not modified.
    - A hook already in ``base`` is chained: jaxtransport registers first, then the user's hook
      runs (an import-path string is passed on through the ``JAXTRANSPORT_RAY_USER_HOOK`` env
      var; a callable is wrapped in a closure that Ray pickles). Applying ``runtime_env`` twice
      changes nothing.
    - ``placement`` is how workers materialize arrays they receive ("device", "host",
      "preserve"); ``None`` keeps what ``base`` set, else "device". For "preserve" of a sharded
      array the workers need the sender's devices: for CPU meshes set ``XLA_FLAGS`` (e.g.
      ``--xla_force_host_platform_device_count=8``) in ``env_vars``.
    - When this process has 64-bit types enabled, workers get ``JAX_ENABLE_X64=1`` unless
      ``base`` sets it, so float64/int64/complex128 arrays arrive bit-exact.
    - ``huge_pages`` (default True) adds ``glibc.malloc.hugetlb=1`` to the workers'
      ``GLIBC_TUNABLES`` (after ``base``'s value, else this process's), so that JAX's large
      host buffers get transparent huge pages as numpy's do and results are copied into the
      object store as fast as numpy arrays (*Huge pages* in the Troubleshooting page).
      ``huge_pages=False`` leaves malloc alone.

    Use it as the job's runtime_env (``ray.init(runtime_env=...)`` or a job submission);
    jaxtransport must be importable in the workers (installed there, or shipped with
    ``py_modules``).
    """
    env = dict(base) if base is not None else {}
    env_vars = {str(k): str(v) for k, v in dict(env.get("env_vars") or {}).items()}
    if placement is None:
        placement = env_vars.get(_PLACEMENT_ENV, "device")
    _codec.check_placement(placement)
    env_vars[_PLACEMENT_ENV] = placement

    hook = env.get("worker_process_setup_hook")
    if hook is None or hook == SETUP_HOOK or hook is _setup_worker or hasattr(hook, _CHAINED):
        env["worker_process_setup_hook"] = hook if hook is not None else SETUP_HOOK
    elif isinstance(hook, str):
        previous = env_vars.get(_USER_HOOK_ENV)
        if previous not in (None, hook):
            raise ValueError(
                f"runtime_env: base sets worker_process_setup_hook={hook!r} and "
                f"{_USER_HOOK_ENV}={previous!r}; jaxtransport can chain one hook given as an "
                "import path. Combine them into one function and pass its import path."
            )
        env_vars[_USER_HOOK_ENV] = hook
        env["worker_process_setup_hook"] = SETUP_HOOK
    elif callable(hook):
        env["worker_process_setup_hook"] = _chain(hook)
    else:
        raise TypeError(
            "runtime_env: worker_process_setup_hook must be a callable or a "
            f"'module.function' import path string, got {type(hook).__name__}: {hook!r}."
        )

    env["env_vars"] = _procenv.child_jax_env(env_vars, huge_pages=huge_pages)
    return env


def init(*, placement: str = "device", huge_pages: bool = True, **ray_init_kwargs: Any) -> Any:
    """``ray.init(**ray_init_kwargs)`` with :func:`runtime_env` merged into its ``runtime_env``,
    then :func:`register` on the driver. Returns what ``ray.init`` returns.

    ``placement`` applies to the driver and to every worker of the job; ``huge_pages`` is
    :func:`runtime_env`'s. If Ray is already
    initialized, ``ray.init`` raises as usual; with ``ignore_reinit_error=True`` the running
    job keeps its runtime_env, so unless it was started with jaxtransport's hook a
    RuntimeWarning says that worker results will use Ray's default serialization.
    """
    _codec.check_placement(placement)
    kwargs = dict(ray_init_kwargs)
    was_initialized = ray.is_initialized()
    kwargs["runtime_env"] = runtime_env(kwargs.get("runtime_env"), placement=placement, huge_pages=huge_pages)
    context = ray.init(**kwargs)
    register(placement)
    if was_initialized and not _job_has_hook():
        warnings.warn(
            "jaxtransport.ray.init(): Ray was already initialized without jaxtransport's "
            "worker setup hook, so only this driver is registered: arrays it sends are "
            "zero-copy, but results computed in workers come back through Ray's default "
            "(in-band, copying) serialization. Fix: ray.shutdown() first, or pass "
            "runtime_env=jaxtransport.ray.runtime_env(...) to your first ray.init().",
            RuntimeWarning,
            stacklevel=2,
        )
    return context


def _job_has_hook() -> bool:
    try:
        env = ray.get_runtime_context().runtime_env or {}
        return _PLACEMENT_ENV in (env.get("env_vars") or {})
    except Exception:  # pragma: no cover - a Ray without runtime contexts
        return False
