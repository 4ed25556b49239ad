"""Horovod allreduce backend: one grouped allreduce per step."""

from __future__ import annotations

from typing import Literal

import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.aggregation.base import Aggregator, GradsAndVars, merge_nones, split_nones


class HorovodAggregator(Aggregator):
    """Averages gradients across Horovod processes with one grouped allreduce.

    Each Horovod process computes its loss as the mean over its local batch, so the
    AVERAGE of the processes' gradients is the gradient of the mean loss over the
    global batch (equal local batch sizes).

    Dense gradients go into a single `hvd.grouped_allreduce` call. `IndexedSlices`
    are densified first when `sparse_as_dense=True`; otherwise each is allgathered
    (values and indices) and stays sparse, its values divided by the process count for
    `reduction="mean"`.

    Horovod is imported when the aggregator is created: without it, creating one
    raises `MissingDependencyError` naming the set-up step. If `hvd.init()` has not
    been called, the first aggregation calls it.

    Args:
      reduction: `"mean"` (default) or `"sum"`.
      sparse_as_dense: densify `IndexedSlices` before the allreduce.
    """

    name = "horovod"

    def __init__(self, reduction: Literal["mean", "sum"] = "mean", sparse_as_dense: bool = False):
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"`reduction` must be 'mean' or 'sum'. Received: reduction={reduction!r}"
            )
        self.reduction = reduction
        self.sparse_as_dense = bool(sparse_as_dense)
        self._hvd = _compat.import_horovod()

    def __call__(self, grads_and_vars: GradsAndVars) -> list:
        hvd = self._hvd
        grads_and_vars = list(grads_and_vars)
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            raise ValueError(
                "The Horovod backend cannot run inside a tf.distribute strategy with "
                f"{tf.distribute.get_strategy().num_replicas_in_sync} replicas: the "
                "gradients would be aggregated twice. Use `aggregate_gradients='strategy'` "
                "inside the strategy, or Horovod without one."
            )
        if not hvd.is_initialized():
            hvd.init()
        if hvd.size() == 1:
            return grads_and_vars
        op = hvd.Average if self.reduction == "mean" else hvd.Sum
        positions, grads = split_nones(grads_and_vars)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        dense_idx = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        reduced = list(grads)
        if dense_idx:
            out = hvd.grouped_allreduce([grads[i] for i in dense_idx], op=op)
            for i, g in zip(dense_idx, out):
                reduced[i] = g
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                values = hvd.allgather(g.values)
                if op == hvd.Average:
                    values = values / tf.cast(hvd.size(), values.dtype)
                reduced[i] = tf.IndexedSlices(values, hvd.allgather(g.indices), g.dense_shape)
        return merge_nones(grads_and_vars, positions, reduced)

    def get_config(self) -> dict:
        return {"reduction": self.reduction, "sparse_as_dense": self.sparse_as_dense}
