"""tf.distribute all-reduce: MirroredStrategy and MultiWorkerMirroredStrategy."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize.aggregation import sharded
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

    # -- a sharded step (Optimizer(shard_optimizer_state=True); aggregation/sharded.py) --
    # MultiWorkerMirroredStrategy with one device per worker: tf.distribute's public
    # replica context offers an all-reduce and an all-gather, no reduce-scatter, so each
    # bucket is all-reduced and each process keeps its segment. (TensorFlow's own
    # reduce-scatter op, CollectiveReduceScatterV2, is implemented by NCCL only, "undef"
    # on CPUs, and takes the strategy's private collective keys: docs/sharding.md.)

    def processes(self) -> tuple[int, int]:
        """(number of replicas, this process's replica id); (1, 0) with one replica."""
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync == 1:
            return 1, 0
        if not one_replica_per_process():
            raise ValueError(
                f"A sharded step under {type(strategy).__name__} needs one replica per process "
                "(MultiWorkerMirroredStrategy with one device per worker). Received: "
                f"{len(strategy.extended.worker_devices)} devices in this process")
        return strategy.num_replicas_in_sync, worker_rank(strategy)

    def reduce_scatter(self, grads_and_vars: GradsAndVars, owners) -> list:
        """This process's share of the summed gradients: one all-reduce per bucket, sliced."""
        size, rank = self.processes()
        ctx = tf.distribute.get_replica_context()

        def collective(buffer, k):
            return sharded.own_segment(ctx.all_reduce(tf.distribute.ReduceOp.SUM, buffer, options=self.options),
                                       size, rank)

        return sharded.reduce_scatter(list(grads_and_vars), owners, size, rank, collective)

    def all_gather(self, variables, updated, owners) -> None:
        """Every process's updated variables written on every process (one all-gather per
        bucket; the copies written in one cross-replica update per bucket). Outside a
        step (the cross-replica context) it runs on every replica by `strategy.run`."""
        if tf.distribute.in_cross_replica_context():
            tf.distribute.get_strategy().run(self.all_gather, args=(variables, updated, owners))
            return
        size, rank = self.processes()
        ctx = tf.distribute.get_replica_context()
        sharded.all_gather(variables, updated, owners, size, rank,
                           lambda segment, k: ctx.all_gather(segment, axis=0, options=self.options),
                           write=_write_mirrored)

    def sum_scalar(self, value: tf.Tensor) -> tf.Tensor:
        """`value` summed over the replicas (one all-reduce)."""
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value,
                                                              options=self.options)

    def planned_reduce_scatters(self, grads_and_vars: GradsAndVars, owners) -> int | None:
        return sharded.planned([g for g, _ in grads_and_vars], owners, self.processes()[0])


def _write_mirrored(pairs: list):
    """Writes each (mirrored variable, value) pair from the replica context: a mirrored
    variable is written in the cross-replica context (`strategy.extended.update`)."""
    ctx = tf.distribute.get_replica_context()

    def write(strategy, values):
        ops = []
        for (variable, _), value in zip(pairs, values):
            target = variable.value if isinstance(variable, keras.Variable) else variable
            ops += strategy.extended.update(target, lambda v, t: v.assign(t), args=(value,), group=False)
        return tf.group(ops)

    return ctx.merge_call(write, args=([value for _, value in pairs],))


def one_replica_per_process() -> bool:
    """Whether the current strategy runs one replica in each process: MultiWorkerMirroredStrategy
    with one device per worker."""
    strategy = tf.distribute.get_strategy()
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and \
        len(strategy.extended.worker_devices) == 1


def worker_rank(strategy) -> int:
    """This worker's replica id under MultiWorkerMirroredStrategy with one device per
    worker: its place in the cluster, the chief first (what tf.distribute numbers its
    replicas by, and the order of an all-gather)."""
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec().as_dict()
    if resolver.task_type == "chief":
        return 0
    return resolver.task_id + (1 if spec.get("chief") else 0)


