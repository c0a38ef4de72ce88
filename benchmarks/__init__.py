"""jaxtransport benchmarks: `python -m benchmarks [--quick]` runs them all."""
