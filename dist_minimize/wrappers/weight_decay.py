"""Decoupled weight decay (Loshchilov & Hutter 2019) around any update rule."""

from __future__ import annotations

import inspect
import re
from typing import Callable, Sequence

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.step.stages import variable_name
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative
from dist_minimize.wrappers.base import OptimizerWrapper


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

    The rate, `weight_decay`, is read at every update and may be:

    * a number >= 0;
    * a `keras.optimizers.schedules.LearningRateSchedule`: called with the update
      count (the wrapped optimizer's `iterations`, the updates applied before this one);
    * a callable taking no argument (TF Addons' and Keras's convention, e.g.
      `lambda: 1e-4 * lr_variable`): called as `weight_decay()` at each update;
    * a callable taking one argument: called with the update count, as a schedule.

    Which callable is which is read from its signature (`inspect.signature`): one
    that accepts a positional argument (a parameter, with or without a default, or
    `*args`) gets the count (so every callable accepted before zero-argument ones
    were is called as it was); one that accepts none (`lambda: 0.01`, a `__call__(self)`) is called without. A
    callable whose signature cannot be read (some built-ins and extension types) is
    called with the count. `weight_decay` (the property) returns this setting; setting
    it replaces it (a traced step keeps the rate of a number it traced with, as
    Keras's own `weight_decay` does).

    Args:
      optimizer: a dist_minimize optimizer.
      weight_decay: a number >= 0, a `LearningRateSchedule`, or a callable with no
        argument or one (the update count); see above.
      exclude_from_weight_decay: variable-path patterns never decayed.
      scale_by_learning_rate: multiply by the inner learning rate.

    Raises:
      ValueError: a negative `weight_decay`, or a second DecoupledWeightDecay in the stack.
      TypeError: a pattern that is not a string, or a `weight_decay` that is neither a
        number nor a callable.
    """

    shards_state = True  # per-variable work on the pairs it is given (docs/sharding.md)

    once_per_stack = True

    def __init__(self, optimizer: StagedOptimizer, weight_decay: float | Callable,
                 exclude_from_weight_decay: Sequence[str] | None = None,
                 scale_by_learning_rate: bool = False, name: str | None = None):
        weight_decay = _check_weight_decay(weight_decay)
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

    @property
    def weight_decay(self):
        """This wrapper's decay setting (a number, a schedule or a callable), not the
        wrapped Keras update rule's `weight_decay` (the base class's property).
        Setting it replaces the setting (validated as in the constructor)."""
        return self.__dict__.get("weight_decay_value")

    @weight_decay.setter
    def weight_decay(self, value):
        if not getattr(self, "_dm_constructed", False):
            return  # Keras's base constructor sets None; the constructor's argument counts
        self.weight_decay_value = _check_weight_decay(value)

    def current_weight_decay(self) -> tf.Tensor:
        """This update's decay rate: the number, or the callable's value (called with the
        update count, or with no argument: see the class docstring)."""
        wd = self.weight_decay_value
        if callable(wd):
            value = wd(self.iterations) if _takes_the_count(wd) else wd()
            return tf.cast(value, tf.float32)
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


def _check_weight_decay(weight_decay):
    """A number >= 0 (as a float) or a callable; a config dict is deserialised first."""
    if isinstance(weight_decay, dict):  # from get_config
        weight_decay = keras.saving.deserialize_keras_object(weight_decay)
    if callable(weight_decay):
        return weight_decay
    return check_nonnegative("weight_decay", weight_decay)


def _takes_the_count(fn) -> bool:
    """Whether the callable `fn` is called with the update count: a schedule, a callable
    whose signature accepts one positional argument, or one whose signature cannot be
    read. False: it accepts no positional argument (called as `fn()`)."""
    if isinstance(fn, keras.optimizers.schedules.LearningRateSchedule):
        return True
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(0)
    except TypeError:
        return False
    return True


class _Choice:
    """The variables chosen for the current step (a plain object TF's tracking ignores)."""

    ids: set | None = None
