"""Write the golden files of jaxtransport's data at rest (run once per array format version).

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python tests/golden/generate.py        # from the repository root

writes ``tests/golden/format_v<FORMAT_VERSION>.pkl``: a plain pickle (builtins only: str, bytes,
int, bool, tuple, dict, list) of one entry per case, each with

- ``dumps``: ``jt.dumps(x)``'s pickle bytes and its out-of-band buffers (as bytes);
- ``pickle5`` / ``pickle4``: ``pickle.dumps(x, protocol=5 / 4)`` with ``jt.register()`` active
  (buffers in-band: what a cache or checkpoint written through pickle holds);
- ``expected``: what the reader must return, independent of jaxtransport: the dtype name, the
  shape, the weak type, the PRNG implementation name (None for plain arrays), the sharding
  (mesh axis names, mesh shape, partition spec as strings; None when unsharded) and the raw
  bytes of the values (the key data for PRNG keys).

Cases: every dtype this JAX has (x64 on, so the 64-bit ones too), a weak-typed scalar, typed
PRNG keys of two implementations, and an array sharded over a 2-device mesh. Never regenerate a
committed file: a new format version adds a new file; tests/test_golden.py reads them all.
"""

from __future__ import annotations

import os
import pickle
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jaxtransport as jt  # noqa: E402
from jaxtransport import _codec, _compat  # noqa: E402
from tests.conftest import weak_typed  # noqa: E402
from tests.test_codec import ALL_DTYPES, random_bits  # noqa: E402

DTYPES = [*ALL_DTYPES, "int64", "uint64", "float64", "complex128"]


def _bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _expected(x, sharding=None) -> dict:
    impl = None
    data = x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = _compat.prng_impl_name(x)
        data = jax.random.key_data(x)
    return {
        "dtype": str(data.dtype),
        "shape": tuple(data.shape),
        "weak_type": bool(getattr(x, "weak_type", False)),
        "prng_impl": impl,
        "sharding": sharding,
        "bits": _bits(data),
    }


def cases() -> dict:
    out = {}
    for i, name in enumerate(DTYPES):
        try:
            x = jnp.asarray(random_bits(name, (2, 3), seed=i))
        except Exception as e:  # this JAX lacks the dtype
            print(f"skipping {name}: {type(e).__name__}")
            continue
        out[f"dtype-{name}"] = x
    out["weak-float32"] = weak_typed(jnp.asarray([1.5, -0.0], jnp.float32))
    out["weak-int32-scalar"] = weak_typed(jnp.asarray(7, jnp.int32))
    out["key-threefry"] = jax.random.key(42)
    out["key-rbg"] = jax.random.split(jax.random.key(7, impl="rbg"), 3)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    out["sharded-x"] = jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(8, 2), NamedSharding(mesh, P("x")))
    return out


def main() -> None:
    assert len(jax.devices()) >= 2, "run with XLA_FLAGS=--xla_force_host_platform_device_count=2"
    entries = {}
    for name, x in cases().items():
        sharding = None
        if name.startswith("sharded"):
            sharding = (tuple(x.sharding.mesh.axis_names), tuple(x.sharding.mesh.devices.shape), str(x.sharding.spec))
        data, buffers = jt.dumps(x)
        jt.register()
        try:
            p5 = pickle.dumps(x, protocol=5)
            p4 = pickle.dumps(x, protocol=4)
        finally:
            jt.unregister()
        entries[name] = {
            "dumps": (bytes(data), [bytes(memoryview(b)) for b in buffers]),
            "pickle5": p5,
            "pickle4": p4,
            "expected": _expected(x, sharding),
        }
    record = {
        "format_version": _codec.FORMAT_VERSION,
        "written_by": {"jax": jax.__version__, "numpy": np.__version__, "jaxtransport": jt.__version__},
        "entries": entries,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"format_v{_codec.FORMAT_VERSION}.pkl")
    with open(path, "wb") as f:
        pickle.dump(record, f, protocol=4)
    print(f"wrote {path}: {len(entries)} entries, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
