"""The aggregation protocol: grads_and_vars in, grads_and_vars out, plus its meaning."""

from __future__ import annotations

import abc
from typing import Literal, Sequence, Tuple

import tensorflow as tf

GradsAndVars = Sequence[Tuple[tf.Tensor | tf.IndexedSlices | None, tf.Variable]]
Reduction = Literal["sum", "mean", "none"]


class Aggregator(abc.ABC):
    """Aggregates per-replica gradients into gradients identical on every replica.

    Contract:
      * called exactly once per optimizer step, in the replica context (or, without
        tf.distribute, in each process);
      * returns a list with the same variables in the same order; `None` gradients
        come back as `None`, untouched;
      * after it, every replica holds the gradient of the MEAN loss over the GLOBAL
        batch, given the loss convention its `reduction` states.

    Attributes:
      name: the name `aggregate_gradients=` accepts.
      reduction: what the collective computes across replicas: `"sum"` (each replica's
        loss is already divided by the number of replicas, as Keras and
        `tf.nn.compute_average_loss` do), `"mean"` (each process's loss is its local
        mean, as under Horovod), or `"none"` (nothing to aggregate).
    """

    name: str = "base"
    reduction: Reduction = "none"

    @abc.abstractmethod
    def __call__(self, grads_and_vars: GradsAndVars) -> list:
        """Returns the aggregated (gradient, variable) pairs (see the class contract)."""

    def get_config(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


class IdentityAggregator(Aggregator):
    """No aggregation: one replica, or the caller aggregates elsewhere."""

    name = "none"
    reduction = "none"

    def __call__(self, grads_and_vars: GradsAndVars) -> list:
        return list(grads_and_vars)


def split_nones(grads_and_vars: GradsAndVars):
    """Returns (positions of non-None gradients, those gradients)."""
    positions, grads = [], []
    for i, (g, _) in enumerate(grads_and_vars):
        if g is not None:
            positions.append(i)
            grads.append(g)
    return positions, grads


def merge_nones(grads_and_vars: GradsAndVars, positions, reduced) -> list:
    """Puts reduced gradients back at their positions; `None` gradients stay `None`."""
    out = [(None, v) for _, v in grads_and_vars]
    for i, g in zip(positions, reduced):
        out[i] = (g, grads_and_vars[i][1])
    return out
