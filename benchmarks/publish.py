"""``python -m benchmarks.publish [--check]``: rewrite every figure in the README and docs/ from the
published results files (benchmarks/results/*.json) without running a benchmark; see
:mod:`benchmarks.figures`."""

import sys

from .figures import main

if __name__ == "__main__":
    sys.exit(main())
