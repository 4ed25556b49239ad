"""Which stacks may be updated device by device under a merge-call strategy
(`StagedOptimizer._per_device_ok`), and the device whose copies the update being traced
writes."""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

# The device types on which the guarded update may be made device by device. An
# unlowered If runs its branch as a function on its own device, without soft placement:
# an op of the update with no kernel for that device fails there, where the lowered cond
# of `run_if` would have placed it on the host (int64 FloorMod, in SWA's and Lookahead's
# schedules, has no GPU kernel). Only CPUs are checked here; `ci/gpu_check.py` runs the
# per-device update on GPUs with "GPU" added, and reports whether it works there.
PER_DEVICE_TYPES: tuple[str, ...] = ("CPU",)

# What a class outside this package may define on an optimizer of a stack that is still
# updated device by device: the stages that run before the update, and set-up. Any other
# method (a step hook, or a helper one of this package's hooks calls, such as
# MovingAverage.decay_at) may synchronise, which a per-device branch cannot hold.
_PRE_UPDATE_METHODS = frozenset((
    "__init__", "__repr__", "transform_loss", "get_gradients", "transform_unaggregated_gradients",
    "aggregate_gradients", "transform_gradients", "update_condition", "build", "build_state",
    "check_stack", "get_config", "from_config", "finalize_variable_values"))


def class_fits(cls: type, step_hooks: Sequence[str]) -> bool:
    """Whether an optimizer of class `cls` may be updated device by device: each of its
    `step_hooks` is defined by a class that declares `_dm_per_device_hooks`, and the
    classes of its MRO before this package's own define only `_PRE_UPDATE_METHODS` (or
    declare `_dm_per_device_hooks` themselves)."""
    for hook in step_hooks:
        owner = next(c for c in cls.__mro__ if hook in c.__dict__)
        if not owner.__dict__.get("_dm_per_device_hooks", False):
            return False
    for c in cls.__mro__:
        if c.__module__.split(".")[0] == "dist_minimize":
            return True
        if "_dm_per_device_hooks" in c.__dict__:
            return bool(c.__dict__["_dm_per_device_hooks"])
        for name, value in c.__dict__.items():
            if name in _PRE_UPDATE_METHODS or (name.startswith("__") and name.endswith("__")
                                                and name not in ("__getattr__", "__getattribute__")):
                continue
            if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
                return False
    return True


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
