"""The names of the device benchmark's rows (``benchmarks/device.py``), which the page figures
(``benchmarks/figures.py``) find its results by: each is ``(name, transport)`` in
``device.json``. Here, below both, so that the figures need not import the benchmark (which
itself writes its results through the runner, which renders the figures)."""

from __future__ import annotations

D2H, H2D = ("D2H", "np.asarray"), ("H2D", "jax.device_put")
#: The same limits measured again at the end of the run.
D2H_AGAIN, H2D_AGAIN = "np.asarray (again, last)", "jax.device_put (again, last)"
#: (row name, jaxtransport transport, stock transport): the questions measured against a limit.
QUESTIONS = (
    ("dumps", "jt.dumps", "pickle.dumps (JAX's reducer)"),
    ("loads", "jt.loads", "pickle.loads (JAX's reducer)"),
    ("codec round trip", "jt.dumps + jt.loads", "pickle.dumps + loads (JAX's reducer)"),
    ("Pool argument", "jaxtransport.Pool", "np.asarray + multiprocessing.Pool"),
    ("Pool production", "jaxtransport.Pool (tiny result)", None),
    ("Pool result", "jaxtransport.Pool (placement=device)", "multiprocessing.Pool + jax.device_put"),
    ("Queue", "jaxtransport.multiprocessing.Queue", "np.asarray + multiprocessing.Queue"),
)
