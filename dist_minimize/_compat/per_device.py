"""The Keras/TensorFlow internals of the per-device guarded update: Keras's apply made on
one device's copies, tf.distribute's update context, and an unlowered `If`. Part of
`dist_minimize._compat` (every internal, each with a canary test)."""

from __future__ import annotations

import keras
import tensorflow as tf


# -- the update of one device, for the non-finite guard under merge-call strategies ------

# The Keras methods between `apply` and `update_step`; `keras_apply_on_device` does
# what they do for a plain optimizer, so it serves only optimizers that keep them.
_KERAS_APPLY_PATH = ("apply", "apply_gradients", "_backend_apply_gradients", "_backend_update_step",
                     "_distributed_tf_update_step", "_apply_weight_decay", "_clip_gradients",
                     "_filter_empty_gradients", "_overwrite_variables_directly_with_gradients")


def keras_apply_on_device_blocker(optimizer: keras.optimizers.Optimizer, grads_and_vars: list) -> str | None:
    """Why `keras_apply_on_device` cannot stand for `optimizer.apply` here, or None.

    It can for a Keras TensorFlow optimizer that keeps Keras's own `apply` path (Adam,
    AdamW, SGD, RMSprop, ...; not Nadam, Muon or LossScaleOptimizer, which change it),
    without Keras-side clipping, accumulation, EMA or loss scale (dist_minimize
    translates those away), on variables without constraints or
    `overwrite_with_gradient`, with a gradient for every variable.
    """
    base = keras.optimizers.Optimizer
    for name in _KERAS_APPLY_PATH:
        if not hasattr(base, name):
            return f"Keras {keras.__version__} has no Optimizer.{name}"
        if getattr(type(optimizer), name, None) is not getattr(base, name):
            return f"{type(optimizer).__name__} overrides {name}"
    for setting in ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps",
                    "loss_scale_factor"):
        if getattr(optimizer, setting, None) is not None:
            return f"the Keras optimizer sets {setting}"
    if getattr(optimizer, "use_ema", False):
        return "the Keras optimizer sets use_ema"
    for grad, variable in grads_and_vars:
        if grad is None:
            return f"no gradient for {getattr(variable, 'path', None) or variable.name}"
        if getattr(variable, "constraint", None) is not None or getattr(variable, "overwrite_with_gradient", False):
            return f"{getattr(variable, 'path', None) or variable.name} has a constraint or overwrite_with_gradient"
    return None


def check_variables_are_known(optimizer: keras.optimizers.Optimizer, variables: list) -> None:
    """Keras's own check that `optimizer` was built for `variables` (its error)."""
    optimizer._check_variables_are_known(variables)


def keras_apply_on_device(optimizer: keras.optimizers.Optimizer, strategy: tf.distribute.Strategy,
                          index: int, grads: list, variables: list) -> None:
    """What `optimizer.apply(grads, variables)` does to the copies on device `index`.

    Call it in the cross-replica context, under `update_context(index)` and that
    device's scope, with that device's gradients. Keras's own `apply` makes the same
    writes from the cross-replica context for every device in turn
    (`strategy.extended.update`): decoupled weight decay of the variables it selects,
    `update_step` for each variable (the optimizer's update rule, its slots read and
    written on this device), then the iterations counter. Only where
    `keras_apply_on_device_blocker` returns None.
    """
    local = [strategy.experimental_local_results(v.value if isinstance(v, keras.Variable) else v)[index]
             for v in variables]
    if optimizer.weight_decay is not None:
        for variable in local:
            if optimizer._use_weight_decay(variable):
                lr = tf.cast(optimizer.learning_rate, variable.dtype)
                wd = tf.cast(optimizer.weight_decay, variable.dtype)
                variable.assign_sub(variable * wd * lr)
    learning_rate = optimizer.learning_rate
    for grad, variable in zip(grads, local):
        optimizer.update_step(grad, variable, learning_rate)
    strategy.experimental_local_results(optimizer.iterations.value)[index].assign_add(1)


def update_context(index: int):
    """tf.distribute's `UpdateContext(index)` (`distribute_lib`, private): in the
    cross-replica context, reads and writes of a distributed variable inside it reach
    its copy on device `index` (what `strategy.extended.update` enters per device)."""
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib.UpdateContext(index)


def unlowered_cond(pred: tf.Tensor, true_fn, false_fn, device: str | None = None) -> bool:
    """`tf.cond(pred, true_fn, false_fn)` kept as one `If` op when executed.

    Inside `tf.function`, TensorFlow lowers every `If` into a Switch and an Identity
    per input and a Merge per output (`_lower_using_switch_merge`, set by cond_v2),
    so that parts of the branches can run on several devices. An `If` whose inputs
    all live on one device does not need it; kept whole it costs one kernel launch
    instead of hundreds. The attribute is private; eagerly this is a plain branch.

    With `device`, the `If` is kept whole only when every resource it reads or writes
    lives on `device`: TensorFlow cannot place one op on resources of two devices
    (e.g. a learning-rate callable reading a variable made outside `strategy.scope()`,
    on another device than this branch's copies). Otherwise it is lowered as any
    `tf.cond`: the same result, at the usual cost.

    Returns:
      Whether the cond is kept whole (True eagerly).
    """
    if tf.executing_eagerly():
        (true_fn if bool(pred) else false_fn)()
        return True
    from tensorflow.core.framework import attr_value_pb2

    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    tf.cond(pred, true_fn, false_fn)
    made = [op for op in graph.get_operations()[first:] if op.type in ("If", "StatelessIf")]
    if len(made) != 1 or "_lower_using_switch_merge" not in made[0].node_def.attr:
        raise RuntimeError(
            f"This TensorFlow ({tf.__version__}) builds tf.cond differently ({[op.type for op in made]}); "
            "dist_minimize cannot keep its per-device update in one op. Supported: TensorFlow 2.16-2.21.")
    if device is not None and not resources_on(made[0].inputs, device):
        return False
    made[0]._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    return True


def resources_on(tensors, device: str) -> bool:
    """Whether every resource tensor among `tensors` is a handle to a resource on
    `device` (a resource whose device cannot be told counts as elsewhere).

    Inside `tf.function` a variable's handle is a placeholder standing for a handle
    captured from outside; it is followed, through every enclosing function graph
    (`FuncGraph.captures`, private), to the handle it stands for, which has the
    resource's device.
    """
    want = tf.DeviceSpec.from_string(device)
    captured: dict = {}  # graph -> {id(placeholder): captured tensor}
    for t in tensors:
        if t.dtype != tf.resource:
            continue
        while tf.is_symbolic_tensor(t) and t.op.type == "Placeholder":
            graph = t.graph
            if graph not in captured:
                captured[graph] = {id(inner): outer for outer, inner in getattr(graph, "captures", ())}
            outer = captured[graph].get(id(t))
            if outer is None:
                break
            t = outer
        if not t.device or not _same_device(tf.DeviceSpec.from_string(t.device), want):
            return False
    return True


def _same_device(a: tf.DeviceSpec, b: tf.DeviceSpec) -> bool:
    """Whether two device specs can name the same device (a field either leaves open matches)."""
    for x, y in ((a.job, b.job), (a.replica, b.replica), (a.task, b.task), (a.device_index, b.device_index)):
        if x is not None and y is not None and x != y:
            return False
    return a.device_type is None or b.device_type is None or a.device_type.upper() == b.device_type.upper()
