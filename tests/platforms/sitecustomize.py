"""Runs at every interpreter start-up with this directory on PYTHONPATH (the test process and
every worker it spawns): hides what Linux adds as ``JAXTRANSPORT_SIMULATE`` says (``_simulate``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import _simulate
finally:
    del sys.path[0]

_simulate.hide(os.environ.get("JAXTRANSPORT_SIMULATE", ""))
