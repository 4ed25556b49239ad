"""`Optimizer`: RFC 234's customizable optimizer around a Keras 3 update rule.

The stages, drivers and step protocol every dist_minimize optimizer shares are in
`dist_minimize.staged` (`StagedOptimizer`); this module adds the bottom of every stack:
the constructor's transforms and backends, the Keras update rule, and the translation
of the Keras optimizer's own settings (`dist_minimize._keras_settings`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat, _keras_settings, aggregation
from dist_minimize.sharding import sharded_state
from dist_minimize.sharding import local
from dist_minimize.step import stages
from dist_minimize.step.finite import all_finite  # noqa: F401  (re-exported: dist_minimize.all_finite)
from dist_minimize.aggregation import exactly_once
from dist_minimize.step.context import CONTEXT
from dist_minimize.staged import StagedOptimizer, _delegated_learning_rate

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
    return optimizer


@keras.saving.register_keras_serializable(package="dist_minimize")
class Optimizer(StagedOptimizer):
    """RFC 234's customizable optimizer around a Keras 3 update rule.

    The wrapped Keras optimizer provides only `apply_updates` (its update rule); its own
    clipping, accumulation and all-reduce never run, so gradients are aggregated
    exactly once per step, by `aggregate_gradients`.

    Keras settings of the wrapped optimizer, which Keras would apply on each replica
    before aggregation, become their dist_minimize equivalent, made after aggregation
    (and the Keras optimizer's own copy is switched off; one INFO line on the
    "dist_minimize" logger says what became what):

    * `clipnorm=c`, `clipvalue=c`, `global_clipnorm=c`: `clip_by_norm(c)`,
      `clip_by_value(c)`, `clip_by_global_norm(c)` appended to `transform_gradients`
      (last, as Keras clips the final gradients); refused next to a dist_minimize
      clipper in `transform_gradients`.
    * `use_ema=True` (`ema_momentum=m`, `ema_overwrite_frequency=f`): the result is
      `MovingAverage(Optimizer(...), average_decay=m, start_step=1,
      overwrite_frequency=f, assign_on_finalize=True)`: Keras's rule (the average is
      the weights after the first update, then moves with momentum m; every f-th
      update the weights are overwritten with it; `fit` ends with the averages in the
      weights).
    * `gradient_accumulation_steps=K`: the result is
      `GradientAccumulation(Optimizer(...), steps=K)`.
    * `loss_scale_factor=s`: the result is
      `LossScaleOptimizer(Optimizer(...), initial_scale=s, dynamic=False)` (a
      non-finite step is skipped, where Keras would apply it).
    * `use_ema` with `gradient_accumulation_steps`: refused (Keras moves the average
      on every micro-step; build the stack you mean explicitly).

    The last three settings make a stack, which `Optimizer.from_keras(optimizer, ...)`
    builds and returns (`Optimizer(...)` refuses them, as it returns an `Optimizer`;
    `stack()[-1]` of the result is the `Optimizer`). Read on any dist_minimize optimizer, `clipnorm`, `use_ema`,
    `gradient_accumulation_steps`, ... report what the stack applies.

    Args:
      optimizer: a Keras 3 optimizer (or its name/config); its name is this
        optimizer's default name.
      transform_loss: a callable `loss -> loss`, or a sequence applied in order.
      transform_unaggregated_gradients: a callable `grads_and_vars -> grads_and_vars`,
        or a sequence applied in order, run on each replica before aggregation.
      aggregate_gradients: a backend name (`"auto"`, `"strategy"`, `"horovod"`,
        `"none"`), an `Aggregator`, a callable, or a sequence of these.
      transform_gradients: like `transform_unaggregated_gradients`, run on the
        aggregated gradients; e.g. `dist_minimize.clip_by_global_norm(1.0)`.
      skip_nonfinite: skip (on every replica) steps whose final gradients are not
        finite, instead of writing inf/NaN into the weights.
      name: the optimizer's name (default: the Keras optimizer's).

    Raises:
      TypeError: `optimizer` is not a Keras optimizer, or a transform is not callable.
      ValueError: a Keras setting without an equivalent (above), an unknown backend
        name, or an unknown keyword argument.

    Example:
      >>> with strategy.scope():
      ...     model.compile(loss="mse", optimizer=dist_minimize.Optimizer(
      ...         keras.optimizers.Adam(1e-3),
      ...         transform_gradients=dist_minimize.clip_by_global_norm(1.0)))
    """


    @classmethod
    def from_keras(cls, optimizer: keras.optimizers.Optimizer | str, **kwargs) -> StagedOptimizer:
        """The stack a Keras optimizer's settings call for: this `Optimizer` around
        `optimizer`, inside the wrappers that `use_ema`, `gradient_accumulation_steps`
        and `loss_scale_factor` become (outermost first:
        `LossScaleOptimizer(GradientAccumulation|MovingAverage(Optimizer(...)))`), or
        the `Optimizer` alone when none is set. `kwargs` are the constructor's.

        Example:
          >>> opt = dist_minimize.Optimizer.from_keras(keras.optimizers.Adam(use_ema=True))
          >>> [type(o).__name__ for o in opt.stack()]
          ['MovingAverage', 'Optimizer']
        """
        inner = _check_inner(optimizer)
        wrappers = _keras_settings.take_wrappers(inner)
        return _keras_settings.wrap(cls(inner, **kwargs), wrappers)

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        transform_loss: Callable | Sequence[Callable] | None = None,
        transform_unaggregated_gradients: Callable | Sequence[Callable] | None = None,
        aggregate_gradients: str | Callable | Sequence[str | Callable] = "auto",
        transform_gradients: Callable | Sequence[Callable] | None = None,
        skip_nonfinite: bool = True,
        name: str | None = None,
        shard_optimizer_state: bool = False,
        **kwargs,
    ):
        if kwargs:
            raise ValueError(
                f"`Optimizer` does not take {sorted(kwargs)}: set update-rule options on "
                "the inner Keras optimizer and clipping with `transform_gradients`. "
                f"Received: {kwargs}")
        inner = _check_inner(optimizer)
        loss_fns = stages.as_callables(transform_loss, "transform_loss")
        unaggregated_fns = stages.as_callables(
            transform_unaggregated_gradients, "transform_unaggregated_gradients")
        if isinstance(aggregate_gradients, (list, tuple)):
            aggregators = [aggregation.get(a) for a in aggregate_gradients]
        else:
            aggregators = [aggregation.get(aggregate_gradients)]
        aggregating = [a for a in aggregators
                       if isinstance(a, aggregation.Aggregator) and not isinstance(a, aggregation.IdentityAggregator)]
        if len(aggregating) > 1:
            raise ValueError(
                f"`aggregate_gradients` holds {len(aggregating)} aggregating backends "
                f"({', '.join(repr(a.name) for a in aggregating)}): the gradients would be aggregated "
                f"{len(aggregating)} times per step. Pass one backend (custom callables may go around it). "
                f"Received: aggregate_gradients={aggregate_gradients!r}")
        gradient_fns = stages.as_callables(transform_gradients, "transform_gradients")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"`skip_nonfinite` must be a bool. Received: skip_nonfinite={skip_nonfinite!r}")
        if not isinstance(shard_optimizer_state, bool):
            raise TypeError("`shard_optimizer_state` must be a bool. "
                            f"Received: shard_optimizer_state={shard_optimizer_state!r}")
        if shard_optimizer_state:
            sharded_state.check_backends(aggregating, aggregate_gradients)
        translation = _keras_settings.translate(inner, gradient_fns)
        if translation.wrappers:
            raise ValueError(
                f"`optimizer` sets {', '.join(translation.wrapper_settings)}, which dist_minimize makes a "
                f"wrapper around the Optimizer ({', '.join(c.__name__ for c, _ in translation.wrappers)}): "
                "build the stack with `dist_minimize.Optimizer.from_keras(optimizer, ...)`, which returns it. "
                f"Received: optimizer={type(inner).__name__}({', '.join(translation.wrapper_settings)})")
        if shard_optimizer_state:
            sharded_state.check_transforms(list(gradient_fns) + list(translation.clippers))
        _keras_settings.disable(inner, translation)
        super().__init__(learning_rate=_delegated_learning_rate, name=name if name is not None else inner.name)
        exactly_once.neutralise(inner)
        self.inner_optimizer = inner
        self._loss_fns = tuple(loss_fns)
        self._unaggregated_fns = tuple(unaggregated_fns)
        self._aggregators = tuple(aggregators)
        self._gradient_fns = tuple(gradient_fns) + tuple(translation.clippers)
        translation.log(inner)
        self._skip_nonfinite = skip_nonfinite
        self._skipped_steps = None
        self._sharding = sharded_state.Sharding(aggregating[0]) if shard_optimizer_state else None
        self._local = local.LocalVariables()
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
        """Applies the constructor's aggregator(s) (default "auto") in order, checking each.

        Once per step (a second call in the same step raises `AggregationError`); a
        backend that declares its plan (`Aggregator.planned_collectives`) must make
        exactly that many collectives.
        """
        exactly_once.note_aggregation(f"{type(self).__name__} {self.name!r}")
        if self._sharding is not None and self._sharding.active():
            return self._sharding.reduce_scatter(grads_and_vars, self._local.scaled)
        if self._local:
            return self._local.aggregate(self.inner_optimizer, list(grads_and_vars), self._aggregate)
        return self._aggregate(grads_and_vars)

    def _aggregate(self, grads_and_vars):
        for agg in self._aggregators:
            stage = f"aggregate_gradients ({_fn_name(agg)})"
            plan = agg.planned_collectives(grads_and_vars) if isinstance(agg, aggregation.Aggregator) else None
            with exactly_once.planned(plan, f"`{stage}`"):
                out = agg(grads_and_vars)
            grads_and_vars = stages.check_stage_output(stage, grads_and_vars, out)
        return grads_and_vars

    # -- rank-local variables (Horovod's register_local_var; dist_minimize.sharding.local) --

    def register_local_var(self, variable) -> None:
        """Horovod's `register_local_var` (see `dist_minimize.sharding.local`): `variable`'s
        gradient is not aggregated across processes; each process updates its own copy
        with its own gradient, divided by the process count when
        `scale_local_gradients` (True, Horovod's default).

        Raises:
          ValueError: under a tf.distribute strategy of several replicas, with a
            Horovod process set, after the optimizer is built, or with a
            `transform_gradients` callable without `shards_state = True`.
        """
        self._local.register(self, variable)

    register_local_source = register_local_var  # the custom-loop form of Horovod's tape's

    def is_local(self, variable) -> bool:
        """Whether `variable` was registered with `register_local_var`."""
        return self._local.contains(self.inner_optimizer, variable)

    def shard(self, var_list: list) -> list:
        """The variables of `var_list` whose optimizer state this process keeps: all of
        them, or with `shard_optimizer_state=True` this process's share (the first call
        partitions the list: `dist_minimize.sharding.shards.Partition.balanced`; a
        rank-local variable is every process's own, outside the partition)."""
        return list(var_list) if self._sharding is None else self._sharding.mine(var_list, self.is_local)

    @property
    def scale_local_gradients(self) -> bool:
        """Whether rank-local gradients are divided by the process count (Horovod's default)."""
        return self._local.scale

    @scale_local_gradients.setter
    def scale_local_gradients(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"`scale_local_gradients` must be a bool. Received: scale_local_gradients={value!r}")
        self._local.scale = value

    @property
    def shard_optimizer_state(self) -> bool:
        return self._sharding is not None

    def save_own_variables(self, store):
        """Keras's saving (`.keras`): this process's state; sharded, its share only, with a
        warning (`Checkpointer` writes every process's share; docs/sharding.md)."""
        if self._sharding is not None and self._sharding.size > 1:
            sharded_state.logger.warning(
                "Saving a model whose optimizer state is sharded over %d processes: the file holds the "
                "weights and this process's share of the optimizer state, which Keras does not load "
                "(the optimizer restarts from a fresh state). dm.Checkpointer saves every process's share "
                "and resumes on any number of processes.", self._sharding.size)
        super().save_own_variables(store)

    def transform_gradients(self, grads_and_vars):
        """Applies the constructor's `transform_gradients` in order (e.g. the clipper), checking each."""
        return _chain("transform_gradients", self._gradient_fns, grads_and_vars)

    def apply_updates(self, grads_and_vars):
        """Applies the gradients with the inner Keras optimizer's update rule (no all-reduce)."""
        rule = self.inner_optimizer
        with exactly_once.update_rule(f"The update rule of {type(self).__name__} {self.name!r} "
                              f"({type(rule).__name__} {rule.name!r})"):
            device = CONTEXT.device
            if device is None:
                rule.apply_gradients(grads_and_vars)
                return
            # Inside the per-device update (`dist_minimize._per_device.possible`): what Keras's
            # `apply` makes on every device, made on this one.
            _compat.keras_apply_on_device(rule, tf.distribute.get_strategy(), device,
                                          [g for g, _ in grads_and_vars], [v for _, v in grads_and_vars],
                                          CONTEXT.rule_inputs)

    def keras_settings(self) -> dict:
        """The clip bounds of `transform_gradients` as Keras's `clipnorm`, `clipvalue` and
        `global_clipnorm` (the last clipper of each kind)."""
        out = {}
        for setting, cls in _keras_settings.clipper_classes().items():
            found = [fn for fn in self._gradient_fns if isinstance(fn, cls)]
            if found:
                out[setting] = found[-1].clip_value if setting == "clipvalue" else found[-1].clip_norm
        return out

    def set_clip_bound(self, setting: str, value, holder: StagedOptimizer | None = None) -> None:
        """`clipnorm`, `clipvalue` or `global_clipnorm` set on `holder` (any optimizer of
        this stack, default this one): see `dist_minimize._keras_settings.assign_clip`."""
        _keras_settings.assign_clip(holder if holder is not None else self, setting, value)

    # -- state ---------------------------------------------------------------------------

    @property
    def transforms(self) -> tuple:
        """Every transform and aggregator given to the constructor, in pipeline order."""
        return self._loss_fns + self._unaggregated_fns + self._aggregators + self._gradient_fns

    def build_state(self, var_list):
        """Creates the inner optimizer's slots, the transforms' state and the skip counter."""
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
        with sharded_state.local_state(self):  # the update rule's slots: this process's own
            self.inner_optimizer.build(var_list)
        exactly_once.neutralise(self.inner_optimizer)  # sub-optimizers a router creates in `build`

    @property
    def skip_nonfinite(self) -> bool:
        return self._skip_nonfinite

    @property
    def skipped_steps(self):
        """How many steps the non-finite guard skipped (a variable, after `build`)."""
        return self._skipped_steps

    def on_skipped(self):
        """Counts the skipped step in `skipped_steps`."""
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
        """The stack's training state, the Keras update rule's first (as on the Keras
        optimizer: `variables[0]` is `iterations`). Statistics (`skipped_steps`, the
        clippers' statistics) are saved and checkpointed but not listed."""
        statistics = {id(v) for v in self.statistics_variables()}
        return self.inner_optimizer.variables + [v for v in _compat.own_variables(self) if id(v) not in statistics]

    def statistics_variables(self) -> list:
        """The variables that only count or measure (`skipped_steps`, the transforms'
        `statistics_variables()`): saved, checkpointed, not in `variables`."""
        out = [self._skipped_steps] if self._skipped_steps is not None else []
        for fn in self.transforms:
            if hasattr(fn, "statistics_variables"):
                out += list(fn.statistics_variables())
        return out

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
            "shard_optimizer_state": self._sharding is not None,
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
        grads_and_vars = stages.check_stage_output(f"{stage} ({_fn_name(fn)})", grads_and_vars, fn(grads_and_vars))
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

