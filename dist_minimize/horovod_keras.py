"""Keras 3 + Horovod: broadcast, metric averaging, rank-0-only output, data sharding.

Horovod's own Keras integration does not work with Keras 3 (its optimizer hooks are never
called by Keras 3's `fit`; `DistributedGradientTape` calls `.ref()` on Keras variables;
its callbacks use removed `keras.backend` functions). These pieces use only Horovod's
core collectives, which work with Keras 3 tensors; gradients are averaged by
`dist_minimize.Optimizer` (the `"horovod"` backend, chosen by `"auto"`).

Example (run with `horovodrun -np 2 python train.py`):
  >>> hvd = dm.horovod_keras.init()
  >>> model.compile(optimizer=dm.Optimizer(keras.optimizers.Adam(1e-3),
  ...               transform_gradients=dm.clip_by_global_norm(1.0)), loss=...)
  >>> model.fit(dm.horovod_keras.shard(dataset), verbose=dm.horovod_keras.verbosity(2),
  ...           callbacks=[dm.horovod_keras.BroadcastVariablesCallback(),
  ...                      dm.horovod_keras.MetricAverageCallback()])
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat


def _hvd() -> Any:
    hvd = _compat.import_horovod()
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def init(comm: Any = None) -> Any:
    """Initialises Horovod (optionally on an mpi4py communicator); returns `horovod.tensorflow`."""
    from dist_minimize import cluster

    hvd = _compat.import_horovod()
    if not hvd.is_initialized():
        cluster.init_horovod(comm)
    return hvd


def is_root() -> bool:
    """Whether this is Horovod rank 0 (the process that prints and writes files)."""
    return _hvd().rank() == 0


def verbosity(verbose: int | str = "auto") -> int | str:
    """`verbose` on rank 0, 0 elsewhere: pass to `model.fit(verbose=...)`."""
    return verbose if is_root() else 0


def root_only(callbacks: Sequence[keras.callbacks.Callback]) -> list:
    """The callbacks on rank 0, none elsewhere (checkpoints, TensorBoard, CSV logs)."""
    return list(callbacks) if is_root() else []


def shard(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """This rank's shard of `dataset`: every `size`-th element, starting at `rank`.

    Shard before batching (with the local batch size) so that each step's global batch
    is the concatenation of the ranks' local batches.
    """
    hvd = _hvd()
    return dataset.shard(hvd.size(), hvd.rank())


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0) -> None:
    """Sets every variable to its value on `root_rank` (one broadcast per variable)."""
    hvd = _hvd()
    if not 0 <= root_rank < hvd.size():
        raise ValueError(f"`root_rank` must be in [0, {hvd.size()}). Received: root_rank={root_rank}")
    for i, v in enumerate(variables):
        value = hvd.broadcast(tf.convert_to_tensor(v), root_rank, name=f"dm_broadcast_{i}")
        v.assign(value)


def broadcast_model_and_optimizer(model: keras.Model, optimizer: Any = None, root_rank: int = 0) -> None:
    """Builds `optimizer` on the model's trainable variables, then broadcasts both.

    Call it once before the first training step of a custom loop (or use
    `BroadcastVariablesCallback` with `fit`), so that every rank starts from rank 0's
    weights and optimizer state.

    Raises:
      ValueError: the model has no weights yet (build it first, e.g. with `keras.Input`).
    """
    if not model.built or not model.variables:
        raise ValueError(
            "The model must be built before its weights can be broadcast: give it a "
            "`keras.Input` or call `model.build(input_shape)` first. Received: an unbuilt "
            f"model {model.name!r}")
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    variables = list(model.variables)
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables += _held_by_every_rank(list(optimizer.variables))
    broadcast_variables(variables, root_rank)


def _held_by_every_rank(variables: list) -> list:
    """`variables` less the ones of this rank's share of a sharded optimizer state
    (`shard_optimizer_state=True`): those that every rank holds (by path), in the same
    order everywhere."""
    everyone = _hvd().allgather_object([v.path for v in variables])
    common = set.intersection(*(set(paths) for paths in everyone))
    if len(common) == len(variables) and all(len(paths) == len(variables) for paths in everyone):
        return variables
    return sorted((v for v in variables if v.path in common), key=lambda v: v.path)


class BroadcastVariablesCallback(keras.callbacks.Callback):
    """Puts rank 0's model weights and optimizer state on every rank before the first step.

    Unlike Horovod's callback (which broadcasts after the first batch, once the optimizer
    exists), this builds the optimizer at `on_train_begin` and broadcasts there, so the
    first step already starts from identical weights.

    Args:
      root_rank: the rank whose values everyone takes.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self._done = False

    def on_train_begin(self, logs=None):
        if not self._done:
            broadcast_model_and_optimizer(self.model, self.model.optimizer, self.root_rank)
            self._done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each numeric epoch log with its average over all Horovod ranks.

    Put it before callbacks that read the logs (checkpointing, early stopping, the
    gradient statistics logger) in `callbacks=[...]`.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        hvd = _hvd()
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float)) or tf.is_tensor(v))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="dm_metric_average").numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class ShareAccumulatorsCallback(keras.callbacks.Callback):
    """Makes rank 0's checkpoint of a `GradientAccumulation` exact for every rank.

    Each Horovod process accumulates its own micro-batch gradients; a checkpoint written
    by rank 0 alone would hold rank 0's partial sums only, and a run resumed from it
    mid-window would not be exact. At the end of each epoch (and every
    `every_n_batches` batches, to match a `ModelCheckpoint(save_freq=N)`), this calls
    `GradientAccumulation.share_accumulators()` on every rank. Put it BEFORE the
    checkpoint callback in `callbacks=[...]`, on every rank (it is a collective).

    Args:
      every_n_batches: also share every N batches (None: at epoch ends only).
    """

    def __init__(self, every_n_batches: int | None = None):
        super().__init__()
        if every_n_batches is not None and (isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int)
                                            or every_n_batches < 1):
            raise ValueError(f"`every_n_batches` must be None or an integer >= 1. "
                             f"Received: every_n_batches={every_n_batches!r}")
        self.every_n_batches = every_n_batches
        self._batches = 0  # across epochs, as ModelCheckpoint(save_freq=N) counts

    def _share(self):
        from dist_minimize.wrappers.accumulation import GradientAccumulation

        opt = getattr(self.model, "optimizer", None)
        accumulation = opt.find(GradientAccumulation) if hasattr(opt, "find") else None
        if accumulation is not None:
            accumulation.share_accumulators()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.every_n_batches and self._batches % self.every_n_batches == 0:
            self._share()

    def on_epoch_end(self, epoch, logs=None):
        self._share()
