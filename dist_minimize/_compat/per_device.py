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


def keras_update_inputs(optimizer: keras.optimizers.Optimizer) -> tuple:
    """What Keras's `update_step` derives its per-variable scalars from, read now: the
    step counter's value and the learning rate, as tensors (of this replica's copies).

    Read before the guard's branch and handed to `keras_apply_on_device`, they leave
    the branch only the work that needs the gradients. Inside a branch nothing starts
    before the condition, and Keras's rules read the counter once per variable and
    build its powers from it (Adam: about ten small ops per variable), so read inside,
    that work waits for the condition (benchmarks/RESULTS.md, section 9).
    """
    return tf.identity(optimizer.iterations), tf.identity(optimizer.learning_rate)


def keras_apply_on_device(optimizer: keras.optimizers.Optimizer, strategy: tf.distribute.Strategy,
                          index: int, grads: list, variables: list, inputs: tuple) -> None:
    """What `optimizer.apply(grads, variables)` does to the copies on device `index`.

    Under a merge-call strategy, call it in the cross-replica context, under
    `update_context(index)` and that device's scope, with that device's gradients
    (elsewhere: device 0, the process's own variables). Keras's own `apply` makes the
    same writes from the cross-replica context for every device in turn
    (`strategy.extended.update`): decoupled weight decay of the variables it selects,
    `update_step` for each variable (the optimizer's update rule, its slots read and
    written on this device), then the iterations counter. Only where
    `keras_apply_on_device_blocker` returns None.

    `inputs`: `keras_update_inputs(optimizer)`, read earlier on this device; the
    update rule then reads the counter's value from it (`keras.StatelessScope`, whose
    mapping Keras consults on every read of a Keras variable) and takes the learning
    rate from it. A write of a Keras variable that the scope held back instead of
    making (a rule writing one of its own variables directly rather than through
    `self.assign`) is made after the rule, on this device; any other is refused.
    """
    local = [strategy.experimental_local_results(v.value if isinstance(v, keras.Variable) else v)[index]
             for v in variables]
    iterations, learning_rate = inputs
    with keras.StatelessScope(state_mapping=[(optimizer.iterations, iterations)]) as scope:
        counter = scope.get_current_value(optimizer.iterations)
        if optimizer.weight_decay is not None:
            for variable in local:
                if optimizer._use_weight_decay(variable):
                    lr = tf.cast(learning_rate, variable.dtype)
                    wd = tf.cast(optimizer.weight_decay, variable.dtype)
                    variable.assign_sub(variable * wd * lr)
        for grad, variable in zip(grads, local):
            optimizer.update_step(grad, variable, learning_rate)
    _make_held_back_writes(scope, optimizer, strategy, index, counter)
    strategy.experimental_local_results(optimizer.iterations.value)[index].assign_add(1)


def _make_held_back_writes(scope, optimizer, strategy, index: int, counter: tf.Tensor) -> None:
    held = dict(scope.state_mapping)  # id(Keras variable) -> its value in the scope (private layout)
    if held.pop(id(optimizer.iterations), None) is not counter:
        raise RuntimeError(f"{type(optimizer).__name__}.update_step wrote its iterations counter; dist_minimize's "
                           "update adds 1 after every variable's update_step, as Keras's apply does")
    for variable in optimizer.variables:
        value = held.pop(id(variable), None)
        if value is not None:
            strategy.experimental_local_results(variable.value)[index].assign(value)
    if held:
        raise RuntimeError(f"{type(optimizer).__name__}.update_step wrote {len(held)} Keras variable(s) that are "
                           "not the optimizer's own (by Variable.assign); write them through the optimizer's "
                           "assign/assign_add/assign_sub")


def update_context(index: int):
    """tf.distribute's `UpdateContext(index)` (`distribute_lib`, private): in the
    cross-replica context, reads and writes of a distributed variable inside it reach
    its copy on device `index` (what `strategy.extended.update` enters per device)."""
    from tensorflow.python.distribute import distribute_lib

    return distribute_lib.UpdateContext(index)


def unlowered_cond(pred: tf.Tensor, true_fn, false_fn) -> bool:
    """`tf.cond(pred, true_fn, false_fn)` kept as one `If` op where it can be.

    Inside `tf.function`, TensorFlow lowers every `If` into a Switch and an Identity
    per input and a Merge per output (`_lower_using_switch_merge`, set by cond_v2),
    so that parts of the branches can run on several devices and an op without a
    kernel on one device can fall back to another. Kept whole, an `If` costs one
    kernel launch instead of hundreds, and runs its branches as functions on its own
    device. That is safe, and done, when every resource it reads or writes lives on
    one device that the `If` may be placed on (`one_resource_device`), and every op of
    its branches, nested functions included, has a kernel for that device's type
    (`ops_without_kernel`: on a GPU, an int64 FloorMod has none). Otherwise the `If` is
    lowered as any `tf.cond`: the same result, at the usual cost. Eagerly this is a
    plain branch. (The attribute is private.)

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
    if len(made) != 1:
        raise RuntimeError(
            f"This TensorFlow ({tf.__version__}) builds tf.cond differently ({[op.type for op in made]}); "
            "dist_minimize cannot keep its update in one op. Supported: TensorFlow 2.16-2.21.")
    if "_lower_using_switch_merge" not in made[0].node_def.attr:
        return False  # a cond TensorFlow does not lower anyway (inside an XLA-compiled function)
    device = one_resource_device(made[0])
    if device is None or ops_without_kernel(made[0], device.device_type):
        return False
    made[0]._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
    return True


def one_resource_device(op: tf.Operation) -> tf.DeviceSpec | None:
    """The one device every resource input of `op` lives on, if there is one and `op`'s
    own requested device (if any) can be it; else None (no resource, resources on
    several devices, or a resource whose device cannot be told)."""
    captured: dict = {}
    devices = [resource_device(t, captured) for t in op.inputs if t.dtype == tf.resource]
    if not devices or any(d is None for d in devices):
        return None
    first = devices[0]
    if not first.device_type or any(not _same_device(d, first) for d in devices[1:]):
        return None
    if op.device and not _same_device(tf.DeviceSpec.from_string(op.device), first):
        return None
    return first


def resource_device(handle: tf.Tensor, captured: dict | None = None) -> tf.DeviceSpec | None:
    """The device of the resource behind `handle`, or None where it cannot be told.

    Inside `tf.function` a variable's handle is a placeholder standing for a handle
    captured from outside; it is followed, through every enclosing function graph
    (`FuncGraph.captures`, private), to the handle it stands for, which has the
    resource's device. `captured`: a cache of each graph's captures, for many calls.
    """
    captured = {} if captured is None else captured
    t = handle
    while tf.is_symbolic_tensor(t) and t.op.type == "Placeholder":
        if t.graph not in captured:
            captured[t.graph] = {id(inner): outer for outer, inner in getattr(t.graph, "captures", ())}
        outer = captured[t.graph].get(id(t))
        if outer is None:
            break
        t = outer
    return tf.DeviceSpec.from_string(t.device) if t.device else None


def resources_on(tensors, device: str) -> bool:
    """Whether every resource tensor among `tensors` is a handle to a resource on
    `device` (a resource whose device cannot be told counts as elsewhere)."""
    want, captured = tf.DeviceSpec.from_string(device), {}
    for t in tensors:
        if t.dtype == tf.resource:
            found = resource_device(t, captured)
            if found is None or not _same_device(found, want):
                return False
    return True


def ops_without_kernel(op: tf.Operation, device_type: str) -> list[str]:
    """The ops inside `op`'s functions (an `If`'s branches, and every function they
    call, recursively) that have no kernel registered for `device_type` with their
    types, e.g. `["FloorMod(T=int64)"]`; empty when each has one. Reads TensorFlow's
    kernel registry (`tensorflow.python.framework.kernels`) and the graph's function
    library (`Graph._get_function`, private)."""
    graph, missing, seen = op.graph, [], set()
    pending = [a.func.name for a in op.node_def.attr.values() if a.HasField("func")]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        function = graph._get_function(name)
        if function is None:
            return [f"function {name} (not found)"]
        definition = getattr(function, "definition", None) or function.cached_definition
        for node in definition.node_def:
            pending += [a.func.name for a in node.attr.values() if a.HasField("func")]
            pending += [f.name for a in node.attr.values() for f in a.list.func]
            if not _has_kernel(node, device_type.upper()):
                types = ",".join(f"{k}={tf.dtypes.as_dtype(a.type).name}" for k, a in sorted(node.attr.items())
                                 if a.type)
                missing.append(f"{node.op}({types})")
    return sorted(set(missing))


def _has_kernel(node, device_type: str) -> bool:
    """Whether a kernel for `device_type` (or every device) accepts `node`'s type attributes."""
    for kernel in _registered_kernels(node.op):
        if kernel.device_type not in (device_type, "DEFAULT"):
            continue
        if all(_allows(node.attr.get(c.name), c) for c in kernel.constraint):
            return True
    return False


def _allows(attr, constraint) -> bool:
    allowed = set(constraint.allowed_values.list.type)
    if attr is None or not allowed:  # an attribute left at its default, or a constraint on no type
        return True
    if attr.type:
        return attr.type in allowed
    return all(t in allowed for t in attr.list.type)


_KERNELS: dict = {}


def _registered_kernels(op_type: str) -> list:
    if op_type not in _KERNELS:
        from tensorflow.python.framework import kernels

        try:
            _KERNELS[op_type] = list(kernels.get_registered_kernels_for_op(op_type).kernel)
        except Exception:  # an op TensorFlow does not know (a custom op's library not loaded)
            _KERNELS[op_type] = []
    return _KERNELS[op_type]


def _same_device(a: tf.DeviceSpec, b: tf.DeviceSpec) -> bool:
    """Whether two device specs can name the same device (a field either leaves open matches)."""
    for x, y in ((a.job, b.job), (a.replica, b.replica), (a.task, b.task), (a.device_index, b.device_index)):
        if x is not None and y is not None and x != y:
            return False
    return a.device_type is None or b.device_type is None or a.device_type.upper() == b.device_type.upper()
