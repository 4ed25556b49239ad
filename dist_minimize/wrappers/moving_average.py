"""An exponential moving average of the weights."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.optimizer import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative_int, check_unit_interval
from dist_minimize.wrappers.averaging import AveragingWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class MovingAverage(AveragingWrapper):
    """Keeps an exponential moving average of the weights (TF Addons' MovingAverage, for Keras 3).

    With t the number of applied updates including the current one (a skipped step
    changes nothing): after update t, if t <= `start_step` the average is the weights;
    otherwise, with k = t - `start_step` and d = `average_decay` (with `dynamic_decay`,
    d = min(average_decay, (1 + k) / (10 + k))), average = d * average + (1 - d) * w.
    The averages start as the weights at `build`. Under MirroredStrategy it works in
    `fit` and `tf.function` (Keras 3's own `use_ema` with `ema_overwrite_frequency`
    raises there).

    Evaluate or save with the averages: `with opt.averaged_weights(): ...`,
    `opt.assign_average_vars()` at the end, or `dist_minimize.callbacks.AveragedWeights`.

    Args:
      optimizer: a dist_minimize optimizer.
      average_decay: d, in [0, 1].
      dynamic_decay: use min(average_decay, (1 + k) / (10 + k)) (a faster start).
      start_step: updates before averaging begins (>= 0).

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer, or a bool/number given
        as the other.
      ValueError: `average_decay` outside [0, 1], `start_step` < 0, or a second
        MovingAverage in the stack.
    """

    def __init__(self, optimizer: StagedOptimizer, average_decay: float = 0.99, dynamic_decay: bool = False,
                 start_step: int = 0, name: str | None = None):
        average_decay = check_unit_interval("average_decay", average_decay)
        start_step = check_nonnegative_int("start_step", start_step)
        if not isinstance(dynamic_decay, bool):
            raise TypeError(f"`dynamic_decay` must be a bool. Received: dynamic_decay={dynamic_decay!r}")
        super().__init__(optimizer, name=name)
        self.average_decay = average_decay
        self.dynamic_decay = dynamic_decay
        self.start_step = start_step

    def decay_at(self, t: tf.Tensor) -> tf.Tensor:
        """The decay d used after update t (float32; 0 while t <= start_step)."""
        t = tf.cast(t, tf.float32)
        k = t - float(self.start_step)
        d = tf.constant(self.average_decay, tf.float32)
        if self.dynamic_decay:
            d = tf.minimum(d, (1.0 + k) / (10.0 + k))
        return tf.where(k <= 0.0, tf.zeros_like(d), d)

    def on_applied(self, grads_and_vars):
        """Moves each average toward the updated weights."""
        d = self.decay_at(self.iterations)
        updates = []
        for _, v in grads_and_vars:
            average = self.average_of(v)
            decay = tf.cast(d, average.dtype)
            updates.append((average, decay * tf.convert_to_tensor(average) + (1.0 - decay) * tf.convert_to_tensor(v)))
        distribute.flush_updates(updates)

    def get_config(self):
        """The wrapped optimizer and the averaging settings."""
        config = super().get_config()
        config.update(average_decay=self.average_decay, dynamic_decay=self.dynamic_decay,
                      start_step=self.start_step)
        return config
