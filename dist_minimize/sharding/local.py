"""Rank-local variables (Horovod's `register_local_var` and `register_local_source`):
variables whose gradient is not aggregated across Horovod processes, each process
updating its own copy with its own gradient (divided by the process count when
`scale_local_gradients`, Horovod's default). For variables that differ per process: a
rank's embedding shard, a per-rank head, a model-parallel layer whose gradient already
holds every contribution it needs.

The rest of the step stays identical on every process, so the shared weights cannot
diverge: within the step, `StepContext.everyones_values` completes per-pair values with
the local pairs' summed over the processes (a global norm adds every process's local
squares) and `StepContext.sum_over_shards` adds across processes (the non-finite guard's
decision is agreed), the same calls a sharded step answers; so a `transform_gradients`
callable must declare `shards_state = True`, as with sharded state. With sharded state
(`shard_optimizer_state=True`) the partition leaves them out: every process owns its
rank-local variables and their state (`Sharding.mine`), and their pairs are `scaled`,
never reduce-scattered (`Sharding.reduce_scatter`).
"""

from __future__ import annotations

import os
import shutil

import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.sharding import sharded_state
from dist_minimize.step.context import CONTEXT
from dist_minimize.transforms.base import map_gradient


class LocalVariables:
    """The rank-local variables of one `Optimizer` (keys of its update rule) and whether
    their gradients are scaled by 1 / processes."""

    def __init__(self):
        self.keys: set = set()
        self.scale = True

    def __bool__(self) -> bool:
        return bool(self.keys)

    def register(self, optimizer, variable) -> None:
        name = getattr(variable, "path", None) or getattr(variable, "name", variable)
        if distribute.strategy_replicas() > 1:
            raise ValueError(
                "register_local_var: under a tf.distribute strategy of "
                f"{distribute.strategy_replicas()} replicas a variable is mirrored (one value on every replica), "
                "so it cannot hold each process's own; rank-local variables need Horovod (one replica per "
                f"process). Received: {name!r}")
        sets = [t for t in optimizer.transforms if getattr(t, "process_set", None) is not None]
        if sets:
            raise ValueError(
                "register_local_var with a Horovod process set: rank-local gradients are scaled and combined over "
                "every process, not the set's; not supported together. Received: " + repr(name))
        if optimizer.built:
            raise ValueError(
                "register_local_var after the optimizer is built: a step already traced would aggregate the "
                "variable's gradient; register rank-local variables before the first step (or `build`). "
                f"Received: {name!r}")
        sharded_state.check_transforms(list(optimizer._gradient_fns), "rank-local variables")
        self.keys.add(_compat.variable_key(optimizer.inner_optimizer, variable))

    def contains(self, rule, variable) -> bool:
        return bool(self.keys) and _compat.variable_key(rule, variable) in self.keys

    def scaled(self, local_pairs: list) -> list:
        """Rank-local (gradient, variable) pairs as the update takes them: each process's
        own gradient, divided by the process count when `scale` (Horovod's default)."""
        if not local_pairs:
            return []
        if distribute.strategy_replicas() > 1:
            raise ValueError(
                "A step with rank-local variables runs under a tf.distribute strategy of "
                f"{distribute.strategy_replicas()} replicas, whose variables are mirrored; rank-local variables "
                "need Horovod (one replica per process).")
        size = distribute.horovod_size()
        if not self.scale or size == 1:
            return list(local_pairs)
        return [(map_gradient(g, lambda t: t / tf.cast(size, t.dtype)), v) for g, v in local_pairs]

    def aggregate(self, rule, grads_and_vars: list, aggregate) -> list:
        """The shared pairs through `aggregate`, the local ones `scaled`; registers the
        per-process combination for the rest of the step. (With sharded state the
        partition keeps them apart: `Sharding.reduce_scatter`.)"""
        local = [self.contains(rule, v) for _, v in grads_and_vars]
        scaled = iter(self.scaled([p for p, is_local in zip(grads_and_vars, local) if is_local]))
        shared = iter(aggregate([p for p, is_local in zip(grads_and_vars, local) if not is_local]))
        out = [next(scaled) if is_local else next(shared) for is_local in local]
        size = distribute.horovod_size()
        step = CONTEXT.sharded
        if step is not None and size > 1:
            step.sum = lambda value: distribute.sum_across(value, name="dm_local_sum")
            step.everyones = lambda values: _with_local_sums(values, local)
        return out


def _with_local_sums(values: list, local: list) -> list:
    """Per-pair values of a step with rank-local variables: the shared pairs' as they are
    (equal on every process), then the local pairs' summed over the processes (one
    collective)."""
    if len(values) != len(local):
        raise ValueError(f"A step with rank-local variables takes one value per pair of the step ({len(local)}). "
                         f"Received: {len(values)} values")
    shared = [v for v, is_local in zip(values, local) if v is not None and not is_local]
    mine = [v for v, is_local in zip(values, local) if v is not None and is_local]
    dtype = next((v.dtype for v in values if v is not None), tf.float32)
    total = tf.add_n(mine) if mine else tf.zeros([], dtype)
    return shared + [distribute.sum_across(total, name="dm_local_norm")]


# -- checkpoints: each process's local variables, beside the shared checkpoint ------------

def checkpointed(model, optimizer) -> list:
    """The variables a checkpoint must hold per process: the rank-local trained variables
    of `optimizer`'s stack and their optimizer state, in an order every process shares."""
    is_local = getattr(sharded_state.stack_of(optimizer)[-1], "is_local", None)
    trained = list(model.trainable_variables)
    local = {i for i, v in enumerate(trained) if is_local is not None and is_local(v)}
    if not local:
        return []
    from dist_minimize.sharding import sharded_checkpoint

    keyed = sharded_checkpoint.held_by_key(optimizer, trained)
    slots = [keyed[k] for k in sorted(keyed) if sharded_checkpoint.slot_index(k) in local]
    return [v for i, v in enumerate(trained) if i in local] + slots


def file_of(directory: str, name: str, rank: int) -> str:
    return os.path.join(directory, "local", f"{name}-rank{rank}")


def write(directory: str, name: str, rank: int, variables: list) -> None:
    """Writes this process's local variables for the checkpoint `name` (atomically)."""
    final = file_of(directory, name, rank)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(variables)}).write(os.path.join(tmp, "state"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def read(directory: str, name: str, rank: int, variables: list) -> None:
    """Restores this process's local variables of the checkpoint `name`.

    Raises:
      FileNotFoundError: no file for this process (the checkpoint was written by fewer
        processes, or before the variables were registered as local).
    """
    path = file_of(directory, name, rank)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"The checkpoint {name} has no rank-local variables for process {rank} ({path}): it was written by "
            "fewer processes or without them. A job with rank-local variables resumes on as many processes as "
            "wrote it.")
    tf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(variables)}).read(
        os.path.join(path, "state")).assert_existing_objects_matched()


def prune(directory: str, oldest_kept: str) -> None:
    """Removes the local files of checkpoints older than `oldest_kept` (names sort by
    step); newer ones may belong to a checkpoint not published yet."""
    folder = os.path.join(directory, "local")
    for entry in os.listdir(folder) if os.path.isdir(folder) else []:
        if entry.rsplit("-rank", 1)[0] < oldest_kept:
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)
