"""Horovod's learning-rate callbacks, with Horovod's names, arguments and numbers, and the
same rates as a Keras `LearningRateSchedule` for custom loops and tf.distribute.

`LearningRateScheduleCallback(initial_lr, multiplier, start_epoch, end_epoch, staircase,
momentum_correction, steps_per_epoch)`: within epochs [start_epoch, end_epoch) the rate
is `initial_lr * multiplier(epoch)` (a number `m` means `m ** (epoch - start_epoch)`), set at the first
batch of each epoch (`staircase=True`) or at every batch with a fractional epoch
`epoch + batch / steps_per_epoch` (`staircase=False`). Outside its epochs a callback sets
nothing: the rate stays what was last set. `LearningRateWarmupCallback(initial_lr,
warmup_epochs, ...)` is the schedule whose multiplier rises from about `1 / size` to 1
over `warmup_epochs`: `(1 / size) * ((epoch + 1 / steps_per_epoch) * (size - 1) /
warmup_epochs + 1)`, per batch (Goyal et al., "Accurate, Large Minibatch SGD").

Momentum correction: when the rate changes from `old` to `new` within a run, Horovod
multiplies the momentum by `new / old` for that one step. Keras 3 bakes a Python-float
momentum into the traced step, so changing it does nothing; the callbacks instead
multiply the momentum slots by `new / old` before the step, which is the same update for
SGD (without Nesterov) and RMSprop (their slot is multiplied by the momentum once per
step). Nesterov SGD uses its momentum twice per step, where no rescaling of the slot
gives Horovod's update: refused there (pass `momentum_correction=False`).

`EpochSchedule(callbacks, steps_per_epoch)` is the rate these callbacks would set at
each step, as a function of the optimizer's step counter: the same numbers in custom
loops and under MirroredStrategy or MultiWorkerMirroredStrategy (without momentum
correction, which needs the slots between steps).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat, distribute


def world_size(replicas: int | None = None) -> int:
    """Horovod's size where Horovod is initialised, else `replicas` (a callback's model's
    strategy), else the replicas of the strategy in scope (1 without one)."""
    hvd = distribute.horovod()
    if hvd is not None:
        return hvd.size()
    return replicas if replicas is not None else tf.distribute.get_strategy().num_replicas_in_sync


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's `LearningRateScheduleCallback` (module docstring).

    Args:
      initial_lr: the rate the multiplier scales.
      multiplier: a function of the (fractional) epoch (called with a tensor inside
        `EpochSchedule`: use `tf.where`, not `if`), or a number `m` meaning
        `m ** (epoch - start_epoch)`.
      start_epoch, end_epoch: the epochs [start, end) it acts in (end None: no end).
      staircase: set the rate at each epoch's first batch (True) or at every batch.
      momentum_correction: rescale the momentum slots when the rate changes (SGD without
        Nesterov, RMSprop; other rules with a momentum are refused at `on_train_begin`).
      steps_per_epoch: batches per epoch (needed for `staircase=False`; default: the
        `steps` of `fit`).
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required. Received: initial_lr=None")
        if isinstance(multiplier, (int, float)):
            constant = float(multiplier)
            self.multiplier = lambda epoch: constant ** (epoch - start_epoch)
        elif callable(multiplier):
            self.multiplier = multiplier
        else:
            raise TypeError(f"`multiplier` must be a number or a function of the epoch. Received: "
                            f"multiplier={multiplier!r}")
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int)
                                            or steps_per_epoch < 1):
            raise ValueError(f"`steps_per_epoch` must be None or an integer >= 1. Received: "
                             f"steps_per_epoch={steps_per_epoch!r}")
        self.initial_lr = float(initial_lr)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.replicas = None  # the model's strategy's replicas, read at on_train_begin

    # -- the rule, shared with EpochSchedule --------------------------------------------

    def rate(self, epoch):
        """The rate at a (fractional) epoch inside the callback's epochs."""
        return self.initial_lr * self.multiplier(epoch)

    def acts(self, epoch: int, batch: int) -> bool:
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return False
        return batch == 0 or not self.staircase

    # -- the callback -------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    f"{type(self).__name__} could not tell the number of steps per epoch (`fit` gave no "
                    "`steps`): pass `steps_per_epoch=`.")
            self.steps_per_epoch = int(steps)
        if self.momentum_correction:
            check_momentum_correction(self.model.optimizer)
        # (Keras runs callbacks outside the strategy's scope: its size is the model's.)
        self.replicas = self.model.distribute_strategy.num_replicas_in_sync

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self.acts(self.current_epoch, batch):
            return
        epoch = self.current_epoch if self.staircase else self.current_epoch + float(batch) / self.steps_per_epoch
        set_rate(self.model.optimizer, self.rate(epoch), self.momentum_correction)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's `LearningRateWarmupCallback`: per batch, from about `initial_lr / size`
    to `initial_lr` over `warmup_epochs` (module docstring); `size` defaults to Horovod's
    (or the strategy's replicas). `verbose=1` prints the end of the warmup on rank 0."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0, size: int | None = None):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            n = self.size if self.size is not None else world_size(self.replicas)
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose, self.size = warmup_epochs, verbose, size

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and world_rank() == 0:
            rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


def world_rank() -> int:
    hvd = distribute.horovod()
    return hvd.rank() if hvd is not None else 0


def _update_rule(optimizer: Any) -> keras.optimizers.Optimizer:
    bottom = optimizer.stack()[-1] if hasattr(optimizer, "stack") else optimizer
    return getattr(bottom, "inner_optimizer", bottom)


def check_momentum_correction(optimizer: Any) -> None:
    """Raises ValueError where rescaling the momentum slots is not Horovod's correction."""
    rule = _update_rule(optimizer)
    momentum = getattr(rule, "momentum", 0.0)
    if not isinstance(momentum, (int, float)) or not momentum:
        return
    if isinstance(rule, keras.optimizers.SGD) and getattr(rule, "nesterov", False):
        raise ValueError(
            "momentum_correction=True with Nesterov SGD: Keras 3 fixes the momentum when the step is traced, and "
            "Nesterov's update uses it twice per step, so no rescaling of the momentum slots gives Horovod's "
            "corrected step. Pass `momentum_correction=False`. Received: SGD(nesterov=True, "
            f"momentum={momentum})")
    if not isinstance(rule, (keras.optimizers.SGD, keras.optimizers.RMSprop)):
        raise ValueError(
            f"momentum_correction=True with {type(rule).__name__}: the correction is rescaling the momentum "
            "slots, which is Horovod's correction for SGD and RMSprop only. Pass `momentum_correction=False`. "
            f"Received: {type(rule).__name__}(momentum={momentum})")


def set_rate(optimizer: Any, rate: float, momentum_correction: bool) -> None:
    """Sets the learning rate; with `momentum_correction`, multiplies the momentum slots by
    new / old when it changes (module docstring)."""
    old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    optimizer.learning_rate = rate
    if momentum_correction and old and rate != old:
        rule = _update_rule(optimizer)
        momentum = getattr(rule, "momentum", 0.0)  # (Horovod corrects only a rule with a momentum)
        if rule.built and isinstance(momentum, (int, float)) and momentum:
            factor = float(keras.ops.convert_to_numpy(optimizer.learning_rate)) / old
            for slot in _compat.momentum_slots(rule):
                slot.assign(slot * tf.cast(factor, slot.dtype))


class EpochSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The rate a list of the callbacks above would set at each step (the optimizer's
    step counter), for custom loops and tf.distribute (a warmup without `size` takes
    the size where the step runs: Horovod's, or the strategy's replicas): the last callback in the list
    among those that acted most recently, or `initial_learning_rate` before any acted
    (default: the first callback's `initial_lr`). Without momentum correction.

    Example:
      >>> schedule = EpochSchedule([LearningRateWarmupCallback(0.1, warmup_epochs=5),
      ...                           LearningRateScheduleCallback(0.1, 0.5, start_epoch=5)],
      ...                          steps_per_epoch=100)
      >>> keras.optimizers.SGD(schedule, momentum=0.9)
    """

    def __init__(self, callbacks: Sequence[LearningRateScheduleCallback], steps_per_epoch: int,
                 initial_learning_rate: float | None = None):
        if not callbacks or not all(isinstance(c, LearningRateScheduleCallback) for c in callbacks):
            raise TypeError("`callbacks` must be a non-empty list of LearningRateScheduleCallback or "
                            f"LearningRateWarmupCallback. Received: callbacks={callbacks!r}")
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
            raise ValueError(f"`steps_per_epoch` must be an integer >= 1. Received: steps_per_epoch={steps_per_epoch!r}")
        for c in callbacks:
            c.steps_per_epoch = c.steps_per_epoch or steps_per_epoch
            if c.steps_per_epoch != steps_per_epoch:
                raise ValueError(f"A callback's steps_per_epoch ({c.steps_per_epoch}) is not the schedule's "
                                 f"({steps_per_epoch}).")
        self.callbacks, self.steps_per_epoch = list(callbacks), steps_per_epoch
        self.initial_learning_rate = float(initial_learning_rate if initial_learning_rate is not None
                                           else callbacks[0].initial_lr)

    def __call__(self, step):
        per = tf.constant(self.steps_per_epoch, tf.int64)
        step = tf.cast(step, tf.int64)
        best_step = tf.constant(-1, tf.int64)
        rate = tf.constant(self.initial_learning_rate, tf.float64)
        for c in self.callbacks:  # later callbacks win ties: `>=`
            last = self._last_action(c, step, per)
            epoch, batch = last // per, last % per
            at = tf.cast(epoch, tf.float64) if c.staircase else (
                tf.cast(epoch, tf.float64) + tf.cast(batch, tf.float64) / float(self.steps_per_epoch))
            value = tf.cast(c.rate(at), tf.float64)
            newer = tf.logical_and(last >= 0, last >= best_step)
            rate = tf.where(newer, value, rate)
            best_step = tf.where(newer, last, best_step)
        return tf.cast(rate, tf.float32)

    @staticmethod
    def _last_action(c: LearningRateScheduleCallback, step, per):
        """The last step <= `step` at which `c` sets the rate (-1: none yet)."""
        start = tf.constant(c.start_epoch, tf.int64) * per
        if c.staircase:
            epoch = step // per
            if c.end_epoch is not None:
                epoch = tf.minimum(epoch, c.end_epoch - 1)
            last = epoch * per
        else:
            last = step if c.end_epoch is None else tf.minimum(step, c.end_epoch * per - 1)
        return tf.where(tf.logical_and(step >= start, last >= start), last, tf.constant(-1, tf.int64))

    def get_config(self):
        raise TypeError(
            "EpochSchedule holds callbacks whose multipliers may be any Python function; it is not saved in a "
            ".keras file. Save the weights, or rebuild the schedule when loading (custom_objects).")
