"""An exponential moving average of the weights."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.optimizer import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative_int, check_positive_int, check_unit_interval
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

    Keras's `use_ema=True, ema_momentum=m, ema_overwrite_frequency=f` is
    `MovingAverage(opt, average_decay=m, start_step=1, overwrite_frequency=f,
    assign_on_finalize=True)` (the average is the weights after the first update, then
    moves with momentum m); `dist_minimize.Optimizer` builds exactly that from a Keras
    optimizer with `use_ema=True`.

    Evaluate or save with the averages: `with opt.averaged_weights(): ...`,
    `opt.assign_average_vars()` at the end, or `dist_minimize.callbacks.AveragedWeights`.

    Args:
      optimizer: a dist_minimize optimizer.
      average_decay: d, in [0, 1].
      dynamic_decay: use min(average_decay, (1 + k) / (10 + k)) (a faster start).
      start_step: updates before averaging begins (>= 0).
      overwrite_frequency: None (default), or n >= 1: after every update t with
        t % n == 0 (once the average has moved), the weights are overwritten with the
        averages (Keras's `ema_overwrite_frequency`).
      assign_on_finalize: whether `finalize_variable_values` (which Keras's `fit` calls
        at the end of training) writes the averages into the variables, as Keras's
        `use_ema` does. Default False: call `assign_average_vars()` when you want them.

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer, or a bool/number given
        as the other.
      ValueError: `average_decay` outside [0, 1], `start_step` < 0,
        `overwrite_frequency` < 1, or a second MovingAverage in the stack.
    """

    # Its step hooks only read and write variables: they may run device by device
    # (`StagedOptimizer._per_device_ok`).
    _dm_per_device_hooks = True

    def __init__(self, optimizer: StagedOptimizer, average_decay: float = 0.99, dynamic_decay: bool = False,
                 start_step: int = 0, overwrite_frequency: int | None = None, assign_on_finalize: bool = False,
                 name: str | None = None):
        average_decay = check_unit_interval("average_decay", average_decay)
        start_step = check_nonnegative_int("start_step", start_step)
        if overwrite_frequency is not None:
            overwrite_frequency = check_positive_int("overwrite_frequency", overwrite_frequency)
        for flag, value in (("dynamic_decay", dynamic_decay), ("assign_on_finalize", assign_on_finalize)):
            if not isinstance(value, bool):
                raise TypeError(f"`{flag}` must be a bool. Received: {flag}={value!r}")
        super().__init__(optimizer, name=name)
        self.average_decay = average_decay
        self.dynamic_decay = dynamic_decay
        self.start_step = start_step
        self.overwrite_frequency = overwrite_frequency
        self.assign_on_finalize = assign_on_finalize

    def decay_at(self, t: tf.Tensor) -> tf.Tensor:
        """The decay d used after update t (float32; 0 while t <= start_step)."""
        t = tf.cast(t, tf.float32)
        k = t - float(self.start_step)
        d = tf.constant(self.average_decay, tf.float32)
        if self.dynamic_decay:
            d = tf.minimum(d, (1.0 + k) / (10.0 + k))
        return tf.where(k <= 0.0, tf.zeros_like(d), d)

    def on_applied(self, grads_and_vars):
        """Moves each average toward the updated weights; with `overwrite_frequency`,
        every n-th update also writes the new averages into the weights."""
        d = self.decay_at(self.iterations)
        variables = [v for _, v in grads_and_vars]
        averages = []
        updates = []
        for v in variables:
            average = self.average_of(v)
            decay = tf.cast(d, average.dtype)
            new = decay * tf.convert_to_tensor(average) + (1.0 - decay) * tf.convert_to_tensor(v)
            averages.append(new)
            updates.append((average, new))
        distribute.flush_updates(updates)
        if self.overwrite_frequency is None:
            return
        overwrite = tf.equal(tf.cast(self.iterations, tf.int64) % self.overwrite_frequency, 0)

        def write_averages(values):
            distribute.flush_updates(list(zip(variables, values)))

        distribute.run_if(overwrite, write_averages, args=(averages,))

    def finalize_variable_values(self, var_list):
        """With `assign_on_finalize`, writes the averages into `var_list` (Keras's `fit`
        calls this at the end of training); then the wrapped optimizer's."""
        if self.assign_on_finalize and self.built:
            self.assign_average_vars(var_list)
        super().finalize_variable_values(var_list)

    def get_config(self):
        """The wrapped optimizer and the averaging settings."""
        config = super().get_config()
        config.update(average_decay=self.average_decay, dynamic_decay=self.dynamic_decay,
                      start_step=self.start_step, overwrite_frequency=self.overwrite_frequency,
                      assign_on_finalize=self.assign_on_finalize)
        return config
