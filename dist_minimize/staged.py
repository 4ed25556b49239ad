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
import threading
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat, _stages, distribute
from dist_minimize._finite import all_finite
from dist_minimize.aggregation import once

# Keras optimizer settings that act per replica, before any aggregation: set on a
# dist_minimize optimizer they would change nothing, so setting one is refused, naming
# what to use instead. (On the wrapped Keras optimizer they are translated:
# `_keras_settings`.) `clipnorm`, `clipvalue` and `global_clipnorm` may be set: they
# reach the stack's clipper (`_keras_setting_property`).
_PER_REPLICA_SETTINGS = {
    "gradient_accumulation_steps": "dist_minimize.GradientAccumulation(optimizer, steps={}) around it, or "
    "gradient_accumulation_steps={} on the Keras optimizer given to dist_minimize.Optimizer",
    "use_ema": "dist_minimize.MovingAverage(optimizer, average_decay=..., start_step=1) around it, or "
    "use_ema={} on the Keras optimizer given to dist_minimize.Optimizer",
}

# Keras's optimizer settings that dist_minimize applies after aggregation, with Keras's
# value for "not applied". Read on a dist_minimize optimizer, each reports what the stack
# applies: the first optimizer of the stack (outermost first) whose `keras_settings()`
# names it answers.
KERAS_SETTING_DEFAULTS = {
    "clipnorm": None, "clipvalue": None, "global_clipnorm": None,
    "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
    "gradient_accumulation_steps": None, "loss_scale_factor": None,
}
CLIP_SETTINGS = ("clipnorm", "clipvalue", "global_clipnorm")


def _keras_setting_property(setting: str) -> property:
    def get(self):
        if not getattr(self, "_dm_constructed", False) or getattr(self, "_dm_keras_build", False):
            return KERAS_SETTING_DEFAULTS[setting] if setting == "use_ema" else None
        for opt in self.stack():
            values = opt.keras_settings()
            if setting in values:
                return values[setting]
        return KERAS_SETTING_DEFAULTS[setting]

    def set(self, value):
        # Keras's base constructor assigns each one (its defaults): nothing to keep.
        if not getattr(self, "_dm_constructed", False):
            return
        if setting in CLIP_SETTINGS:
            # tf-keras allows `opt.clipnorm = 2.0` between steps: the stack's clipper takes
            # the new bound from the next step (None: off); see `Optimizer.set_clip_bound`.
            core = self.stack()[-1]
            if not hasattr(core, "set_clip_bound"):
                raise TypeError(f"`{setting}` can be set on a stack around a `dist_minimize.Optimizer` only. "
                                f"Received: {setting}={value!r} on {type(self).__name__} around "
                                f"{type(core).__name__}")
            core.set_clip_bound(setting, value, holder=self)
            return
        if value != get(self):
            raise TypeError(
                f"`{setting}` on a dist_minimize optimizer reports the stack (what applies after "
                f"aggregation: {setting}={get(self)!r}); it cannot be changed by assignment. Build the "
                f"optimizer with the setting you want. Received: {setting}={value!r} on {type(self).__name__}")

    writable = setting in CLIP_SETTINGS
    return property(get, set, doc=f"Keras's `{setting}`, as the stack applies it "
                                  f"({'settable between steps' if writable else 'read-only'}).")


# The device types on which the guarded update may be made device by device. An
# unlowered If runs its branch as a function on its own device, without soft placement:
# an op of the update with no kernel for that device fails there, where the lowered cond
# of `run_if` would have placed it on the host (int64 FloorMod, in SWA's and Lookahead's
# schedules, has no GPU kernel). Only CPUs are checked here; `ci/gpu_check.py` runs the
# per-device update on GPUs with "GPU" added, and reports whether it works there.
PER_DEVICE_TYPES: tuple[str, ...] = ("CPU",)

# What a class outside this package may define on an optimizer of a stack that is still
# updated device by device: the stages that run before the update, and set-up. Any other
# method (a step hook, or a helper one of this package's hooks calls, such as
# MovingAverage.decay_at) may synchronise, which a per-device branch cannot hold.
_PRE_UPDATE_METHODS = frozenset((
    "__init__", "__repr__", "transform_loss", "get_gradients", "transform_unaggregated_gradients",
    "aggregate_gradients", "transform_gradients", "update_condition", "build", "build_state",
    "check_stack", "get_config", "from_config", "finalize_variable_values"))


def _class_fits_per_device(cls: type, step_hooks: Sequence[str]) -> bool:
    """Whether an optimizer of class `cls` may be updated device by device: each of its
    `step_hooks` is defined by a class that declares `_dm_per_device_hooks`, and the
    classes of its MRO before this package's own define only `_PRE_UPDATE_METHODS` (or
    declare `_dm_per_device_hooks` themselves)."""
    for hook in step_hooks:
        owner = next(c for c in cls.__mro__ if hook in c.__dict__)
        if not owner.__dict__.get("_dm_per_device_hooks", False):
            return False
    for c in cls.__mro__:
        if c.__module__.split(".")[0] == "dist_minimize":
            return True
        if "_dm_per_device_hooks" in c.__dict__:
            return bool(c.__dict__["_dm_per_device_hooks"])
        for name, value in c.__dict__.items():
            if name in _PRE_UPDATE_METHODS or (name.startswith("__") and name.endswith("__")
                                                and name not in ("__getattr__", "__getattribute__")):
                continue
            if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
                return False
    return True


class StagedOptimizer(_compat.UntrackedBaseState, keras.optimizers.Optimizer, metaclass=abc.ABCMeta):
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
                 tape: tf.GradientTape | None = None, decay_var_list: Sequence | None = None) -> tf.Variable:
        """Runs all six stages: one optimisation step of `loss` over `variables`.

        Args:
          loss: a scalar tensor recorded by `tape`, or a zero-argument callable that
            computes it (then `tape` is optional).
          variables: the variables to update.
          tape: the `tf.GradientTape` that recorded a tensor `loss`.
          decay_var_list: with a `DecoupledWeightDecay` in the stack, the variables it
            decays in this step (instead of its default choice). Inside `tf.function`,
            the choice made when the function was traced is the one it keeps.

        Returns:
          The iterations counter.

        Raises:
          ValueError: a tensor `loss` without `tape`, or a `decay_var_list` without a
            `DecoupledWeightDecay` in the stack (or naming a variable not trained).
        """
        if decay_var_list is not None:
            with self._decaying_step(decay_var_list):
                return self.minimize(loss, variables, tape=tape)
        variables = list(variables)
        if not self.built:  # the stages may use the optimizer's state from the first one on
            self._build_on_first_use(variables)
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

    def apply_gradients(self, grads_and_vars, aggregate: bool = True,
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
        grads_and_vars = _stages.as_grads_and_vars(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        if not self.built:
            self._build_on_first_use([v for _, v in grads_and_vars])
        if aggregate:
            grads_and_vars = self._run_stage(
                "transform_unaggregated_gradients", self.transform_unaggregated_gradients, grads_and_vars)
        self.run_update(grads_and_vars, top=self, aggregate=aggregate)
        return self.iterations

    def _build_on_first_use(self, variables: list) -> None:
        """Builds the stack from `minimize`/`apply_gradients` when `build` was not called.

        As an explicit `build` under the strategy scope would: once, in the cross-replica
        context (a `merge_call` from the replicas), outside any function being traced
        (`tf.init_scope`), under the strategy in use. Built in the replica context of a
        traced step instead, a variable whose initial value the graph computes (a
        replica's copy of the first replica's value, a slot that starts from the weights)
        cannot be lifted out of the function: under MirroredStrategy TensorFlow then
        fails with "You must feed a value for placeholder tensor
        'cond/else/_1/cond/Placeholder'".

        Args:
          variables: the variables to build for (the first step's).
        """
        _stages.check_variables_in_strategy(variables)
        strategy = tf.distribute.get_strategy()

        def build(*_):
            if self.built:
                return
            with tf.init_scope(), strategy.scope(), keras.name_scope(self.name, caller=self):
                self.build(variables)

        context = tf.distribute.get_replica_context()
        if context is None:
            build()
        else:
            context.merge_call(build)

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

    def apply(self, grads, trainable_variables=None):
        """Keras's `apply(grads, trainable_variables)`: same as `apply_gradients`."""
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "`trainable_variables` is required until the optimizer is built: call "
                    "`optimizer.build(model.trainable_variables)` first. "
                    "Received: trainable_variables=None")
            trainable_variables = self.trained_variables
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
                    "`apply_gradients`, so the override would be skipped without a word. Call "
                    "`dist_minimize.integrate(model)` after `model.compile` (fit then runs every "
                    "stage), train with a custom loop that calls `optimizer.minimize(loss, variables, "
                    "tape=tape)`, or move the change into `transform_unaggregated_gradients`.")
            opt = getattr(opt, "wrapped", None)
        if not tf.is_tensor(loss):  # Keras's own accepts a Python number
            loss = tf.convert_to_tensor(loss, dtype=keras.backend.floatx() if isinstance(loss, (int, float)) else None)
        return self.transform_loss(loss)

    @staticmethod
    def _run_stage(name: str, fn: Callable, grads_and_vars: list) -> list:
        return _stages.check_stage_output(name, grads_and_vars, fn(list(grads_and_vars)))

    # -- the step protocol (what a wrapper may change besides the stages) ----------------

    def run_update(self, grads_and_vars: list, *, top: "StagedOptimizer", aggregate: bool) -> None:
        """The part of a step after `transform_unaggregated_gradients`, with `top`'s stages.

        `minimize`/`apply_gradients` run `transform_loss`, `get_gradients` and
        `transform_unaggregated_gradients` on every call (every micro-step), then call
        `top.run_update(...)`; by default it is the update itself: `aggregate_gradients`
        (when `aggregate`), `transform_gradients`, then `apply_updates` if
        `top.update_condition(...)` holds, followed by `on_applied` (or `on_skipped`)
        on every optimizer of the stack. Under MirroredStrategy and
        MultiWorkerMirroredStrategy that branch is one unlowered cond per device when
        the whole stack allows it (`_per_device_ok`), else `run_if`'s one cond.
        Wrappers pass the call inward, so a wrapper that changes WHEN the update
        happens (gradient accumulation) overrides this and
        calls `super().run_update(...)` under `dist_minimize.distribute.run_if`.

        Args:
          grads_and_vars: this micro-step's per-replica (gradient, variable) pairs.
          top: the outermost optimizer (the one `apply_gradients` was called on): its
            stages are the ones that run.
          aggregate: False when the caller aggregated already (`apply_gradients(...,
            aggregate=False)`).
        """
        if distribute.strategy_replicas() > 1 and distribute.uses_merge_call():
            distribute.refuse_xla(
                f"A step under {type(tf.distribute.get_strategy()).__name__} on these devices",
                "the strategy synchronises its replicas through merge_call, and TensorFlow cannot "
                "compile such a step (stock Keras fails at run time: 'Trying to access resource ... "
                "located in device ...'); Keras's own default under a strategy is jit_compile=False")
        with distribute.deferred_updates() as pending, once.step():
            if aggregate:
                grads_and_vars = top._run_stage("aggregate_gradients", top.aggregate_gradients, grads_and_vars)
            grads_and_vars = top._run_stage("transform_gradients", top.transform_gradients, grads_and_vars)
            condition = top.update_condition(grads_and_vars)
        # The transforms' statistics and counters (`assign_replicated`) are made in the
        # same cross-replica step as the update decision: one synchronisation per step.
        if condition is None:
            distribute.flush_updates(pending)
            top._apply_and_notify(grads_and_vars)
            return
        if distribute.uses_merge_call() and top._per_device_ok(grads_and_vars):
            variables = [v for _, v in grads_and_vars]
            _compat.check_variables_are_known(top.stack()[-1].inner_optimizer, variables)

            def apply_on(index, grads):
                with _on_device(index):
                    top._apply_and_notify(list(zip(grads, variables)))

            def skip_on(index):
                with _on_device(index):
                    top._notify_skipped()

            distribute.run_if_per_device(condition, apply_on, args=([g for g, _ in grads_and_vars],),
                                         otherwise=skip_on, updates=pending)
        else:
            distribute.run_if(condition, top._apply_and_notify, args=(grads_and_vars,),
                              otherwise=top._notify_skipped, updates=pending)

    # The step hooks run inside the update's branch, and which classes of this package
    # define them so that they may run device by device (`_per_device_ok`).
    _STEP_HOOKS = ("apply_updates", "on_applied", "on_skipped", "_apply_and_notify", "_notify_skipped")
    _dm_per_device_hooks = True

    def _per_device_ok(self, grads_and_vars: list) -> bool:
        """Whether this stack's update can be made device by device under a merge-call
        strategy (`distribute.run_if_per_device`), instead of by `run_if`.

        Why: `run_if` takes its branch once in the cross-replica context, and TensorFlow
        lowers that multi-device `tf.cond` into a Switch and an Identity per input per
        device (about 800 at 100 variables on 2 devices: a 1.13x step). One unlowered
        cond per device holds the same update and costs one kernel each.

        Yes when every step hook of every optimizer in the stack is one of this
        package's (they read and write variables only, which inside tf.distribute's
        update context of a device reach that device's copies; their `run_if` and
        `flush_updates` then act on that device alone), no class outside this package
        overrides what those hooks call (only the stages before the update,
        `_PRE_UPDATE_METHODS`), the devices are of a type in `PER_DEVICE_TYPES` (CPUs),
        every variable has one copy per device (not so under CentralStorageStrategy),
        and the Keras update rule at the bottom keeps Keras's own `apply` path
        (`_compat.keras_apply_on_device_blocker`). Anything else (a hook or helper of
        yours may synchronise) keeps `run_if`.
        """
        stack = self.stack()
        if not all(_class_fits_per_device(type(opt), self._STEP_HOOKS) for opt in stack):
            return False
        rule = stack[-1].__dict__.get("inner_optimizer")  # the Keras update rule, if any
        if rule is None:
            return False
        if not distribute.worker_device_types() <= set(PER_DEVICE_TYPES):
            return False
        if not distribute.has_copy_per_device([v for _, v in grads_and_vars] + [self.iterations]):
            return False
        return _compat.keras_apply_on_device_blocker(rule, grads_and_vars) is None

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
        self.apply_updates(grads_and_vars)
        for opt in reversed(self.stack()):
            opt.on_applied(grads_and_vars)

    def _notify_skipped(self) -> None:
        for opt in reversed(self.stack()):
            opt.on_skipped()

    def stack(self) -> list:
        """This optimizer and every optimizer it wraps, outermost first (the last is the
        `Optimizer` around the Keras update rule)."""
        out = [self]
        while getattr(out[-1], "wrapped", None) is not None:
            out.append(out[-1].wrapped)
        return out

    def find(self, kind: type) -> "StagedOptimizer | None":
        """The outermost optimizer of the stack (self included) that is a `kind`, or None."""
        for opt in self.stack():
            if isinstance(opt, kind):
                return opt
        return None

    def keras_settings(self) -> dict:
        """The Keras optimizer settings this optimizer itself applies, by name (e.g.
        `{"gradient_accumulation_steps": 4}`), of `KERAS_SETTING_DEFAULTS`.

        Read on any optimizer of a stack, `clipnorm`, `use_ema`, ... report the value of
        the first optimizer (outermost first) that names the setting here, else Keras's
        default. Default: none.
        """
        return {}

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
        self._dm_state = _BuiltState(var_list)
        self.build_state(var_list)
        # Keras's base `build` creates EMA averages and gradient accumulators when
        # `use_ema`/`gradient_accumulation_steps` read true; here they report the stack,
        # whose wrappers hold that state, so they read as Keras's "off" meanwhile.
        self._dm_keras_build = True
        try:
            super().build(var_list)
        finally:
            self._dm_keras_build = False

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
        state = getattr(self, "_dm_state", None)
        return list(state.trained) if state is not None else []

    def add_slot(self, variable, name: str, initializer: Any = "zeros", replica_local: bool = False):
        """Creates this optimizer's slot `name` for `variable` (in `build_state`) and returns it.

        Args:
          variable: a trainable variable of `build`'s `var_list`.
          name: the slot's name (one per purpose: "average", "slow", ...).
          initializer: a Keras initializer (or its name), or `"value"`: start from the
            variable's current value.
          replica_local: False (default): ONE replicated value, identical on every
            replica (mirrored, written from the first replica, which holds the same
            value as the others by contract): for state every replica computes alike
            from aggregated values (averages, slow weights). True: each replica keeps
            its own copy and updates it without communication (accumulators of
            per-replica gradients); read outside the replica context, and so in
            checkpoints and `.keras` files, it is the SUM of the copies, and a
            restored value is split evenly among the replicas (TensorFlow's sync-on-read
            SUM variable).

        Returns:
          The slot variable (also returned later by `slot(name, variable)`).

        Raises:
          ValueError: called before `build_state`, twice for the same slot, or for a
            variable `build` did not receive.
        """
        state = getattr(self, "_dm_state", None)
        if state is None:
            raise ValueError(f"`add_slot` must be called from `build_state`. Received: name={name!r}")
        key = _compat.variable_key(self, variable)
        if key not in {_compat.variable_key(self, v) for v in self.trained_variables}:
            raise ValueError(f"`add_slot`: {_stages.variable_name(variable)} is not a variable this optimizer "
                             f"was built for. Received: name={name!r}")
        table = state.slots.setdefault(name, {})
        if key in table:
            raise ValueError(f"Slot {name!r} already exists for {_stages.variable_name(variable)}.")
        if replica_local:
            if initializer != "zeros":
                raise ValueError("A replica-local slot starts at zeros (each replica's share of a "
                                 f"sum). Received: initializer={initializer!r}")
            slot = _compat.add_replica_local_variable(self, variable, name=f"{_slot_prefix(variable)}_{name}")
        else:
            slot = _compat.add_replicated_variable(self, variable, name=f"{_slot_prefix(variable)}_{name}",
                                                   initializer=initializer)
        table[key] = slot
        return slot

    def slot(self, name: str, variable):
        """This optimizer's slot `name` of `variable` (see `add_slot`).

        Raises:
          KeyError: no such slot (naming the slot and the variable).
        """
        try:
            return self._dm_state.slots[name][_compat.variable_key(self, variable)]
        except (KeyError, TypeError, AttributeError):
            raise KeyError(f"{type(self).__name__} has no slot {name!r} for "
                           f"{_stages.variable_name(variable)}") from None

    def slots(self, name: str) -> list:
        """Slot `name` of every variable this optimizer was built for, in order."""
        return [self.slot(name, v) for v in self.trained_variables]

    def save_own_variables(self, store):
        """Saves this optimizer's own state (Keras saves each wrapped optimizer, and the
        inner Keras optimizer, under its own path: every variable is written once)."""
        for i, variable in enumerate(_compat.own_variables(self)):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores what `save_own_variables` wrote.

        Raises:
          ValueError: the file holds a different number of arrays for this optimizer.
        """
        own = _compat.own_variables(self)
        if len(store.keys()) != len(own):
            raise ValueError(
                f"Cannot restore optimizer {self.name!r} ({type(self).__name__}): it has {len(own)} "
                f"state variables and the file holds {len(store.keys())} (built for another model, "
                "or saved with another optimizer stack).")
        for i, variable in enumerate(own):
            variable.assign(store[str(i)])

    # -- non-finite guard --------------------------------------------------------------

    @property
    @abc.abstractmethod
    def skip_nonfinite(self) -> bool:
        """Whether steps with non-finite final gradients are skipped (the guard)."""

    run_if = staticmethod(distribute.run_if)

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
        if name in _PER_REPLICA_SETTINGS and value and getattr(self, "_dm_constructed", False):
            raise TypeError(
                f"Setting `{name}` on a dist_minimize optimizer would change nothing (its Keras "
                f"update rule runs inside the stages). Use {_PER_REPLICA_SETTINGS[name].format(value, value)}. "
                f"Received: {name}={value!r} on {type(self).__name__}")
        if (getattr(self, "_dm_constructed", False) and not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name)):
            rule = self._dm_update_rule()
            if rule is not None and hasattr(rule, name):
                # Read-through (`__getattr__`) would make it look set while the rule kept its own.
                raise TypeError(
                    f"`{name}` belongs to the wrapped Keras optimizer's update rule "
                    f"({type(rule).__name__}); setting it here would change nothing. Set it there: "
                    f"`optimizer.stack()[-1].inner_optimizer.{name} = ...`. Received: {name}={value!r} on "
                    f"{type(self).__name__}")
        super().__setattr__(name, value)

    def _dm_update_rule(self):
        """The Keras optimizer at the bottom of the stack (None while constructing), found
        without attribute look-ups that could reach `__getattr__`."""
        opt = self
        while True:
            state = opt.__dict__
            if "inner_optimizer" in state:
                return state["inner_optimizer"]
            if "wrapped" not in state:
                return None
            opt = state["wrapped"]

    def __getattr__(self, name):
        # Only reached when normal look-up fails: public attributes of the wrapped Keras
        # optimizer read through (`opt.beta_1`, Muon's `lr_adjust`), as on the Keras
        # optimizer the user had. Private names never do.
        if not name.startswith("_"):
            rule = self._dm_update_rule()
            if rule is not None:
                try:
                    return getattr(rule, name)
                except AttributeError:
                    pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Keras's settings, read on a dist_minimize optimizer: what the stack applies.
    clipnorm = _keras_setting_property("clipnorm")
    clipvalue = _keras_setting_property("clipvalue")
    global_clipnorm = _keras_setting_property("global_clipnorm")
    use_ema = _keras_setting_property("use_ema")
    ema_momentum = _keras_setting_property("ema_momentum")
    ema_overwrite_frequency = _keras_setting_property("ema_overwrite_frequency")
    gradient_accumulation_steps = _keras_setting_property("gradient_accumulation_steps")
    loss_scale_factor = _keras_setting_property("loss_scale_factor")

    @property
    def weight_decay(self):
        """The wrapped Keras optimizer's `weight_decay` (reading and setting reach it)."""
        if not getattr(self, "_dm_constructed", False):
            return None
        return self._decaying_optimizer().weight_decay

    @weight_decay.setter
    def weight_decay(self, value):
        if not getattr(self, "_dm_constructed", False):
            return  # Keras's base constructor sets None; the update rule's own setting counts
        self._decaying_optimizer().weight_decay = value

    def update_step(self, gradient, variable, learning_rate):
        """The wrapped Keras optimizer's `update_step`: its update rule on one variable.

        As in Keras, only the rule: no stage, clip, average or counter runs (Keras's
        `apply` does that around it, dist_minimize's `apply_gradients`). Build first.
        """
        rule = self._dm_update_rule()
        rule.update_step(gradient, variable, learning_rate)

    def set_weights(self, weights):
        """Assigns `weights` to `variables` (the whole stack's, in that order).

        Raises:
          ValueError: not built, or a shape differs (naming the variable).
        """
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been built. Call "
                "`optimizer.build(trainable_variables)` first.")
        for variable, weight in zip(self.variables, weights):
            if tuple(variable.shape) != tuple(getattr(weight, "shape", ())):
                raise ValueError(f"Optimizer variable {variable.path} has shape {tuple(variable.shape)}, not "
                                 f"compatible with the weight's {tuple(getattr(weight, 'shape', ()))}.")
            variable.assign(weight)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Exempts variables from the wrapped Keras optimizer's `weight_decay`.

        Keras's public way to do it, forwarded to the optimizer that applies the decay
        (on this object itself it would change nothing).
        """
        self._decaying_optimizer().exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def _decaying_optimizer(self):
        """The Keras optimizer whose update rule applies `weight_decay`."""
        return self._dm_update_rule()

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Not supported: dist_minimize optimizers are stateful (TensorFlow backend)."""
        raise ValueError("dist_minimize optimizers are stateful (TensorFlow backend only).")


class _BuiltState:
    """What `build` records: the trained variables and the slots (a plain object, so that
    TensorFlow's tracking neither wraps nor checkpoints these containers; the slot
    variables themselves are tracked by `add_variable`)."""

    def __init__(self, trained: list):
        self.trained = tuple(trained)
        self.slots: dict = {}


def _delegated_learning_rate():
    """The learning rate given to Keras's base constructor (a callable, so that it creates
    no variable): every dist_minimize optimizer reports its inner optimizer's."""
    raise RuntimeError("A dist_minimize optimizer's learning rate is its inner optimizer's.")


def _slot_prefix(variable) -> str:
    return _stages.variable_name(variable).replace("/", "_").replace(":", "_")



class _OnDevice(threading.local):
    index: int | None = None


# The device whose copies the update being traced writes (per-device update), or None.
_ON_DEVICE = _OnDevice()


@contextlib.contextmanager
def _on_device(index: int):
    previous, _ON_DEVICE.index = _ON_DEVICE.index, index
    try:
        yield
    finally:
        _ON_DEVICE.index = previous
