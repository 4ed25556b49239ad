"""The guarded update made device by device (`StagedOptimizer.run_update`): whether a
stack's can be (`possible`), how (`update`), and the device whose copies the update
being traced writes (`StepContext.device`). Functions of the stack's outermost
optimizer, not methods of it: a wrapper author never meets them."""

from __future__ import annotations

import contextlib

import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.step.context import CONTEXT


@contextlib.contextmanager
def on_device(index: int, inputs: tuple | None = None):
    """The update traced inside writes the copies of device `index` (`StepContext.device`)."""
    previous = CONTEXT.device, CONTEXT.rule_inputs
    CONTEXT.device, CONTEXT.rule_inputs = index, inputs
    try:
        yield
    finally:
        CONTEXT.device, CONTEXT.rule_inputs = previous


def update(top, condition: tf.Tensor, grads_and_vars: list, pending: list, scaled: tuple | None = None) -> None:
    """The guarded update made device by device: under a merge-call strategy one `If`
    per device (`distribute.run_if_per_device`), each writing that device's copies;
    elsewhere (one device, each Horovod process) `run_if`'s one `If`, on device 0.
    The rule's step counter and learning rate are read before the branch
    (`_compat.keras_update_inputs`), so that only gradient work waits for it.
    `scaled`: `distribute.known_scaled` of the gradients, read within the step: the
    unscaled gradients and their factor, the products then made in the branch."""
    variables = [v for _, v in grads_and_vars]
    rule = top.stack()[-1].inner_optimizer
    _compat.check_variables_are_known(rule, variables)
    grads, inputs = [g for g, _ in grads_and_vars], _compat.keras_update_inputs(rule)
    grads, factor = scaled or (grads, None)  # (`distribute.scale`: the same op, the same values)

    def apply_on(index, grads, inputs, factor):
        if factor is not None:
            grads = [None if g is None else distribute.scale(g, factor) for g in grads]
        with on_device(index, inputs):
            top._apply_and_notify(list(zip(grads, variables)))

    def skip_on(index):
        with on_device(index):
            top._notify_skipped()

    if distribute.uses_merge_call():
        distribute.run_if_per_device(condition, apply_on, args=(grads, inputs, factor), otherwise=skip_on,
                                     updates=pending)
    else:
        distribute.run_if(condition, lambda *args: apply_on(0, *args), args=(grads, inputs, factor),
                          otherwise=lambda: skip_on(0), updates=pending)


def possible(top, grads_and_vars: list) -> bool:
    """Whether the guarded update of `top`'s stack can be made device by device
    (`update`), instead of by `run_if` around the whole stack.

    Why: under a merge-call strategy `run_if` takes its branch once in the
    cross-replica context, and TensorFlow lowers that multi-device `tf.cond` into a
    Switch and an Identity per input per device (about 800 at 100 variables on 2
    devices: a 1.13x step). One unlowered cond per device holds the same update and
    costs one kernel each (where its ops have kernels for the device:
    `_compat.unlowered_cond`). On every backend, the Keras rule's own scalar work
    (its step counter, its learning rate) is then read before the branch.

    The step hooks (`apply_updates`, `on_applied`, `on_skipped`) may run device by
    device because their contract allows only reading and writing variables (no
    collective: `_apply_and_notify` checks it, for every class alike). Yes when
    every variable has one copy per device (not so under CentralStorageStrategy),
    and the Keras update rule at the bottom keeps Keras's own `apply` path
    (`_compat.keras_apply_on_device_blocker`: Nadam, Muon, MultiOptimizer,
    constraints, ... keep `run_if`).
    """
    rule = top.stack()[-1].__dict__.get("inner_optimizer")  # the Keras update rule, if any
    if rule is None:
        return False
    if distribute.uses_merge_call() and not distribute.has_copy_per_device(
            [v for _, v in grads_and_vars] + [top.iterations]):
        return False
    return _compat.keras_apply_on_device_blocker(rule, grads_and_vars) is None
