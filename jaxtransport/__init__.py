"""jaxtransport: move JAX arrays between processes at memory speed, faithfully.

Importing this package has no side effects: it registers nothing, starts no JAX backend and no
process, and imports neither JAX nor Ray (each name below is imported on first use;
``jaxtransport.ray`` imports Ray when you import it).
"""

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it, imported on first access (PEP 562): importing
# jaxtransport imports neither JAX nor anything else heavy, so a Pool worker that runs numpy-only
# tasks starts without JAX (it imports JAX when a task first needs it).
_PUBLIC = {
    "PLACEMENTS": "._nojax",
    "PlacementFallbackWarning": "._codec",
    "ArrayDeletedError": "._errors",
    "BrokenExecutorError": "._errors",
    "CorruptTransferError": "._errors",
    "DeviceUnavailableError": "._errors",
    "DtypeUnavailableError": "._errors",
    "MainGuardError": "._errors",
    "PlacementError": "._errors",
    "PoolStateError": "._errors",
    "PoolTerminatedError": "._errors",
    "ShmCapacityError": "._errors",
    "ShmHandleError": "._errors",
    "TracerTransportError": "._errors",
    "TransportError": "._errors",
    "UnsupportedArrayError": "._errors",
    "WorkerLostError": "._errors",
    "dumps": "._pickling",
    "is_registered": "._pickling",
    "loads": "._pickling",
    "register": "._pickling",
    "unregister": "._pickling",
    "check_transportable": "._tracers",
    "Executor": ".pool",
    "get_reusable_executor": ".pool",
    "Pool": ".pool",
    "SharedTree": ".pool",
}

if TYPE_CHECKING:
    from ._codec import PlacementFallbackWarning as PlacementFallbackWarning
    from ._errors import ArrayDeletedError as ArrayDeletedError
    from ._errors import BrokenExecutorError as BrokenExecutorError
    from ._errors import CorruptTransferError as CorruptTransferError
    from ._errors import DeviceUnavailableError as DeviceUnavailableError
    from ._errors import DtypeUnavailableError as DtypeUnavailableError
    from ._errors import MainGuardError as MainGuardError
    from ._errors import PlacementError as PlacementError
    from ._errors import PoolStateError as PoolStateError
    from ._errors import PoolTerminatedError as PoolTerminatedError
    from ._errors import ShmCapacityError as ShmCapacityError
    from ._errors import ShmHandleError as ShmHandleError
    from ._errors import TracerTransportError as TracerTransportError
    from ._errors import TransportError as TransportError
    from ._errors import UnsupportedArrayError as UnsupportedArrayError
    from ._errors import WorkerLostError as WorkerLostError
    from ._nojax import PLACEMENTS as PLACEMENTS
    from ._pickling import dumps as dumps
    from ._pickling import is_registered as is_registered
    from ._pickling import loads as loads
    from ._pickling import register as register
    from ._pickling import unregister as unregister
    from ._tracers import check_transportable as check_transportable
    from .pool import Executor as Executor
    from .pool import Pool as Pool
    from .pool import SharedTree as SharedTree
    from .pool import get_reusable_executor as get_reusable_executor


def __getattr__(name: str) -> Any:
    if name in ("data", "multiprocessing"):  # the subpackages, imported on first use (they register nothing)
        return importlib.import_module(f".{name}", __name__)
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"


__all__ = [
    "PLACEMENTS",
    "ArrayDeletedError",
    "BrokenExecutorError",
    "CorruptTransferError",
    "DeviceUnavailableError",
    "DtypeUnavailableError",
    "Executor",
    "MainGuardError",
    "PlacementError",
    "PlacementFallbackWarning",
    "Pool",
    "PoolStateError",
    "PoolTerminatedError",
    "SharedTree",
    "ShmCapacityError",
    "ShmHandleError",
    "TracerTransportError",
    "TransportError",
    "UnsupportedArrayError",
    "WorkerLostError",
    "check_transportable",
    "dumps",
    "get_reusable_executor",
    "is_registered",
    "loads",
    "register",
    "unregister",
]
