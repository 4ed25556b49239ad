"""Stochastic Weight Averaging (Izmailov et al. 2018)."""

from __future__ import annotations

from typing import Iterable

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.wrappers._periodic import on_period
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms.base import check_nonnegative_int, check_positive_int
from dist_minimize.wrappers.averaging import AveragingWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class SWA(AveragingWrapper):
    """Stochastic Weight Averaging: a running mean of snapshots of the weights.

    With t the number of applied updates including the current one (a skipped step
    changes nothing): after update t, if t >= `start_averaging` and
    (t - start_averaging) % `average_period` == 0, the weights join the running mean,
    average = (average * n + w) / (n + 1), and n (`num_averaged`) grows by one.

    The usual last steps: `opt.assign_average_vars()` (or `with opt.averaged_weights():`),
    then `dist_minimize.update_batch_norm(model, dataset)` to recompute the
    batch-normalisation statistics for the averaged weights.

    Args:
      optimizer: a dist_minimize optimizer.
      start_averaging: the first update that may join (>= 0).
      average_period: updates between snapshots (>= 1).

    Raises:
      ValueError: `start_averaging` < 0, `average_period` < 1, or a second SWA in the
        stack.
    """

    def __init__(self, optimizer: StagedOptimizer, start_averaging: int = 0, average_period: int = 10,
                 name: str | None = None):
        start_averaging = check_nonnegative_int("start_averaging", start_averaging)
        average_period = check_positive_int("average_period", average_period)
        super().__init__(optimizer, name=name)
        self.start_averaging = start_averaging
        self.average_period = average_period
        self._num_averaged = None

    def build_state(self, var_list):
        """Creates the `average` slots and the snapshot count."""
        super().build_state(var_list)
        self._num_averaged = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                               aggregation="only_first_replica", name="num_averaged")

    @property
    def num_averaged(self):
        """How many snapshots the averages hold (a variable, after `build`)."""
        return self._num_averaged

    def on_applied(self, grads_and_vars):
        """Adds the weights to the running mean on snapshot updates (every
        `average_period`-th from `start_averaging`); other updates compute nothing."""
        join = on_period(self.iterations, self.average_period, self.start_averaging)
        variables = [v for _, v in grads_and_vars]

        def snapshot():
            n = tf.convert_to_tensor(self._num_averaged)
            updates = []
            for v in variables:
                average = self.average_of(v)
                a = tf.convert_to_tensor(average)
                nf = tf.cast(n, a.dtype)
                updates.append((average, (a * nf + tf.convert_to_tensor(v)) / (nf + 1.0)))
            updates.append((self._num_averaged, n + 1))
            distribute.flush_updates(updates)

        # `join` derives from the replicated counter: the same on every replica. (Was a
        # tf.where over every average on every update: measured 1.04 of the hand-written
        # step without the guard, benchmarks/RESULTS.md.)
        distribute.run_if(join, snapshot)

    def get_config(self):
        """The wrapped optimizer and the SWA schedule."""
        config = super().get_config()
        config.update(start_averaging=self.start_averaging, average_period=self.average_period)
        return config


def update_batch_norm(model: keras.Model, data: Iterable, steps: int | None = None) -> int:
    """Recomputes every BatchNormalization layer's moving statistics over `data`.

    The usual last step of SWA: averaged weights need statistics of their own. Each
    layer's moving mean and variance become the plain mean, over the batches, of the
    batch statistics of a training-mode forward pass (the momentum of batch i is set to
    (i - 1) / i, then restored). Only the moving statistics change. Call it with the
    averages in the model (after `assign_average_vars`, or inside `averaged_weights()`),
    outside any training step.

    Args:
      model: the Keras model.
      data: batches `x` or `(x, ...)` (a `tf.data.Dataset` or any iterable).
      steps: at most this many batches.

    Returns:
      The number of batches used (0 when the model has no BatchNormalization layer).

    Raises:
      ValueError: `data` yields no batch for a model with BatchNormalization layers.
    """
    layers = [l for l in _walk(model) if isinstance(l, keras.layers.BatchNormalization)]
    if not layers:
        return 0
    momenta = [l.momentum for l in layers]
    used = 0
    try:
        for batch in data:
            if steps is not None and used >= steps:
                break
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            used += 1
            for layer in layers:
                layer.momentum = (used - 1.0) / used
            model(x, training=True)
    finally:
        for layer, m in zip(layers, momenta):
            layer.momentum = m
    if used == 0:
        raise ValueError("`update_batch_norm` received no batch: `data` is empty.")
    return used


def _walk(layer):
    """Every layer inside `layer` (public `layers` attributes, recursively), once each."""
    seen = set()
    stack = list(getattr(layer, "layers", []) or [])
    while stack:
        sub = stack.pop(0)
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        yield sub
        stack.extend(getattr(sub, "layers", []) or [])
