"""Normalising stage arguments and checking stage contracts (RFC 234 question 3)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import tensorflow as tf


def as_callables(value: Any, argument: str) -> list[Callable]:
    """`None`, one callable, or a sequence of callables -> a list of callables."""
    if value is None:
        return []
    if callable(value):
        return [value]
    if isinstance(value, (list, tuple)):
        for i, fn in enumerate(value):
            if not callable(fn):
                raise TypeError(
                    f"`{argument}` must be a callable or a sequence of callables. "
                    f"Received: {argument}[{i}]={fn!r} of type {type(fn).__name__}"
                )
        return list(value)
    raise TypeError(
        f"`{argument}` must be a callable or a sequence of callables. "
        f"Received: {argument}={value!r} of type {type(value).__name__}"
    )


def as_grads_and_vars(grads_and_vars: Any, argument: str = "grads_and_vars", convert: bool = True) -> list:
    """Materialises `grads_and_vars` (a zip, a list of pairs) and checks its form.

    Args:
      grads_and_vars: an iterable of `(gradient, variable)` pairs.
      argument: the argument's name, for messages.
      convert: convert each gradient Keras's `apply_gradients` would accept (a Python
        list or number, a NumPy array, a variable) with
        `tf.convert_to_tensor(gradient, dtype=variable.dtype)`; `tf.Tensor`,
        `tf.IndexedSlices` and `None` are kept as they are. False (stage outputs):
        keep every gradient as it is, so that a stage's contract is checked on what
        it returned.

    Returns:
      The pairs, as a list of tuples.

    Raises:
      TypeError: `grads_and_vars` is not iterable, or a gradient cannot be converted
        to a tensor of its variable's dtype (naming the variable).
      ValueError: an item is not a pair.
    """
    try:
        pairs = list(grads_and_vars)
    except TypeError:
        raise TypeError(
            f"`{argument}` must be an iterable of (gradient, variable) pairs. "
            f"Received: {argument}={grads_and_vars!r}"
        ) from None
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise ValueError(
                f"`{argument}` must hold (gradient, variable) pairs; item {i} is "
                f"{pair!r}. Received: {argument} of length {len(pairs)}"
            )
    pairs = [tuple(p) for p in pairs]
    if convert:
        pairs = [(as_gradient(g, v), v) for g, v in pairs]
        check_variables_in_strategy([v for _, v in pairs])
    return pairs


def check_variables_in_strategy(variables: Sequence) -> None:
    """Under a tf.distribute strategy of several replicas, every variable to update must
    have been created in its scope (a single-copy variable cannot be updated by
    replicas: TensorFlow fails with a bare AssertionError or IndexError).

    Raises:
      ValueError: a variable created outside `strategy.scope()` (naming it and the fix).
    """
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync <= 1:
        return
    for v in variables:
        raw = getattr(v, "value", v) if _is_keras_variable(v) else v
        if not isinstance(raw, tf.Variable) or strategy.extended.variable_created_in_scope(raw):
            continue
        raise ValueError(
            f"Variable `{variable_name(v)}` was created outside `strategy.scope()` of the "
            f"{type(strategy).__name__} in use ({strategy.num_replicas_in_sync} replicas): it has a single copy, "
            "which the replicas cannot update. Create it (the model, and every variable trained) inside "
            "`with strategy.scope():`. Received: a variable of type "
            f"{type(raw).__name__} on {getattr(raw, 'device', '?')}")


def _is_keras_variable(v) -> bool:
    import keras

    return isinstance(v, keras.Variable)


def as_gradient(gradient: Any, variable: Any) -> Any:
    """`gradient` as a tensor of `variable`'s dtype, unless it is None, a `tf.Tensor` or a
    `tf.IndexedSlices` (kept as they are: Keras's update rules cast those themselves).

    Raises:
      TypeError: the gradient cannot be converted (naming the variable).
    """
    if gradient is None or isinstance(gradient, (tf.Tensor, tf.IndexedSlices)):
        return gradient
    dtype = getattr(variable, "dtype", None)
    try:
        return tf.convert_to_tensor(gradient, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"The gradient of variable `{variable_name(variable)}` must be a tensor, a tf.IndexedSlices, "
            f"None, or what converts to a tensor of the variable's dtype ({dtype}): {e} "
            f"Received: a {type(gradient).__name__}") from None


def check_lengths(grads: Sequence, variables: Sequence) -> None:
    """Gradients and variables must pair one to one."""
    if len(grads) != len(variables):
        raise ValueError(
            "`grads` and `variables` must have the same length. Received: "
            f"{len(grads)} gradients and {len(variables)} variables"
        )


def variable_name(v) -> str:
    """A variable's path (Keras) or name, for messages."""
    return getattr(v, "path", None) or getattr(v, "name", repr(v))


def slot_prefix(variable) -> str:
    """How Keras and dist_minimize begin the names of a variable's slots."""
    return variable_name(variable).replace("/", "_").replace(":", "_")


def elements_of(variable) -> int:
    """A variable's (or tensor's) number of elements."""
    shape = variable.shape
    count = 1
    for n in shape:
        count *= int(n)
    return count


def check_stage_output(stage: str, before: list, after: Any) -> list:
    """Raises if a stage broke its contract; returns its output as a list of pairs.

    The contract: one pair per input pair, the same variables in the same order, each
    gradient `None` or shaped like its variable. Only static shapes are compared, so the
    check costs nothing at run time.
    """
    if after is None:
        raise ValueError(f"Stage `{stage}` returned None; it must return the (gradient, variable) pairs.")
    try:
        after = as_grads_and_vars(after, argument=f"the output of `{stage}`", convert=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Stage `{stage}` broke its contract: {e}") from None
    if len(after) != len(before):
        raise ValueError(
            f"Stage `{stage}` returned {len(after)} (gradient, variable) pairs for "
            f"{len(before)} received; it must return one pair per variable."
        )
    for i, ((_, v0), (g, v)) in enumerate(zip(before, after)):
        if v is not v0:
            raise ValueError(
                f"Stage `{stage}` returned other variables: position {i} held "
                f"`{variable_name(v0)}` and came back as `{variable_name(v)}`. Stages must keep the "
                "variables and their order."
            )
        if g is None:
            continue
        shape = g.dense_shape if isinstance(g, tf.IndexedSlices) else g.shape
        if isinstance(g, tf.IndexedSlices):
            ok = g.values.shape[1:].is_compatible_with(v.shape[1:])
            shape = g.values.shape
        else:
            ok = tf.TensorShape(shape).is_compatible_with(v.shape)
        if not ok:
            raise ValueError(
                f"Stage `{stage}` returned a gradient of shape {shape} for variable "
                f"`{variable_name(v)}` of shape {tuple(v.shape)}."
            )
    return after


def takes_loss_fn(method: Callable) -> bool:
    """Whether a `get_gradients` accepts the `loss_fn` keyword (overrides written before it
    existed take three arguments, and keep working: they are called without it)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "loss_fn" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def get_gradients(optimizer, loss, variables, tape, loss_fn) -> list:
    """`optimizer.get_gradients(loss, variables, tape, loss_fn=loss_fn)`, without
    `loss_fn` for an override that does not take it."""
    if takes_loss_fn(optimizer.get_gradients):
        return optimizer.get_gradients(loss, variables, tape, loss_fn=loss_fn)
    return optimizer.get_gradients(loss, variables, tape)
