"""The distribution mechanics, in one place: counts, sums, Horovod detection, agreed branches.

Every part of dist_minimize that needs to know how many replicas take part, to reduce a
value across them, or to branch on a condition all of them must take alike, uses these
functions; wrapper authors should too. They work in the three contexts a training step
runs in:

* a tf.distribute strategy of several replicas (MirroredStrategy,
  MultiWorkerMirroredStrategy), in the replica context (`strategy.run`, `model.fit`);
* a Horovod job (`horovodrun`, `mpirun`): one replica per process, Horovod initialised;
* neither: one replica.

(Horovod inside a multi-replica strategy is not a supported combination: the strategy
wins.)
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.step import zones
from dist_minimize.step.context import CONTEXT


def horovod() -> Any | None:
    """`horovod.tensorflow` when it is imported AND initialised in this process, else None.

    Never imports Horovod itself (importing it has side effects and costs seconds).
    """
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is None:
        return None
    try:
        return hvd if hvd.is_initialized() else None
    except (ValueError, AttributeError):
        return None


def horovod_size() -> int:
    """The number of Horovod processes (1 when Horovod is not initialised)."""
    hvd = horovod()
    return hvd.size() if hvd is not None else 1


def strategy_replicas() -> int:
    """Replicas in sync of the current tf.distribute strategy (1 without one)."""
    if not tf.distribute.has_strategy():
        return 1
    return tf.distribute.get_strategy().num_replicas_in_sync


def num_replicas() -> int:
    """How many replicas a step's gradients are aggregated over, in this context.

    The strategy's replicas in sync when it has several, else Horovod's process count,
    else 1.
    """
    n = strategy_replicas()
    return n if n > 1 else horovod_size()


def _replica_context_or_raise(what: str):
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        zones.record(f"`dist_minimize.distribute.{what}`")  # inside a step hook: its contract's error
        raise RuntimeError(
            f"`{what}` must run in a replica context (inside `strategy.run` or `model.fit`), "
            "not in the cross-replica context.")
    return tf.distribute.get_replica_context()


def sum_across(value, name: str = "dm_sum_across"):
    """The sum of `value` (a tensor, or a list of tensors) over every replica or process.

    In the replica context of a multi-replica strategy: one `ReplicaContext.all_reduce`;
    in a Horovod job of several processes: one (grouped) Horovod allreduce named `name`;
    otherwise `value` itself. Integer sums are exact.

    Raises:
      RuntimeError: called in a strategy's cross-replica context.
    """
    return _reduce(value, "sum", name)


def mean_across(value, name: str = "dm_mean_across"):
    """The mean of `value` over every replica or process (see `sum_across`)."""
    return _reduce(value, "mean", name)


def _reduce(value, op: str, name: str):
    many = isinstance(value, (list, tuple))
    values = [tf.convert_to_tensor(v) for v in (value if many else [value])]
    ctx = _replica_context_or_raise(f"{op}_across")
    if tf.distribute.has_strategy() and ctx is not None and ctx.num_replicas_in_sync > 1:
        reduce_op = tf.distribute.ReduceOp.SUM if op == "sum" else tf.distribute.ReduceOp.MEAN
        # One all-reduce per dtype: tf.distribute packs a list into one buffer, which
        # fails for values of several dtypes.
        out = [None] * len(values)
        by_dtype: dict = {}
        for i, v in enumerate(values):
            by_dtype.setdefault(v.dtype, []).append(i)
        for indices in by_dtype.values():
            for i, r in zip(indices, ctx.all_reduce(reduce_op, [values[i] for i in indices])):
                out[i] = r
    else:
        hvd = horovod()
        if hvd is not None and hvd.size() > 1:
            hvd_op = hvd.Sum if op == "sum" else hvd.Average
            if all(v.dtype.is_integer for v in values) and op == "mean":
                raise TypeError(f"`mean_across` needs floating-point values. Received dtypes "
                                f"{[v.dtype.name for v in values]}")
            out = hvd.grouped_allreduce(values, op=hvd_op, name=name)
        else:
            out = values
    out = list(out)
    return out if many else out[0]


XLA_FIX = ("Compile without XLA: `model.compile(..., jit_compile=False)` (Keras turns XLA on by "
           "default on a machine with a GPU when no tf.distribute strategy is active, which is "
           "the Horovod case), or `tf.function(..., jit_compile=False)` for a custom loop; "
           "`dist_minimize.integrate(model)` does it for a model, with a logged reason.")


def in_xla() -> bool:
    """Whether the step being traced will be compiled by XLA."""
    return _compat.in_xla_context()


def refuse_xla(what: str, why: str) -> None:
    """Raises `RuntimeError` naming `what`, `why` and the fix if the step is XLA-compiled.

    For parts of a step that would fail or silently do nothing under XLA.
    """
    if _compat.in_xla_context():
        raise RuntimeError(f"{what} cannot run in an XLA-compiled step: {why}. {XLA_FIX}")


ASSERT_DROPPED = "TensorFlow drops `tf.debugging.Assert` from XLA-compiled functions, so it would never fail"


def check_agreed(condition: tf.Tensor, what: str = "condition") -> tf.Operation | None:
    """An assertion that the scalar bool `condition` is the same on every replica or process.

    Costs one small integer all-reduce. Returns the assertion op in graph mode (None
    eagerly, where it raises at once). The failure is `tf.errors.InvalidArgumentError`
    naming `what`. (Under XLA, TensorFlow drops assertions; see docs/pipeline.md.)
    """
    n = num_replicas()
    if n == 1:
        return None
    refuse_xla("run_if(..., check=True)", ASSERT_DROPPED)
    votes = sum_across(tf.cast(condition, tf.int32), name="dm_check_agreed")
    return tf.debugging.Assert(
        tf.logical_or(tf.equal(votes, 0), tf.equal(votes, n)),
        [f"The {what} differs across replicas (it must be identical on every replica "
         "and process); replicas where it holds:", votes, "of", n])


def uses_merge_call() -> bool:
    """Whether the current strategy synchronises replicas through `merge_call` (every
    CPU strategy does)."""
    return tf.distribute.has_strategy() and _compat.strategy_uses_merge_call()


def _merge_call_replica_context():
    """The replica context when updates synchronise through merge_call, else None."""
    ctx = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and ctx is not None and _compat.strategy_uses_merge_call():
        return ctx
    return None


@contextlib.contextmanager
def deferred_updates():
    """Collects `assign_replicated` calls made inside, to be made by `run_if(updates=...)`.

    Yields the list (`StepContext.writes`); pass it to the step's `run_if(...,
    updates=pending)` (or `flush_updates(pending)`), which makes them all in its one
    cross-replica step. What a dist_minimize step does around its stages, so that the
    statistics and counters of every transform cost no synchronisation of their own.
    What `note_all_finite` and `note_scaled` record holds inside it too.
    """
    previous = CONTEXT.writes, CONTEXT.memos
    CONTEXT.writes, CONTEXT.memos = [], {}
    try:
        yield CONTEXT.writes
    finally:
        CONTEXT.writes, CONTEXT.memos = previous


def note_all_finite(grads, value: tf.Tensor) -> None:
    """Records, for the rest of this step, whether every element of `grads` is finite.

    A transform that knows it (the global-norm clipper: its outputs are finite exactly
    when the norm is) saves the non-finite guard another pass over every gradient
    element. Only within a dist_minimize step; elsewhere it does nothing
    (`StepContext.note_all_finite`).
    """
    CONTEXT.note_all_finite(grads, value)


def known_all_finite(grads) -> tf.Tensor | None:
    """What `note_all_finite` recorded for exactly these gradient tensors in this step, or None."""
    return CONTEXT.known_all_finite(grads)


def scale(g: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
    """`g * factor` in `g`'s dtype: how a transform that scales every gradient by one
    scalar (the global-norm clipper) makes each product, wherever it is made."""
    return g * tf.cast(factor, g.dtype)


def note_scaled(outputs, inputs, factor: tf.Tensor) -> None:
    """Records, for the rest of this step, that each dense tensor of `outputs` is
    `scale(inputs[i], factor)`: the guarded update, handed exactly `outputs`, makes the
    products in its branch instead (docs/writing-a-wrapper.md says why). Only within a
    dist_minimize step, and only for dense tensors."""
    if all(isinstance(g, tf.Tensor) for g in outputs if g is not None):
        CONTEXT.note_scaled(outputs, inputs, factor)


def known_scaled(grads) -> tuple | None:
    """`(inputs, factor)` that `note_scaled` recorded for exactly these tensors in this step, or None."""
    return CONTEXT.known_scaled(grads)


def assign_replicated(variable, value) -> None:
    """`variable.assign(value)` for a replicated variable that every replica sets alike.

    Under a merge-call strategy each such assign in the replica context is a
    synchronisation of all replicas; inside `deferred_updates` (every dist_minimize
    step) it is made later, together with the others, in the step's one cross-replica
    branch, each device's copy from its own replica's value (`_assign_each`). Reads of
    `variable` later in the same step see the old value. Elsewhere it assigns at once.

    The value must be the same on every replica: derived from aggregated gradients,
    replicated variables and constants (as each worker of a MultiWorkerMirroredStrategy
    writes its own copies from its own value, so does each device).
    """
    if CONTEXT.writes is not None and _merge_call_replica_context() is not None:
        CONTEXT.writes.append((variable, tf.convert_to_tensor(value)))
    else:
        variable.assign(value)


def assign_local(pairs: Sequence) -> None:
    """Writes each replica's own value into its own copy of each variable, now.

    For a stage that changes the model's variables inside a step and puts them back
    (SAM's perturbation): `pairs` are (variable, value) with this replica's value; the
    values may differ between replicas. Under a merge-call strategy that is one
    synchronisation of the replicas (a `merge_call`, no collective) after which each
    device's copy holds its replica's value; elsewhere (one device, each Horovod process)
    plain assigns. Reads later in the step see the new values.
    """
    pairs = [(v, tf.convert_to_tensor(x)) for v, x in pairs]
    ctx = _merge_call_replica_context()
    if ctx is None:
        for variable, value in pairs:
            variable.assign(value)
        return

    def cross(strategy, values):
        for (variable, _), value in zip(pairs, values):
            target = variable.value if isinstance(variable, keras.Variable) else variable
            strategy.extended.update(target, lambda copy, x: copy.assign(x), args=(value,), group=False)

    ctx.merge_call(cross, args=([value for _, value in pairs],))


def _assign_each(strategy, pairs: Sequence, values) -> None:
    """Each device's copy of each replicated variable from that device's replica's value:
    nothing crosses devices (a copy of the first replica's value to every device cost
    2.5% of a 20-variable MirroredStrategy step). A variable with one copy for all
    devices (CentralStorageStrategy) takes the first replica's value."""
    for (variable, _), value in zip(pairs, values):
        target = variable.value if isinstance(variable, keras.Variable) else variable
        if has_copy_per_device([target]):
            strategy.extended.update(target, lambda copy, x: copy.assign(x), args=(value,), group=False)
        else:
            variable.assign(strategy.experimental_local_results(value)[0])


def flush_updates(updates: Sequence) -> None:
    """Makes deferred `assign_replicated` updates now (one synchronisation for all)."""
    updates = list(updates)
    if not updates:
        return
    ctx = _merge_call_replica_context()
    if ctx is None:
        for variable, value in updates:
            variable.assign(value)
        return
    ctx.merge_call(lambda strategy, values: _assign_each(strategy, updates, values),
                   args=([value for _, value in updates],))


def run_if(condition: tf.Tensor, fn: Callable, args: tuple = (), otherwise: Callable | None = None,
           check: bool = False, updates: Sequence = ()) -> None:
    """Runs `fn(*args)` on every replica when the agreed `condition` holds, else `otherwise()`.

    `condition` must be identical on every replica and process: derive it from
    aggregated gradients, from replicated counters, or from `sum_across`. With
    `check=True` that is verified first (`check_agreed`, one small all-reduce).

    `fn` may use collectives and variable updates. Under strategies that synchronise
    through `merge_call` (every CPU strategy), tf.distribute does not allow a
    `merge_call` inside a `tf.cond` taken per replica (what makes Keras's own
    accumulation and EMA overwrite fail under MirroredStrategy). So the branch is taken
    once, in the cross-replica context, on replica 0's `condition` (equal on all, by
    contract), and `fn` then runs on every replica. `otherwise` runs once there;
    elsewhere (no strategy, Horovod) both run in each process, in one `If` op that
    TensorFlow does not lower where all the branch's resources live on one device
    (`_compat.unlowered_cond`).

    Pass every per-replica tensor `fn` needs through `args`: under merge-call
    strategies `fn` runs from the cross-replica context, where a tensor it captured
    from the calling replica is replica 0's on every replica. Variables may be captured
    (each replica resolves its own copy). `otherwise` takes no arguments and should
    only update replicated variables.

    `updates`: (replicated variable, per-replica value) pairs, e.g. from
    `deferred_updates`, assigned before the branch in the same cross-replica step (no
    synchronisation of their own).
    """
    otherwise = otherwise if otherwise is not None else (lambda: None)
    if check:
        assertion = check_agreed(condition)
        if assertion is not None:
            with tf.control_dependencies([assertion]):
                condition = tf.identity(condition)
    updates = list(updates)
    ctx = _merge_call_replica_context()
    if ctx is not None:
        def cross_replica(strategy, condition, args, values):
            _assign_each(strategy, updates, values)
            agreed = strategy.experimental_local_results(condition)[0]

            def run():
                strategy.extended.call_for_each_replica(fn, args=args)

            tf.cond(agreed, run, lambda: _discard(otherwise()))

        ctx.merge_call(cross_replica, args=(condition, args, [value for _, value in updates]))
        return
    for variable, value in updates:
        variable.assign(value)
    _compat.unlowered_cond(condition, lambda: _discard(fn(*args)), lambda: _discard(otherwise()))


def _discard(_) -> None:
    """A branch's result is not `run_if`'s: the two branches need not return alike."""
    return None


def worker_device_types() -> set[str]:
    """The types of the current strategy's devices ("CPU", "GPU", ...; "?" where a
    device name does not say)."""
    devices = tf.distribute.get_strategy().extended.worker_devices
    return {(tf.DeviceSpec.from_string(d).device_type or "?").upper() for d in devices}


def has_copy_per_device(variables: Sequence) -> bool:
    """Whether each variable has one copy on each of the current strategy's devices
    (mirrored variables do; a CentralStorageStrategy variable has one copy in all)."""
    strategy = tf.distribute.get_strategy()
    devices = len(strategy.extended.worker_devices)
    for v in variables:
        v = v.value if isinstance(v, keras.Variable) else v
        if len(strategy.experimental_local_results(v)) != devices:
            return False
    return True


def run_if_per_device(condition: tf.Tensor, fn: Callable, args: tuple = (), otherwise: Callable | None = None,
                      updates: Sequence = ()) -> None:
    """`run_if` for an update made device by device, under a merge-call strategy only.

    In one `merge_call`: the `updates` (as in `run_if`), then, for each of the
    strategy's devices `i`, on that device and in tf.distribute's update context
    of `i`: `fn(i, *local_args)` if replica 0's `condition` holds, else
    `otherwise(i)`. `local_args` is `args` with every per-replica value replaced by its
    value on device `i`. Each branch is one `If` op on its device that TensorFlow
    does not lower (`_compat.unlowered_cond`; lowered after all if it reads a resource
    of another device, such as a variable made outside the strategy's scope, or holds
    an op without a kernel for the device): `fn` must
    write only that device's copies (what `strategy.extended.update` does per device,
    and what distributed variables resolve to inside the update context) and must not
    use collectives or `merge_call`.

    Raises:
      RuntimeError: not in the replica context of a merge-call strategy.
    """
    ctx = _merge_call_replica_context()
    if ctx is None:
        raise RuntimeError("`run_if_per_device` needs the replica context of a strategy that synchronises "
                           "through merge_call (MirroredStrategy, MultiWorkerMirroredStrategy); use `run_if`.")
    otherwise = otherwise if otherwise is not None else (lambda i: None)
    updates = list(updates)

    def cross_replica(strategy, condition, args, values):
        _assign_each(strategy, updates, values)
        agreed = strategy.experimental_local_results(condition)[0]
        for i, device in enumerate(strategy.extended.worker_devices):
            local_args = tf.nest.map_structure(
                lambda a: strategy.experimental_local_results(a)[i]
                if isinstance(a, tf.distribute.DistributedValues) else a, args)
            with tf.device(device), _compat.update_context(i):
                _compat.unlowered_cond(agreed, lambda: _discard(fn(i, *local_args)), lambda: _discard(otherwise(i)))

    ctx.merge_call(cross_replica, args=(condition, tuple(args), [value for _, value in updates]))
