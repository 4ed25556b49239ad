"""Loss scaling for mixed precision, with the skip decision made on aggregated gradients."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.step.finite import all_finite
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_positive_finite, check_positive_int, map_gradient
from dist_minimize.wrappers.base import OptimizerWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class LossScaleOptimizer(OptimizerWrapper):
    """Scales the loss, unscales the aggregated gradients, and skips non-finite steps.

    * `transform_loss` multiplies the loss by the current scale;
    * `transform_gradients` first divides the AGGREGATED gradients by the scale, then
      hands them to the wrapped optimizer's transforms (so a global-norm clipper sees
      unscaled gradients);
    * the non-finite check runs on those aggregated gradients, which are identical on
      every replica and every worker: a step with an inf/NaN anywhere is skipped by all,
      and the scale is divided by `growth_factor` on all (Keras 3's own
      `LossScaleOptimizer` decides from replica 0's local gradients instead, so an inf on
      another replica reaches the weights, or one worker skips while another waits in
      the all-reduce);
    * dynamic mode: after `growth_interval` finite steps in a row the scale is multiplied
      by `growth_factor`. Fixed mode (`dynamic=False`): the scale never changes, and
      non-finite steps are still skipped.

    `transform_unaggregated_gradients` and `aggregate_gradients` see SCALED gradients
    (aggregation is linear, so unscaling after it is equivalent and keeps float16
    gradients away from underflow until then).

    With `model.compile` under a `mixed_float16` policy, pass `auto_scale_loss=False`:
    otherwise Keras wraps the optimizer in its own `LossScaleOptimizer`, which
    dist_minimize refuses with an error.

    Args:
      optimizer: a dist_minimize optimizer (its stages do the rest).
      initial_scale: the starting scale (Keras's default, 2**15).
      dynamic: adjust the scale (default) or keep it fixed.
      growth_interval: finite steps in a row before the scale grows (Keras: 2000).
      growth_factor: the factor by which the scale grows, and shrinks on a skip (2.0).

    State (checkpointed and saved): `loss_scale`, `good_steps`; skips are counted in
    the wrapped optimizer's `skipped_steps`.

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer.
      ValueError: a non-positive or non-finite `initial_scale`, a `growth_interval` < 1,
        or a `growth_factor` <= 1.
    """

    shards_state = True  # per-variable work on the pairs it is given (docs/sharding.md)

    def __init__(self, optimizer: StagedOptimizer, initial_scale: float = 2.0 ** 15, dynamic: bool = True,
                 growth_interval: int = 2000, growth_factor: float = 2.0, name: str | None = None):
        initial_scale = check_positive_finite("initial_scale", initial_scale)
        growth_interval = check_positive_int("growth_interval", growth_interval)
        growth_factor = check_positive_finite("growth_factor", growth_factor)
        if growth_factor <= 1.0:
            raise ValueError(f"`growth_factor` must be > 1. Received: growth_factor={growth_factor!r}")
        if not isinstance(dynamic, bool):
            raise TypeError(f"`dynamic` must be a bool. Received: dynamic={dynamic!r}")
        super().__init__(optimizer, name=name)
        self.initial_scale = initial_scale
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self._loss_scale = None
        self._good_steps = None

    once_per_stack = True

    def keras_settings(self) -> dict:
        """Keras's `loss_scale_factor` (a fixed scale; None when the scale is dynamic)."""
        return {"loss_scale_factor": None if self.dynamic else self.initial_scale}

    def build_state(self, var_list):
        """Creates `loss_scale` and `good_steps`."""
        self._loss_scale = self.add_variable(
            shape=(), dtype="float32", initializer=keras.initializers.Constant(self.initial_scale),
            aggregation="only_first_replica", name="loss_scale")
        self._good_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="only_first_replica", name="good_steps")

    @property
    def loss_scale(self):
        """The current scale (a variable once built, else the initial value)."""
        return self._loss_scale if self._loss_scale is not None else self.initial_scale

    # -- stages ------------------------------------------------------------------------

    def transform_loss(self, loss):
        """The wrapped optimizer's transformed loss, times the current scale."""
        loss = self.wrapped.transform_loss(loss)
        return loss * tf.cast(tf.convert_to_tensor(self.loss_scale), loss.dtype)

    def transform_gradients(self, grads_and_vars):
        """Divides the aggregated gradients by the scale, then runs the wrapped transforms."""
        scale = tf.convert_to_tensor(self.loss_scale)

        def unscale(g):
            return g / tf.cast(scale, g.dtype)

        unscaled = [(map_gradient(g, unscale) if g is not None else None, v) for g, v in grads_and_vars]
        return self.wrapped.transform_gradients(unscaled)

    def update_condition(self, grads_and_vars):
        """All final gradients finite (whatever the wrapped `skip_nonfinite` says), and,
        in dynamic mode, the scale's bookkeeping: a finite step counts as good and the
        scale grows every `growth_interval` good steps; a non-finite one divides it by
        `growth_factor`. (Made in the step's one cross-replica synchronisation.)"""
        inner = self.wrapped.update_condition(grads_and_vars)
        finite = all_finite([g for g, _ in grads_and_vars])
        if inner is not None:
            finite = tf.logical_and(finite, inner)
        if self.dynamic:
            scale = tf.convert_to_tensor(self._loss_scale)
            good = tf.where(finite, tf.convert_to_tensor(self._good_steps) + 1, tf.zeros([], tf.int64))
            grow = good >= self.growth_interval
            scale = tf.where(finite, tf.where(grow, scale * self.growth_factor, scale), scale / self.growth_factor)
            distribute.assign_replicated(self._loss_scale, scale)
            distribute.assign_replicated(self._good_steps, tf.where(grow, tf.zeros_like(good), good))
        return finite

    @property
    def skip_nonfinite(self) -> bool:
        return True  # loss scaling relies on skipping overflowed steps

    def gradient_stats(self) -> dict:
        """The wrapped statistics plus `loss_scale`."""
        stats = self.wrapped.gradient_stats()
        stats["loss_scale"] = tf.convert_to_tensor(self.loss_scale)
        return stats

    def get_config(self):
        """The wrapped optimizer and the scaling settings."""
        config = super().get_config()
        config.update(initial_scale=self.initial_scale, dynamic=self.dynamic,
                      growth_interval=self.growth_interval, growth_factor=self.growth_factor)
        return config
