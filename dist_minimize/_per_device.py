"""The guarded update made device by device under a merge-call strategy
(`StagedOptimizer.run_update`): whether a stack can be (`PerDeviceUpdate._per_device_ok`),
how (`_update_device_by_device`), and the device whose copies the update being traced
writes. A mixin of `StagedOptimizer`."""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from dist_minimize import _compat, distribute


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


class PerDeviceUpdate:
    """The device-by-device guarded update (see the module docstring)."""

    def _update_device_by_device(self, condition: tf.Tensor, grads_and_vars: list, pending: list) -> None:
        """The guarded update under a merge-call strategy, one `If` per device
        (`distribute.run_if_per_device`), each writing that device's copies."""
        variables = [v for _, v in grads_and_vars]
        _compat.check_variables_are_known(self.stack()[-1].inner_optimizer, variables)

        def apply_on(index, grads):
            with on_device(index):
                self._apply_and_notify(list(zip(grads, variables)))

        def skip_on(index):
            with on_device(index):
                self._notify_skipped()

        distribute.run_if_per_device(condition, apply_on, args=([g for g, _ in grads_and_vars],),
                                     otherwise=skip_on, updates=pending)

    def _per_device_ok(self, grads_and_vars: list) -> bool:
        """Whether this stack's update can be made device by device under a merge-call
        strategy (`distribute.run_if_per_device`), instead of by `run_if`.

        Why: `run_if` takes its branch once in the cross-replica context, and TensorFlow
        lowers that multi-device `tf.cond` into a Switch and an Identity per input per
        device (about 800 at 100 variables on 2 devices: a 1.13x step). One unlowered
        cond per device holds the same update and costs one kernel each (where its ops
        have kernels for the device: `_compat.unlowered_cond`).

        The step hooks (`apply_updates`, `on_applied`, `on_skipped`) may run device by
        device because their contract allows only reading and writing variables (no
        collective: `_apply_and_notify` checks it, for every class alike). Yes when
        every variable has one copy per device (not so under CentralStorageStrategy),
        and the Keras update rule at the bottom keeps Keras's own `apply` path
        (`_compat.keras_apply_on_device_blocker`: Nadam, Muon, MultiOptimizer,
        constraints, ... keep `run_if`).
        """
        rule = self.stack()[-1].__dict__.get("inner_optimizer")  # the Keras update rule, if any
        if rule is None:
            return False
        if not distribute.has_copy_per_device([v for _, v in grads_and_vars] + [self.iterations]):
            return False
        return _compat.keras_apply_on_device_blocker(rule, grads_and_vars) is None
