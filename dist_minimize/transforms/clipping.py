"""Gradient clipping: by global norm (cross-replica), by each tensor's norm, by value.

Give a clipper to `transform_gradients` to act on aggregated gradients (identical on
every replica), or to `transform_unaggregated_gradients` to act on each replica's own
gradients before aggregation. Only the first is equivalent to clipping on one device
with the global batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dist_minimize import distribute
from dist_minimize.step.context import CONTEXT
from dist_minimize.transforms.base import (
    GradientTransform,
    accumulation_dtype,
    check_positive_finite,
    dense_values,
    map_gradient,
)

# Layout of ClipByGlobalNorm's state vector.
_LAST_NORM, _LAST_CLIPPED, _NORM_SUM, _STEPS, _CLIPPED_STEPS, _NONFINITE_STEPS = range(6)
_TOTALS = [False, False, True, True, True, True]  # the entries that accumulate


class _Bound:
    """The settable clip bound shared by the clippers (`clip_norm` or `clip_value`).

    Until `build` it is a Python number, made a constant of the step. `build` puts it in
    a variable (mirrored under a strategy) that the step reads, so that assigning the
    attribute later (`clipper.clip_norm = 2.0`, or `optimizer.clipnorm = 2.0` on the
    optimizer holding the clipper) reaches a step that is already traced (a
    `tf.function` custom loop, Keras's `fit` train function) from its next run, without
    retracing. `None` means no clipping: the variable then holds +inf, with which every
    clipper returns its input unchanged (bitwise).

    The variable is not checkpointed or saved (it is no dependency of the optimizer):
    the bound is configuration, like Keras's `clipnorm`, and `get_config` returns the
    current value, so a saved model restores it from its config; a checkpoint restored
    into an optimizer keeps that optimizer's bound. Saving it as well would let a
    checkpoint change the bound behind the config's back, and would change the number of
    optimizer variables that files saved before hold.
    """

    _bound_name = "clip_norm"
    # The bound's dtype in the variable: float64 for the norms (cast to the norm's
    # dtype, as the Python number was); ClipByValue made its bound a float32 first.
    _bound_dtype = tf.float64

    def _init_bound(self, value) -> None:
        self._bound = _check_bound(self._bound_name, value)
        self._bound_variable = None

    def _get_bound(self):
        return self._bound

    def _set_bound(self, value) -> None:
        value = _check_bound(self._bound_name, value)
        if self._bound_variable is not None:
            self._bound_variable.assign(_stored(value))
        self._bound = value

    def build(self, optimizer, variables):
        """Creates the bound's variable (mirrored, not checkpointed: see `_Bound`)."""
        self._build_bound()

    def _build_bound(self) -> None:
        if self._bound_variable is not None:
            return
        self._bound_variable = tf.Variable(
            _stored(self._bound), dtype=self._bound_dtype, trainable=False,
            synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            name=f"{type(self).__name__}_{self._bound_name}")

    def _bound_tensor(self, dtype) -> tf.Tensor:
        """The bound as a tensor of `dtype` (+inf for None)."""
        if self._bound_variable is not None:
            return tf.cast(tf.convert_to_tensor(self._bound_variable), dtype)
        return tf.cast(tf.constant(_stored(self._bound), self._bound_dtype), dtype)

    @property
    def bound_variable(self) -> tf.Variable | None:
        """The variable the step reads the bound from (None before `build`)."""
        return self._bound_variable


def _check_bound(name: str, value):
    return None if value is None else check_positive_finite(name, value)


def _stored(value) -> float:
    return float("inf") if value is None else value


def _scale_factor(norm: tf.Tensor, clip: tf.Tensor, finite: tf.Tensor | None = None) -> tf.Tensor:
    """`clip / norm` where the norm exceeds the bound, 1 where it does not (so a bound of
    +inf gives exactly 1), NaN where the norm is not finite: the non-finite guard then
    skips the step everywhere; `clip / inf = 0` would instead apply an all-zero step
    (advancing `iterations` and decaying Adam's moments). Bitwise equal to
    `clip / max(norm, clip)` for a finite bound. `finite`: `is_finite(norm)`, when the
    caller has it already (one check per step)."""
    if finite is None:
        finite = tf.math.is_finite(norm)
    one = tf.ones_like(norm)
    return tf.where(finite, tf.where(norm > clip, clip / norm, one), tf.constant(float("nan"), norm.dtype))


def global_norm(gradients) -> tf.Tensor:
    """The L2 norm of all gradients together, accumulated in float32 (or float64).

    `None` gradients are ignored; `IndexedSlices` count as the dense gradient they sum
    to. Returns 0.0 when there is no gradient.
    """
    gradients = list(gradients)
    dtype = accumulation_dtype([g for g in gradients if g is not None])
    # `l2_loss` (sum(x**2) / 2) is one fused kernel per tensor, where square + sum is two
    # ops and a temporary the size of the gradient; doubling is exact.
    halves = [tf.nn.l2_loss(tf.cast(dense_values(g), dtype)) if g is not None else None for g in gradients]
    # In a sharded step (`shard_optimizer_state=True`) each process holds its share of
    # the gradients: every process's halves, in the unsharded step's order (one collective).
    everyones = CONTEXT.everyones_values(halves)
    halves = everyones if everyones is not None else [h for h in halves if h is not None]
    if not halves:
        return tf.constant(0.0, dtype)
    return tf.sqrt(2.0 * tf.add_n(halves))


@keras.saving.register_keras_serializable(package="dist_minimize")
class ClipByGlobalNorm(_Bound, GradientTransform):
    """Scales all gradients by `clip_norm / max(global_norm, clip_norm)`.

    In `transform_gradients` the norm is that of the aggregated gradients, so every
    replica computes the same norm and scales by the same factor: the result equals
    clipping on a single device with the global batch. The norm is accumulated in
    float32 for float16/bfloat16 gradients (float64 if any gradient is float64) and
    each gradient is scaled in its own dtype. The factor is a clamp, not a branch, so
    clipping costs no host synchronisation.

    Non-finite norm: if any gradient holds an inf or NaN, or finite gradients have a
    norm that overflows their accumulation dtype, the norm is not finite and the scaled
    gradients are made non-finite (NaN) too; the optimizer's non-finite guard
    (`Optimizer(skip_nonfinite=True)`, the default) then skips the step on every
    replica, so no weight becomes NaN. Such steps are counted in `nonfinite_steps`
    and left out of `mean_norm`.

    Statistics (after `build`, i.e. inside an optimizer): `stats()` returns
    `global_norm` (last pre-clip norm), `clipped` (1.0 if the last step was clipped),
    and running totals `norm_sum`, `steps`, `clipped_steps`, `nonfinite_steps`, from
    which `dist_minimize.callbacks.GradientStatsLogger` reports per-epoch means.

    The bound may be changed between steps: `clipper.clip_norm = 2.0` (or
    `optimizer.clipnorm = 2.0` on the optimizer holding it; None turns clipping off)
    applies from the next step, also in a traced step (see `_Bound`).

    Args:
      clip_norm: the maximum global norm, a positive finite number, or None for no
        clipping (the statistics are still recorded).

    Raises:
      ValueError: `clip_norm` is not positive and finite (nor None).
      TypeError: `clip_norm` is a string or no number.

    Example:
      >>> opt = dist_minimize.Optimizer(
      ...     keras.optimizers.SGD(0.1),
      ...     transform_gradients=dist_minimize.clip_by_global_norm(1.0))
    """

    shards_state = True  # the norm combines every process's share (`StepContext.everyones_values`)

    def __init__(self, clip_norm: float | None):
        self._init_bound(clip_norm)
        self._state = None

    clip_norm = property(_Bound._get_bound, _Bound._set_bound,
                         doc="The maximum global norm (None: no clipping); settable between steps.")

    def statistics_variables(self):
        """The statistics vector (once built)."""
        return [self._state] if self._state is not None else []

    def build(self, optimizer, variables):
        """Creates the statistics vector (mirrored, checkpointed with the optimizer) and
        the bound's variable (mirrored, not checkpointed: see `_Bound`)."""
        self._build_bound()
        if self._state is not None:
            return
        self._state = optimizer.add_variable(
            shape=(6,),
            dtype="float64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="clip_by_global_norm_stats",
        )

    def __call__(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        grads = [g for g, _ in grads_and_vars]
        norm = global_norm(grads)
        clip = self._bound_tensor(norm.dtype)
        # A norm that is not finite (an inf/NaN gradient, or finite gradients whose norm
        # overflows) gives a NaN factor (`_scale_factor`).
        finite = tf.math.is_finite(norm)
        factor = _scale_factor(norm, clip, finite)
        if self._state is not None:
            self._record(norm, clip, finite)

        out = [(map_gradient(g, lambda t: distribute.scale(t, factor)), v) for g, v in grads_and_vars]
        # Finite norm <=> every scaled element finite (a non-finite norm gives a NaN
        # factor): the guard need not scan the gradients again; and it may make the
        # products inside its branch.
        distribute.note_all_finite([g for g, _ in out], finite)
        distribute.note_scaled([g for g, _ in out], grads, factor)
        return out

    def _record(self, norm, clip, finite):
        norm64 = tf.cast(norm, tf.float64)
        clipped = tf.cast(tf.logical_and(finite, norm > clip), tf.float64)
        finite_f = tf.cast(finite, tf.float64)
        # One vector op for the six entries: the last norm and flag replaced, the totals
        # added to (a few ops per step, whatever the number of gradients).
        step = tf.stack([norm64, clipped, tf.where(finite, norm64, tf.zeros_like(norm64)), finite_f, clipped,
                         1.0 - finite_f])
        distribute.assign_replicated(self._state, tf.where(_TOTALS, tf.convert_to_tensor(self._state) + step, step))

    def stats(self) -> dict:
        """Last norm, last clipped flag, and running totals (see the class docstring)."""
        if self._state is None:
            return {}
        s = tf.convert_to_tensor(self._state)
        return {
            "global_norm": s[_LAST_NORM],
            "clipped": s[_LAST_CLIPPED],
            "norm_sum": s[_NORM_SUM],
            "steps": s[_STEPS],
            "clipped_steps": s[_CLIPPED_STEPS],
            "nonfinite_steps": s[_NONFINITE_STEPS],
        }

    def get_config(self) -> dict:
        """The transform's configuration."""
        return {"clip_norm": self.clip_norm}


@keras.saving.register_keras_serializable(package="dist_minimize")
class ClipByNorm(_Bound, GradientTransform):
    """Clips each gradient tensor to an L2 norm of at most `clip_norm`, independently.

    `IndexedSlices` are clipped as the dense gradient they sum to. The bound may be
    changed between steps, as `ClipByGlobalNorm`'s.

    Args:
      clip_norm: the maximum norm of each tensor, a positive finite number, or None
        for no clipping.

    Raises:
      ValueError: `clip_norm` is not positive and finite (nor None).
      TypeError: `clip_norm` is a string or no number.
    """

    shards_state = True  # each tensor alone

    def __init__(self, clip_norm: float | None):
        self._init_bound(clip_norm)

    clip_norm = property(_Bound._get_bound, _Bound._set_bound,
                         doc="The maximum norm of each tensor (None: no clipping); settable between steps.")

    def __call__(self, grads_and_vars):
        def clip(values):
            norm = global_norm([values])
            # As in ClipByGlobalNorm: a norm that is not finite gives NaN, so the guard
            # skips the step instead of applying a zero step.
            factor = _scale_factor(norm, self._bound_tensor(norm.dtype))
            return values * tf.cast(factor, values.dtype)

        return [(map_gradient(g, clip), v) for g, v in grads_and_vars]

    def get_config(self) -> dict:
        """The transform's configuration."""
        return {"clip_norm": self.clip_norm}


@keras.saving.register_keras_serializable(package="dist_minimize")
class ClipByValue(_Bound, GradientTransform):
    """Clips every gradient element to `[-clip_value, clip_value]`.

    `IndexedSlices` are clipped as the dense gradient they sum to (rows of repeated
    indices are summed first). The bound may be changed between steps, as
    `ClipByGlobalNorm`'s.

    Args:
      clip_value: a positive finite number, or None for no clipping.

    Raises:
      ValueError: `clip_value` is not positive and finite (nor None).
      TypeError: `clip_value` is a string or no number.
    """

    shards_state = True  # each element alone

    _bound_name = "clip_value"
    _bound_dtype = tf.float32

    def __init__(self, clip_value: float | None):
        self._init_bound(clip_value)

    clip_value = property(_Bound._get_bound, _Bound._set_bound,
                          doc="The largest absolute element (None: no clipping); settable between steps.")

    def __call__(self, grads_and_vars):
        def clip(values):
            c = self._bound_tensor(values.dtype)
            return tf.clip_by_value(values, -c, c)

        return [(map_gradient(g, clip), v) for g, v in grads_and_vars]

    def get_config(self) -> dict:
        """The transform's configuration."""
        return {"clip_value": self.clip_value}


def clip_by_global_norm(clip_norm: float) -> ClipByGlobalNorm:
    """Returns a cross-replica global-norm clipper; see `ClipByGlobalNorm`."""
    return ClipByGlobalNorm(clip_norm)


def clip_by_norm(clip_norm: float) -> ClipByNorm:
    """Returns a per-tensor norm clipper; see `ClipByNorm`."""
    return ClipByNorm(clip_norm)


def clip_by_value(clip_value: float) -> ClipByValue:
    """Returns an element-wise value clipper; see `ClipByValue`."""
    return ClipByValue(clip_value)
