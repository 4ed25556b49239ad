"""The device whose copies the update being traced writes, when the guarded update is
made device by device under a merge-call strategy (`StagedOptimizer.run_update`)."""

from __future__ import annotations

import contextlib
import threading


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
