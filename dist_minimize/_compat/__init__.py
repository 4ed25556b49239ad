"""Every optional import and every Keras/TensorFlow internal this package touches.

Keeping them in one place (this package: the per-device update's internals are in
`per_device.py`) means a Keras or Horovod change breaks in one place, with a
message that says what to do, instead of deep inside a training step.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any

import keras
import tensorflow as tf

from keras.src.utils import tracking as _keras_tracking
from keras.src.utils.tracking import no_automatic_dependency_tracking  # noqa: E402,F401

SETUP_HINT = "Run `bash ci/setup.sh` (it builds Horovod 0.28.1 with TensorFlow, Gloo and MPI)."


class MissingDependencyError(ImportError):
    """An optional dependency a requested feature needs is not installed."""


def import_horovod() -> Any:
    """Returns `horovod.tensorflow`, or raises `MissingDependencyError` saying how to get it."""
    try:
        return importlib.import_module("horovod.tensorflow")
    except ImportError as e:
        raise MissingDependencyError(
            "The Horovod backend needs Horovod built with TensorFlow support "
            f"(`horovod.tensorflow` failed to import: {e}). {SETUP_HINT}"
        ) from e


def import_dp_accounting() -> Any:
    """Returns Google's `dp_accounting`, or raises `MissingDependencyError` saying how to get it."""
    try:
        return importlib.import_module("dp_accounting")
    except ImportError as e:
        raise MissingDependencyError(
            "dist_minimize.privacy.epsilon needs Google's dp-accounting package (`pip install "
            f"dp-accounting==0.6.0`, or `pip install dist_minimize[privacy]`; import failed: {e}). "
            f"{SETUP_HINT}") from e


def import_mpi4py() -> Any:
    """Returns `mpi4py.MPI`, or raises `MissingDependencyError` saying how to get it."""
    try:
        return importlib.import_module("mpi4py.MPI")
    except ImportError as e:
        raise MissingDependencyError(
            f"mpi4py is needed here but failed to import ({e}). {SETUP_HINT}"
        ) from e


def disable_keras_all_reduce(optimizer: keras.optimizers.Optimizer) -> None:
    """Stops a Keras 3 TensorFlow optimizer from all-reducing gradients itself.

    Keras's TensorFlow optimizer sums gradients across replicas inside
    `apply_gradients` (`_all_reduce_sum_gradients`). dist_minimize aggregates exactly
    once, in its own `aggregate_gradients` stage, so the inner optimizer's reduction is
    replaced by the identity on that instance only.
    """
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(
            f"This Keras version ({keras.__version__}) has no "
            "`_all_reduce_sum_gradients` on its TensorFlow optimizer; dist_minimize "
            "cannot guarantee a single aggregation per step with it. Supported: the "
            "Keras 3 that TensorFlow 2.16-2.21 install."
        )
    optimizer._all_reduce_sum_gradients = _identity_grads_and_vars


def _identity_grads_and_vars(grads_and_vars):
    return list(grads_and_vars)


_ALL_REDUCE_LISTENERS: list = []


def listen_to_all_reduce(listener) -> None:
    """Registers `listener(replica_context, value)`, called before every
    `tf.distribute.ReplicaContext.all_reduce` made while some thread is inside
    `hearing_all_reduce()`. Changes nothing in TensorFlow by itself."""
    if listener not in _ALL_REDUCE_LISTENERS:
        _ALL_REDUCE_LISTENERS.append(listener)


class _Hearing:
    """How many threads are inside `hearing_all_reduce`, and what it replaced."""

    lock = threading.Lock()
    inside = 0
    original = None
    wrapper = None


@contextlib.contextmanager
def hearing_all_reduce():
    """While any thread is inside: TensorFlow's `ReplicaContextBase.all_reduce`
    (`distribute_lib`, private; inherited by every strategy's replica context) calls the
    registered listeners first, then reduces as before. The first thread in wraps it,
    the last one out puts back what was there, so outside dist_minimize's own step
    TensorFlow is unchanged. `dist_minimize.aggregation.exactly_once` hears with it a collective
    made where none may run.
    """
    from tensorflow.python.distribute import distribute_lib

    base = distribute_lib.ReplicaContextBase
    with _Hearing.lock:
        if _Hearing.inside == 0:
            original = base.__dict__.get("all_reduce")
            if original is None:
                raise RuntimeError(
                    f"This TensorFlow ({tf.__version__}) has no ReplicaContextBase.all_reduce; dist_minimize "
                    "cannot check that a step aggregates once. Supported: TensorFlow 2.16-2.21.")

            def all_reduce(self, reduce_op, value, options=None):
                for heard in _ALL_REDUCE_LISTENERS:
                    heard(self, value)
                return original(self, reduce_op, value, options)

            all_reduce.__doc__, all_reduce.__wrapped__ = original.__doc__, original
            _Hearing.original, _Hearing.wrapper = original, all_reduce
            base.all_reduce = all_reduce
        _Hearing.inside += 1
    try:
        yield
    finally:
        with _Hearing.lock:
            _Hearing.inside -= 1
            if _Hearing.inside == 0:
                if base.__dict__.get("all_reduce") is _Hearing.wrapper:  # (unless someone replaced it since)
                    base.all_reduce = _Hearing.original
                _Hearing.original = _Hearing.wrapper = None


_LOCAL_VARIABLE_ARGS = ("initial_value", "trainable", "name", "dtype", "shape", "constraint")


def local_variables():
    """A scope in which every variable created is this process's own: a plain resource
    variable on the default device, not the strategy's (under MultiWorkerMirroredStrategy a
    variable made in the strategy's scope is mirrored, and its initial value broadcast from
    the first worker: a collective per variable, which processes holding different
    variables cannot pair). Made by `ResourceVariable` directly (private), past the
    strategy's variable creator."""
    from tensorflow.python.ops import resource_variable_ops

    def create(next_creator, **kwargs):
        del next_creator
        return resource_variable_ops.ResourceVariable(
            **{k: v for k, v in kwargs.items() if k in _LOCAL_VARIABLE_ARGS})

    return tf.variable_creator_scope(create)


def inner_strategy(optimizer: keras.optimizers.Optimizer) -> tf.distribute.Strategy | None:
    """The tf.distribute strategy a Keras optimizer captured when it was created."""
    return getattr(optimizer, "_distribution_strategy", None)


def strategy_uses_merge_call() -> bool:
    """Whether the current strategy needs `merge_call` for cross-replica updates."""
    return not tf.__internal__.distribute.strategy_supports_no_merge_call()


def add_replica_local_variable(optimizer: keras.optimizers.Optimizer, reference: Any, name: str) -> Any:
    """A zero variable shaped like `reference` that each replica keeps for itself.

    tf.distribute's sync-on-read (SUM) variable: in the replica context every replica
    reads and writes its own copy without communication; read in the cross-replica
    context (and so in checkpoints) it is the sum of the copies. It is tracked by
    `optimizer`, so it is checkpointed and saved with it.
    """
    ref = reference.value if isinstance(reference, keras.Variable) else reference
    strategy = getattr(optimizer, "_distribution_strategy", None) or tf.distribute.get_strategy()
    with strategy.extended.colocate_vars_with(ref), keras.name_scope(optimizer.name, caller=optimizer):
        variable = keras.Variable(
            initializer=keras.initializers.Zeros(), shape=tuple(reference.shape), dtype=reference.dtype,
            trainable=False, synchronization="on_read", aggregation="sum", name=name)
    optimizer._track_variable(variable)
    return variable


def add_replicated_variable(optimizer: keras.optimizers.Optimizer, reference: Any, name: str,
                            initializer: Any = "zeros") -> Any:
    """A variable shaped like `reference`, replicated like it, colocated with it.

    `initializer="value"` starts it from `reference`'s current value. Aggregation
    "only_first_replica": written in the replica context, the first replica's value goes
    to every copy (all replicas compute the same value, by contract).
    """
    ref = reference.value if isinstance(reference, keras.Variable) else reference
    if isinstance(initializer, str) and initializer == "value":
        start = tf.identity(tf.convert_to_tensor(ref))

        def initializer(shape, dtype=None):
            return tf.cast(start, dtype) if dtype is not None else start

    strategy = getattr(optimizer, "_distribution_strategy", None) or tf.distribute.get_strategy()
    with strategy.extended.colocate_vars_with(ref):
        return optimizer.add_variable(shape=tuple(reference.shape), initializer=initializer,
                                      dtype=reference.dtype, aggregation="only_first_replica", name=name)


def variable_key(optimizer: keras.optimizers.Optimizer, variable: Any) -> Any:
    """A key that identifies a trainable variable in every context (Keras's own).

    Under a strategy the same variable reaches an optimizer as the Keras variable, its
    distributed container or one replica's component; Keras's TensorFlow optimizer maps
    them all to one key (`_var_key`).
    """
    if not hasattr(optimizer, "_var_key"):
        raise RuntimeError(
            f"This Keras version ({keras.__version__}) has no `_var_key` on its TensorFlow optimizer; "
            "dist_minimize cannot find a variable's slots with it. Supported: the Keras 3 that "
            "TensorFlow 2.16-2.21 install.")
    return optimizer._var_key(variable)


def own_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables `optimizer` created itself (Keras's `_variables`), in creation order."""
    return list(optimizer._variables)


def momentum_slots(rule: keras.optimizers.Optimizer) -> list:
    """The momentum slots of a built SGD (`momentums`) or RMSprop (`_momentums`): the
    variables its step multiplies by `momentum` once each."""
    if isinstance(rule, keras.optimizers.RMSprop):
        return list(rule._momentums)
    if isinstance(rule, keras.optimizers.SGD):
        return list(rule.momentums)
    raise TypeError(f"No momentum slots are known for {type(rule).__name__}; SGD and RMSprop only.")


class UntrackedBaseState:
    """Mixin for dist_minimize optimizers: Keras's base constructor leaves no unused state.

    Keras's `Optimizer.__init__` always creates an `iteration` variable (and, for a
    float learning rate, a `learning_rate` variable; dist_minimize passes a callable, so
    none). A dist_minimize optimizer counts iterations in the Keras optimizer it wraps;
    its own counter would never change, yet be saved and checkpointed at every level of
    a stack. So the base constructor runs with Keras's attribute tracking off and
    `_track_variable` ignoring it, and its counter is dropped from TensorFlow's
    checkpoint dependencies after it.
    """

    def __init__(self, *args, **kwargs):
        with _keras_tracking.DotNotTrackScope():
            super().__init__(*args, **kwargs)
        if getattr(self, "_iterations", None) is not None:
            del self._iterations  # TensorFlow's tracking forgets the dependency
        self._iterations = None
        self._dm_base_released = True

    def _track_variable(self, variable):
        if getattr(self, "_dm_base_released", False):
            super()._track_variable(variable)


def initialized_outside_functions(variables) -> bool:
    """Whether every variable holds a value outside the functions being traced (False for
    one created by the function being traced, which is initialized only when it runs)."""
    with tf.init_scope():
        for v in variables:
            raw = v.value if isinstance(v, keras.Variable) else v
            try:
                if not bool(raw.is_initialized()):
                    return False
            except (AttributeError, TypeError, ValueError, tf.errors.OpError):
                return False
    return True


def in_xla_context() -> bool:
    """Whether the code being traced will be compiled by XLA (`tf.function(jit_compile=True)`,
    which is what Keras's `jit_compile=True` uses). TensorFlow's `control_flow_util`."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


# -- Keras's train step, for dist_minimize.fit ------------------------------------------


def call_training(model: keras.Model, x: Any) -> Any:
    """The forward pass as Keras's train step makes it (`training=True` where `call` takes it)."""
    if model._call_has_training_arg:
        return model(x, training=True)
    return model(x)


def compute_loss(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
    """The compiled loss as Keras's train step computes it (`Trainer._compute_loss`: it
    calls a user's `compute_loss` override with or without `training`)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)


def track_loss(model: keras.Model, loss: tf.Tensor, x: Any) -> None:
    """Updates the model's "loss" metric as Keras's train step does (`_loss_tracker`, with
    the loss unscaled from its per-replica share; a vector of per-example losses, which
    Keras leaves unscaled, is tracked as its mean)."""
    from keras.src import losses as loss_module

    first = next(i for i in tf.nest.flatten(x) if i is not None)
    if loss.shape.rank:  # per-example losses (reduction=None, for DifferentialPrivacy): not scaled
        value = tf.reduce_mean(loss)
    else:
        value = loss_module.loss.unscale_loss_for_distribution(loss)
    model._loss_tracker.update_state(value, sample_weight=tf.shape(first)[0])


def build_from_local_batch(model: keras.Model) -> None:
    """Under MultiWorkerMirroredStrategy, builds `model` from this worker's part of the
    first batch.

    Keras's TensorFlow `_maybe_symbolic_build` reduces the first distributed batch with
    `strategy.reduce("MEAN", ...)` only to learn its shapes, which
    MultiWorkerMirroredStrategy rejects. This instance's method takes the first local
    value instead (same shapes), then calls Keras's `_symbolic_build`.
    """
    if not hasattr(model, "_maybe_symbolic_build") or not hasattr(model, "_symbolic_build"):
        raise RuntimeError(
            f"This Keras version ({keras.__version__}) has no `_maybe_symbolic_build`/`_symbolic_build` "
            "on its TensorFlow trainer; dist_minimize.integrate cannot make fit work under "
            "MultiWorkerMirroredStrategy with it. Supported: the Keras 3 that TensorFlow 2.16-2.21 install.")

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return model.distribute_strategy.experimental_local_results(value)[0]
        return value

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(local, next(it))
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    import types

    model._maybe_symbolic_build = types.MethodType(maybe_symbolic_build, model)


def cross_device_ops_name(strategy: tf.distribute.Strategy) -> str:
    """The class name of the all-reduce a tf.distribute strategy was built with."""
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return type(ops).__name__ if ops is not None else "none"


def coordination_client() -> Any:
    """TensorFlow's client of the multi-worker coordination service in this process.

    `tensorflow.python.eager.context.context()` (private): its `wait_at_barrier`,
    `set_config_key_value` and `get_config_key_value` reach the coordination service
    that MultiWorkerMirroredStrategy starts on its first worker.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    missing = [name for name in ("wait_at_barrier", "set_config_key_value", "get_config_key_value")
               if not hasattr(ctx, name)]
    if missing:
        raise RuntimeError(
            f"This TensorFlow ({tf.__version__}) has no {missing} on its eager context; "
            "dist_minimize.cluster.exit_worker cannot end the workers cleanly with it. "
            "Supported: TensorFlow 2.16-2.21.")
    return ctx


# The update of one device (the per-device guarded update): dist_minimize/_compat/per_device.py.
from dist_minimize._compat.per_device import (  # noqa: E402,F401
    check_variables_are_known,
    keras_apply_on_device,
    keras_apply_on_device_blocker,
    keras_update_inputs,
    ops_without_kernel,
    resources_on,
    unlowered_cond,
    update_context,
)
