"""The accelerator kinds jaxtransport knows, one small class each behind one interface.

Modelled on Ray's accelerator managers (``python/ray/_private/accelerators/``). Each kind
answers, without starting any runtime (a JAX backend in the parent would take the device):

- :meth:`Kind.host_ids`: which devices of this kind this process may see (the host's, narrowed by
  the visibility variable when it is set);
- :meth:`Kind.visible_env`: the variables that give a child exactly the devices named;
- :meth:`Kind.off_env`: the variables that keep a child off every device of this kind;

and states :attr:`Kind.exclusive`: whether one device can be opened by one process only. A TPU
chip can (libtpu takes a lock per chip: a second process fails with "The TPU is already in use"
or "Internal error when accessing libtpu multi-process lockfile"); a GPU can be shared between
processes. Nothing outside this package branches on a kind's name.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from typing import ClassVar

from .. import _os

__all__ = ["KINDS", "Gpu", "Kind", "Tpu"]


class Kind:
    """One kind of accelerator (see the module docstring)."""

    #: JAX's platform names for it (``JAX_PLATFORMS`` entries, ``Device.platform``).
    platforms: ClassVar[tuple[str, ...]] = ()
    #: The variable that lists the devices a process may open.
    visibility_var: ClassVar[str] = ""
    #: One device, one process.
    exclusive: ClassVar[bool] = False
    #: What to call one device in messages ("chip", "GPU").
    noun: ClassVar[str] = "device"

    def host_count(self) -> int:
        """How many devices of this kind the host has (0: none), read from the OS."""
        raise NotImplementedError

    def host_ids(self, environ: Mapping[str, str]) -> list[str]:
        """The ids of the devices a process with ``environ`` may see."""
        visible = environ.get(self.visibility_var)
        count = self.host_count()
        if visible is not None:
            ids = [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
            return ids if count else []
        return [str(i) for i in range(count)]

    def visible_env(self, ids: Sequence[str], host_count: int) -> dict[str, str | None]:
        """The variables that give a child exactly the devices ``ids``."""
        return {self.visibility_var: ",".join(ids)}

    def off_env(self) -> dict[str, str | None]:
        """The variables that keep a child off every device of this kind (JAX on the CPU)."""
        return {"JAX_PLATFORMS": "cpu"}


class Tpu(Kind):
    """Google TPU chips. Counted as Ray counts them (``/dev/accel*``, else ``/dev/vfio/<n>``);
    a child gets its chips through ``TPU_VISIBLE_CHIPS`` with ``TPU_CHIPS_PER_HOST_BOUNDS`` and
    ``TPU_HOST_BOUNDS`` for the chips' shape, as Ray's ``TPUAcceleratorManager`` sets them
    (``set_current_process_visible_accelerator_ids``): one chip ``1,1,1``, two ``1,2,1``, four
    ``2,2,1``; all the host's chips, none of the bounds (libtpu's defaults)."""

    platforms = ("tpu",)
    visibility_var = "TPU_VISIBLE_CHIPS"
    exclusive = True
    noun = "chip"
    dev_root: ClassVar[str] = "/dev"  # tests point this at a fake /dev

    _BOUNDS: ClassVar[dict[int, str]] = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}

    def host_count(self) -> int:
        accel = glob.glob(os.path.join(self.dev_root, "accel[0-9]*"))
        if accel:
            return len(accel)
        return len(glob.glob(os.path.join(self.dev_root, "vfio", "[0-9]*")))

    def visible_env(self, ids: Sequence[str], host_count: int) -> dict[str, str | None]:
        if len(ids) == host_count:
            return {self.visibility_var: ",".join(ids), "TPU_CHIPS_PER_HOST_BOUNDS": None, "TPU_HOST_BOUNDS": None}
        bounds = self._BOUNDS.get(len(ids))
        if bounds is None:
            raise ValueError(
                f"devices_per_worker={len(ids)}: a process on a TPU host can hold 1, 2 or 4 chips "
                f"(or all {host_count}); libtpu has no chip layout for {len(ids)}."
            )
        return {self.visibility_var: ",".join(ids), "TPU_CHIPS_PER_HOST_BOUNDS": bounds, "TPU_HOST_BOUNDS": "1,1,1"}


class Gpu(Kind):
    """NVIDIA GPUs (as the driver lists them: ``_os.nvidia_gpu_count``), through ``CUDA_VISIBLE_DEVICES``. Several
    processes can share one GPU (each worker gets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``)."""

    platforms = ("cuda", "gpu", "rocm")
    visibility_var = "CUDA_VISIBLE_DEVICES"
    noun = "GPU"

    def host_count(self) -> int:
        return _os.nvidia_gpu_count()


KINDS: tuple[Kind, ...] = (Tpu(), Gpu())
