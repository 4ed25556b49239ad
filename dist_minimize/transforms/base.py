"""The gradient-transform protocol and helpers shared by the transforms."""

from __future__ import annotations

import abc
from typing import Sequence

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="dist_minimize")
class GradientTransform(abc.ABC):
    """A step of the pipeline: grads_and_vars in, grads_and_vars out.

    Any callable `grads_and_vars -> grads_and_vars` can be given to a stage; subclass
    this when the transform has configuration to serialise or state to keep.

    Contract:
      * returns one `(gradient, variable)` pair per pair received, same variables in the
        same order, each gradient `None` or shaped like its variable;
      * runs inside the training step (eagerly or traced by `tf.function`, in the
        replica context under tf.distribute): decisions are tensors, not Python
        branches on tensor values.

    Sharded state (`Optimizer(shard_optimizer_state=True)`): each process's transform then
    receives the pairs of its own share only. A transform that works on each pair alone
    declares `shards_state = True`; one that combines the pairs (a global norm) must
    combine every process's share, as `ClipByGlobalNorm` does, before declaring it. An
    undeclared transform is refused there, naming it.

    State: `build(optimizer, variables)` is called once, from the optimizer's `build`,
    under the strategy scope; create variables there with `optimizer.add_variable` so
    that they are mirrored, checkpointed and saved with the optimizer. `stats()`
    returns the values worth logging.
    """

    #: Whether the transform is correct on a process's share of the pairs (see above).
    shards_state: bool = False

    def build(self, optimizer: keras.optimizers.Optimizer, variables: Sequence[tf.Variable]) -> None:
        """Creates the transform's state, if any. Default: stateless."""

    @abc.abstractmethod
    def __call__(self, grads_and_vars):
        """Returns the transformed (gradient, variable) pairs (see the class contract)."""

    def stats(self) -> dict:
        """Values for logging (tensors or variables). Default: none."""
        return {}

    def statistics_variables(self) -> list:
        """The variables of this transform that only measure (kept out of the optimizer's
        `variables`, still saved and checkpointed). Default: none."""
        return []

    def get_config(self) -> dict:
        """The configuration `from_config` rebuilds the transform from. Default: none."""
        return {}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


def dense_values(g: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """The tensor whose elements are the gradient's nonzero contributions.

    For `IndexedSlices` with repeated indices (an all-gathered sparse gradient), rows of
    the same index are summed first, so that norms and clipping see the dense
    gradient's rows, not the pieces it was gathered from.
    """
    if isinstance(g, tf.IndexedSlices):
        return dedupe(g).values
    return g


def dedupe(g: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sums the rows of repeated indices, so that each index appears once."""
    unique, pos = tf.unique(g.indices)
    values = tf.math.unsorted_segment_sum(g.values, pos, tf.shape(unique)[0])
    return tf.IndexedSlices(values, unique, g.dense_shape)


def map_gradient(g, fn):
    """Applies `fn` to a dense gradient or to a (deduplicated) sparse one's values."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        d = dedupe(g)
        return tf.IndexedSlices(fn(d.values), d.indices, d.dense_shape)
    return fn(g)


def accumulation_dtype(grads) -> tf.DType:
    """float64 if any gradient is float64, else float32 (also for float16/bfloat16)."""
    if any(g is not None and g.dtype == tf.float64 for g in grads):
        return tf.float64
    return tf.float32


def check_positive_finite(name: str, value) -> float:
    """Validates a positive finite number, naming the argument on failure.

    Strings and bools are refused (`float("1.0")` would accept a string); Python and
    NumPy numbers and scalar tensors are accepted.
    """
    number = _check_number(name, value, "a positive finite number")
    if not number > 0 or number == float("inf"):
        raise ValueError(f"`{name}` must be a positive finite number. Received: {name}={value!r}")
    return number


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """Validates an integer >= `minimum` (bools refused), naming the argument on failure."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}")
    return value


def _check_number(name: str, value, what: str) -> float:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"`{name}` must be {what}. Received: {name}={value!r}")
    if isinstance(value, bool) or getattr(value, "dtype", None) == bool:
        raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` must be {what}. Received: {name}={value!r}") from None


def check_unit_interval(name: str, value, open_low: bool = False) -> float:
    """Validates a number in [0, 1] (or (0, 1] with `open_low`), naming the argument."""
    what = "a number in (0, 1]" if open_low else "a number in [0, 1]"
    number = _check_number(name, value, what)
    if not ((0.0 < number) if open_low else (0.0 <= number)) or not number <= 1.0:
        raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")
    return number


def check_nonnegative(name: str, value) -> float:
    """Validates a finite number >= 0, naming the argument."""
    number = _check_number(name, value, "a finite number >= 0")
    if not 0.0 <= number < float("inf"):
        raise ValueError(f"`{name}` must be a finite number >= 0. Received: {name}={value!r}")
    return number


def check_nonnegative_int(name: str, value) -> int:
    """Validates an integer >= 0 (bools refused), naming the argument."""
    return check_positive_int(name, value, minimum=0)
