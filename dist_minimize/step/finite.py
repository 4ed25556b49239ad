"""`all_finite`: whether every element of a step's gradients is finite (the guard's test)."""

from __future__ import annotations

import tensorflow as tf

from dist_minimize.step.context import CONTEXT


def all_finite(grads) -> tf.Tensor:
    """A scalar bool: whether every element of every gradient is finite.

    Within a step, computed once per list of gradient tensors (and not at all where a
    transform already knows: `dist_minimize.distribute.note_all_finite`).
    """
    grads = list(grads)
    known = CONTEXT.known_all_finite(grads)
    if known is not None:
        return known
    result = _all_finite(grads)
    if CONTEXT.sharded is not None and CONTEXT.sharded.sum is not None:
        # A sharded step: this process holds its share of the gradients; agreed by a sum.
        result = tf.equal(CONTEXT.sum_over_shards(1.0 - tf.cast(result, tf.float32)), 0.0)
    CONTEXT.note_all_finite(grads, result)
    return result


def _all_finite(grads) -> tf.Tensor:
    checks = [
        tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in grads if g is not None
    ]
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))
