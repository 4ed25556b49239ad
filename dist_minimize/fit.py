"""`model.fit` through every stage: `integrate(model)`.

Keras's own train step computes the gradients with its tape and calls the optimizer's
`apply_gradients`, so `transform_loss` runs (through `scale_loss`) but `get_gradients`
never does, and a dist_minimize optimizer whose `get_gradients` is overridden refuses
plain `fit` with an error. `integrate(model)` gives the model a train step that calls
`optimizer.minimize(loss, model.trainable_variables, tape=tape)` instead: all six stages
run under `fit`, in the same order as in a custom loop. It also makes two Keras paths
work that fail without it:

* XLA: Keras compiles the train step with XLA by default on a machine with a GPU and no
  tf.distribute strategy (`jit_compile="auto"`), which is exactly the Horovod case;
  Horovod's collectives fail there, and assertions vanish. `integrate` turns XLA off
  for the model when the optimizer stack cannot run under it, and logs why.
* MultiWorkerMirroredStrategy: Keras 3's `fit` reduces the first distributed batch
  across workers to build the model symbolically, which MultiWorkerMirroredStrategy
  rejects (before any optimizer code runs); `integrate` builds from this worker's own
  part of the batch instead (only its shapes are used). Keras then reduces each
  step's scalar logs with `strategy.reduce("MEAN", value, axis=0)`, which fails for a
  scalar; the integrated step returns them as one-element vectors, which that reduce
  turns into the mean over the workers.
"""

from __future__ import annotations

import logging
import types

import keras
import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.staged import StagedOptimizer

logger = logging.getLogger("dist_minimize")


def integrate(model: keras.Model) -> keras.Model:
    """Makes `model.fit` run every stage of the model's dist_minimize optimizer.

    Call it after `model.compile(optimizer=dist_minimize...)` and before `fit` (again
    after a new `compile`). Changes only this model object: its `train_step` (see the
    module docstring), its `jit_compile` when the optimizer stack cannot run under XLA
    (with a logged warning saying why), and, under MultiWorkerMirroredStrategy, how
    Keras builds it from the first batch.

    Returns:
      `model`, for chaining.

    Raises:
      TypeError: `model` is not a compiled Keras model, or its optimizer is not a
        dist_minimize optimizer.
      ValueError: `steps_per_execution` > 1 under a strategy where Keras's multi-step
        train function cannot run (`steps_per_execution_blocker`).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model. Received: model={model!r} of type {type(model).__name__}")
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, StagedOptimizer):
        raise TypeError(
            "`integrate(model)` needs a model compiled with a dist_minimize optimizer: call "
            "`model.compile(optimizer=dist_minimize.Optimizer(...), ...)` first. Received: "
            f"optimizer={type(optimizer).__name__ if optimizer is not None else None}")
    own = _own_train_step(model)
    if own is not None:
        raise ValueError(
            f"{own} defines its own `train_step`, which `integrate` would replace. Keep yours and call the "
            "optimizer from it: `self.optimizer.minimize(loss, self.trainable_variables, tape=tape, "
            "loss_fn=...)` (every stage runs; `loss_fn`, a zero-argument function that computes this "
            "batch's loss again, lets `get_gradients` evaluate the loss again, as SAM does), and do not "
            f"call `integrate`. Received: model={model.name!r}")
    with model.distribute_strategy.scope():
        blocker = steps_per_execution_blocker(model)
    if blocker:
        raise ValueError(blocker)
    model.train_function = None  # Keras caches it at the first fit; rebuild it with this step
    strategy = model.distribute_strategy
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    if multi_worker:
        _compat.build_from_local_batch(model)
        model.train_step = types.MethodType(_multi_worker_step, model)
    else:
        model.train_step = types.MethodType(train_step, model)
    if model.jit_compile:
        with model.distribute_strategy.scope():
            reasons = xla_blockers(optimizer)
        if reasons:
            logger.warning("dist_minimize.integrate: jit_compile turned off for %s: %s.",
                           model.name, "; ".join(reasons))
            model.jit_compile = False
    return model


def _own_train_step(model: keras.Model) -> str | None:
    """Where `model`'s own `train_step` is defined (a class below keras.Model, or this
    object), or None for Keras's own or the one `integrate` installed."""
    step = model.__dict__.get("train_step")
    if step is not None:
        installed = getattr(step, "__func__", None) in (train_step, _multi_worker_step)
        return None if installed else f"The model {model.name!r}"
    for cls in type(model).__mro__:
        if "train_step" in cls.__dict__:
            return None if cls.__module__.startswith("keras") else f"{cls.__module__}.{cls.__qualname__}"
    return None


def steps_per_execution_blocker(model: keras.Model) -> str | None:
    """Why `model.fit` cannot run its `steps_per_execution` here (None: it can).

    Keras 3 runs `steps_per_execution` > 1 steps as a `tf.while_loop` whose body calls
    `strategy.run` under a `tf.cond`. Under MirroredStrategy on CPU devices (measured:
    TensorFlow 2.18.1, Keras 3.15.1, 2 replicas), that function fails at its first
    step with "You must feed a value for placeholder tensor
    'while/body/.../while/cond/Placeholder' with dtype int32", with stock Keras
    optimizers as with dist_minimize's; one step per execution works. Other devices
    were not measured and are let through.

    Args:
      model: a compiled Keras model (the current strategy is the model's).

    Returns:
      The error message naming the limit and the fix, or None.
    """
    steps = getattr(model, "steps_per_execution", 1) or 1
    if steps <= 1 or distribute.strategy_replicas() <= 1 or not distribute.uses_merge_call():
        return None
    if not distribute.worker_device_types() <= {"CPU"}:
        return None
    return (f"`steps_per_execution={steps}` cannot run under {type(tf.distribute.get_strategy()).__name__} on "
            f"CPU devices ({distribute.strategy_replicas()} replicas): Keras's multi-step train function (a "
            "tf.while_loop over strategy.run) fails there at its first step with \"You must feed a value for "
            "placeholder tensor 'while/.../Placeholder'\" (stock Keras optimizers alike; TensorFlow "
            f"{tf.__version__}, Keras {keras.__version__}). Compile with `steps_per_execution=1` (the default) "
            f"under this strategy. Received: steps_per_execution={steps} for model {model.name!r}")


def _multi_worker_step(model: keras.Model, data) -> dict:
    # Keras reduces fit's logs under MultiWorkerMirroredStrategy with
    # strategy.reduce("MEAN", value, axis=0), which fails for the scalar metric results
    # a train step returns; a one-element vector reduces to their mean.
    return tf.nest.map_structure(_as_vector, train_step(model, data))


def _as_vector(value):
    value = tf.convert_to_tensor(value)
    return tf.reshape(value, [1]) if value.shape.rank == 0 else value


def train_step(model: keras.Model, data) -> dict:
    """One `fit` step through every stage (what `integrate` installs as `train_step`).

    Forward pass, the compiled loss (Keras's, with its distribution scaling) and the
    "loss" metric as in Keras's own step; then `model.optimizer.minimize(loss,
    model.trainable_variables, tape=tape)` instead of `apply_gradients`.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = _compat.call_training(model, x)
        loss = _compat.compute_loss(model, x, y, y_pred, sample_weight)
    _compat.track_loss(model, loss, x)

    def loss_fn():  # this replica's batch, the compiled loss, a fresh forward pass
        return _compat.compute_loss(model, x, y, _compat.call_training(model, x), sample_weight)

    if model.trainable_variables:
        model.optimizer.minimize(loss, model.trainable_variables, tape=tape, loss_fn=loss_fn)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def xla_blockers(optimizer: StagedOptimizer) -> list[str]:
    """Why `optimizer`'s stack cannot run in an XLA-compiled step here (empty: it can)."""
    from dist_minimize import aggregation
    from dist_minimize.transforms.consistency import ConsistencyCheck
    from dist_minimize.transforms.nonfinite import LimitNonFiniteSteps

    reasons = []
    if distribute.strategy_replicas() > 1 and distribute.uses_merge_call():
        reasons.append(f"{type(tf.distribute.get_strategy()).__name__} on these devices synchronises "
                       "through merge_call, which TensorFlow cannot compile with XLA")
    base = optimizer.stack()[-1]
    horovod_job = distribute.strategy_replicas() == 1 and distribute.horovod_size() > 1
    for fn in base.transforms:
        if isinstance(fn, aggregation.HorovodAggregator) or (
                horovod_job and isinstance(fn, (aggregation.AutoAggregator, aggregation.NcclAggregator))):
            reasons.append("the Horovod backend's collectives have no XLA kernels in Horovod 0.28.1")
        if isinstance(fn, (LimitNonFiniteSteps, ConsistencyCheck)):
            reasons.append(f"{type(fn).__name__} raises through an assertion, which XLA drops")
    return reasons
