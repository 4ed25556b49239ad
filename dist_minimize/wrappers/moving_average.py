"""An exponential moving average of the weights."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.wrappers._periodic import on_period
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative_int, check_positive_int, check_unit_interval
from dist_minimize.wrappers.averaging import AveragingWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class MovingAverage(AveragingWrapper):
    """Keeps an exponential moving average of the weights (TF Addons' MovingAverage, for Keras 3).

    With t the number of applied updates including the current one (a skipped step
    changes nothing) and c = t - 1 - `start_step` the number of averaging updates made
    before this one: after update t, if t <= `start_step` (c < 0) the average is the
    weights; otherwise average = d * average + (1 - d) * w with the decay

      d = `average_decay`,
      d = min(d, (1 + n) / (10 + n)) with `num_updates` n (when given),
      d = min(d, (1 + c) / (10 + c)) with `dynamic_decay`,

    so with `dynamic_decay` the first averaging update uses 0.1, the next 2 / 11, ...
    This is TF Addons' `tfa.optimizers.MovingAverage` rule (its `_get_decay` reads the
    optimizer's `iterations` before they count the current update): the same numbers,
    e.g. weights [1, 2], gradient [0.1, 0.1], SGD(2.0), `average_decay=0.5,
    dynamic_decay=True`: averages [0.82, 1.82] after one update, [0.64, 1.64] after two
    (TF Addons' `test_dynamic_decay`). The averages start as the weights at `build`.
    Under MirroredStrategy it works in `fit` and `tf.function` (Keras 3's own `use_ema`
    with `ema_overwrite_frequency` raises there).

    Keras's `use_ema=True, ema_momentum=m, ema_overwrite_frequency=f` is
    `MovingAverage(opt, average_decay=m, start_step=1, overwrite_frequency=f,
    assign_on_finalize=True)` (the average is the weights after the first update, then
    moves with momentum m); `dist_minimize.Optimizer.from_keras` builds exactly that from
    a Keras optimizer with `use_ema=True`.

    Evaluate or save with the averages: `with opt.averaged_weights(): ...`,
    `opt.assign_average_vars()` at the end (variables it does not average, such as
    batch-normalisation statistics in `model.variables`, are skipped with one logged
    warning, as in TF Addons), or `dist_minimize.callbacks.AveragedWeights`.

    Differences from TF Addons: the arguments after `average_decay` are in another
    order (pass them by keyword; `num_updates` is keyword-only); a `num_updates`
    variable is read at every update (TF Addons under TF 2 reads its value once, when
    the wrapper is constructed; the documented meaning, as in
    `tf.train.ExponentialMovingAverage`, is the count at each update).

    Args:
      optimizer: a dist_minimize optimizer.
      average_decay: d, in [0, 1].
      dynamic_decay: also cap the decay at (1 + c) / (10 + c), c the number of
        averaging updates before this one (0.1 at the first: a faster start).
      start_step: updates before averaging begins (>= 0); they copy the weights.
      overwrite_frequency: None (default), or n >= 1: after every update t with
        t % n == 0 (once the average has moved), the weights are overwritten with the
        averages (Keras's `ema_overwrite_frequency`).
      assign_on_finalize: whether `finalize_variable_values` (which Keras's `fit` calls
        at the end of training) writes the averages into the variables, as Keras's
        `use_ema` does. Default False: call `assign_average_vars()` when you want them.
      name: the wrapper's name.
      num_updates: TF Addons' `num_updates` (keyword-only): None (default), an integer
        n >= 0, or an integer variable or tensor holding the number of updates applied
        so far (e.g. a global step you keep): the decay is capped at
        (1 + n) / (10 + n), n read at each update, whatever `dynamic_decay` says. An
        integer is kept in `get_config`; a variable or tensor cannot be serialised, and
        the config holds None for it (pass it again when rebuilding).

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer, a bool/number given
        as the other, or `num_updates` of another type (a float, a string, a float
        variable).
      ValueError: `average_decay` outside [0, 1], `start_step` < 0,
        `overwrite_frequency` < 1, a negative integer `num_updates`, or a second
        MovingAverage in the stack.
    """

    def __init__(self, optimizer: StagedOptimizer, average_decay: float = 0.99, dynamic_decay: bool = False,
                 start_step: int = 0, overwrite_frequency: int | None = None, assign_on_finalize: bool = False,
                 name: str | None = None, *, num_updates: int | tf.Variable | tf.Tensor | None = None):
        average_decay = check_unit_interval("average_decay", average_decay)
        num_updates = _check_num_updates(num_updates)
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
        # A plain holder: a variable here must not become optimizer state (TensorFlow's
        # and Keras's tracking would checkpoint it and list it in `variables`).
        self._num_updates = _Holder(num_updates)

    def keras_settings(self) -> dict:
        """Keras's `use_ema`, `ema_momentum` and `ema_overwrite_frequency`, which this applies."""
        return {"use_ema": True, "ema_momentum": self.average_decay,
                "ema_overwrite_frequency": self.overwrite_frequency}

    @property
    def num_updates(self):
        """TF Addons' `num_updates`: None, an integer, or the variable or tensor given."""
        return self._num_updates.value

    def decay_at(self, t: tf.Tensor) -> tf.Tensor:
        """The decay d used by update t (float32; 0 while t <= start_step).

        t counts the applied updates including this one; c = t - 1 - start_step, the
        averaging updates made before it, drives `dynamic_decay` (TF Addons' rule).
        """
        t = tf.cast(t, tf.float32)
        c = t - 1.0 - float(self.start_step)
        d = tf.constant(self.average_decay, tf.float32)
        n = self.num_updates
        if n is not None:
            n = tf.cast(tf.convert_to_tensor(n), tf.float32)
            d = tf.minimum(d, (1.0 + n) / (10.0 + n))
        if self.dynamic_decay:
            d = tf.minimum(d, (1.0 + c) / (10.0 + c))
        return tf.where(c < 0.0, tf.zeros_like(d), d)

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
        overwrite = on_period(self.iterations, self.overwrite_frequency)

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
                      assign_on_finalize=self.assign_on_finalize,
                      num_updates=self.num_updates if isinstance(self.num_updates, int) else None)
        return config


class _Holder:
    """One value kept out of TensorFlow's and Keras's tracking (a plain object)."""

    def __init__(self, value):
        self.value = value


def _check_num_updates(num_updates):
    """None, an integer >= 0, or an integer variable or tensor (TF Addons' `num_updates`)."""
    if num_updates is None:
        return None
    what = ("`num_updates` must be None, an integer >= 0, or an integer variable or tensor (the number of "
            f"updates applied so far). Received: num_updates={num_updates!r}")
    if isinstance(num_updates, (int, np.integer)) and not isinstance(num_updates, (bool, np.bool_)):
        if num_updates < 0:
            raise ValueError(what)
        return int(num_updates)
    if isinstance(num_updates, (tf.Variable, tf.Tensor, keras.Variable)):
        dtype = tf.as_dtype(num_updates.dtype)
        if dtype.is_integer and tf.TensorShape(num_updates.shape).rank in (0, None):
            return num_updates
    raise TypeError(what)
