"""The staged optimizer: RFC 234's `minimize`, split into public, overridable stages.

One training step, per replica::

    transform_loss(loss)                          per replica   e.g. loss scaling
    get_gradients(loss, variables, tape)          per replica
    transform_unaggregated_gradients(g&v)         per replica   e.g. per-example clipping
    aggregate_gradients(g&v)                      exactly once  strategy / horovod backend
    transform_gradients(g&v)                      aggregated: identical on every replica
    apply_updates(g&v)                            the wrapped Keras optimizer's update rule

`minimize` runs all six; `apply_gradients(grads_and_vars, aggregate=True)` runs the
last four (this is what Keras's `model.fit` calls). Every stage's output is checked
against its contract, and an error names the stage that broke it.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat, _stages, aggregation

# Keras optimizer settings that act per replica, before any aggregation, and what to
# use instead.
_PER_REPLICA_SETTINGS = {
    "clipnorm": "transform_gradients=dist_minimize.clip_by_norm({})",
    "clipvalue": "transform_gradients=dist_minimize.clip_by_value({})",
    "global_clipnorm": "transform_gradients=dist_minimize.clip_by_global_norm({})",
    "gradient_accumulation_steps": "no gradient_accumulation_steps on the inner optimizer ({}); "
    "Keras accumulates per replica and fails under MirroredStrategy in tf.function",
    "use_ema": "no use_ema on the inner optimizer ({}); Keras's EMA overwrite fails under "
    "MirroredStrategy in tf.function",
    "loss_scale_factor": "no loss_scale_factor on the inner optimizer ({}); scale the loss "
    "with `transform_loss` and unscale in `transform_unaggregated_gradients`",
}


class StagedOptimizer(keras.optimizers.Optimizer, metaclass=abc.ABCMeta):
    """Base of every dist_minimize optimizer: the drivers around the six stages.

    Subclasses implement the stages (`Optimizer` with a Keras update rule and
    constructor transforms, `OptimizerWrapper` by delegation). It is a Keras 3
    optimizer, so it can be given to `model.compile(optimizer=...)`; `model.fit`
    calls `scale_loss` (-> `transform_loss`) and `apply_gradients`.

    Non-finite guard: when `skip_nonfinite` is true (the default), a step whose
    aggregated, transformed gradients hold an inf or NaN is skipped: no weight, slot or
    iteration counter changes, on every replica alike (the decision is made on
    aggregated gradients, identical everywhere). Skipped steps are counted in
    `skipped_steps`.
    """

    # -- the six stages ----------------------------------------------------------------

    @abc.abstractmethod
    def transform_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Transforms the per-replica loss before differentiation (e.g. loss scaling).

        Runs inside the gradient tape. Must return a scalar tensor.
        """

    def get_gradients(self, loss: tf.Tensor, variables: Sequence[tf.Variable], tape: tf.GradientTape) -> list:
        """Returns `[(gradient, variable), ...]` of `loss` w.r.t. `variables`.

        Args:
          loss: the transformed per-replica loss.
          variables: the variables to differentiate against.
          tape: the `tf.GradientTape` that recorded `loss`.

        Returns:
          One pair per variable, in order; a gradient is `None` where `loss` does not
          depend on the variable.
        """
        grads = tape.gradient(loss, list(variables))
        return list(zip(grads, variables))

    get_gradients._dm_default_stage = True  # not an override (see `scale_loss`)

    @abc.abstractmethod
    def transform_unaggregated_gradients(self, grads_and_vars: list) -> list:
        """Transforms each replica's own gradients, before aggregation."""

    @abc.abstractmethod
    def aggregate_gradients(self, grads_and_vars: list) -> list:
        """Aggregates gradients across replicas/processes, exactly once per step.

        After it, every replica holds the gradient of the mean loss over the global
        batch (see `dist_minimize.aggregation.Aggregator`).
        """

    @abc.abstractmethod
    def transform_gradients(self, grads_and_vars: list) -> list:
        """Transforms aggregated gradients (e.g. global-norm clipping).

        Its inputs are identical on every replica, so every decision it makes is too.
        """

    @abc.abstractmethod
    def apply_updates(self, grads_and_vars: list) -> None:
        """Applies final gradients to the variables with the update rule."""

    # -- drivers -----------------------------------------------------------------------

    def minimize(self, loss: tf.Tensor | Callable[[], tf.Tensor], variables: Sequence[tf.Variable],
                 tape: tf.GradientTape | None = None) -> tf.Variable:
        """Runs all six stages: one optimisation step of `loss` over `variables`.

        Args:
          loss: a scalar tensor recorded by `tape`, or a zero-argument callable that
            computes it (then `tape` is optional).
          variables: the variables to update.
          tape: the `tf.GradientTape` that recorded a tensor `loss`.

        Returns:
          The iterations counter.

        Raises:
          ValueError: a tensor `loss` without `tape`.
        """
        variables = list(variables)
        if callable(loss):
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                value = self.transform_loss(loss())
        else:
            if tape is None:
                raise ValueError(
                    "`tape` is required when `loss` is a tensor: pass the "
                    "`tf.GradientTape` that computed it, or pass `loss` as a "
                    f"zero-argument callable. Received: loss={loss!r}, tape=None"
                )
            with tape:
                value = self.transform_loss(loss)
        before = [(None, v) for v in variables]
        grads_and_vars = _stages.check_stage_output(
            "get_gradients", before, self.get_gradients(value, variables, tape))
        return self.apply_gradients(grads_and_vars)

    def apply_gradients(self, grads_and_vars, aggregate: bool = True) -> tf.Variable:
        """Runs the last four stages on per-replica gradients.

        Args:
          grads_and_vars: `(gradient, variable)` pairs (a list or a zip).
          aggregate: `False` when the caller has already aggregated the gradients:
            `transform_unaggregated_gradients` and `aggregate_gradients` are skipped,
            `transform_gradients` still runs.

        Returns:
          The iterations counter.
        """
        grads_and_vars = _stages.as_grads_and_vars(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build([v for _, v in grads_and_vars])
        if aggregate:
            grads_and_vars = self._run_stage(
                "transform_unaggregated_gradients", self.transform_unaggregated_gradients, grads_and_vars)
        self._aggregate_and_apply(self, grads_and_vars, aggregate)
        return self.iterations

    def apply(self, grads, trainable_variables=None):
        """Keras's `apply(grads, trainable_variables)`: same as `apply_gradients`."""
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "`trainable_variables` is required until the optimizer is built: call "
                    "`optimizer.build(model.trainable_variables)` first. "
                    "Received: trainable_variables=None")
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        _stages.check_lengths(grads, trainable_variables)
        return self.apply_gradients(zip(grads, trainable_variables))

    def scale_loss(self, loss):
        """Keras `model.fit` hook: runs `transform_loss` inside the training tape.

        Raises:
          RuntimeError: an optimizer of the stack overrides `get_gradients`, which
            Keras's `fit` never calls (it takes the gradients from its own tape and calls
            `apply_gradients`): the override would be silently skipped.
        """
        opt = self
        while opt is not None:
            if not getattr(type(opt).get_gradients, "_dm_default_stage", False):
                raise RuntimeError(
                    f"{type(opt).__name__} overrides `get_gradients`, but Keras's `model.fit` never "
                    "calls it: it computes the gradients with its own tape and calls "
                    "`apply_gradients`, so the override would be skipped without a word. Train with a "
                    "custom loop that calls `optimizer.minimize(loss, variables, tape=tape)` (it runs "
                    "every stage), or move the change into `transform_unaggregated_gradients`.")
            opt = getattr(opt, "wrapped", None)
        return self.transform_loss(loss)

    @staticmethod
    def _run_stage(name: str, fn: Callable, grads_and_vars: list) -> list:
        return _stages.check_stage_output(name, grads_and_vars, fn(list(grads_and_vars)))

    def _aggregate_and_apply(self, top: "StagedOptimizer", grads_and_vars: list, aggregate: bool) -> None:
        """The step after `transform_unaggregated_gradients`, with `top`'s stages.

        `top` is the outermost optimizer (the one `apply_gradients` was called on).
        Wrappers pass this call inward, so a wrapper that changes WHEN the rest of the
        step happens (gradient accumulation) can do so wherever it sits in a stack.
        """
        if aggregate:
            grads_and_vars = top._run_stage("aggregate_gradients", top.aggregate_gradients, grads_and_vars)
        grads_and_vars = top._run_stage("transform_gradients", top.transform_gradients, grads_and_vars)
        top._guarded_apply(grads_and_vars)

    # -- non-finite guard --------------------------------------------------------------

    @property
    @abc.abstractmethod
    def skip_nonfinite(self) -> bool:
        """Whether steps with non-finite final gradients are skipped (the guard)."""

    @abc.abstractmethod
    def _record_skip(self) -> None:
        """Counts one skipped step (and lets wrappers react, e.g. lower the loss scale)."""

    def _guarded_apply(self, grads_and_vars: list) -> None:
        if not self.skip_nonfinite:
            self.apply_updates(grads_and_vars)
            return
        self.apply_updates_if(all_finite([g for g, _ in grads_and_vars]), grads_and_vars)

    def apply_updates_if(self, condition: tf.Tensor, grads_and_vars: list,
                         on_skip: Callable[[], None] | None = None) -> None:
        """Runs `apply_updates` when `condition` holds, else `on_skip` (default: count a skip).

        `condition` must be identical on every replica (derive it from aggregated
        gradients or from replicated counters). See `run_if`.
        """
        self.run_if(condition, self.apply_updates, args=(grads_and_vars,),
                    otherwise=on_skip if on_skip is not None else self._record_skip)

    @staticmethod
    def run_if(condition: tf.Tensor, fn: Callable, args: tuple = (), otherwise: Callable | None = None) -> None:
        """Runs `fn(*args)` on every replica when the agreed `condition` holds, else `otherwise()`.

        `fn` may use collectives and variable updates. Under strategies that synchronise
        through `merge_call` (every CPU strategy), tf.distribute does not allow a
        `merge_call` inside a `tf.cond` taken per replica (what makes Keras's own
        accumulation and EMA overwrite fail under MirroredStrategy). So the branch is
        taken once, in the cross-replica context, on replica 0's `condition` (equal on
        all, by contract), and `fn` then runs on every replica. `otherwise` runs once
        there; elsewhere (no strategy, Horovod) both run in each process.

        Pass every per-replica tensor `fn` needs through `args`: under merge-call
        strategies `fn` runs from the cross-replica context, where a tensor it captured
        from the calling replica is replica 0's on every replica. Variables may be
        captured (each replica resolves its own copy).
        """
        otherwise = otherwise if otherwise is not None else (lambda: None)
        ctx = tf.distribute.get_replica_context()
        if (tf.distribute.has_strategy() and ctx is not None
                and _compat.strategy_uses_merge_call()):
            def cross_replica(strategy, condition, args):
                agreed = strategy.experimental_local_results(condition)[0]

                def run():
                    strategy.extended.call_for_each_replica(fn, args=args)

                tf.cond(agreed, run, otherwise)

            ctx.merge_call(cross_replica, args=(condition, args))
        elif tf.executing_eagerly():
            if bool(condition):
                fn(*args)
            else:
                otherwise()
        else:
            tf.cond(condition, lambda: fn(*args), otherwise)

    # -- Keras optimizer surface -------------------------------------------------------

    def __setattr__(self, name, value):
        # Keras's LossScaleOptimizer sets `inner_optimizer.loss_scale_factor = None` when
        # it wraps an optimizer (model.compile does so under a mixed_float16 policy).
        # It would decide skips from one replica's gradients: refuse at compile time.
        if name == "loss_scale_factor" and getattr(self, "_dm_constructed", False):
            raise TypeError(
                "A dist_minimize optimizer must not be wrapped in Keras's LossScaleOptimizer "
                "(it decides whether to skip a step from one replica's unaggregated "
                "gradients). Under a mixed_float16 policy, compile with "
                "`model.compile(..., auto_scale_loss=False)` and use "
                "`dist_minimize.LossScaleOptimizer`. Received: an attempt to set "
                f"loss_scale_factor={value!r} on {type(self).__name__}")
        super().__setattr__(name, value)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Exempts variables from the wrapped Keras optimizer's `weight_decay`.

        Keras's public way to do it, forwarded to the optimizer that applies the decay
        (on this object itself it would change nothing).
        """
        self._decaying_optimizer().exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def _decaying_optimizer(self):
        """The Keras optimizer whose update rule applies `weight_decay`."""
        opt = self
        while not isinstance(opt, Optimizer):
            opt = opt.wrapped
        return opt.inner_optimizer

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Not supported: dist_minimize optimizers are stateful (TensorFlow backend)."""
        raise ValueError("dist_minimize optimizers are stateful (TensorFlow backend only).")


def all_finite(grads) -> tf.Tensor:
    """A scalar bool: whether every element of every gradient is finite."""
    checks = [
        tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in grads if g is not None
    ]
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))


def _check_inner(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, (str, dict)):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, StagedOptimizer):
        raise TypeError(
            "`optimizer` is already a dist_minimize optimizer; to add behaviour around "
            "it, wrap it in an `OptimizerWrapper` subclass. "
            f"Received: optimizer={type(optimizer).__name__}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "`optimizer` must not be a Keras `LossScaleOptimizer`: it decides whether to "
            "skip a step from one replica's unaggregated gradients. Pass its "
            "`inner_optimizer` and scale the loss in dist_minimize's stages instead. "
            "Received: optimizer=LossScaleOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a Keras 3 optimizer instance such as "
            f"`keras.optimizers.SGD(0.1)`. Received: optimizer={optimizer!r} of type "
            f"{type(optimizer).__name__}")
    for setting, instead in _PER_REPLICA_SETTINGS.items():
        value = getattr(optimizer, setting, None)
        if value:
            raise ValueError(
                f"The inner optimizer sets `{setting}`, which Keras applies on each "
                "replica before aggregation (wrong under distribution). Use "
                f"{instead.format(value)}. Received: optimizer="
                f"{type(optimizer).__name__}({setting}={value!r})")
    return optimizer


@keras.saving.register_keras_serializable(package="dist_minimize")
class Optimizer(StagedOptimizer):
    """RFC 234's customizable optimizer around a Keras 3 update rule.

    The wrapped Keras optimizer provides only `apply_updates` (its update rule); its own
    clipping, accumulation and all-reduce never run, so gradients are aggregated
    exactly once per step, by `aggregate_gradients`.

    Args:
      optimizer: a Keras 3 optimizer (or its name/config) without `clipnorm`,
        `clipvalue`, `global_clipnorm`, `gradient_accumulation_steps`, `use_ema` or
        `loss_scale_factor`, which Keras would apply per replica.
      transform_loss: a callable `loss -> loss`, or a sequence applied in order.
      transform_unaggregated_gradients: a callable `grads_and_vars -> grads_and_vars`,
        or a sequence applied in order, run on each replica before aggregation.
      aggregate_gradients: a backend name (`"auto"`, `"strategy"`, `"horovod"`,
        `"none"`), an `Aggregator`, a callable, or a sequence of these.
      transform_gradients: like `transform_unaggregated_gradients`, run on the
        aggregated gradients; e.g. `dist_minimize.clip_by_global_norm(1.0)`.
      skip_nonfinite: skip (on every replica) steps whose final gradients are not
        finite, instead of writing inf/NaN into the weights.
      name: the optimizer's name.

    Raises:
      TypeError: `optimizer` is not a Keras optimizer, or a transform is not callable.
      ValueError: `optimizer` has a per-replica setting, an unknown backend name, or
        an unknown keyword argument.

    Example:
      >>> with strategy.scope():
      ...     model.compile(loss="mse", optimizer=dist_minimize.Optimizer(
      ...         keras.optimizers.Adam(1e-3),
      ...         transform_gradients=dist_minimize.clip_by_global_norm(1.0)))
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        transform_loss: Callable | Sequence[Callable] | None = None,
        transform_unaggregated_gradients: Callable | Sequence[Callable] | None = None,
        aggregate_gradients: str | Callable | Sequence[str | Callable] = "auto",
        transform_gradients: Callable | Sequence[Callable] | None = None,
        skip_nonfinite: bool = True,
        name: str | None = None,
        **kwargs,
    ):
        if kwargs:
            raise ValueError(
                f"`Optimizer` does not take {sorted(kwargs)}: set update-rule options on "
                "the inner Keras optimizer and clipping with `transform_gradients`. "
                f"Received: {kwargs}")
        inner = _check_inner(optimizer)
        loss_fns = _stages.as_callables(transform_loss, "transform_loss")
        unaggregated_fns = _stages.as_callables(
            transform_unaggregated_gradients, "transform_unaggregated_gradients")
        if isinstance(aggregate_gradients, (list, tuple)):
            aggregators = [aggregation.get(a) for a in aggregate_gradients]
        else:
            aggregators = [aggregation.get(aggregate_gradients)]
        gradient_fns = _stages.as_callables(transform_gradients, "transform_gradients")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"`skip_nonfinite` must be a bool. Received: skip_nonfinite={skip_nonfinite!r}")
        super().__init__(learning_rate=0.0, name=name)
        _compat.disable_keras_all_reduce(inner)
        self.inner_optimizer = inner
        self._loss_fns = tuple(loss_fns)
        self._unaggregated_fns = tuple(unaggregated_fns)
        self._aggregators = tuple(aggregators)
        self._gradient_fns = tuple(gradient_fns)
        self._skip_nonfinite = skip_nonfinite
        self._skipped_steps = None
        self._dm_constructed = True

    # -- stages --------------------------------------------------------------------------

    def transform_loss(self, loss):
        """Applies the constructor's `transform_loss` callables in order."""
        for fn in self._loss_fns:
            loss = fn(loss)
        return loss

    def transform_unaggregated_gradients(self, grads_and_vars):
        """Applies the constructor's `transform_unaggregated_gradients` in order, checking each."""
        return _chain("transform_unaggregated_gradients", self._unaggregated_fns, grads_and_vars)

    def aggregate_gradients(self, grads_and_vars):
        """Applies the constructor's aggregator(s) (default "auto") in order, checking each."""
        return _chain("aggregate_gradients", self._aggregators, grads_and_vars)

    def transform_gradients(self, grads_and_vars):
        """Applies the constructor's `transform_gradients` in order (e.g. the clipper), checking each."""
        return _chain("transform_gradients", self._gradient_fns, grads_and_vars)

    def apply_updates(self, grads_and_vars):
        """Applies the gradients with the inner Keras optimizer's update rule (no all-reduce)."""
        self.inner_optimizer.apply_gradients(grads_and_vars)

    # -- state ---------------------------------------------------------------------------

    @property
    def transforms(self) -> tuple:
        """Every transform and aggregator given to the constructor, in pipeline order."""
        return self._loss_fns + self._unaggregated_fns + self._aggregators + self._gradient_fns

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        """Creates the inner optimizer's slots, the transforms' state and the skip counter."""
        if self.built:
            return
        current = tf.distribute.get_strategy()
        captured = _compat.inner_strategy(self.inner_optimizer)
        if captured is not None and captured is not current:
            raise ValueError(
                "The inner optimizer was created under a different tf.distribute strategy "
                "than the one active now. Create the optimizer (inner one included) inside "
                f"`strategy.scope()`. Received: inner strategy {type(captured).__name__}, "
                f"current {type(current).__name__}")
        self._skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros",
            aggregation="only_first_replica", name="skipped_steps")
        for fn in self.transforms:
            if hasattr(fn, "build"):
                fn.build(self, var_list)
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def skip_nonfinite(self) -> bool:
        return self._skip_nonfinite

    @property
    def skipped_steps(self):
        """How many steps the non-finite guard skipped (a variable, after `build`)."""
        return self._skipped_steps

    def _record_skip(self):
        self._skipped_steps.assign_add(1)

    def gradient_stats(self) -> dict:
        """Current statistics of every stateful transform, plus `skipped_steps`."""
        stats = {}
        for fn in self.transforms:
            if hasattr(fn, "stats"):
                stats.update(fn.stats())
        if self._skipped_steps is not None:
            stats["skipped_steps"] = tf.convert_to_tensor(self._skipped_steps)
        return stats

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list):
        """Delegates to the inner Keras optimizer (called by Keras at the end of `fit`)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    # -- serialisation ---------------------------------------------------------------------

    def get_config(self):
        """The inner optimizer, transforms and backends, serialised (see `from_config`)."""
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "transform_loss": [_serialize(f) for f in self._loss_fns],
            "transform_unaggregated_gradients": [_serialize(f) for f in self._unaggregated_fns],
            "aggregate_gradients": [_serialize_aggregator(a) for a in self._aggregators],
            "transform_gradients": [_serialize(f) for f in self._gradient_fns],
            "skip_nonfinite": self._skip_nonfinite,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)

        def load(items):
            return [keras.saving.deserialize_keras_object(i, custom_objects=custom_objects)
                    if isinstance(i, dict) else i for i in items]

        config["optimizer"] = keras.saving.deserialize_keras_object(
            config["optimizer"], custom_objects=custom_objects)
        for key in ("transform_loss", "transform_unaggregated_gradients",
                    "aggregate_gradients", "transform_gradients"):
            config[key] = load(config.get(key) or [])
        if not config["aggregate_gradients"]:
            config["aggregate_gradients"] = "auto"
        return cls(**config)


def _chain(stage: str, fns: Sequence[Callable], grads_and_vars: list) -> list:
    for fn in fns:
        grads_and_vars = _stages.check_stage_output(f"{stage} ({_fn_name(fn)})", grads_and_vars, fn(grads_and_vars))
    return grads_and_vars


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _serialize(fn):
    return keras.saving.serialize_keras_object(fn)


def _serialize_aggregator(agg):
    if isinstance(agg, aggregation.Aggregator) and agg.name in aggregation.BACKEND_NAMES:
        if not agg.get_config() or agg.get_config() == type(agg)().get_config():
            return agg.name
    return _serialize(agg)
