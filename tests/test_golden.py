"""Data at rest: pickles written by earlier releases load bit-exactly with this one.

``tests/golden/format_v<N>.pkl`` (written once by ``tests/golden/generate.py``, never rewritten)
hold, per case, ``jt.dumps`` output and ``pickle`` protocol 5 and 4 output under
``jt.register()``, with the values expected back written independently of jaxtransport. Every
file is read on every run: the reader accepts every older array format (Note [format versions]
in ``jaxtransport/_codec.py``).
"""

from __future__ import annotations

import glob
import os
import pickle

import jax
import numpy as np
import pytest

import jaxtransport as jt
from jaxtransport import _codec

from .conftest import dtype_missing, run_python

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
FILES = sorted(glob.glob(os.path.join(HERE, "format_v*.pkl")))
WIDE = ("int64", "uint64", "float64", "complex128")


def _load_file(path):
    with open(path, "rb") as f:
        return pickle.load(f)  # builtins only (see generate.py)


def _cases():
    out = []
    for path in FILES:
        record = _load_file(path)
        for name, entry in record["entries"].items():
            for flavor in ("dumps", "pickle5", "pickle4"):
                out.append(pytest.param(path, name, flavor, id=f"{os.path.basename(path)}-{name}-{flavor}"))
    return out


def test_golden_files_exist_for_every_format_version():
    versions = sorted(_load_file(p)["format_version"] for p in FILES)
    assert versions == list(range(_codec.OLDEST_FORMAT_VERSION, _codec.FORMAT_VERSION + 1))
    assert all(os.path.getsize(p) < 64 * 1024 for p in FILES)  # small files in the repository


def _read(entry, flavor, placement):
    if flavor == "dumps":
        data, buffers = entry["dumps"]
        return jt.loads(data, buffers, placement=placement)
    jt.register(placement=placement)
    try:
        return pickle.loads(entry[flavor])
    finally:
        jt.unregister()


@pytest.mark.parametrize("path, name, flavor", _cases())
def test_golden_entry_loads_bit_exactly(path, name, flavor):
    entry = _load_file(path)["entries"][name]
    want = entry["expected"]
    why = dtype_missing(want["dtype"]) if want["dtype"] not in WIDE else None
    if why:
        pytest.skip(why)
    # 64-bit values without x64 (the suite's default) come back as numpy: bits compared as-is.
    placement = "host" if want["dtype"] in WIDE and want["prng_impl"] is None else "device"
    x = _read(entry, flavor, placement)
    data = x
    if want["prng_impl"] is not None:
        assert jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        from jaxtransport import _compat

        assert _compat.prng_impl_name(x) == want["prng_impl"]
        data = jax.random.key_data(x)
    else:
        assert isinstance(x, np.ndarray if placement == "host" else jax.Array)
        assert bool(getattr(x, "weak_type", False)) == want["weak_type"]
    assert str(data.dtype) == want["dtype"] and tuple(data.shape) == want["shape"]
    assert np.ascontiguousarray(np.asarray(data)).view(np.uint8).tobytes() == want["bits"]


def test_golden_sharding_is_preserved_on_a_matching_mesh():
    code = f"""
import pickle, numpy as np, jax, jaxtransport as jt
with open({FILES[-1]!r}, "rb") as f:
    entry = pickle.load(f)["entries"]["sharded-x"]
axes, shape, spec = entry["expected"]["sharding"]
data, buffers = entry["dumps"]
for x in (jt.loads(data, buffers, placement="preserve"),):
    s = x.sharding
    assert tuple(s.mesh.axis_names) == axes and tuple(s.mesh.devices.shape) == shape, s
    assert str(s.spec) == spec, s.spec
    assert np.asarray(x).tobytes() == entry["expected"]["bits"]
print("ok")
"""
    proc = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_reader_accepts_older_versions_and_refuses_newer_ones_by_name():
    x = jax.numpy.arange(4, dtype=jax.numpy.float32)
    meta, buffers = _codec.encode(x)
    for version in range(_codec.OLDEST_FORMAT_VERSION, _codec.FORMAT_VERSION + 1):
        y = _codec.decode(tuple(meta._replace(version=version)), buffers)
        assert np.asarray(y).tobytes() == np.asarray(x).tobytes()
    newer = tuple(meta._replace(version=_codec.FORMAT_VERSION + 1))
    with pytest.raises(jt.UnsupportedArrayError, match=r"newer jaxtransport release.*Upgrade"):
        _codec.decode(newer, buffers)
    with pytest.raises(jt.UnsupportedArrayError, match="newer"):
        _codec.decoder(newer, buffers)()
    with pytest.raises(jt.UnsupportedArrayError, match="Unsupported jaxtransport array format 0"):
        _codec.decode(tuple(meta._replace(version=0)), buffers)
