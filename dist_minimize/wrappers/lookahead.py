"""Lookahead (Zhang et al. 2019): slow weights that follow the fast ones every k updates."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.wrappers._periodic import on_period
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_positive_int, check_unit_interval
from dist_minimize.wrappers.base import OptimizerWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class Lookahead(OptimizerWrapper):
    """Lookahead around any update rule.

    Slow weights start as the variables at `build`. With t the number of applied
    updates including the current one (a skipped step changes nothing): after update t,
    if t % `sync_period` == 0, slow = slow + `slow_step_size` * (w - slow), then w = slow.
    The slow weights are optimizer state (a replicated `slow` slot per variable), so
    they are identical on every replica, checkpointed and saved.

    Args:
      optimizer: a dist_minimize optimizer (the fast update rule is its own).
      sync_period: k, updates between synchronisations (>= 1).
      slow_step_size: alpha, in (0, 1].

    Raises:
      ValueError: `sync_period` < 1, `slow_step_size` outside (0, 1], or a second
        Lookahead in the stack.
    """

    once_per_stack = True
    shards_state = True  # per-variable work on the pairs it is given, in the step (docs/sharding.md)

    def __init__(self, optimizer: StagedOptimizer, sync_period: int = 6, slow_step_size: float = 0.5,
                 name: str | None = None):
        sync_period = check_positive_int("sync_period", sync_period)
        slow_step_size = check_unit_interval("slow_step_size", slow_step_size, open_low=True)
        super().__init__(optimizer, name=name)
        self.sync_period = sync_period
        self.slow_step_size = slow_step_size

    def build_state(self, var_list):
        """Creates one `slow` slot per variable, starting at its value."""
        for v in var_list:
            self.add_slot(v, "slow", initializer="value")

    def on_applied(self, grads_and_vars):
        """Every `sync_period` updates: moves the slow weights, and the weights to them."""
        variables = [v for _, v in grads_and_vars]
        sync = on_period(self.iterations, self.sync_period)

        def synchronise(values):
            updates = []
            for v, w in zip(variables, values):
                slow = self.slot("slow", v)
                s = tf.convert_to_tensor(slow)
                new = s + tf.cast(self.slow_step_size, s.dtype) * (w - s)
                updates += [(slow, new), (v, new)]
            distribute.flush_updates(updates)

        distribute.run_if(sync, synchronise, args=([tf.convert_to_tensor(v) for v in variables],))

    def get_config(self):
        """The wrapped optimizer and the Lookahead settings."""
        config = super().get_config()
        config.update(sync_period=self.sync_period, slow_step_size=self.slow_step_size)
        return config
