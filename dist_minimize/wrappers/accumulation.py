"""Gradient accumulation: K micro-batches per update, aggregated once per update."""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.aggregation import exactly_once
from dist_minimize.sharding import sharded_state, shards
from dist_minimize.staged import StagedOptimizer
from dist_minimize.step import stages
from dist_minimize.step.context import CONTEXT
from dist_minimize.transforms.base import check_positive_int
from dist_minimize.wrappers.base import OptimizerWrapper


@keras.saving.register_keras_serializable(package="dist_minimize")
class GradientAccumulation(OptimizerWrapper):
    """Sums gradients of `steps` micro-batches locally, then runs ONE aggregation and update.

    Each call of `apply_gradients` (each `model.fit` batch, each `minimize`) is a
    micro-step: `transform_unaggregated_gradients` runs, and the result is added to a
    per-replica accumulator (no communication). Every `steps`-th micro-step the mean of
    the accumulated gradients (their sum with `average=False`) goes through the rest of
    the pipeline once:
    `aggregate_gradients` (one collective per update, not per micro-step),
    `transform_gradients` (the global-norm clipper and loss-scale unscaling act on the
    accumulated gradient), the non-finite guard and `apply_updates`; then the
    accumulators are zeroed. With equal micro-batches, the update equals one step on the
    `steps`-times larger batch. `iterations` counts updates, not micro-steps (Keras's
    meaning); `micro_step` counts micro-steps (Horovod's `backward_passes_per_step`
    counts these in its `iterations`): key a schedule or a log on it where code
    counts backward passes.

    The boundary decision comes from a replicated micro-step counter, so it is the same
    on every replica and worker; under tf.distribute it is taken in the cross-replica
    context (see `dist_minimize.distribute.run_if`), so it works in `model.fit` and in
    `tf.function` under MirroredStrategy, where Keras's own
    `gradient_accumulation_steps` fails.

    Accumulated gradients are dense (an `IndexedSlices` gradient is densified when
    accumulated). A variable with a `None` gradient at the update's micro-step still gets
    the mean of what it accumulated in the window, provided some step has ever given it
    a gradient (a variable that never had one stays out of the update, as with Keras; one
    that had gradients in an earlier window but none in this one gets a zero mean).

    The accumulators and the micro-step counter are optimizer state: checkpointed and
    restored, so a run resumed mid-accumulation continues exactly. Under tf.distribute a
    checkpoint holds the SUM of the replicas' accumulators; restored, each replica holds
    an equal share, and only the sum is ever used. Under Horovod each process keeps its
    own accumulators, and a checkpoint is usually written by rank 0 alone: call
    `share_accumulators()` on every process first (or put
    `dist_minimize.horovod_keras.ShareAccumulatorsCallback()` before the checkpoint
    callback), so that rank 0's file holds what every process needs.

    Stacking: it may sit anywhere in a stack (its place only decides which wrappers'
    stages run per micro-step: `transform_loss` and `transform_unaggregated_gradients`
    always do); one accumulation per stack.

    Args:
      optimizer: a dist_minimize optimizer.
      steps: micro-steps per update (>= 1; 1 updates every step).
      average: update with the mean of the micro-steps' gradients (True) or their sum
        (False: Horovod's `average_aggregated_gradients=False`).
      shard_accumulators: with `shard_optimizer_state=True` at the bottom of the stack,
        reduce-scatter every micro-step and keep only this process's share of the
        accumulators (ZeRO stage 2: 1/N of their memory, `steps` times the traffic).

    Raises:
      TypeError: `optimizer` is not a dist_minimize optimizer.
      ValueError: `steps` < 1, the stack already accumulates, or `shard_accumulators`
        on a stack whose state is not sharded.
    """

    def __init__(self, optimizer: StagedOptimizer, steps: int, average: bool = True,
                 shard_accumulators: bool = False, name: str | None = None):
        steps = check_positive_int("steps", steps)
        for arg, value in (("average", average), ("shard_accumulators", shard_accumulators)):
            if not isinstance(value, bool):
                raise TypeError(f"`{arg}` must be a bool. Received: {arg}={value!r}")
        super().__init__(optimizer, name=name)
        if shard_accumulators and not getattr(self.stack()[-1], "shard_optimizer_state", False):
            raise ValueError("`shard_accumulators=True` shares the accumulators out like the optimizer state: it "
                             "needs `dist_minimize.Optimizer(..., shard_optimizer_state=True)` at the bottom of the "
                             "stack. Received: shard_accumulators=True on an unsharded stack")
        self.steps = steps
        self.average = average
        self.shard_accumulators = shard_accumulators
        self._micro_step = None

    once_per_stack = True
    # Sharded (docs/sharding.md): the update rule's state is each process's share; the
    # accumulators by default are not: they sum this process's unaggregated gradients of
    # EVERY variable, and their mean is reduce-scattered once per window. With
    # `shard_accumulators=True` (ZeRO stage 2) each micro-step is reduce-scattered and
    # each process accumulates its share only: 1/N of the memory, `steps` times the traffic.
    shards_state = True

    @property
    def micro_steps_per_update(self) -> int:
        """How many micro-steps one update averages (`steps`)."""
        return self.steps

    def keras_settings(self) -> dict:
        """Keras's `gradient_accumulation_steps`, which this applies."""
        return {"gradient_accumulation_steps": self.steps}

    def build_state(self, var_list):
        """Creates the micro-step counter and one replica-local accumulator per trained
        variable (all of them, also where `var_list` is this process's share; with
        `shard_accumulators`, one per variable of the share)."""
        self._micro_step = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                             aggregation="only_first_replica", name="micro_step")
        # Sharded over processes, an accumulator holds aggregated values (one replica per
        # process): this process's own variable, made like the update rule's sharded slots.
        sharded = self.shard_accumulators and sharded_state.of(self).size > 1
        for v in var_list if sharded else self.trained_variables:
            self.add_slot(v, "accumulated", replica_local=not sharded)
        self._seen = _Seen()

    def share_accumulators(self) -> None:
        """Under Horovod: every process's accumulators become the mean over the processes.

        Their sum, the only thing the update uses, is unchanged, so training continues
        exactly; and a checkpoint written by any ONE process (rank 0) then restores
        exactly on every process. A collective: call it on every process, outside the
        training step, before writing the checkpoint. Does nothing in one process or
        under a tf.distribute strategy (whose checkpoints already hold the sum).
        """
        if (not self.built or self.shard_accumulators or distribute.strategy_replicas() > 1
                or distribute.horovod_size() == 1):
            return  # (sharded accumulators hold aggregated values, each process its own variables')
        is_local = self.stack()[-1].is_local  # a rank-local variable's accumulator is its rank's own: not shared
        accumulators = [self.slot("accumulated", v) for v in self.trained_variables if not is_local(v)]
        means = distribute.mean_across([tf.convert_to_tensor(a) for a in accumulators],
                                       name="dm_share_accumulators")
        for acc, mean in zip(accumulators, means):
            acc.assign(mean)

    def share_process_state(self) -> None:
        """`share_accumulators`: what `Checkpointer` calls before rank 0 writes."""
        self.share_accumulators()

    @property
    def micro_step(self):
        """Micro-steps taken so far (a variable, after `build`)."""
        return self._micro_step

    def run_update(self, grads_and_vars, *, top, aggregate):
        """Adds this micro-step's gradients to the accumulators; every `steps`-th
        micro-step, runs the wrapped update once on their mean (their sum with
        `average=False`)."""
        full = list(grads_and_vars)
        sharded = self.shard_accumulators and sharded_state.of(self).size > 1 and aggregate
        if sharded:  # this micro-step reduce-scattered: this process's share, aggregated
            with shards.step(), exactly_once.step(top._aggregations_allowed()):
                aggregated = top.aggregate_gradients(list(full))
                grads_and_vars = stages.check_stage_output("aggregate_gradients", CONTEXT.share(full), aggregated)
        accumulators = [self.slot("accumulated", v) for _, v in grads_and_vars]
        for (g, v), acc in zip(grads_and_vars, accumulators):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
        for g, v in full:
            if g is not None:
                self._seen.add(_compat.variable_key(self, v))
        # A variable whose gradient is None in THIS call still gets its accumulated mean
        # if any call (any traced step) has given it a gradient: a window's micro-steps
        # may come from different step functions, and the last one's None must not
        # drop the window's sum. (Decided on every process alike, for every variable.)
        present = [g is not None or self._seen.has(_compat.variable_key(self, v)) for g, v in full]
        mine = dict(zip((id(v) for _, v in grads_and_vars), accumulators))
        micro = self._micro_step + 1

        def update():
            divisor = self.steps if self.average else 1
            # Sharded: another process's variable holds zeros here (its share is its own).
            combined = [((tf.convert_to_tensor(mine[id(v)]) / divisor if id(v) in mine else tf.zeros(v.shape, v.dtype))
                         if p else None, v) for p, (_, v) in zip(present, full)]
            self.wrapped.run_update(combined, top=top, aggregate=aggregate and not sharded)
            for acc in accumulators:
                acc.assign(tf.zeros_like(acc))

        # The counter is set in the branch's own synchronisation (no merge_call of its own).
        distribute.run_if(tf.equal(micro % self.steps, 0), update, updates=[(self._micro_step, micro)])

    def get_config(self):
        """The wrapped optimizer, `steps` and `average`."""
        config = super().get_config()
        config["steps"] = self.steps
        config["average"] = self.average
        config["shard_accumulators"] = self.shard_accumulators
        return config


class _Seen:
    """Variables that have had a gradient through this accumulation (a plain object, so
    that TensorFlow's tracking leaves it alone)."""

    def __init__(self):
        self._refs = set()

    def add(self, key) -> None:
        self._refs.add(key)

    def has(self, key) -> bool:
        return key in self._refs
