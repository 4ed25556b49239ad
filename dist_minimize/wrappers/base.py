"""`OptimizerWrapper`: override some stages of a dist_minimize optimizer, delegate the rest."""

from __future__ import annotations

import contextlib
from typing import Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.step import stages
from dist_minimize.step.stages import variable_name
from dist_minimize.staged import StagedOptimizer, _delegated_learning_rate


@keras.saving.register_keras_serializable(package="dist_minimize")
class OptimizerWrapper(StagedOptimizer):
    """Wraps a dist_minimize optimizer and delegates every stage to it.

    Subclass it and override only what a feature needs (every hook is public; see
    docs/writing-a-wrapper.md):

    * the six stages: call `super()` to reach the wrapped optimizer's stage;
    * `build_state(var_list)`: create the wrapper's state with `self.add_variable` and
      `self.add_slot` (one per trainable variable, replicated or replica-local);
      `self.slot(name, variable)` finds it again;
    * `run_update(grads_and_vars, top=..., aggregate=...)`: what runs per update rather
      than per micro-step (gradient accumulation overrides it);
    * `update_condition(grads_and_vars)`: the agreed condition for applying an update;
    * `on_applied(grads_and_vars)` / `on_skipped()`: what follows an applied or a
      skipped update (called on every optimizer of the stack; no need to chain);
    * `once_per_stack = True` or `check_stack()`: which stacks are valid.

    Everything else (iterations, learning rate, the non-finite guard's setting,
    statistics) goes to the wrapped optimizer. State is checkpointed and saved with the
    optimizer, each variable once. `dist_minimize.distribute` holds the collectives and
    the agreed branch (`run_if`) a wrapper may need, and `swap_values` puts other values
    (averages) into the model's variables and back.

    Stacking order: the outermost wrapper's stage runs first and calls inward, so
    `A(B(Optimizer(...)))` runs A's `transform_loss`, then B's, then the optimizer's; the
    same for every stage. `model.fit` and `minimize` drive the outermost object.

    Args:
      optimizer: a `dist_minimize.Optimizer` or another `OptimizerWrapper`.
      name: the wrapper's name.

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer.

    Example:
      >>> class ScaleLoss(dist_minimize.OptimizerWrapper):
      ...     def transform_loss(self, loss):
      ...         return super().transform_loss(loss * 2.0)
    """

    def __init__(self, optimizer: StagedOptimizer, name: str | None = None):
        if not isinstance(optimizer, StagedOptimizer):
            raise TypeError(
                "`optimizer` must be a dist_minimize optimizer (`dist_minimize.Optimizer` "
                "or an `OptimizerWrapper`); to wrap a Keras optimizer use "
                f"`dist_minimize.Optimizer(keras_optimizer)`. Received: optimizer="
                f"{optimizer!r} of type {type(optimizer).__name__}")
        super().__init__(learning_rate=_delegated_learning_rate, name=name)
        self.wrapped = optimizer
        self.check_stack()
        self._dm_constructed = True

    #: Whether a stack may hold at most one wrapper of this class (checked at construction).
    once_per_stack: bool = False

    #: Wrappers that may not sit OUTSIDE this one, by class name (a subclass counts as its
    #: base), each with the error that says why (`{outer}` names the refused wrapper).
    refuses_outside: dict = {}

    def check_stack(self) -> None:
        """Raises if this wrapper cannot sit on `self.wrapped`'s stack.

        Called by the constructor. Default: with `once_per_stack`, refuses a stack that
        already holds a wrapper of this class, and refuses to wrap a stack whose wrappers
        name this class in their `refuses_outside`. Override to add rules (call `super()`).

        Raises:
          ValueError: an invalid stack, naming the wrapper.
        """
        if self.once_per_stack and self.wrapped.find(type(self)) is not None:
            raise ValueError(f"The wrapped optimizer already holds a {type(self).__name__}; one "
                             f"{type(self).__name__} per stack. Received: a nested {type(self).__name__}")
        mine = {c.__name__ for c in type(self).__mro__}
        for inner in self.wrapped.stack():
            for name, why in type(inner).refuses_outside.items() if hasattr(type(inner), "refuses_outside") else ():
                if name in mine:
                    raise ValueError(why.format(outer=type(self).__name__))

    # -- stages: delegate ----------------------------------------------------------------

    def transform_loss(self, loss):
        """Delegates to the wrapped optimizer."""
        return self.wrapped.transform_loss(loss)

    def get_gradients(self, loss, variables, tape, loss_fn=None):
        """Delegates to the wrapped optimizer."""
        return stages.get_gradients(self.wrapped, loss, variables, tape, loss_fn)

    get_gradients._dm_default_stage = True  # delegation, not an override (see `scale_loss`)

    def transform_unaggregated_gradients(self, grads_and_vars):
        """Delegates to the wrapped optimizer."""
        return self.wrapped.transform_unaggregated_gradients(grads_and_vars)

    def aggregate_gradients(self, grads_and_vars):
        """Delegates to the wrapped optimizer."""
        return self.wrapped.aggregate_gradients(grads_and_vars)

    def transform_gradients(self, grads_and_vars):
        """Delegates to the wrapped optimizer."""
        return self.wrapped.transform_gradients(grads_and_vars)

    def apply_updates(self, grads_and_vars):
        """Delegates to the wrapped optimizer."""
        self.wrapped.apply_updates(grads_and_vars)

    # -- state: delegate -----------------------------------------------------------------

    def update_condition(self, grads_and_vars):
        """Delegates to the wrapped optimizer (see `StagedOptimizer.update_condition`)."""
        return self.wrapped.update_condition(grads_and_vars)

    def run_update(self, grads_and_vars, *, top, aggregate):
        """Delegates to the wrapped optimizer (see `StagedOptimizer.run_update`)."""
        self.wrapped.run_update(grads_and_vars, top=top, aggregate=aggregate)

    def _build_wrapped(self, var_list):
        self.wrapped.build(var_list)

    @property
    def skip_nonfinite(self) -> bool:
        return self.wrapped.skip_nonfinite

    @property
    def skipped_steps(self):
        return self.wrapped.skipped_steps

    def gradient_stats(self) -> dict:
        """The wrapped optimizer's statistics."""
        return self.wrapped.gradient_stats()

    @property
    def variables(self):
        """The wrapped optimizer's `variables`, then this wrapper's state."""
        return self.wrapped.variables + _compat.own_variables(self)

    @property
    def iterations(self):
        return self.wrapped.iterations

    @property
    def learning_rate(self):
        return self.wrapped.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.wrapped.learning_rate = learning_rate

    def finalize_variable_values(self, var_list):
        """Delegates to the wrapped optimizer."""
        self.wrapped.finalize_variable_values(var_list)

    def get_config(self):
        """The wrapped optimizer, serialised."""
        return {"name": self.name, "optimizer": keras.saving.serialize_keras_object(self.wrapped)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects)
        return cls(**config)


@contextlib.contextmanager
def swap_values(variables: Sequence, values: Sequence):
    """Puts `values` into `variables` for the `with` block, then restores what they held.

    For evaluating or saving with averaged weights (a moving average, SWA): pass the
    model's variables and the averages (e.g. a wrapper's `slots("average")`). Call it
    outside the training step (in the cross-replica context under a strategy, where
    assigning a mirrored variable sets every replica's copy). The previous values are
    restored even if the block raises.

    Raises:
      ValueError: the lists differ in length, or a value's shape differs from its
        variable's (naming it).
    """
    variables, values = list(variables), list(values)
    if len(variables) != len(values):
        raise ValueError(f"`variables` and `values` must have the same length. Received: "
                         f"{len(variables)} variables and {len(values)} values")
    for v, x in zip(variables, values):
        if tuple(v.shape) != tuple(x.shape):
            raise ValueError(f"`swap_values`: {variable_name(v)} has shape {tuple(v.shape)}, its value "
                             f"{tuple(x.shape)}")
    saved = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
    try:
        for v, x in zip(variables, values):
            v.assign(tf.cast(tf.convert_to_tensor(x), v.dtype))
        yield
    finally:
        for v, x in zip(variables, saved):
            v.assign(x)
