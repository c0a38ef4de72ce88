"""jaxtransport: move JAX arrays between processes at memory speed, faithfully.

Importing this package has no side effects: it registers nothing, starts no JAX backend and no
process, and does not import Ray (``jaxtransport.ray`` does, when you import it).
"""

from ._codec import PLACEMENTS as PLACEMENTS
from ._codec import PlacementFallbackWarning as PlacementFallbackWarning
from ._errors import ArrayDeletedError as ArrayDeletedError
from ._errors import CorruptTransferError as CorruptTransferError
from ._errors import DtypeUnavailableError as DtypeUnavailableError
from ._errors import PlacementError as PlacementError
from ._errors import PoolStateError as PoolStateError
from ._errors import PoolTerminatedError as PoolTerminatedError
from ._errors import ShmCapacityError as ShmCapacityError
from ._errors import ShmHandleError as ShmHandleError
from ._errors import TracerTransportError as TracerTransportError
from ._errors import TransportError as TransportError
from ._errors import UnsupportedArrayError as UnsupportedArrayError
from ._errors import WorkerLostError as WorkerLostError
from ._pickling import dumps as dumps
from ._pickling import is_registered as is_registered
from ._pickling import loads as loads
from ._pickling import register as register
from ._pickling import unregister as unregister
from ._tracers import check_transportable as check_transportable
from .pool import Pool as Pool
from .pool import SharedTree as SharedTree

__version__ = "0.1.0"

__all__ = [
    "PLACEMENTS",
    "ArrayDeletedError",
    "CorruptTransferError",
    "DtypeUnavailableError",
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
    "is_registered",
    "loads",
    "register",
    "unregister",
]
