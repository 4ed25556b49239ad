"""The device types on which the guarded update may be made device by device under a
merge-call strategy (`StagedOptimizer._per_device_ok`), and the device whose copies the
update being traced writes."""

from __future__ import annotations

import contextlib
import threading

# The device types on which the guarded update may be made device by device. An
# unlowered If runs its branch as a function on its own device, without soft placement:
# an op of the update with no kernel for that device fails there, where the lowered cond
# of `run_if` would have placed it on the host (int64 FloorMod, in SWA's and Lookahead's
# schedules, has no GPU kernel). Only CPUs are checked here; `ci/gpu_check.py` runs the
# per-device update on GPUs with "GPU" added, and reports whether it works there.
PER_DEVICE_TYPES: tuple[str, ...] = ("CPU",)

class _OnDevice(threading.local):
    index: int | None = None


# The device whose copies the update being traced writes (per-device update), or None.
_ON_DEVICE = _OnDevice()


@contextlib.contextmanager
def on_device(index: int):
    previous, _ON_DEVICE.index = _ON_DEVICE.index, index
    try:
        yield
    finally:
        _ON_DEVICE.index = previous
