"""Canaries: one test per private Keras/TensorFlow/Horovod internal that
dist_minimize/_compat/ (and horovod_runner.py, the launcher's horovodrun) uses. Each
fails, naming the internal, when a Keras or TensorFlow release moves it."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import mirrored_strategy, requires_horovod
from dist_minimize import _compat


def test_no_automatic_dependency_tracking_is_keras_decorator():
    from keras.src.utils import tracking

    assert _compat.no_automatic_dependency_tracking is tracking.no_automatic_dependency_tracking


def test_keras_tf_optimizer_all_reduces_through_all_reduce_sum_gradients():
    """Keras's TensorFlow optimizer must still reduce in `_all_reduce_sum_gradients`,
    and disabling it must make that the identity on one instance only."""
    opt, other = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)
    assert callable(getattr(opt, "_all_reduce_sum_gradients", None))
    import inspect

    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    assert "_all_reduce_sum_gradients" in inspect.getsource(tf_optimizer.TFOptimizer)
    _compat.disable_keras_all_reduce(opt)
    g = [(tf.constant([1.0]), tf.Variable([0.0]))]
    assert opt._all_reduce_sum_gradients(g) == g
    assert other._all_reduce_sum_gradients is not opt._all_reduce_sum_gradients


def test_every_replica_context_all_reduce_is_heard_inside_and_tensorflow_is_unchanged_outside():
    """`hearing_all_reduce` wraps TensorFlow's `ReplicaContextBase.all_reduce` while some
    thread is inside: every strategy's replica context must inherit it (MirroredStrategy's,
    in a traced step and eagerly), the call must still reduce, and once the last thread
    is out the class holds what it held before."""
    from tensorflow.python.distribute import distribute_lib

    from conftest import mirrored_strategy

    heard = []

    def listener(ctx, value):
        heard.append(ctx.num_replicas_in_sync)

    before = distribute_lib.ReplicaContextBase.__dict__["all_reduce"]
    s = mirrored_strategy()

    def step():
        return s.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0)))

    _compat.listen_to_all_reduce(listener)
    try:
        for fn in (step, tf.function(step)):
            heard.clear()
            with _compat.hearing_all_reduce(), _compat.hearing_all_reduce():  # (nested: one wrapper)
                assert distribute_lib.ReplicaContextBase.all_reduce.__wrapped__ is before
                for context_class in (tf.distribute.ReplicaContext, type(tf.distribute.get_replica_context())):
                    assert context_class.all_reduce is distribute_lib.ReplicaContextBase.all_reduce
                out = s.experimental_local_results(fn())
            assert [float(o) for o in out] == [2.0, 2.0]
            assert heard == [2, 2]
            assert distribute_lib.ReplicaContextBase.__dict__["all_reduce"] is before
        heard.clear()
        s.experimental_local_results(tf.function(step)())
        assert heard == []
    finally:
        _compat._ALL_REDUCE_LISTENERS.remove(listener)


def test_a_variable_made_by_the_traced_function_is_not_initialized_outside_it():
    """`initialized_outside_functions` reads `is_initialized()` of the resource variable
    (its value lifted out of a function only once the function runs)."""
    made = []

    @tf.function
    def step():
        if not made:
            made.append(tf.Variable(1.0))
            made.append(keras.Variable([1.0, 2.0]))
        outside = _compat.initialized_outside_functions(made)
        made_before.append(outside)
        return made[0] + 1.0

    made_before = []
    step()
    assert made_before[0] is False
    assert _compat.initialized_outside_functions(made)
    assert _compat.initialized_outside_functions([tf.Variable(2.0), keras.Variable(3.0)])


def test_keras_optimizer_captures_its_distribution_strategy():
    opt = keras.optimizers.SGD(0.1)
    assert _compat.inner_strategy(opt) is tf.distribute.get_strategy()


def test_strategy_supports_no_merge_call_is_reachable():
    assert _compat.strategy_uses_merge_call() in (True, False)
    assert callable(tf.__internal__.distribute.strategy_supports_no_merge_call)


def test_replica_local_variable_is_tracked_sync_on_read():
    opt = keras.optimizers.SGD(0.1)
    ref = keras.Variable([1.0, 2.0])
    v = _compat.add_replica_local_variable(opt, ref, "acc")
    assert tuple(v.shape) == (2,)
    assert v.value.synchronization == tf.VariableSynchronization.ON_READ
    assert v.value.aggregation == tf.VariableAggregation.SUM
    assert any(x is v for x in opt.variables)


def test_strategy_cross_device_ops_attribute():
    s = tf.distribute.get_strategy()
    assert _compat.cross_device_ops_name(s) == "none"
    from tensorflow.python.distribute import mirrored_strategy

    assert "_cross_device_ops" in open(mirrored_strategy.__file__).read()


def test_coordination_client_has_barrier_and_key_value_store():
    client = _compat.coordination_client()
    for name in ("wait_at_barrier", "set_config_key_value", "get_config_key_value"):
        assert callable(getattr(client, name))


def test_keras_base_constructor_state_is_what_untracked_base_state_drops():
    """Keras's base constructor creates exactly one variable, `iteration`, held in
    `_iterations` and registered through `_track_variable` (the learning rate is a
    callable here, so it makes none); UntrackedBaseState keeps it out of the optimizer."""
    plain = keras.optimizers.SGD(learning_rate=lambda: 0.1)
    assert [v.name for v in plain.variables] == ["iteration"]
    assert plain._iterations is plain.variables[0]

    class Probe(_compat.UntrackedBaseState, keras.optimizers.SGD):
        pass

    probe = Probe(learning_rate=lambda: 0.1)
    assert probe.variables == [] and probe._iterations is None
    assert "_iterations" not in {name for name, _ in probe._trackable_children().items()}
    probe.build([keras.Variable([1.0])])
    assert probe.variables == []  # SGD without momentum: no slots
    extra = probe.add_variable(shape=(), name="extra")
    assert probe.variables == [extra]


@pytest.mark.parametrize("rule", ["SGD", "RMSprop"])
def test_momentum_slots_are_the_slots_keras_multiplies_by_momentum(rule):
    v = keras.Variable([1.0, -2.0], name="w")
    opt = getattr(keras.optimizers, rule)(0.1, momentum=0.5)
    opt.apply([tf.constant([1.0, 1.0])], [v])
    slots = _compat.momentum_slots(opt)
    assert len(slots) == 1 and "momentum" in slots[0].path
    before = v.numpy().copy()
    slots[0].assign(tf.zeros([2]))  # no momentum carried: the next step is the momentum-free one
    opt.apply([tf.constant([1.0, 1.0])], [v])
    step = v.numpy() - before  # the slot is what the step adds (SGD) or subtracts (RMSprop)
    np.testing.assert_allclose(step, slots[0].numpy() if rule == "SGD" else -slots[0].numpy(), rtol=1e-6)
    assert np.all(step != 0)


def test_own_variables_is_keras_variables_list():
    opt = keras.optimizers.Adam(0.1)
    opt.build([keras.Variable([1.0])])
    assert _compat.own_variables(opt) == opt.variables
    assert _compat.own_variables(opt) is not opt._variables  # a copy


def test_variable_key_identifies_a_variable_in_and_out_of_replica_context():
    opt = keras.optimizers.SGD(0.1)
    a, b = keras.Variable([1.0]), keras.Variable([2.0])
    assert _compat.variable_key(opt, a) == _compat.variable_key(opt, a.value)
    assert _compat.variable_key(opt, a) != _compat.variable_key(opt, b)


def test_replicated_variable_starts_from_value_and_is_tracked():
    opt = keras.optimizers.SGD(0.1)
    ref = keras.Variable([1.0, 2.0])
    v = _compat.add_replicated_variable(opt, ref, "copy", initializer="value")
    assert v.numpy().tolist() == [1.0, 2.0]
    assert any(x is v for x in opt.variables)


def test_in_xla_context_sees_jit_compile():
    seen = {}

    def probe(key):
        seen[key] = _compat.in_xla_context()
        return tf.constant(0)

    tf.function(lambda: probe("xla"), jit_compile=True)()
    tf.function(lambda: probe("graph"))()
    assert seen == {"xla": True, "graph": False} and _compat.in_xla_context() is False


def _compiled_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    return model


def test_keras_train_step_internals_used_by_integrate():
    """Keras's TensorFlow train step uses `_call_has_training_arg`, `_compute_loss`,
    `_loss_tracker` and `unscale_loss_for_distribution`; the integrated step does too."""
    import inspect

    from keras.src.backend.tensorflow import trainer

    source = inspect.getsource(trainer.TensorFlowTrainer.train_step)
    for name in ("_call_has_training_arg", "_compute_loss", "_loss_tracker", "unscale_loss_for_distribution"):
        assert name in source, name
    model = _compiled_model()
    x, y = tf.ones((4, 2)), tf.zeros((4, 1))
    y_pred = _compat.call_training(model, x)
    loss = _compat.compute_loss(model, x, y, y_pred, None)
    _compat.track_loss(model, loss, x)
    assert float(model._loss_tracker.result()) == float(loss)


def test_keras_symbolic_build_internals_used_by_integrate():
    """`_maybe_symbolic_build` (which reduces the first distributed batch) and
    `_symbolic_build` exist on Keras's TensorFlow trainer."""
    import inspect

    from keras.src.backend.tensorflow import trainer

    assert 'distribute_strategy.reduce(' in inspect.getsource(trainer.TensorFlowTrainer._maybe_symbolic_build)
    model = _compiled_model()
    _compat.build_from_local_batch(model)
    model._maybe_symbolic_build(data_batch=(tf.ones((4, 2)), tf.zeros((4, 1)), None))
    assert model.optimizer.built


@requires_horovod
def test_horovodrun_servers_bind_through_find_port_and_the_runner_moves_them_to_loopback():
    """dist_minimize/launch/horovod_runner.py (the launcher's horovodrun for local jobs): Horovod's
    rendezvous server still binds every interface through `find_port`, imported by name
    in the modules patched, and `mpi_run._OMPI_FLAGS` still chooses `-mca btl`; patched,
    the rendezvous server binds 127.0.0.1 and mpirun's transport is shared memory."""
    import importlib.util
    import inspect

    from horovod.runner import mpi_run
    from horovod.runner.common.util import network as common_network
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    assert "('', port)" in inspect.getsource(network.find_port)  # every interface
    assert http_server.find_port is network.find_port is common_network.find_port
    assert "find_port(" in inspect.getsource(http_server.RendezvousServer.start)
    assert any(f.startswith("-mca btl ") for f in mpi_run._OMPI_FLAGS)
    spec = importlib.util.spec_from_file_location(
        "dm_compat_runner", os.path.join(os.path.dirname(os.path.dirname(_compat.__file__)), "launch", "horovod_runner.py"))
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    saved = [(m, m.find_port) for m in (network, http_server, common_network)]
    saved_flags = list(mpi_run._OMPI_FLAGS)
    server = http_server.RendezvousServer()
    try:
        runner.bind_horovodrun_to_loopback()
        assert mpi_run._OMPI_FLAGS == ["-mca pml ob1", "-mca btl self,vader"]
        port = server.start()
        assert server._httpd.server_address == ("127.0.0.1", port)
    finally:
        if server._httpd is not None:
            server.stop()
        for module, original in saved:
            module.find_port = original
        mpi_run._OMPI_FLAGS = saved_flags


def test_tensorflow_server_def_still_has_no_bind_address():
    """docs/security.md says TensorFlow's gRPC server cannot be bound to loopback:
    ServerDef (what TF_CONFIG becomes) has a port but no address to listen on. When a
    release adds one, this fails: bind local multiworker jobs to 127.0.0.1 with it."""
    fields = {f.name for f in tf.train.ServerDef.DESCRIPTOR.fields}
    assert "port" in fields
    assert not [f for f in fields if any(w in f for w in ("addr", "host", "bind", "interface"))], fields


# -- the per-device update (the non-finite guard under merge-call strategies) ------------


def _per_device_setup(make_opt, strategy):
    with strategy.scope():
        variables = [keras.Variable([[1.0, -2.0], [0.5, 3.0]], name="kernel"),
                     keras.Variable([0.25, -0.75], name="bias")]
        opt = make_opt()
        _compat.disable_keras_all_reduce(opt)
        opt.build(variables)
    return variables, opt


def _replica_grads(step):
    """Different gradients on each replica, so a device that got another's shows."""
    rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
    scale = (1.0 + rid) * (1.0 + tf.cast(step, tf.float32))
    return [tf.constant([[0.3, -0.1], [0.2, 0.4]]) * scale, tf.constant([-0.5, 0.7]) * scale]


def _copies(values, strategy):
    return [[np.array(c) for c in strategy.experimental_local_results(v.value if isinstance(v, keras.Variable) else v)]
            for v in values]


PER_DEVICE_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.1),
    "adamw_excluding_bias": lambda: _excluding_bias(keras.optimizers.AdamW(0.1, weight_decay=0.2)),
    "sgd_momentum_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5), momentum=0.9),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
}


def _excluding_bias(opt):
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


@pytest.mark.parametrize("name", sorted(PER_DEVICE_OPTIMIZERS))
def test_keras_apply_on_device_makes_the_writes_of_keras_apply(name):
    """`keras_apply_on_device`, device by device in the cross-replica context, leaves every
    device's copy of the weights, the slots and the iterations exactly as Keras's own
    `apply` does from the replica context, each replica with its own gradients (3 steps).
    Fails when a Keras release changes what its `apply` does for a plain optimizer."""
    from conftest import mirrored_strategy

    s = mirrored_strategy()
    assert _compat.keras_apply_on_device_blocker(PER_DEVICE_OPTIMIZERS[name](), []) is None
    ref_vars, ref_opt = _per_device_setup(PER_DEVICE_OPTIMIZERS[name], s)
    vars_, opt = _per_device_setup(PER_DEVICE_OPTIMIZERS[name], s)

    @tf.function
    def keras_step(step):
        s.run(lambda: ref_opt.apply(_replica_grads(step), ref_vars))

    @tf.function
    def device_step(step):
        def replica():
            grads = _replica_grads(step)

            def cross(strategy, grads):
                for i, device in enumerate(strategy.extended.worker_devices):
                    with tf.device(device), _compat.update_context(i):
                        local = [strategy.experimental_local_results(g)[i] for g in grads]
                        _compat.keras_apply_on_device(opt, strategy, i, local, vars_,
                                                      _compat.keras_update_inputs(opt))

            tf.distribute.get_replica_context().merge_call(cross, args=(grads,))
        s.run(replica)

    for step in range(3):
        keras_step(tf.constant(step))
        device_step(tf.constant(step))
    got, want = _copies(vars_ + opt.variables, s), _copies(ref_vars + ref_opt.variables, s)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got[0][0], got[0][1])  # the devices' gradients differed, and so do the copies
    assert [int(c) for c in _copies([opt.iterations], s)[0]] == [3, 3]


def test_keras_apply_on_device_blocker_names_what_changes_keras_apply():
    v = keras.Variable([1.0], name="w")
    constrained = keras.Variable([1.0], name="c")
    constrained.constraint = keras.constraints.NonNeg()  # as Layer.add_weight(constraint=...) sets it
    blocked = {
        "Nadam": (keras.optimizers.Nadam(0.1), [(tf.ones([1]), v)]),
        "LossScaleOptimizer": (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), [(tf.ones([1]), v)]),
        "clipnorm": (keras.optimizers.SGD(0.1, clipnorm=1.0), [(tf.ones([1]), v)]),
        "use_ema": (keras.optimizers.SGD(0.1, use_ema=True), [(tf.ones([1]), v)]),
        "no gradient": (keras.optimizers.SGD(0.1), [(None, v)]),
        "constraint": (keras.optimizers.SGD(0.1), [(tf.ones([1]), constrained)]),
    }
    for what, (opt, grads_and_vars) in blocked.items():
        reason = _compat.keras_apply_on_device_blocker(opt, grads_and_vars)
        assert reason is not None, what
    assert _compat.keras_apply_on_device_blocker(keras.optimizers.Adam(0.1), [(tf.ones([1]), v)]) is None


def test_update_context_routes_distributed_variable_writes_to_one_device():
    from conftest import mirrored_strategy

    s = mirrored_strategy()
    with s.scope():
        v = tf.Variable([0.0, 0.0])

    @tf.function
    def step():
        def replica():
            def cross(strategy):
                with tf.device(strategy.extended.worker_devices[1]), _compat.update_context(1):
                    v.assign_add([1.0, 2.0])
            tf.distribute.get_replica_context().merge_call(cross)
        s.run(replica)

    step()
    a, b = [np.array(c) for c in s.experimental_local_results(v)]
    np.testing.assert_array_equal(a, [0.0, 0.0])
    np.testing.assert_array_equal(b, [1.0, 2.0])


def test_resources_on_follows_captures_to_the_variables_device():
    # `_compat.resources_on` reads FuncGraph.captures (private) to find where the
    # resource behind a handle placeholder lives, through nested function graphs.
    with tf.device("/cpu:1"):
        v = tf.Variable(1.0)
    seen = {}

    @tf.function
    def step():
        seen["outer"] = (_compat.resources_on([v.handle], "/cpu:1"), _compat.resources_on([v.handle], "/cpu:0"))

        def branch():
            seen["nested"] = (_compat.resources_on([v.handle], "/job:localhost/replica:0/task:0/device:CPU:1"),
                              _compat.resources_on([v.handle], "/cpu:0"))
            return v.read_value()

        return tf.cond(tf.constant(True), branch, lambda: tf.constant(0.0))

    step.get_concrete_function()
    assert seen == {"outer": (True, False), "nested": (True, False)}


def _ifs(step, *args):
    graph = step.get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]


def test_unlowered_cond_stays_lowered_on_resources_of_two_devices():
    with tf.device("/cpu:1"):
        v = tf.Variable(0.0)
    with tf.device("/cpu:0"):
        w = tf.Variable(0.0)
    seen = []

    @tf.function
    def step(pred):
        seen.append(_compat.unlowered_cond(pred, lambda: v.assign_add(w + 1.0), lambda: v.assign_add(10.0)))

    step(tf.constant(True))
    assert float(v.numpy()) == 1.0 and seen == [False]
    ifs = _ifs(step, tf.constant(True))
    assert len(ifs) == 1 and ifs[0].get_attr("_lower_using_switch_merge") is True


def test_unlowered_cond_stays_lowered_when_placed_away_from_its_resources():
    with tf.device("/cpu:1"):
        v = tf.Variable(0.0)
    seen = []

    @tf.function
    def step(pred):
        with tf.device("/cpu:0"):
            seen.append(_compat.unlowered_cond(pred, lambda: v.assign_add(1.0), lambda: v.assign_add(10.0)))

    step(tf.constant(False))
    assert float(v.numpy()) == 10.0 and seen == [False]


def test_unlowered_cond_stays_lowered_when_a_branch_op_has_no_kernel_for_the_device():
    """`_compat.ops_without_kernel` reads TensorFlow's kernel registry (and the graph's
    function library, through nested functions): a uint8 MatMul has no CPU kernel, so
    the If holding it is left to TensorFlow's lowering. (On a GPU, an int64 FloorMod is
    such an op: dist_minimize's schedules avoid it, `_periodic.on_period`.)"""
    v = tf.Variable(0.0)
    seen = {}

    @tf.function
    def step(pred, x):
        def inner():
            return tf.cast(tf.reduce_sum(tf.matmul(x, x)), tf.float32)

        def branch():
            nested = tf.function(inner)  # the op sits in a function the branch calls
            v.assign_add(nested())

        def other():
            v.assign_add(1.0)

        seen["whole"] = _compat.unlowered_cond(pred, branch, other)
        if_op = [op for op in tf.compat.v1.get_default_graph().get_operations() if op.type in ("If", "StatelessIf")][0]
        seen["CPU"] = _compat.ops_without_kernel(if_op, "CPU")

    step.get_concrete_function(tf.TensorSpec([], tf.bool), tf.TensorSpec([2, 2], tf.uint8))
    assert seen == {"whole": False, "CPU": ["MatMul(T=uint8)"]}


def test_unlowered_cond_keeps_its_if_op_and_takes_each_branch():
    v = tf.Variable(0.0)

    def add(amount):
        v.assign_add(amount)

    @tf.function
    def step(pred):
        _compat.unlowered_cond(pred, lambda: add(1.0), lambda: add(10.0))

    step(tf.constant(True))
    step(tf.constant(False))
    assert float(v.numpy()) == 11.0
    graph = step.get_concrete_function(tf.constant(True)).graph
    ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert len(ifs) == 1 and ifs[0].get_attr("_lower_using_switch_merge") is False


def test_an_adam_update_has_a_kernel_for_every_op_on_cpu():
    v = tf.Variable([1.0, 2.0])
    opt = keras.optimizers.Adam(0.1)
    opt.build([v])
    seen = {}

    @tf.function
    def step(pred, g):
        seen["whole"] = _compat.unlowered_cond(pred, lambda: opt.apply([g], [v]), lambda: None)
        if_op = [op for op in tf.compat.v1.get_default_graph().get_operations() if op.type in ("If", "StatelessIf")][0]
        seen["CPU"] = _compat.ops_without_kernel(if_op, "CPU")

    step(tf.constant(True), tf.constant([0.5, 0.5]))
    assert seen == {"whole": True, "CPU": []}
    assert int(opt.iterations.numpy()) == 1


def test_local_variables_are_made_past_the_strategy():
    """`_compat.local_variables` makes `ResourceVariable` directly (private), past the
    strategy's variable creator: under a strategy's scope a variable made inside it is a
    plain variable of this process with its initial value (a sharded stack's state under
    MultiWorkerMirroredStrategy, which the workers hold differently), one made outside it
    the strategy's."""
    strategy = mirrored_strategy()
    with strategy.scope():
        mirrored = tf.Variable(1.0)
        with _compat.local_variables():
            local = tf.Variable([2.0, 3.0], name="local")
            keras_local = keras.Variable(np.ones((2, 2), "float32"))
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    assert not isinstance(local, tf.distribute.DistributedValues) and local.numpy().tolist() == [2.0, 3.0]
    assert not isinstance(keras_local.value, tf.distribute.DistributedValues)
    assert keras_local.numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_stateless_scope_holds_writes_by_variable_id():
    """`keras_apply_on_device` maps the rule's step counter through `keras.StatelessScope`
    and reads the writes it held back from `scope.state_mapping` (id -> value)."""
    v, counter = keras.Variable(1.0), keras.Variable(3, dtype="int64")
    with keras.StatelessScope(state_mapping=[(counter, tf.constant(5, tf.int64))]) as scope:
        assert int(counter + 1) == 6
        v.assign(2.0)
    assert set(scope.state_mapping) == {id(v), id(counter)}
    assert float(scope.state_mapping[id(v)]) == 2.0 and float(v.numpy()) == 1.0


class _CountingSGD(keras.optimizers.SGD):
    """A user's Keras rule that writes a variable of its own directly (Variable.assign)."""

    def build(self, variables):
        super().build(variables)
        self.count = self.add_variable(shape=(), dtype="float32", initializer="zeros", name="count")

    def update_step(self, gradient, variable, learning_rate):
        self.count.assign(self.count + 1.0)
        super().update_step(gradient, variable, learning_rate)


@pytest.mark.parametrize("where", ["one_device", "mirrored"])
def test_a_rules_direct_write_held_back_by_the_scope_is_made(where):
    """A write the scope held back (a rule writing its own variable by Variable.assign) is
    made after the rule, on each device: not lost."""
    import dist_minimize as dm

    s = mirrored_strategy() if where == "mirrored" else tf.distribute.get_strategy()
    with s.scope():
        vs = [tf.Variable([1.0, 2.0]), tf.Variable([3.0])]
        opt = dm.Optimizer(_CountingSGD(0.1))
        opt.build(vs)

    @tf.function
    def step():
        s.run(lambda: opt.apply_gradients([(tf.constant([0.5, -0.5]), vs[0]), (tf.constant([1.0]), vs[1])]))

    step()
    step()
    rule = opt.inner_optimizer
    assert [float(c.numpy()) for c in s.experimental_local_results(rule.count.value)] == [4.0] * s.num_replicas_in_sync


def test_check_variables_are_known_is_keras_check_of_the_built_variables():
    """`check_variables_are_known` is Keras's own check (`_check_variables_are_known`)
    that an optimizer was built for the variables it updates: quiet for them, Keras's
    error for another."""
    known, other = keras.Variable([1.0]), keras.Variable([2.0])
    opt = keras.optimizers.Adam(0.1)
    opt.build([known])
    _compat.check_variables_are_known(opt, [known])
    with pytest.raises(ValueError, match="Unknown variable"):
        _compat.check_variables_are_known(opt, [other])
