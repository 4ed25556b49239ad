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
from dist_minimize.horovod_keras.learning_rate import (  # noqa: F401
    EpochSchedule, LearningRateScheduleCallback, LearningRateWarmupCallback)
from dist_minimize.horovod_keras.sync_batch_norm import SyncBatchNormalization  # noqa: F401


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
    """Sets every variable to its value on `root_rank` (one broadcast per variable),
    matched by position: the i-th variable of every rank takes the root's i-th.

    Raises:
      ValueError (on every rank, before anything is sent): `root_rank` is out of range,
        or a rank's list differs from the root's in length, a shape or a dtype; the
        message names the first difference.
    """
    _check_root(root_rank)
    _agree(_signature([(f"variables[{i}]", v) for i, v in enumerate(variables)]), root_rank, "broadcast_variables")
    _broadcast(variables, root_rank)


def broadcast_model_and_optimizer(model: keras.Model, optimizer: Any = None, root_rank: int = 0,
                                  local_variables: Sequence[Any] = ()) -> None:
    """Builds `optimizer` on the model's trainable variables, then puts the root rank's
    model weights and optimizer state on every rank.

    Call it once before the first training step of a custom loop (or use
    `BroadcastVariablesCallback` with `fit`), so that every rank starts from the root's
    weights and optimizer state, e.g. after the root loaded a saved model and the others
    built a fresh one.

    Variables are matched by their place, never by name (Keras names a loaded model's
    variables `dense/kernel` and a freshly built one's `sequential/dense/kernel`): a
    model variable by its index in `model.variables`; an optimizer variable by the
    position in the stack of the optimizer that made it and, for a slot, the index of
    its trained variable in `model.trainable_variables` (`"0:3/momentum"`). Every
    optimizer variable is sent.

    With `shard_optimizer_state=True` each rank holds the slots of its own share only, so
    the root cannot send another rank's: the model and the variables every rank holds
    are sent, and it is refused unless every rank's optimizer has made as many steps as
    the root's (state resumed through `dist_minimize.Checkpointer`, which restores each
    rank's share, or not trained yet).

    Rank-local variables (`local_variables`, and those registered with the optimizer's
    `register_local_var`) and their optimizer state are left as they are on every rank.

    Raises:
      ValueError (on every rank, before anything is sent): the model has no weights yet;
        the ranks' models or optimizer stacks differ (another model, stack, number,
        shape or dtype of variables: the first difference is named); sharded state
        whose ranks are at different steps.
    """
    _check_root(root_rank)
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    from dist_minimize.sharding import sharded_checkpoint, sharded_state

    # What decides the collectives below, agreed first, so that a refusal is every rank's.
    built = bool(model.built and model.variables)
    sharded = optimizer is not None and sharded_state.of(optimizer) is not None
    states = _hvd().allgather_object((built, sharded))
    if not all(b for b, _ in states):
        raise ValueError(
            "The model must be built on every rank before its weights can be broadcast: give it a "
            "`keras.Input` or call `model.build(input_shape)` first. Received: an unbuilt model on rank(s) "
            f"{[r for r, (b, _) in enumerate(states) if not b]} ({model.name!r} here)")
    if len({s for _, s in states}) > 1:
        raise ValueError(
            "The ranks' optimizer stacks differ: shard_optimizer_state=True on rank(s) "
            f"{[r for r, (_, s) in enumerate(states) if s]} only; nothing was broadcast.")
    trainable = list(model.trainable_variables)
    is_local = getattr(sharded_state.stack_of(optimizer)[-1], "is_local", None) if optimizer is not None else None
    local = {id(v) for v in local_variables} | {id(v) for v in trainable if is_local is not None and is_local(v)}
    local_index = {i for i, v in enumerate(trainable) if id(v) in local}
    entries = [(f"model.variables[{i}]", v) for i, v in enumerate(model.variables) if id(v) not in local]
    signature = []
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        layers = list(sharded_state.stack_of(optimizer))
        layers += [layers[-1].inner_optimizer] if hasattr(layers[-1], "inner_optimizer") else []
        signature.append(("the optimizer stack", (), " > ".join(type(o).__name__ for o in layers)))
        keyed = sharded_checkpoint.held_by_key(optimizer, trainable)
        held = [(f"optimizer variable {key!r}", keyed[key]) for key in sorted(keyed)
                if sharded_checkpoint.slot_index(key) not in local_index]
        if sharded:
            held = _every_ranks(held, optimizer)
        entries += held
    _agree(signature + _signature(entries), root_rank, "broadcast_model_and_optimizer")
    _broadcast([v for _, v in entries], root_rank)


def _check_root(root_rank: int) -> Any:
    hvd = _hvd()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < hvd.size():
        raise ValueError(f"`root_rank` must be an integer in [0, {hvd.size()}). Received: root_rank={root_rank!r}")
    return hvd


def _describe(entry) -> str:
    return "nothing" if entry is None else f"{entry[0]} of shape {list(entry[1])} and dtype {entry[2]}"


def _signature(entries: list) -> list:
    return [(key, tuple(int(n) for n in v.shape), str(v.dtype)) for key, v in entries]


def _agree(signature: list, root_rank: int, what: str) -> None:
    """Raises ValueError on every rank unless every rank's `_signature` (what it is
    about to send or receive: (key, shape, dtype) each) is the root's. A collective:
    every rank calls it."""
    hvd = _hvd()
    everyone = hvd.allgather_object(signature)
    root = everyone[root_rank]
    for rank, theirs in enumerate(everyone):
        if theirs == root:
            continue
        i = next(i for i in range(max(len(root), len(theirs)))
                 if i >= len(root) or i >= len(theirs) or root[i] != theirs[i])
        raise ValueError(
            f"`{what}`: rank {rank}'s variables differ from root rank {root_rank}'s ({len(theirs)} against "
            f"{len(root)}): at position {i}, rank {rank} has {_describe(theirs[i] if i < len(theirs) else None)} "
            f"where the root has {_describe(root[i] if i < len(root) else None)}. Every rank must build the same "
            "model and optimizer stack before the broadcast; nothing was broadcast.")


def _every_ranks(entries: list, optimizer: Any) -> list:
    """Sharded state: the optimizer's entries every rank holds (the counters, the state of
    unsharded wrappers), after checking that the ranks' optimizers are at the same step
    and that each other entry is a slot of one rank's share (`"OWNER:INDEX/NAME"`, held
    by that rank alone); a share's slots stay where they are. A collective."""
    hvd = _hvd()
    steps = hvd.allgather_object(int(optimizer.iterations.numpy()))
    if len(set(steps)) > 1:
        raise ValueError(
            "`broadcast_model_and_optimizer`: the optimizer state is sharded (shard_optimizer_state=True), so "
            "each rank holds the slots of its own share and the root cannot send the others theirs; the ranks' "
            f"optimizers are at different steps ({', '.join(f'rank {r}: {n}' for r, n in enumerate(steps))}), "
            "so their shares would not belong to the same training. Resume sharded state with "
            "`dist_minimize.Checkpointer` (every rank restores its share; docs/sharding.md); nothing was "
            "broadcast.")
    held = hvd.allgather_object([key for key, _ in entries])
    common = set.intersection(*(set(keys) for keys in held))
    for rank, keys in enumerate(held):
        for key in keys:
            holders = sum(key in other for other in held)
            if key not in common and (holders != 1 or "/" not in key):
                raise ValueError(
                    f"`broadcast_model_and_optimizer`: rank {rank} holds {key}, which "
                    f"{holders} of {len(held)} ranks hold and is not the slot of one rank's share: the ranks' "
                    "optimizer stacks differ. Every rank must build the same model and optimizer stack before "
                    "the broadcast; nothing was broadcast.")
    return [(key, v) for key, v in entries if key in common]


def _broadcast(variables: Sequence[Any], root_rank: int) -> None:
    hvd = _hvd()
    for i, v in enumerate(variables):
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank, name=f"dm_broadcast_{i}"))


def load_model(filepath: str, custom_objects: dict | None = None, compile: bool = True,
               compression: str = "none", custom_optimizers: Sequence[type] | None = None,
               safe_mode: bool = True, **backend_options) -> keras.Model:
    """Horovod's `hvd.load_model`: loads a `.keras` file and returns a model whose
    optimizer aggregates through Horovod.

    A plain Keras optimizer in the file (its state as saved) becomes
    `dist_minimize.Optimizer.from_keras(optimizer, aggregate_gradients=
    HorovodAggregator(compression=compression, **backend_options))`, and the model is
    compiled again with it and the file's loss, metrics and other compile arguments. A
    saved dist_minimize stack is kept as it is: its backend was saved with it.

    Args:
      filepath: the `.keras` file.
      custom_objects: passed to `keras.saving.load_model`.
      compile: False loads the model uncompiled (no optimizer to wrap).
      compression: "none" or "fp16", for the wrapped plain optimizer.
      custom_optimizers: optimizer classes the file may name (Horovod's argument), added
        to `custom_objects` under their class names.
      safe_mode: passed to `keras.saving.load_model`.
      **backend_options: more `HorovodAggregator` options (reduction, sparse_as_dense,
        process_set, ...).

    Raises:
      ValueError: `compression` or `backend_options` given for a file that holds a
        dist_minimize stack (its backend is the saved one).
    """
    from dist_minimize.aggregation import HorovodAggregator
    from dist_minimize.optimizer import Optimizer
    from dist_minimize.staged import StagedOptimizer

    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.saving.load_model(filepath, custom_objects=objects or None, compile=compile, safe_mode=safe_mode)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    if isinstance(optimizer, StagedOptimizer):
        if compression != "none" or backend_options:
            raise ValueError(
                f"{filepath!r} holds a dist_minimize {type(optimizer).__name__}, whose aggregation backend was "
                "saved with it; `compression` and backend options apply to a plain Keras optimizer only. "
                f"Received: compression={compression!r}, {backend_options}")
        return model
    backend = HorovodAggregator(compression=compression, **backend_options)
    with keras.saving.custom_object_scope(objects):
        config = keras.saving.deserialize_keras_object(model.get_compile_config())
    config["optimizer"] = Optimizer.from_keras(optimizer, aggregate_gradients=backend)
    model.compile(**config)
    return model


_OPS = {"average": "mean", "sum": "sum", "adasum": "adasum"}


def DistributedOptimizer(optimizer: Any, compression: Any = "none", sparse_as_dense: bool = False,  # noqa: N802
                         gradient_predivide_factor: float = 1.0, op: Any = "average",
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         process_set: Any = None, scale_local_gradients: bool = True) -> Any:
    """Horovod's `hvd.DistributedOptimizer`, with its arguments: the dist_minimize stack
    that does what it does. A Keras optimizer becomes `dm.Optimizer.from_keras(optimizer,
    aggregate_gradients=HorovodAggregator(...))` (the Keras settings translated: clipping
    after aggregation); `backward_passes_per_step=K > 1` wraps it in
    `GradientAccumulation(steps=K, average=average_aggregated_gradients)`.

    `compression` is "none"/"fp16" or `hvd.Compression.none`/`.fp16`; `op` is
    "average"/"sum"/"adasum" or `hvd.Average`/`hvd.Sum`/`hvd.Adasum`. As in Horovod,
    `average_aggregated_gradients` defaults to False (the sum of the micro-steps'
    gradients); True is the mean, one step on the K-times larger batch.
    """
    from dist_minimize.aggregation import HorovodAggregator
    from dist_minimize.optimizer import Optimizer
    from dist_minimize.wrappers import GradientAccumulation

    hvd = _compat.import_horovod()
    names = {hvd.Average: "average", hvd.Sum: "sum", hvd.Adasum: "adasum"}
    reduction = _OPS.get(names.get(op, op) if not isinstance(op, str) else op.lower())
    if reduction is None:
        raise ValueError(f"`op` must be hvd.Average, hvd.Sum or hvd.Adasum (or their names). Received: op={op!r}")
    if not isinstance(compression, str):
        compression = "fp16" if compression is hvd.Compression.fp16 else (
            "none" if compression is hvd.Compression.none else repr(compression))
    backend = HorovodAggregator(reduction=reduction, compression=compression, sparse_as_dense=sparse_as_dense,
                                gradient_predivide_factor=gradient_predivide_factor, process_set=process_set)
    stack = Optimizer.from_keras(optimizer, aggregate_gradients=backend)
    stack.stack()[-1].scale_local_gradients = scale_local_gradients
    if backward_passes_per_step != 1:
        stack = GradientAccumulation(stack, steps=backward_passes_per_step, average=average_aggregated_gradients)
    return stack


def PartialDistributedOptimizer(optimizer: Any, local_layers: Sequence[keras.layers.Layer] = (),  # noqa: N802
                                **kwargs) -> Any:
    """Horovod's `hvd.PartialDistributedOptimizer`: `DistributedOptimizer(optimizer,
    **kwargs)` (or the dist_minimize stack given, with no kwargs) with every trainable
    weight of `local_layers` registered as rank-local (`register_local_var`).

    Raises:
      ValueError: a layer of `local_layers` is not built yet (it has no weights to
        register), or kwargs given with a dist_minimize stack.
    """
    from dist_minimize.staged import StagedOptimizer

    if isinstance(optimizer, StagedOptimizer):
        if kwargs:
            raise ValueError(f"PartialDistributedOptimizer takes no backend options with a dist_minimize stack (it "
                             f"has its backend). Received: {sorted(kwargs)}")
        stack = optimizer
    else:
        stack = DistributedOptimizer(optimizer, **kwargs)
    for layer in local_layers:
        if not layer.built:
            raise ValueError(f"`local_layers`: layer {layer.name!r} is not built, so it has no weights to register "
                             "as rank-local; build the model first (e.g. give it a keras.Input).")
        for variable in layer.trainable_weights:
            stack.register_local_var(variable)
    return stack


class BroadcastVariablesCallback(keras.callbacks.Callback):
    """Puts rank 0's model weights and optimizer state on every rank before the first step.

    Unlike Horovod's callback (which broadcasts after the first batch, once the optimizer
    exists), this builds the optimizer at `on_train_begin` and broadcasts there, so the
    first step already starts from identical weights.

    Args:
      root_rank: the rank whose values everyone takes.
      local_variables: variables each rank keeps (Horovod's argument; those registered
        with `register_local_var` are kept too).
    """

    def __init__(self, root_rank: int = 0, local_variables: Sequence[Any] = ()):
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = list(local_variables)
        self._done = False

    def on_train_begin(self, logs=None):
        if not self._done:
            broadcast_model_and_optimizer(self.model, self.model.optimizer, self.root_rank, self.local_variables)
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
    """Makes rank 0's checkpoint of a `GradientAccumulation` (or a `CompressedAggregation`)
    exact for every rank.

    Each Horovod process accumulates its own micro-batch gradients; a checkpoint written
    by rank 0 alone would hold rank 0's partial sums only, and a run resumed from it
    mid-window would not be exact. At the end of each epoch (and every
    `every_n_batches` batches, to match a `ModelCheckpoint(save_freq=N)`), this calls
    `share_process_state()` of every optimizer of the stack that has one
    (`GradientAccumulation.share_accumulators`, `CompressedAggregation`'s residuals) on
    every rank. Put it BEFORE the
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
        opt = getattr(self.model, "optimizer", None)
        for each in opt.stack() if hasattr(opt, "stack") else ():
            getattr(each, "share_process_state", lambda: None)()  # accumulators, compression residuals

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self.every_n_batches and self._batches % self.every_n_batches == 0:
            self._share()

    def on_epoch_end(self, epoch, logs=None):
        self._share()
