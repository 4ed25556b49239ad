"""Decoupled weight decay (Loshchilov & Hutter 2019) around any update rule."""

from __future__ import annotations

import re
from typing import Sequence

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize._stages import variable_name
from dist_minimize.optimizer import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative
from dist_minimize.wrapper import OptimizerWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class DecoupledWeightDecay(OptimizerWrapper):
    """Shrinks the decayed weights before each applied update: w = w - weight_decay * s * w.

    s is 1, or with `scale_by_learning_rate=True` the inner optimizer's current
    learning rate (as Keras's AdamW does). The decay is never added to the gradient:
    the global-norm clipper, the statistics and Adam's moments never see it. Then the
    wrapped update runs. A skipped step decays nothing.

    Which variables decay: all trained variables but those whose path matches one of
    the `exclude_from_weight_decay` patterns (regular expressions searched in the
    variable's path, e.g. `["bias", "layer_norm"]`); for one step,
    `minimize(..., decay_var_list=[...])` or `apply_gradients(..., decay_var_list=[...])`
    names them instead (the RFC 234 thread's `decay_var_list`).

    Args:
      optimizer: a dist_minimize optimizer.
      weight_decay: a number >= 0, or a `keras.optimizers.schedules.LearningRateSchedule`
        (or callable) of the update count.
      exclude_from_weight_decay: variable-path patterns never decayed.
      scale_by_learning_rate: multiply by the inner learning rate.

    Raises:
      ValueError: a negative `weight_decay`, or a second DecoupledWeightDecay in the stack.
      TypeError: a pattern that is not a string.
    """

    # Its step hooks only read and write variables: they may run device by device
    # (`StagedOptimizer._per_device_ok`).
    _dm_per_device_hooks = True

    once_per_stack = True

    def __init__(self, optimizer: StagedOptimizer, weight_decay, exclude_from_weight_decay: Sequence[str] | None = None,
                 scale_by_learning_rate: bool = False, name: str | None = None):
        if isinstance(weight_decay, dict):  # from get_config
            weight_decay = keras.saving.deserialize_keras_object(weight_decay)
        if not callable(weight_decay):
            weight_decay = check_nonnegative("weight_decay", weight_decay)
        patterns = list(exclude_from_weight_decay or [])
        for i, p in enumerate(patterns):
            if not isinstance(p, str):
                raise TypeError("`exclude_from_weight_decay` must be a list of variable-path patterns (strings). "
                                f"Received: exclude_from_weight_decay[{i}]={p!r}")
        if not isinstance(scale_by_learning_rate, bool):
            raise TypeError(f"`scale_by_learning_rate` must be a bool. Received: "
                            f"scale_by_learning_rate={scale_by_learning_rate!r}")
        super().__init__(optimizer, name=name)
        self.weight_decay_value = weight_decay
        self.exclude_patterns = tuple(patterns)
        self.scale_by_learning_rate = scale_by_learning_rate
        self._step_choice = _Choice()

    def decays(self, variable) -> bool:
        """Whether `variable` decays by default (no pattern of `exclude_from_weight_decay` matches)."""
        path = variable_name(variable)
        return not any(re.search(p, path) for p in self.exclude_patterns)

    def current_weight_decay(self) -> tf.Tensor:
        """This update's decay rate (the schedule at the current update count)."""
        wd = self.weight_decay_value
        if callable(wd):
            return tf.cast(wd(self.iterations), tf.float32)
        return tf.constant(wd, tf.float32)

    def choose_for_step(self, decay_var_list) -> None:
        """Makes the next update decay exactly `decay_var_list` (used by `minimize` and
        `apply_gradients` with `decay_var_list=`).

        Raises:
          ValueError: a variable this optimizer does not train (after `build`).
        """
        chosen = list(decay_var_list)
        if self.built:
            trained = {id(v) for v in self.trained_variables}
            for v in chosen:
                if id(v) not in trained:
                    raise ValueError(f"`decay_var_list` names {variable_name(v)}, which this optimizer does "
                                     "not train. Received: decay_var_list of "
                                     f"{len(chosen)} variables")
        self._step_choice.ids = {id(v) for v in chosen}

    def choose_for_step_reset(self) -> None:
        """Back to the default choice (`exclude_from_weight_decay`)."""
        self._step_choice.ids = None

    def apply_updates(self, grads_and_vars):
        """Decays the chosen weights, then applies the wrapped update."""
        chosen = self._step_choice.ids
        rate = self.current_weight_decay()
        if self.scale_by_learning_rate:
            rate = rate * tf.cast(tf.convert_to_tensor(self.learning_rate), tf.float32)
        updates = []
        for g, v in grads_and_vars:
            if g is None or not (id(v) in chosen if chosen is not None else self.decays(v)):
                continue
            w = tf.convert_to_tensor(v)
            updates.append((v, w - tf.cast(rate, w.dtype) * w))
        distribute.flush_updates(updates)
        super().apply_updates(grads_and_vars)

    def get_config(self):
        """The wrapped optimizer and the decay settings."""
        config = super().get_config()
        wd = self.weight_decay_value
        config.update(weight_decay=keras.saving.serialize_keras_object(wd) if callable(wd) else wd,
                      exclude_from_weight_decay=list(self.exclude_patterns),
                      scale_by_learning_rate=self.scale_by_learning_rate)
        return config


class _Choice:
    """The variables chosen for the current step (a plain object TF's tracking ignores)."""

    ids: set | None = None
