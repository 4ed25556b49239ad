"""The Keras optimizer surface of a dist_minimize optimizer: Keras's settings read back as
the stack applies them, attributes of the wrapped update rule read through, the Keras
methods that reach the update rule (`update_step`, `weight_decay`, ...), Keras's entry
points to a step (`apply`, and `scale_loss`, which `fit` calls) and its saving hooks.

A base class of `StagedOptimizer`, not an object it holds: Keras calls every one of these
names on the optimizer itself, so a held object would need a delegate per name. It knows
no subclass: each optimizer of a stack answers its own Keras settings
(`keras_settings()`), and the update rule is found by what holds one (`inner_optimizer`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.step import zones
from dist_minimize.step import stages
from dist_minimize.step.context import CONTEXT

# Keras optimizer settings that act per replica, before any aggregation: set on a
# dist_minimize optimizer they would change nothing, so setting one is refused, naming
# what to use instead. (On the wrapped Keras optimizer they are translated:
# `_keras_settings`.) `clipnorm`, `clipvalue` and `global_clipnorm` may be set: they
# reach the stack's clipper (`_keras_setting_property`).
_PER_REPLICA_SETTINGS = {
    "gradient_accumulation_steps": "dist_minimize.GradientAccumulation(optimizer, steps={}) around it, or "
    "gradient_accumulation_steps={} on the Keras optimizer given to dist_minimize.Optimizer.from_keras",
    "use_ema": "dist_minimize.MovingAverage(optimizer, average_decay=..., start_step=1) around it, or "
    "use_ema={} on the Keras optimizer given to dist_minimize.Optimizer.from_keras",
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
        if setting in _PER_REPLICA_SETTINGS and value:
            raise TypeError(
                f"Setting `{setting}` on a dist_minimize optimizer would change nothing (its Keras "
                f"update rule runs inside the stages). Use {_PER_REPLICA_SETTINGS[setting].format(value, value)}. "
                f"Received: {setting}={value!r} on {type(self).__name__}")
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


class KerasSurface:
    """Keras's optimizer surface on a dist_minimize optimizer (see the module docstring)."""

    @tf.autograph.experimental.do_not_convert  # as `apply_gradients`
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
        stages.check_lengths(grads, trainable_variables)
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
                    "`apply_gradients`, so the override would be skipped without a word. Routes that "
                    "work: (1) `dist_minimize.integrate(model)` after `model.compile`: fit then runs every "
                    "stage, and `get_gradients` receives `loss_fn` (the compiled loss on this batch, for a "
                    "stage that evaluates the loss again); (2) a `train_step` of your own that calls "
                    "`self.optimizer.minimize(loss, self.trainable_variables, tape=tape, loss_fn=...)` "
                    "(without `integrate`); (3) a custom loop calling `optimizer.minimize(loss_fn, "
                    "variables)`; (4) for a change of the gradients alone, "
                    "`transform_unaggregated_gradients` instead of `get_gradients`.")
            opt = getattr(opt, "wrapped", None)
        if not tf.is_tensor(loss):  # Keras's own accepts a Python number
            loss = tf.convert_to_tensor(loss, dtype=keras.backend.floatx() if isinstance(loss, (int, float)) else None)
        return self.transform_loss(loss)

    def keras_settings(self) -> dict:
        """The Keras optimizer settings this optimizer itself applies, by name (e.g.
        `{"gradient_accumulation_steps": 4}`), of `KERAS_SETTING_DEFAULTS`.

        Read on any optimizer of a stack, `clipnorm`, `use_ema`, ... report the value of
        the first optimizer (outermost first) that names the setting here, else Keras's
        default. Default: none.
        """
        return {}

    def __setattr__(self, name, value):
        # Keras's settings refuse in their own setters (`_keras_setting_property`), except
        # this one: Keras's LossScaleOptimizer sets `inner_optimizer.loss_scale_factor =
        # None` when it wraps an optimizer (model.compile does so under a mixed_float16
        # policy), and Keras's tracking skips an assignment of the value already read, so
        # the property would never see it. It would decide skips from one replica's
        # gradients: refused at compile time.
        if name == "loss_scale_factor" and getattr(self, "_dm_constructed", False):
            raise TypeError(
                "A dist_minimize optimizer must not be wrapped in Keras's LossScaleOptimizer "
                "(it decides whether to skip a step from one replica's unaggregated "
                "gradients). Under a mixed_float16 policy, compile with "
                "`model.compile(..., auto_scale_loss=False)` and use "
                "`dist_minimize.LossScaleOptimizer`. Received: an attempt to set "
                f"loss_scale_factor={value!r} on {type(self).__name__}")
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
        if CONTEXT.aggregations is not None and getattr(self, "built", False) and _per_call(value):
            raise zones.ContractError(
                f"`{type(self).__name__}.{name}` was set during a step to {_describe(value)}. One optimizer "
                "object serves every replica: under MirroredStrategy each replica runs the step in its own "
                "thread on this same object, so a value kept on `self` between stages is another replica's "
                "by the time it is read (the wrapper contract, docs/writing-a-wrapper.md). Pass it along "
                "instead: `get_gradients` receives `loss_fn`, every stage receives its gradients; keep "
                "state that must outlive the step in variables (`add_variable`, `add_slot`). Received: "
                f"{name}={value!r}")
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

    def save_own_variables(self, store):
        """Keras's saving hook: this optimizer's own state (Keras saves each wrapped optimizer, and the
        inner Keras optimizer, under its own path: every variable is written once)."""
        for i, variable in enumerate(_compat.own_variables(self)):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Restores what `save_own_variables` wrote (ValueError if the count differs)."""
        own = _compat.own_variables(self)
        if len(store.keys()) != len(own):
            raise ValueError(
                f"Cannot restore optimizer {self.name!r} ({type(self).__name__}): it has {len(own)} "
                f"state variables and the file holds {len(store.keys())} (built for another model, "
                "or saved with another optimizer stack).")
        for i, variable in enumerate(own):
            variable.assign(store[str(i)])

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Not supported: dist_minimize optimizers are stateful (TensorFlow backend)."""
        raise ValueError("dist_minimize optimizers are stateful (TensorFlow backend only).")


def _per_call(value) -> bool:
    """Whether `value` belongs to one call of a step (a tensor, a function), judged by what
    holds it: tensors and plain functions, also inside lists, tuples and dicts."""
    import types

    if isinstance(value, (tf.Variable, keras.Variable)):
        return False
    if tf.is_tensor(value) or isinstance(value, (types.FunctionType, types.MethodType)):
        return True
    if isinstance(value, (list, tuple)):
        return any(_per_call(v) for v in value)
    if isinstance(value, dict):
        return any(_per_call(v) for v in value.values())
    return False


def _describe(value) -> str:
    return "a function" if callable(value) and not tf.is_tensor(value) else "a value of this call (a tensor)"
