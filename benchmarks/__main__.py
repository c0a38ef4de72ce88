"""``python -m benchmarks [--quick]``: run every benchmark, write benchmarks/results/."""

import sys

from .run import main

sys.exit(main())
