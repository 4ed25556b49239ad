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
from dist_minimize.transforms.base import (
    GradientTransform,
    accumulation_dtype,
    check_positive_finite,
    dense_values,
    map_gradient,
)

# Layout of ClipByGlobalNorm's state vector.
_LAST_NORM, _LAST_CLIPPED, _NORM_SUM, _STEPS, _CLIPPED_STEPS, _NONFINITE_STEPS = range(6)


def global_norm(gradients) -> tf.Tensor:
    """The L2 norm of all gradients together, accumulated in float32 (or float64).

    `None` gradients are ignored; `IndexedSlices` count as the dense gradient they sum
    to. Returns 0.0 when there is no gradient.
    """
    gradients = [g for g in gradients if g is not None]
    dtype = accumulation_dtype(gradients)
    # `l2_loss` (sum(x**2) / 2) is one fused kernel per tensor, where square + sum is two
    # ops and a temporary the size of the gradient; doubling is exact.
    halves = [tf.nn.l2_loss(tf.cast(dense_values(g), dtype)) for g in gradients]
    if not halves:
        return tf.constant(0.0, dtype)
    return tf.sqrt(2.0 * tf.add_n(halves))


@keras.saving.register_keras_serializable(package="dist_minimize")
class ClipByGlobalNorm(GradientTransform):
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

    Args:
      clip_norm: the maximum global norm, a positive finite number.

    Raises:
      ValueError: `clip_norm` is not positive and finite.

    Example:
      >>> opt = dist_minimize.Optimizer(
      ...     keras.optimizers.SGD(0.1),
      ...     transform_gradients=dist_minimize.clip_by_global_norm(1.0))
    """

    def __init__(self, clip_norm: float):
        self.clip_norm = check_positive_finite("clip_norm", clip_norm)
        self._state = None

    def statistics_variables(self):
        """The statistics vector (once built)."""
        return [self._state] if self._state is not None else []

    def build(self, optimizer, variables):
        """Creates the statistics vector (mirrored, checkpointed with the optimizer)."""
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
        clip = tf.constant(self.clip_norm, norm.dtype)
        # A norm that is not finite (an inf/NaN gradient, or finite gradients whose norm
        # overflows) gives a NaN factor, so the scaled gradients are not finite and the
        # non-finite guard skips the step everywhere; clip / inf = 0 would instead apply
        # an all-zero step (advancing `iterations` and decaying Adam's moments).
        finite = tf.math.is_finite(norm)
        factor = tf.where(finite, clip / tf.maximum(norm, clip), tf.constant(float("nan"), norm.dtype))
        if self._state is not None:
            self._record(norm, clip, finite)

        def scale(g):
            return g * tf.cast(factor, g.dtype)

        out = [(map_gradient(g, scale), v) for g, v in grads_and_vars]
        # Finite norm <=> every scaled element finite (a non-finite norm gives a NaN
        # factor): the guard need not scan the gradients again.
        distribute.note_all_finite([g for g, _ in out], finite)
        return out

    def _record(self, norm, clip, finite):
        norm64 = tf.cast(norm, tf.float64)
        clipped = tf.cast(tf.logical_and(finite, norm > clip), tf.float64)
        finite_f = tf.cast(finite, tf.float64)
        old = tf.convert_to_tensor(self._state)
        new = tf.stack([
            norm64,
            clipped,
            old[_NORM_SUM] + tf.where(finite, norm64, tf.zeros_like(norm64)),
            old[_STEPS] + finite_f,
            old[_CLIPPED_STEPS] + clipped,
            old[_NONFINITE_STEPS] + (1.0 - finite_f),
        ])
        distribute.assign_replicated(self._state, new)

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
class ClipByNorm(GradientTransform):
    """Clips each gradient tensor to an L2 norm of at most `clip_norm`, independently.

    `IndexedSlices` are clipped as the dense gradient they sum to.

    Args:
      clip_norm: the maximum norm of each tensor, a positive finite number.
    """

    def __init__(self, clip_norm: float):
        self.clip_norm = check_positive_finite("clip_norm", clip_norm)

    def __call__(self, grads_and_vars):
        def clip(values):
            norm = global_norm([values])
            c = tf.constant(self.clip_norm, norm.dtype)
            # As in ClipByGlobalNorm: a norm that is not finite gives NaN, so the guard
            # skips the step instead of applying a zero step.
            factor = tf.where(tf.math.is_finite(norm), c / tf.maximum(norm, c), tf.constant(float("nan"), norm.dtype))
            return values * tf.cast(factor, values.dtype)

        return [(map_gradient(g, clip), v) for g, v in grads_and_vars]

    def get_config(self) -> dict:
        """The transform's configuration."""
        return {"clip_norm": self.clip_norm}


@keras.saving.register_keras_serializable(package="dist_minimize")
class ClipByValue(GradientTransform):
    """Clips every gradient element to `[-clip_value, clip_value]`.

    `IndexedSlices` are clipped as the dense gradient they sum to (rows of repeated
    indices are summed first).

    Args:
      clip_value: a positive finite number.
    """

    def __init__(self, clip_value: float):
        self.clip_value = check_positive_finite("clip_value", clip_value)

    def __call__(self, grads_and_vars):
        def clip(values):
            c = tf.cast(self.clip_value, values.dtype)
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
