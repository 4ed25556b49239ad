"""The guarded update under MirroredStrategy (2 of the 4 logical CPUs, in the test
process): made device by device, one unlowered `If` per device where it can be (the one
lowered cond of `run_if` where it cannot), a non-finite step skipped on every device
either way, whoever wrote the wrapper; and one synchronisation per step for the guard,
the counters and the statistics."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy
from inprocess import good_then_poisoned_step, local_values

pytestmark = pytest.mark.distributed


def strategy():
    return mirrored_strategy()


def guarded_step_conds(opt, v):
    """(lowered?, device) of each `If` in one traced guarded step of `opt` on `v`."""
    s = strategy()

    @tf.function
    def step():
        s.run(lambda: opt.apply_gradients([(tf.constant([0.5, -0.5]), v)]))

    graph = step.get_concrete_function().graph
    return [(op.get_attr("_lower_using_switch_merge"), op.device.upper())
            for op in graph.get_operations() if op.type in ("If", "StatelessIf")]


class CountingWrapper(dm.OptimizerWrapper):
    """A user's wrapper with its own step hook (reading and writing variables, as the
    update contract allows)."""

    def build_state(self, var_list):
        self.count = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                       aggregation="only_first_replica", name="count")

    def on_applied(self, grads_and_vars):
        dm.distribute.assign_replicated(self.count, tf.convert_to_tensor(self.count) + 1)


class OutsideReader(dm.OptimizerWrapper):
    """A user's wrapper whose step hook reads a variable made outside the strategy's
    scope (one copy, on CPU:0)."""

    def __init__(self, optimizer, outside):
        super().__init__(optimizer)
        self._outside = outside

    def build_state(self, var_list):
        self.total = self.add_slot(var_list[0], "total")

    def on_applied(self, grads_and_vars):
        self.total.assign_add(tf.fill(tf.shape(self.total), self._outside))


class SlowerAverage(dm.MovingAverage):
    """A user's MovingAverage whose helper (called by the package's own hook) changes the
    decay."""

    def decay_at(self, t):
        return tf.constant(0.75)


class ClippingOptimizer(dm.Optimizer):
    """A user's optimizer that overrides a stage before the update only."""

    def transform_gradients(self, grads_and_vars):
        return super().transform_gradients([(tf.clip_by_value(g, -1.0, 1.0), v) for g, v in grads_and_vars])


PER_DEVICE = [(False, "/JOB:LOCALHOST/REPLICA:0/TASK:0/DEVICE:CPU:0"),
              (False, "/JOB:LOCALHOST/REPLICA:0/TASK:0/DEVICE:CPU:1")]


@pytest.mark.parametrize("case", ["plain", "adam", "moving_average", "swa+decay", "stage_override", "lr_outside_scope",
                                  "hook_reads_outside", "user_hook", "helper_override", "constraint", "nadam"])
def test_guarded_update_is_one_unlowered_cond_per_device_where_it_can_be(case):
    """The guarded update is one `If` per device, on that device, which TensorFlow keeps
    whole (one kernel, not a Switch and an Identity per input), for the
    package's wrappers and a user's alike (a user's step hook, or a user's
    override of what the package's hooks call, takes the same path). Where the Keras
    rule cannot be applied device by device (a constraint, a Keras optimizer that
    changes `apply`), it is the one lowered cond of `run_if`. A device whose update reads
    a variable of another device (made outside the scope) keeps its cond lowered, which
    TensorFlow can place; a learning rate read from such a variable is not that case,
    as the rule's learning rate is read before the branch. Either way the update is
    right and a non-finite step is skipped on every device."""
    lr_var = tf.Variable(0.1, trainable=False)  # outside the scope: one copy, on CPU:0
    s = strategy()
    with s.scope():
        v = keras.Variable([1.0, 2.0], name="w")
        if case == "constraint":
            v.constraint = keras.constraints.NonNeg()
        inner = {"nadam": lambda: keras.optimizers.Nadam(0.1), "adam": lambda: keras.optimizers.Adam(0.1),
                 "lr_outside_scope": lambda: keras.optimizers.SGD(lambda: lr_var)}.get(
                     case, lambda: keras.optimizers.SGD(0.1))()
        kind = ClippingOptimizer if case == "stage_override" else dm.Optimizer
        opt = kind(inner, transform_gradients=dm.clip_by_global_norm(1.0))
        if case == "moving_average":
            opt = dm.MovingAverage(opt, average_decay=0.5)
        if case == "helper_override":
            opt = SlowerAverage(opt)
        if case == "swa+decay":
            opt = dm.SWA(dm.DecoupledWeightDecay(opt, 0.1), start_averaging=0, average_period=1)
        if case == "user_hook":
            opt = CountingWrapper(opt)
        if case == "hook_reads_outside":
            opt = OutsideReader(opt, lr_var)
        opt.build([v])
    conds = guarded_step_conds(opt, v)
    if case in ("plain", "adam", "moving_average", "swa+decay", "stage_override", "user_hook", "helper_override",
                "lr_outside_scope"):
        assert sorted(conds) == PER_DEVICE, conds
    elif case == "hook_reads_outside":
        assert sorted(conds) == [PER_DEVICE[0], (True, PER_DEVICE[1][1])], conds
    else:
        assert [lowered for lowered, _ in conds] == [True], conds

    def replica_fn(poison):
        g = tf.where(poison, tf.constant([np.nan, 1.0]), tf.constant([0.5, -0.5]))
        opt.apply_gradients([(g, v)])

    good_then_poisoned_step(replica_fn, v, use_function=True)
    assert [int(c) for c in local_values(opt.iterations.value)] == [1, 1]
    if case not in ("adam", "nadam", "swa+decay"):
        # SGD 0.1 on the summed gradient [1, -1], clipped to norm 1
        want = np.array([1.0, 2.0]) - 0.1 * np.array([1.0, -1.0]) / np.sqrt(2.0)
        for copy in local_values(v):
            np.testing.assert_allclose(copy, want, rtol=1e-6)
        if case == "helper_override":
            for average in local_values(opt.average_of(v).value):
                np.testing.assert_allclose(average, 0.75 * np.array([1.0, 2.0]) + 0.25 * want, rtol=1e-6)


def test_devices_without_a_kernel_for_an_update_op_keep_their_cond_lowered(monkeypatch):
    """A device's update is kept in one unlowered If only where every op of it has a
    kernel for that device (`_compat.ops_without_kernel`; an unlowered If cannot fall
    back to the host, as a lowered cond does on a GPU for an int64 FloorMod). Checked here
    by making the registry answer that one op has none: each device's cond is lowered,
    and the update is still right."""
    from dist_minimize._compat import per_device

    monkeypatch.setattr(per_device, "ops_without_kernel", lambda op, device_type: ["FloorMod(T=int64)"])
    s = strategy()
    with s.scope():
        v = keras.Variable([1.0, 2.0], name="w")
        opt = dm.SWA(dm.Optimizer(keras.optimizers.SGD(0.1)), average_period=2)
        opt.build([v])
    assert [lowered for lowered, _ in guarded_step_conds(opt, v)] == [True, True]

    def replica_fn(poison):
        g = tf.where(poison, tf.constant([np.nan, 1.0]), tf.constant([0.5, -0.5]))
        opt.apply_gradients([(g, v)])

    good_then_poisoned_step(replica_fn, v, use_function=True)
    want = np.array([1.0, 2.0]) - 0.1 * np.array([1.0, -1.0])
    for copy in local_values(v):
        np.testing.assert_allclose(copy, want, rtol=1e-6)


def test_central_storage_strategy_keeps_one_cond():
    """CentralStorageStrategy synchronises through merge_call too, but its variables have
    one copy for all devices: no per-device update (it raised IndexError once)."""
    s = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:2")
    with s.scope():
        v = keras.Variable([1.0, 2.0], name="w")
        opt = dm.Optimizer(keras.optimizers.SGD(0.1))
        opt.build([v])

    @tf.function
    def step(g):
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * g) / s.num_replicas_in_sync
            opt.apply_gradients([(tape.gradient(loss, v), v)])

        s.run(replica)

    step(tf.constant([0.5, -0.5]))
    step(tf.constant([np.nan, 1.0]))
    np.testing.assert_allclose(v.numpy(), [0.95, 2.05], rtol=1e-6)
    assert int(opt.iterations.numpy()) == 1 and int(opt.skipped_steps.numpy()) == 1
    graph = step.get_concrete_function(tf.constant([0.5, -0.5])).graph
    ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert [op.get_attr("_lower_using_switch_merge") for op in ifs] == [True]


def test_the_per_device_choice_does_not_look_at_classes():
    """No class inspection, no private flag: a user's wrapper with its own hooks,
    in a module of its own, is updated device by device like the package's."""
    class Elsewhere(dm.OptimizerWrapper):
        def on_applied(self, grads_and_vars):
            return None

        def on_skipped(self):
            return None

    Elsewhere.__module__ = "someone_elses_package.wrappers"
    s = strategy()
    with s.scope():
        v = keras.Variable([1.0, 2.0], name="w")
        opt = Elsewhere(dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(0.1)), average_decay=0.5))
        opt.build([v])
    assert sorted(guarded_step_conds(opt, v)) == PER_DEVICE


def count_merge_calls(make_optimizer, monkeypatch):
    """merge_calls made while tracing one step of `make_optimizer()` on 2 replicas
    (aggregation done by the step itself, as in a hand-written step)."""
    from tensorflow.python.distribute import distribute_lib

    s = strategy()
    with s.scope():
        v = tf.Variable([1.0, 2.0])
        opt = make_optimizer()
        opt.build([v])
    calls = []
    original = distribute_lib.ReplicaContext.merge_call

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(distribute_lib.ReplicaContext, "merge_call", counted)

    @tf.function
    def step():
        def replica_fn():
            g = tf.distribute.get_replica_context().all_reduce("sum", [tf.constant([1.0, 1.0])])
            if isinstance(opt, dm.StagedOptimizer):
                opt.apply_gradients([(g[0], v)], aggregate=False)
            else:
                opt.apply_gradients([(g[0], v)])
        s.run(replica_fn)

    step.get_concrete_function()
    monkeypatch.setattr(distribute_lib.ReplicaContext, "merge_call", original)
    return len(calls)


@pytest.mark.parametrize("stack", ["clip", "clip+limit", "lso(clip)"])
def test_one_synchronisation_per_step_for_guard_counters_and_statistics(stack, monkeypatch):
    """Item 7: the guard, the clipper's statistics, the non-finite counter and the loss
    scale's bookkeeping share ONE merge_call per step and replica beyond a hand-written
    step's (before, each had its own: 2, 3 and 4 more per replica). Since the update is
    made device by device inside that one merge_call, where Keras's `apply` makes two
    (update, iterations), it is one per replica FEWER than the hand-written step's."""
    from dist_minimize import _compat

    def hand():
        opt = keras.optimizers.Adam(0.1)
        _compat.disable_keras_all_reduce(opt)
        return opt

    def dm_stack():
        transforms = [dm.clip_by_global_norm(1.0)] + ([dm.limit_nonfinite_steps(3)] if "limit" in stack else [])
        opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=transforms)
        return dm.LossScaleOptimizer(opt) if stack.startswith("lso") else opt

    assert count_merge_calls(dm_stack, monkeypatch) - count_merge_calls(hand, monkeypatch) == -2  # 2 replicas


def branch_consumers(step_fn, handle) -> list:
    """Op types, in the true branch of each guard `If` of the traced `step_fn`, that use
    the resource `handle` (a variable's, captured by the step), one list per `If`."""
    concrete = step_fn.get_concrete_function()
    graph = concrete.graph
    inner = [internal for external, internal in graph.captures if external is handle]
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    out = []
    for op in graph.get_operations():
        if op.type not in ("If", "StatelessIf"):
            continue
        branch = library[op.get_attr("then_branch").name]
        args = {branch.signature.input_arg[k - 1].name for k, t in enumerate(op.inputs)
                if k > 0 and any(t is i for i in inner)}
        out.append(sorted(n.op for n in branch.node_def if any(i.split(":")[0] in args for i in n.input)))
    return out


@pytest.mark.parametrize("where", ["mirrored", "one_device"])
def test_the_rule_reads_its_step_counter_before_the_branch(where):
    """Keras's rules read their step counter once per variable and build their powers
    from it; the guard's branch holds only the counter's increment, the reads made
    before it (`_compat.keras_update_inputs`), so that this scalar work does not wait
    for the condition. Under MirroredStrategy (each device's If) and on one device
    (also each Horovod process's path); the update stays exact."""
    s = strategy() if where == "mirrored" else tf.distribute.get_strategy()
    with s.scope():
        vs = [tf.Variable([1.0, 2.0]), tf.Variable([3.0])]
        opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=dm.clip_by_global_norm(1.0))
        opt.build(vs)
    rule = opt.inner_optimizer
    grads = [tf.constant([0.5, -0.5]), tf.constant([0.25])]

    @tf.function
    def step():
        s.run(lambda: opt.apply_gradients(zip(grads, vs)))

    counters = [c.handle for c in s.experimental_local_results(rule.iterations.value)]
    uses = [u for c in counters for u in branch_consumers(step, c) if u]
    assert uses and all(u == ["AssignAddVariableOp"] for u in uses), uses
    for _ in range(3):
        step()
    for v, r in zip(vs, keras_adam_reference(s, grads)):
        for copy in s.experimental_local_results(v):
            np.testing.assert_allclose(copy.numpy(), r, rtol=1e-6)


def keras_adam_reference(s, grads, steps: int = 3) -> list:
    """Keras's Adam(0.1) on one device from [1, 2], [3], `steps` times on the gradient summed
    over `s`'s replicas and clipped to global norm 1: the weights, as arrays."""
    ref_vars = [tf.Variable([1.0, 2.0]), tf.Variable([3.0])]
    ref = keras.optimizers.Adam(0.1)
    clipped, _ = tf.clip_by_global_norm([g * s.num_replicas_in_sync for g in grads], 1.0)
    for _ in range(steps):
        ref.apply_gradients(zip(clipped, ref_vars))
    return [v.numpy() for v in ref_vars]


@pytest.mark.parametrize("where", ["mirrored", "one_device"])
def test_the_clippers_products_are_made_in_the_branch(where, monkeypatch):
    """The global-norm clipper scales every gradient by one factor; the guard's `If`
    takes the unscaled gradients and that factor, and makes the products in its branch
    (`distribute.note_scaled`), where they interleave with the variables' updates instead
    of all finishing before the first starts. The same ops: weights bit for bit those of
    the products made before the branch, and Keras's Adam on the summed, clipped gradient."""
    s = strategy() if where == "mirrored" else tf.distribute.get_strategy()
    grads = [tf.constant([3.0, -4.0]), tf.constant([12.0])]  # norm 13 (x replicas): clipped

    def train(products_before: bool):
        with s.scope():
            vs = [tf.Variable([1.0, 2.0]), tf.Variable([3.0])]
            opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=dm.clip_by_global_norm(1.0))
            opt.build(vs)

        @tf.function
        def step():
            s.run(lambda: opt.apply_gradients(zip(grads, vs)))

        with monkeypatch.context() as m:
            if products_before:
                m.setattr(dm.distribute, "known_scaled", lambda grads: None)
            graph = step.get_concrete_function().graph
        ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        assert len(ifs) == s.num_replicas_in_sync, ifs
        # the gradient-shaped inputs of each If: the clipper's products, or what they scale
        made = [sorted(t.op.type for t in op.inputs[1:] if t.dtype == tf.float32 and t.shape.rank == 1)
                for op in ifs]
        for _ in range(3):
            step()
        return made, [[c.numpy() for c in s.experimental_local_results(v)] for v in vs]

    made_in, weights_in = train(products_before=False)
    made_before, weights_before = train(products_before=True)
    assert all(types.count("Mul") == len(grads) for types in made_before), made_before
    assert all("Mul" not in types and len(types) >= len(grads) for types in made_in), made_in
    for copies_in, copies_before in zip(weights_in, weights_before):
        for a, b in zip(copies_in, copies_before):
            assert np.array_equal(a, b), (a, b)
    for copies, r in zip(weights_in, keras_adam_reference(s, grads)):
        for copy in copies:
            np.testing.assert_allclose(copy, r, rtol=1e-6)
