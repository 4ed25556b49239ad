"""The base of every dist_minimize optimizer: RFC 234's `minimize`, split into public,
overridable stages, and the drivers and step protocol around them.

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
import contextlib
from typing import Any, Callable, Iterable, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat, _per_device, distribute
from dist_minimize.sharding import sharded_state, shards
from dist_minimize.step import stages
from dist_minimize.step.finite import all_finite
from dist_minimize._keras_surface import KerasSurface
from dist_minimize._slots import SlotTable, build_on_first_use
from dist_minimize.step.context import CONTEXT
from dist_minimize.aggregation import exactly_once


class StagedOptimizer(KerasSurface, _compat.UntrackedBaseState,
                      keras.optimizers.Optimizer, metaclass=abc.ABCMeta):
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

    No AutoGraph: `minimize`, `apply_gradients` and `apply` run every stage as plain
    Python while a `tf.function` traces them, as Keras's own `fit` runs its train step
    (`tf.autograph.experimental.do_not_convert`). A stage, a hook or a callable given to
    them branches on a tensor with `tf.cond` or `dist_minimize.distribute.run_if`, not
    with a Python `if`. Converted, the package's own Python (its checks, its walks of
    the traced graph) took most of a first step's time.
    """

    # -- the six stages ----------------------------------------------------------------

    @abc.abstractmethod
    def transform_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Transforms the per-replica loss before differentiation (e.g. loss scaling).

        Runs inside the gradient tape. Must return a scalar tensor.
        """

    def get_gradients(self, loss: tf.Tensor, variables: Sequence[tf.Variable], tape: tf.GradientTape,
                      loss_fn: Callable[[], tf.Tensor] | None = None) -> list:
        """Returns `[(gradient, variable), ...]` of `loss` w.r.t. `variables`.

        Args:
          loss: the transformed per-replica loss.
          variables: the variables to differentiate against.
          tape: the `tf.GradientTape` that recorded `loss`.
          loss_fn: where the loss is available as a function (a callable given to
            `minimize`, or `minimize(..., loss_fn=...)`, as `dist_minimize.integrate`
            does under `fit`): a zero-argument callable that evaluates this replica's
            loss again at the variables' current values, transformed as `loss` was
            (`transform_loss` of the whole stack). Record it with a tape of your own.
            None where the loss is only a tensor. It belongs to this call (this replica,
            this step): use it here, never keep it on `self` (one optimizer object
            serves every replica thread). An override written without this argument
            keeps working: it is called without it.

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

    #: How many times more than once this optimizer's own stages call
    #: `aggregate_gradients` in one step, on purpose (SAM aggregates the gradient it
    #: perturbs the weights along: 1). The step's check allows once plus the sum over the
    #: stack, and raises `AggregationError` beyond.
    extra_aggregations: int = 0

    @tf.autograph.experimental.do_not_convert  # (see the class docstring: no AutoGraph)
    def minimize(self, loss: tf.Tensor | Callable[[], tf.Tensor], variables: Sequence[tf.Variable],
                 tape: tf.GradientTape | None = None, decay_var_list: Sequence | None = None,
                 loss_fn: Callable[[], tf.Tensor] | None = None) -> tf.Variable:
        """Runs all six stages: one optimisation step of `loss` over `variables`.

        Args:
          loss: a scalar tensor recorded by `tape`, or a zero-argument callable that
            computes it (then `tape` is optional, and `get_gradients` may call it again).
          variables: the variables to update.
          tape: the `tf.GradientTape` that recorded a tensor `loss`.
          decay_var_list: with a `DecoupledWeightDecay` in the stack, the variables it
            decays in this step (instead of its default choice). Inside `tf.function`,
            the choice made when the function was traced is the one it keeps.
          loss_fn: with a tensor `loss`, a zero-argument callable that computes it again
            (what `dist_minimize.integrate` passes under `fit`), for a `get_gradients`
            that evaluates the loss again (`dist_minimize.SAM`).

        Returns:
          The iterations counter.

        Raises:
          ValueError: a tensor `loss` without `tape`, or a `decay_var_list` without a
            `DecoupledWeightDecay` in the stack (or naming a variable not trained).
        """
        if decay_var_list is not None:
            with self._decaying_step(decay_var_list):
                return self.minimize(loss, variables, tape=tape, loss_fn=loss_fn)
        variables = list(variables)
        if not self.built:  # the stages may use the optimizer's state from the first one on
            build_on_first_use(self, variables)
        if callable(loss):
            loss, loss_fn, tape = None, loss, tape if tape is not None else tf.GradientTape()
        elif tape is None:
            raise ValueError(
                "`tape` is required when `loss` is a tensor: pass the `tf.GradientTape` that computed it, or "
                f"pass `loss` as a zero-argument callable. Received: loss={loss!r}, tape=None")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"`loss_fn` must be a zero-argument callable. Received: loss_fn={loss_fn!r}")
        with exactly_once.step(self._aggregations_allowed()):
            with tape:
                value = self.transform_loss(loss if loss is not None else loss_fn())
            again = (lambda: self.transform_loss(loss_fn())) if loss_fn is not None else None
            grads_and_vars = stages.check_stage_output(
                "get_gradients", [(None, v) for v in variables],
                stages.get_gradients(self, value, variables, tape, again))
            return self.apply_gradients(grads_and_vars)

    def _aggregations_allowed(self) -> int:
        return 1 + sum(int(opt.extra_aggregations) for opt in self.stack())

    @tf.autograph.experimental.do_not_convert  # (see the class docstring: no AutoGraph)
    def apply_gradients(self, grads_and_vars: Iterable, aggregate: bool = True,
                        decay_var_list: Sequence | None = None) -> tf.Variable:
        """Runs the last four stages on per-replica gradients.

        Args:
          grads_and_vars: `(gradient, variable)` pairs (a list or a zip).
          aggregate: `False` when the caller has already aggregated the gradients:
            `transform_unaggregated_gradients` and `aggregate_gradients` are skipped,
            `transform_gradients` still runs.
          decay_var_list: as in `minimize`.

        Returns:
          The iterations counter.
        """
        if decay_var_list is not None:
            with self._decaying_step(decay_var_list):
                return self.apply_gradients(grads_and_vars, aggregate=aggregate)
        grads_and_vars = stages.as_grads_and_vars(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        if not self.built:
            build_on_first_use(self, [v for _, v in grads_and_vars])
        if aggregate:
            grads_and_vars = self._run_stage(
                "transform_unaggregated_gradients", self.transform_unaggregated_gradients, grads_and_vars)
        self.run_update(grads_and_vars, top=self, aggregate=aggregate)
        return self.iterations

    @contextlib.contextmanager
    def _decaying_step(self, decay_var_list):
        # The optimizer of the stack that decays weights (DecoupledWeightDecay), found by
        # what it can do.
        decay = next((opt for opt in self.stack() if hasattr(opt, "choose_for_step")), None)
        if decay is None:
            raise ValueError("`decay_var_list` needs a `dist_minimize.DecoupledWeightDecay` in the optimizer "
                             f"stack. Received: decay_var_list for {type(self).__name__} without one")
        decay.choose_for_step(decay_var_list)
        try:
            yield
        finally:
            decay.choose_for_step_reset()

    @staticmethod
    def _run_stage(name: str, fn: Callable, grads_and_vars: list) -> list:
        return stages.check_stage_output(name, grads_and_vars, fn(list(grads_and_vars)))

    # -- the step protocol (what a wrapper may change besides the stages) ----------------

    def run_update(self, grads_and_vars: list, *, top: "StagedOptimizer", aggregate: bool) -> None:
        """The part of a step after `transform_unaggregated_gradients`, with `top`'s stages.

        `minimize`/`apply_gradients` run `transform_loss`, `get_gradients` and
        `transform_unaggregated_gradients` on every call (every micro-step), then call
        `top.run_update(...)`; by default it is the update itself: `aggregate_gradients`
        (when `aggregate`), `transform_gradients`, then `apply_updates` if
        `top.update_condition(...)` holds, followed by `on_applied` (or `on_skipped`)
        on every optimizer of the stack. That branch is one `If` op per device that
        TensorFlow does not lower (`_compat.unlowered_cond`): in each process without a
        merge-call strategy (one device, Horovod), and device by device under
        MirroredStrategy and MultiWorkerMirroredStrategy; where the Keras rule allows it
        (`_per_device.possible`) its step counter and learning rate are read before the
        branch, and under a merge-call strategy where it does not, the branch is
        `run_if`'s one cond taken in the cross-replica context.
        Wrappers pass the call inward, so a wrapper that changes WHEN the update happens
        (accumulation) overrides this, calling `super().run_update(...)` under `run_if`.

        Args:
          grads_and_vars: this micro-step's per-replica (gradient, variable) pairs.
          top: the outermost optimizer (the one `apply_gradients` was called on): its
            stages are the ones that run.
          aggregate: False when the caller aggregated already (`apply_gradients(...,
            aggregate=False)`; with sharded state each process then takes its share).
        """
        with shards.step() as sharded:
            self._update(grads_and_vars, top=top, aggregate=aggregate)
            if sharded.gather is not None:  # a sharded step: every process's new weights, everywhere
                sharded.gather()

    def _update(self, grads_and_vars: list, *, top: "StagedOptimizer", aggregate: bool) -> None:
        if distribute.strategy_replicas() > 1 and distribute.uses_merge_call():
            distribute.refuse_xla(
                f"A step under {type(tf.distribute.get_strategy()).__name__} on these devices",
                "the strategy synchronises its replicas through merge_call, and TensorFlow cannot "
                "compile such a step (stock Keras fails at run time: 'Trying to access resource ... "
                "located in device ...'); Keras's own default under a strategy is jit_compile=False")
        with distribute.deferred_updates() as pending, exactly_once.step(top._aggregations_allowed()):
            if aggregate:  # a sharded step's aggregation returns this process's share of the pairs
                aggregated = top.aggregate_gradients(list(grads_and_vars))
                grads_and_vars = stages.check_stage_output(
                    "aggregate_gradients", CONTEXT.share(grads_and_vars), aggregated)
            else:  # aggregated already: a sharded stack's process takes its share
                grads_and_vars = sharded_state.take_share(top, grads_and_vars)
            grads_and_vars = top._run_stage("transform_gradients", top.transform_gradients, grads_and_vars)
            condition = top.update_condition(grads_and_vars)
            scaled = distribute.known_scaled([g for g, _ in grads_and_vars])  # (noted within this step only)
        # The transforms' statistics and counters (`assign_replicated`) are made in the
        # same cross-replica step as the update decision: one synchronisation per step.
        if condition is None:
            distribute.flush_updates(pending)
            top._apply_and_notify(grads_and_vars)
            return
        if _per_device.possible(top, grads_and_vars):
            _per_device.update(top, condition, grads_and_vars, pending, scaled)
        else:
            distribute.run_if(condition, top._apply_and_notify, args=(grads_and_vars,),
                              otherwise=top._notify_skipped, updates=pending)

    def update_condition(self, grads_and_vars: list) -> tf.Tensor | None:
        """Whether this step's update is applied: a scalar bool tensor, or None for "always".

        Called on the outermost optimizer with the final gradients (after
        `transform_gradients`, identical on every replica). The condition must be
        identical on every replica and process (`dist_minimize.distribute.run_if`).
        Default: `all_finite(gradients)` when `skip_nonfinite`, else None. A wrapper may
        add a condition: `tf.logical_and(super().update_condition(gv), mine)` (mind None).
        """
        if not self.skip_nonfinite:
            return None
        return all_finite([g for g, _ in grads_and_vars])

    @property
    @abc.abstractmethod
    def skip_nonfinite(self) -> bool:
        """Whether steps with non-finite final gradients are skipped (the guard)."""

    def on_applied(self, grads_and_vars: list) -> None:
        """Called after an applied update, on every optimizer of the stack, innermost first.

        Runs on every replica, after `apply_updates` (the variables hold their new
        values), with the final gradients. For what follows an update: moving
        averages, Lookahead's synchronisation, a loss scale's growth. Default: nothing.
        """
        return None

    def on_skipped(self) -> None:
        """Called after a skipped update (`update_condition` was false), on every
        optimizer of the stack, innermost first.

        Under merge-call strategies it runs once, in the cross-replica context (for a
        stack updated device by device, see `run_update`: once per device, where each
        variable write reaches that device's copy): update only replicated variables
        here (`add_variable(..., aggregation="only_first_replica")`, `add_slot`), not
        replica-local ones. Default: nothing
        (`Optimizer` counts the skip in `skipped_steps`).
        """
        return None

    def _apply_and_notify(self, grads_and_vars: list) -> None:
        # Every hook under the update contract: a collective inside raises, naming it.
        with exactly_once.step_hook(self, "apply_updates"):
            self.apply_updates(grads_and_vars)
        for opt in reversed(self.stack()):
            with exactly_once.step_hook(opt, "on_applied"):
                opt.on_applied(grads_and_vars)

    def _notify_skipped(self) -> None:
        for opt in reversed(self.stack()):
            with exactly_once.step_hook(opt, "on_skipped"):
                opt.on_skipped()

    def stack(self) -> list:
        """This optimizer and every optimizer it wraps, outermost first (the last is the
        `Optimizer` around the Keras update rule)."""
        out = [self]
        while getattr(out[-1], "wrapped", None) is not None:
            out.append(out[-1].wrapped)
        return out

    def register_local_var(self, variable) -> None:
        """Horovod's `register_local_var`, on the stack's `Optimizer` (`Optimizer.register_local_var`)."""
        self.stack()[-1].register_local_var(variable)

    register_local_source = register_local_var

    def find(self, kind: type) -> "StagedOptimizer | None":
        """The outermost optimizer of the stack (self included) that is a `kind`, or None."""
        for opt in self.stack():
            if isinstance(opt, kind):
                return opt
        return None

    # -- state -------------------------------------------------------------------------

    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        """Builds the stack once: the wrapped optimizers first, then `build_state`.

        Override `build_state`, not this.
        """
        if self.built:
            return
        var_list = list(var_list)
        self._build_wrapped(var_list)
        self._slot_table = SlotTable(self, var_list)
        # With `shard_optimizer_state=True` at the bottom, every optimizer of the stack
        # keeps state for this process's share of the variables only (`shards_state`).
        var_list = shards.share_of(self, var_list)
        self.build_state(var_list)
        # Keras's base `build` creates EMA averages and gradient accumulators when
        # `use_ema`/`gradient_accumulation_steps` read true; here they report the stack,
        # whose wrappers hold that state, so they read as Keras's "off" meanwhile.
        self._dm_keras_build = True
        try:
            super().build(var_list)
        finally:
            self._dm_keras_build = False

    # Whether this optimizer's state and step hooks work on a process's share of the
    # variables (`Optimizer(shard_optimizer_state=True)`): its `build_state` gets the
    # share, its hooks and `transform_gradients` see the share's gradients only, and it
    # writes no trained variable outside a step. See docs/sharding.md.
    shards_state: bool = False

    def build_state(self, var_list: list) -> None:
        """Creates this optimizer's own state for `var_list`; called once, by `build`.

        Runs under the strategy scope, after the wrapped optimizers are built. Create
        variables with `self.add_variable(...)` (scalars, counters: pass
        `aggregation="only_first_replica"` for a value every replica keeps alike) or
        `self.add_slot(...)` (one per trainable variable); they are checkpointed and
        saved with the optimizer, once. Attributes set here are not wrapped by
        TensorFlow's tracking (plain lists and dicts stay plain). Default: nothing.
        """
        return None

    def _build_wrapped(self, var_list: list) -> None:
        """Builds whatever this optimizer wraps (subclasses)."""
        return None

    @property
    def trained_variables(self) -> list:
        """The variables this optimizer was built for, in order (empty before `build`)."""
        table = getattr(self, "_slot_table", None)
        return list(table.trained) if table is not None else []

    def add_slot(self, variable, name: str, initializer: Any = "zeros", replica_local: bool = False):
        """Creates this optimizer's slot `name` for `variable` (in `build_state`) and returns it.

        Args:
          variable: a trainable variable of `build`'s `var_list`.
          name: the slot's name (one per purpose: "average", "slow", ...).
          initializer: a Keras initializer (or its name), or `"value"`: start from the
            variable's current value.
          replica_local: False (default): ONE value, identical on every replica, for
            state computed from aggregated values (averages, slow weights). True: each
            replica keeps and updates its own copy (accumulators of per-replica
            gradients); read outside a replica, as checkpoints and `.keras` files do,
            it is the SUM of the copies, and a restored value is split evenly.

        Raises:
          ValueError: called before `build_state`, twice for the same slot, or for a
            variable `build` did not receive.
        """
        table = getattr(self, "_slot_table", None)
        if table is None:
            raise ValueError(f"`add_slot` must be called from `build_state`. Received: name={name!r}")
        return table.add(variable, name, initializer, replica_local)

    def slot(self, name: str, variable):
        """This optimizer's slot `name` of `variable` (KeyError naming both if none)."""
        return (getattr(self, "_slot_table", None) or SlotTable(self, ())).get(name, variable)

    def slots(self, name: str) -> list:
        """Slot `name` of every variable this optimizer was built for, in order."""
        return [self.slot(name, v) for v in self.trained_variables]



def _delegated_learning_rate():
    """The learning rate given to Keras's base constructor (a callable, so that it creates
    no variable): every dist_minimize optimizer reports its inner optimizer's."""
    raise RuntimeError("A dist_minimize optimizer's learning rate is its inner optimizer's.")
