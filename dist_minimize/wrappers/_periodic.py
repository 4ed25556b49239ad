"""Periodic schedules inside the update (SWA, Lookahead, MovingAverage's overwrite)."""

from __future__ import annotations

import tensorflow as tf


def on_period(step, period: int, start: int = 0) -> tf.Tensor:
    """Whether `step` is one of `start`, `start + period`, `start + 2 * period`, ...

    A scalar bool tensor made of int64 ops that have kernels on CPUs and GPUs alike
    (FloorDiv, Mul, Equal, GreaterEqual): the update of a device runs in one `If` on
    that device (`dist_minimize.distribute.run_if_per_device`), where an int64 FloorMod,
    which has no GPU kernel, would keep it from being one op.
    """
    t = tf.cast(step, tf.int64) - tf.constant(start, tf.int64)
    period = tf.constant(period, tf.int64)
    return tf.logical_and(t >= 0, tf.equal(t // period * period, t))
