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

    def planned_collectives(self, grads_and_vars: GradsAndVars) -> int | None:
        """How many collectives `__call__` makes for these gradients here, or None if
        it does not say (then the number is not checked).

        A tf.distribute replica-context `all_reduce` call counts as one, however many
        tensors it batches; under Horovod, each collective op. Checked when the call is
        traced (`dist_minimize.aggregation.exactly_once.planned`): an aggregator that makes
        another number fails with `AggregationError`.
        """
        return None

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

    def planned_collectives(self, grads_and_vars: GradsAndVars) -> int:
        return 0


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


def refuse_unaggregated_job(backend: str) -> None:
    """Raises if this process is one of several in a job while `backend` found nothing
    to aggregate with here (no multi-replica strategy, no Horovod it uses): each process
    would train its own model. Does nothing in a one-process job.

    Raises:
      RuntimeError: naming the job, what is missing and the fix.
    """
    import sys

    from dist_minimize import cluster, distribute

    job = cluster.discover()  # environment variables only: cheap, and traced steps call it once
    if job.size == 1:
        return
    if job.launcher == "tf_config":
        raise RuntimeError(
            f"aggregate_gradients={backend!r} found nothing to aggregate with, but TF_CONFIG names "
            f"{job.size} workers (this is worker {job.rank}): each worker would train its own model. "
            "Create the model and the optimizer inside "
            "`tf.distribute.MultiWorkerMirroredStrategy().scope()`, or pass "
            "aggregate_gradients='none' if you aggregate the gradients elsewhere.")
    if distribute.horovod() is not None:
        state = (f"Horovod is initialised, but the {backend!r} backend does not use it: pass "
                 "aggregate_gradients='horovod' (or 'auto')")
    elif "horovod.tensorflow" in sys.modules:
        state = "Horovod is imported but `hvd.init()` was not called"
    else:
        state = "`horovod.tensorflow` is not imported"
    raise RuntimeError(
        f"aggregate_gradients={backend!r} found nothing to aggregate with, but this process is rank "
        f"{job.rank} of {job.size} ({job.launcher} started {job.size} processes) and {state}: each "
        "process would train its own model. Call `dist_minimize.horovod_keras.init()` before "
        "building the model, and broadcast rank 0's initial weights "
        "(`dist_minimize.horovod_keras.BroadcastVariablesCallback()` in `fit`), or create the "
        "model and optimizer inside a `tf.distribute.MultiWorkerMirroredStrategy` scope; pass "
        "aggregate_gradients='none' only if you aggregate the gradients elsewhere.")
