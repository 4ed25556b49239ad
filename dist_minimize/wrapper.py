"""`OptimizerWrapper`: override some stages of a dist_minimize optimizer, delegate the rest."""

from __future__ import annotations

import keras

from dist_minimize import _compat
from dist_minimize.optimizer import StagedOptimizer


@keras.saving.register_keras_serializable(package="dist_minimize")
class OptimizerWrapper(StagedOptimizer):
    """Wraps a dist_minimize optimizer and delegates every stage to it.

    Subclass it and override only the stages a feature needs; call `super()` to reach
    the wrapped optimizer's stage. Everything else (state, iterations, learning rate,
    the non-finite guard, statistics, checkpoints) goes to the wrapped optimizer, and the
    wrapper's own variables (created in `build` with `self.add_variable`) are saved with
    it.

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
        super().__init__(learning_rate=0.0, name=name)
        self.wrapped = optimizer
        self._dm_constructed = True

    # -- stages: delegate ----------------------------------------------------------------

    def transform_loss(self, loss):
        """Delegates to the wrapped optimizer."""
        return self.wrapped.transform_loss(loss)

    def get_gradients(self, loss, variables, tape):
        """Delegates to the wrapped optimizer."""
        return self.wrapped.get_gradients(loss, variables, tape)

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

    def _aggregate_and_apply(self, top, grads_and_vars, aggregate):
        self.wrapped._aggregate_and_apply(top, grads_and_vars, aggregate)

    def _refuse_nested(self, what: str) -> None:
        """Raises if the wrapped chain already holds a wrapper of this one's type."""
        if self._find(type(self)) is not None:
            raise ValueError(f"The wrapped optimizer already {what}; one {type(self).__name__} per stack. "
                             f"Received: a nested {type(self).__name__}")

    def _find(self, kind: type):
        """The first optimizer of type `kind` in this wrapper's chain (excluding self)."""
        opt = self.wrapped
        while True:
            if isinstance(opt, kind):
                return opt
            if not isinstance(opt, OptimizerWrapper):
                return None
            opt = opt.wrapped

    # -- state: delegate -----------------------------------------------------------------

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        """Builds the wrapped optimizer (and this wrapper's own state in subclasses)."""
        if self.built:
            return
        self.wrapped.build(var_list)
        super().build(var_list)

    @property
    def skip_nonfinite(self) -> bool:
        return self.wrapped.skip_nonfinite

    def _record_skip(self):
        self.wrapped._record_skip()

    @property
    def skipped_steps(self):
        return self.wrapped.skipped_steps

    def gradient_stats(self) -> dict:
        """The wrapped optimizer's statistics."""
        return self.wrapped.gradient_stats()

    @property
    def variables(self):
        return self._variables + self.wrapped.variables

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
