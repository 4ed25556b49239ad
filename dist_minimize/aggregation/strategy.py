"""tf.distribute all-reduce: MirroredStrategy and MultiWorkerMirroredStrategy."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize.aggregation.base import Aggregator, GradsAndVars, merge_nones, refuse_unaggregated_job, split_nones


@keras.saving.register_keras_serializable(package="dist_minimize")
class StrategyAggregator(Aggregator):
    """One batched replica-context all-reduce (SUM) of every gradient of the step.

    Keras and `tf.nn.compute_average_loss` divide each replica's loss by the number of
    replicas in sync, so the SUM of the replicas' gradients is the gradient of the mean
    loss over the global batch.

    All gradients of the step go into a single `ReplicaContext.all_reduce` call (one per
    dtype, when the model mixes them), which tf.distribute packs into as few
    collectives as its cross-device ops allow.
    `IndexedSlices` (an `Embedding` layer's gradient) stay sparse: tf.distribute
    all-gathers their values and indices, so the result may hold repeated indices
    (their sum is the dense gradient). `None` gradients pass through untouched.

    With no strategy, or a strategy of one replica, it is the identity. Called in a
    cross-replica context it raises, because there is nothing per-replica to reduce.

    Args:
      options: optional `tf.distribute.experimental.CommunicationOptions` passed to
        the all-reduce (e.g. to choose NCCL or RING for MultiWorkerMirroredStrategy).
    """

    name = "strategy"
    reduction = "sum"

    def __init__(self, options: tf.distribute.experimental.CommunicationOptions | dict | None = None):
        if isinstance(options, dict):  # from get_config
            options = tf.distribute.experimental.CommunicationOptions(
                bytes_per_pack=int(options.get("bytes_per_pack", 0)),
                timeout_seconds=options.get("timeout_seconds"),
                implementation=tf.distribute.experimental.CommunicationImplementation[
                    options.get("implementation", "AUTO")])
        elif options is not None and not isinstance(options, type(tf.distribute.experimental.CommunicationOptions())):
            raise TypeError(
                "`options` must be a tf.distribute.experimental.CommunicationOptions or None. "
                f"Received: options={options!r} of type {type(options).__name__}")
        self.options = options

    def get_config(self) -> dict:
        """The options as plain values (bytes per pack, timeout, implementation name)."""
        if self.options is None:
            return {}
        o = self.options
        return {"options": {"bytes_per_pack": int(o.bytes_per_pack), "timeout_seconds": o.timeout_seconds,
                            "implementation": o.implementation.name}}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def planned_collectives(self, grads_and_vars: GradsAndVars) -> int:
        """One all-reduce per dtype of the non-None gradients (none with one replica)."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return 0
        return len({g.dtype for g, _ in grads_and_vars if g is not None})

    def __call__(self, grads_and_vars: GradsAndVars) -> list:
        grads_and_vars = list(grads_and_vars)
        if tf.distribute.in_cross_replica_context() and tf.distribute.has_strategy():
            raise RuntimeError(
                "`aggregate_gradients` must run in a replica context (inside "
                "`strategy.run` or `model.fit`), not in the cross-replica context."
            )
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            refuse_unaggregated_job(self.name)
            return grads_and_vars
        positions, grads = split_nones(grads_and_vars)
        if not grads:
            return grads_and_vars
        # One all-reduce per dtype: tf.distribute packs a list into one buffer and fails on
        # a list of several dtypes (a float16 layer beside float32 ones; stock Keras too).
        by_dtype: dict = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        reduced = [None] * len(grads)
        for indices in by_dtype.values():
            out = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in indices], options=self.options)
            for i, r in zip(indices, out):
                reduced[i] = r
        return merge_nones(grads_and_vars, positions, reduced)
