"""Stopping a run whose aggregated gradients stay non-finite."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.transforms.base import GradientTransform, check_positive_int


@keras.saving.register_keras_serializable(package="dist_minimize")
class LimitNonFiniteSteps(GradientTransform):
    """Counts consecutive non-finite steps and stops training past a limit.

    Place it in `transform_gradients`. The optimizer's non-finite guard skips every step
    whose aggregated gradients hold an inf or NaN, on all replicas alike; this transform
    counts such steps in a row (reset by a finite step) and, when the count exceeds
    `max_consecutive`, fails the step with `tf.errors.InvalidArgumentError` whose
    message says how many steps were skipped. The count is computed from aggregated
    gradients, so every replica and worker fails at the same step: none is left waiting
    in a collective.

    It needs the guard: building it inside an optimizer with `skip_nonfinite=False`
    raises. Under `LossScaleOptimizer` the guard is always on, and a run whose scale
    keeps falling is stopped here.

    Args:
      max_consecutive: skipped steps in a row that are tolerated (>= 1).

    Raises:
      ValueError: `max_consecutive` < 1, or the optimizer does not skip non-finite steps.
    """

    shards_state = True  # `all_finite` counts every process's share

    def __init__(self, max_consecutive: int = 10):
        self.max_consecutive = check_positive_int("max_consecutive", max_consecutive)
        self._count = None

    def build(self, optimizer, variables):
        """Creates the consecutive-skip counter; refuses an optimizer without the guard."""
        if not optimizer.skip_nonfinite:
            raise ValueError(
                "`limit_nonfinite_steps` needs the optimizer to skip non-finite steps. "
                "Received: skip_nonfinite=False")
        if self._count is None:
            self._count = optimizer.add_variable(shape=(), dtype="int64", initializer="zeros",
                                                 aggregation="only_first_replica",
                                                 name="consecutive_nonfinite_steps")

    def __call__(self, grads_and_vars):
        from dist_minimize.step.finite import all_finite

        grads_and_vars = list(grads_and_vars)
        if self._count is None:
            return grads_and_vars
        distribute.refuse_xla("limit_nonfinite_steps", distribute.ASSERT_DROPPED)
        finite = all_finite([g for g, _ in grads_and_vars])
        count = tf.where(finite, tf.zeros([], tf.int64), tf.convert_to_tensor(self._count) + 1)
        check = tf.debugging.assert_less_equal(
            count, tf.constant(self.max_consecutive, tf.int64),
            message=(f"Training stopped: more than {self.max_consecutive} consecutive steps had "
                     "non-finite aggregated gradients (each was skipped on every replica). "
                     "Lower the learning rate, check the data, or raise max_consecutive."))
        distribute.assign_replicated(self._count, count)
        with tf.control_dependencies([check]):
            out = [(tf.identity(g) if g is not None and not isinstance(g, tf.IndexedSlices) else g, v)
                   for g, v in grads_and_vars]
        distribute.note_all_finite([g for g, _ in out], finite)  # the same values: no second scan
        return out

    def stats(self) -> dict:
        """The current count of consecutive non-finite steps."""
        return {} if self._count is None else {"consecutive_nonfinite_steps": tf.convert_to_tensor(self._count)}

    def get_config(self) -> dict:
        """The transform's configuration."""
        return {"max_consecutive": self.max_consecutive}


def limit_nonfinite_steps(max_consecutive: int = 10) -> LimitNonFiniteSteps:
    """Returns a transform that stops training after `max_consecutive` skipped steps in a row."""
    return LimitNonFiniteSteps(max_consecutive)
