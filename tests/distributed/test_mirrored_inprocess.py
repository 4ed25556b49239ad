"""MirroredStrategy on 2 of the 4 logical CPUs, in the test process: agreement on
non-finite steps planted on one replica, and sparse (Embedding) gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import parity_lib as P
from conftest import mirrored_strategy, requires_horovod

pytestmark = pytest.mark.distributed

def strategy():
    return mirrored_strategy()


def local_values(var):
    return [np.array(v) for v in strategy().experimental_local_results(var)]


def good_then_poisoned_step(replica_fn, v, use_function):
    """Runs a clean step, then a step with `poison=True`; asserts the poisoned step
    changed no replica's copy of `v` and left it finite. Returns the step function."""
    s = strategy()

    def step(poison):
        s.run(replica_fn, args=(tf.constant(poison),))

    if use_function:
        step = tf.function(step)
    step(False)
    good = local_values(v)
    step(True)
    after = local_values(v)
    for a, b in zip(after, good):
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(a)) for a in after)
    return step


@pytest.mark.parametrize("bad_replica", [0, 1])
@pytest.mark.parametrize("use_function", [False, True])
def test_nonfinite_on_one_replica_is_skipped_by_all(bad_replica, use_function):
    s = strategy()
    with s.scope():
        v = tf.Variable([1.0, 2.0])
        opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=dm.clip_by_global_norm(1.0))
        opt.build([v])

    def replica_fn(poison):
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        g = tf.constant([0.5, -0.5])
        g = tf.where(tf.logical_and(poison, tf.equal(rid, bad_replica)), tf.constant([np.inf, np.nan]), g)
        opt.apply_gradients([(g, v)])

    step = good_then_poisoned_step(replica_fn, v, use_function)
    assert int(opt.skipped_steps.numpy()) == 1
    assert int(opt.iterations.numpy()) == 1
    step(False)
    assert int(opt.iterations.numpy()) == 2
    a, b = local_values(v)
    np.testing.assert_array_equal(a, b)
    # every device's copy of the counters (the guarded update is made device by device)
    assert [int(c) for c in local_values(opt.skipped_steps.value)] == [1, 1]
    assert [int(c) for c in local_values(opt.iterations.value)] == [2, 2]


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
                                  "user_hook", "helper_override", "constraint", "nadam"])
def test_guarded_update_is_one_unlowered_cond_per_device_where_it_can_be(case):
    """The guarded update is one `If` per device, on that device, which TensorFlow keeps
    whole (one kernel, not a Switch and an Identity per input: issue 11), for the
    package's wrappers and a user's alike (issue 23: a user's step hook, or a user's
    override of what the package's hooks call, takes the same path). Where the Keras
    rule cannot be applied device by device (a constraint, a Keras optimizer that
    changes `apply`), it is the one lowered cond of `run_if`. A device whose update reads
    a variable of another device (made outside the scope) keeps its cond lowered, which
    TensorFlow can place. Either way the update is right and a non-finite step is
    skipped on every device."""
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
        opt.build([v])
    conds = guarded_step_conds(opt, v)
    if case in ("plain", "adam", "moving_average", "swa+decay", "stage_override", "user_hook", "helper_override"):
        assert sorted(conds) == PER_DEVICE, conds
    elif case == "lr_outside_scope":
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


def test_embedding_sparse_gradients_match_single_device_and_stay_sparse():
    seen = []

    def record(gv):
        seen.append(type(gv[0][0]).__name__)
        return gv

    ids, y = P.embedding_data()
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(P.GLOBAL_BATCH)
    ref = P.train_embedding(tf.distribute.get_strategy(), ds)
    got = P.train_embedding(strategy(), ds, transforms=[record])
    assert P.max_abs_diff(ref, got) <= 1e-6
    assert seen and set(seen) == {"IndexedSlices"}  # aggregated, still sparse


@requires_horovod
def test_horovod_backend_inside_a_strategy_is_refused():
    s = strategy()
    with s.scope():
        v = tf.Variable([1.0])
        opt = dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="horovod")
        opt.build([v])
    with pytest.raises(ValueError, match="aggregated twice"):
        s.run(lambda: opt.apply_gradients([(tf.constant([1.0]), v)]))


@pytest.mark.parametrize("bad_replica", [0, 1])
@pytest.mark.parametrize("use_function", [False, True])
def test_loss_scale_skip_agreed_when_inf_on_one_replica(bad_replica, use_function):
    s = strategy()
    with s.scope():
        v = tf.Variable([1.0, 2.0])
        opt = dm.LossScaleOptimizer(
            dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=dm.clip_by_global_norm(1.0)),
            initial_scale=64.0)
        opt.build([v])

    def replica_fn(poison):
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        with tf.GradientTape() as tape:
            loss = opt.transform_loss(tf.reduce_sum(v * v))
            planted = tf.logical_and(poison, tf.equal(rid, bad_replica))
            loss = loss * tf.where(planted, tf.constant(np.inf), tf.constant(1.0))
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))

    good_then_poisoned_step(replica_fn, v, use_function)
    assert [float(x.numpy()) for x in s.experimental_local_results(opt.loss_scale.value)] == [32.0, 32.0]
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 1


def _accumulation_run(strat, k, mode, count):
    """SGD+clip with accumulation K under `strat`; returns weights and all-reduce calls."""
    x, y = P.make_data(P.STEPS * k)
    with strat.scope():
        model = P.make_model(keras)
        opt = dm.GradientAccumulation(
            dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM)), k)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH)
    count["n"] = 0
    if mode == "fit":
        with strat.scope():
            model.compile(loss="mse", optimizer=opt)
        model.fit(ds, epochs=1, verbose=0, shuffle=False)
    else:  # eager custom loop: counts every executed call
        with strat.scope():
            opt.build(model.trainable_variables)

        def replica_step(xb, yb):
            opt.minimize(lambda: tf.nn.compute_average_loss(
                tf.reduce_mean(tf.square(model(xb) - yb), axis=-1), global_batch_size=P.GLOBAL_BATCH),
                model.trainable_variables)

        for batch in strat.experimental_distribute_dataset(ds):
            strat.run(replica_step, args=batch)
    return P.weights(model), opt


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("mode", ["fit", "eager"])
def test_accumulation_parity_and_one_aggregation_per_update(monkeypatch, k, mode):
    from tensorflow.python.distribute import distribute_lib

    count = {"n": 0}
    original = distribute_lib.ReplicaContextBase.all_reduce

    def counting(self, *a, **kw):
        count["n"] += 1
        return original(self, *a, **kw)

    monkeypatch.setattr(distribute_lib.ReplicaContextBase, "all_reduce", counting)
    x, y = P.make_data(P.STEPS * k)
    ref_model = P.make_model(keras)
    ref_model.compile(loss="mse", optimizer=dm.Optimizer(
        keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM)))
    ref_model.fit(x, y, batch_size=P.GLOBAL_BATCH * k, epochs=1, verbose=0, shuffle=False)
    got, opt = _accumulation_run(strategy(), k, mode, count)
    assert P.max_abs_diff(P.weights(ref_model), got) <= 1e-6
    assert int(opt.iterations.numpy()) == P.STEPS
    assert P.clipped_steps(opt) == P.STEPS  # clipped once per update, not per micro-step
    if mode == "eager":
        # One all-reduce per replica per UPDATE (STEPS updates of K micro-steps each).
        assert count["n"] == 2 * P.STEPS


@pytest.mark.parametrize("use_function", [False, True])
def test_consistency_check_passes_in_sync_and_catches_a_planted_divergence(use_function):
    s = strategy()
    with s.scope():
        a, b = tf.Variable([1.0, 2.0], name="a"), tf.Variable([3.0], name="b")
        check = dm.check_consistency(every_n_steps=2)
        opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=check)
        opt.build([a, b])

    def replica_fn():
        opt.apply_gradients([(tf.constant([1.0, 1.0]), a), (tf.constant([1.0]), b)])

    step = tf.function(lambda: s.run(replica_fn)) if use_function else (lambda: s.run(replica_fn))
    for _ in range(4):
        step()  # checks at steps 2 and 4 pass
    # Plant a divergence: replica 1's copy of `b` differs.
    b.values[1].assign_add([0.5])
    step()  # step 5: not checked
    with pytest.raises(tf.errors.InvalidArgumentError, match="diverged at step 6.*weight b"):
        step()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_loss_scaling_with_mixed_precision_fit(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        s = strategy()
        x, y = P.make_data()
        with s.scope():
            model = P.make_model(keras)
            opt = dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.Adam(0.01),
                                                     transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM)))
            model.compile(loss="mse", optimizer=opt, auto_scale_loss=False)
        history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH), epochs=3,
                            verbose=0, shuffle=False)
        assert model.layers[0].compute_dtype == policy.split("_")[1]
        for w in model.trainable_variables:
            copies = local_values(w.value)
            assert np.isfinite(copies[0]).all()
            np.testing.assert_array_equal(copies[0], copies[1])
        assert int(opt.iterations.numpy()) + int(opt.skipped_steps.numpy()) == 3 * P.STEPS
        assert history.history["loss"][-1] < history.history["loss"][0]
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("use_function", [False, True])
def test_consistency_check_catches_gradients_that_differ_at_that_step(use_function):
    """Defect: run_if ran replica 0's closure on every replica, so the check compared
    replica 0's captured gradients with themselves; with a do-nothing aggregator, gradients
    that differ across replicas passed step 1 (only the weights' divergence was seen, a step
    later)."""
    s = strategy()
    with s.scope():
        w = tf.Variable([1.0, 2.0], name="w")
        opt = dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="none",
                           transform_gradients=dm.check_consistency(every_n_steps=1))
        opt.build([w])

    def replica_fn():
        rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        opt.apply_gradients([(tf.stack([1.0, 1.0 + rid]), w)])

    step = tf.function(lambda: s.run(replica_fn)) if use_function else (lambda: s.run(replica_fn))
    with pytest.raises(tf.errors.InvalidArgumentError, match="diverged at step 1.*gradient of w"):
        step()
    for copy in local_values(w):  # stopped before any update
        np.testing.assert_array_equal(copy, [1.0, 2.0])


@pytest.mark.parametrize("use_function", [False, True])
def test_distribute_helpers_across_two_replicas(use_function):
    s = strategy()

    def replica_fn():
        rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        total = dm.distribute.sum_across(rid + 1.0)
        mean, doubled = dm.distribute.mean_across([rid + 1.0, 2.0 * (rid + 1.0)])
        return total, mean, doubled, dm.distribute.num_replicas()

    run = (lambda: s.run(replica_fn))
    run = tf.function(run) if use_function else run
    total, mean, doubled, n = run()
    assert [float(t) for t in s.experimental_local_results(total)] == [3.0, 3.0]
    assert [float(t) for t in s.experimental_local_results(mean)] == [1.5, 1.5]
    assert [float(t) for t in s.experimental_local_results(doubled)] == [3.0, 3.0]
    assert n == 2


def test_run_if_check_refuses_a_condition_that_differs_across_replicas():
    s = strategy()
    with s.scope():
        v = tf.Variable(0.0)

    @tf.function
    def step(same):
        def replica_fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            cond = tf.logical_or(same, tf.equal(rid, 0))
            dm.distribute.run_if(cond, lambda: v.assign_add(1.0), check=True)
        s.run(replica_fn)

    step(tf.constant(True))
    assert float(v.numpy()) == 1.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="condition differs across replicas"):
        step(tf.constant(False))
    assert float(v.numpy()) == 1.0


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


def test_xla_under_mirrored_on_cpus_is_refused_and_integrate_turns_it_off(caplog):
    """jit_compile=True under MirroredStrategy on CPU devices fails in TensorFlow itself
    (stock Keras too, at run time); dist_minimize refuses at the first trace naming the
    fix, and dm.integrate turns XLA off and trains as without it."""
    import logging

    s = strategy()
    x, y = P.make_data()

    def fit(integrate):
        with s.scope():
            model = P.make_model(keras)
            opt = P.build_optimizer(dm, keras, "sgd-0.01", True, "some", "auto", None)
            model.compile(loss="mse", optimizer=opt, jit_compile=True)
        if integrate:
            dm.integrate(model)
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, shuffle=False, verbose=0)
        return model, opt

    with pytest.raises(RuntimeError, match="cannot run in an XLA-compiled step.*jit_compile=False"):
        fit(False)
    with caplog.at_level(logging.WARNING, logger="dist_minimize"):
        model, opt = fit(True)
    assert model.jit_compile is False and "merge_call" in caplog.text
    ref, _, _ = P.train(tf.distribute.get_strategy(), "sgd-0.01", "fit", clip="some")
    assert P.max_abs_diff(ref, P.weights(model)) <= 1e-6
    assert P.clipped_steps(opt) == P.CLIPPED_STEPS["some"]


def test_replica_local_accumulators_restore_exactly_under_mirrored(tmp_path):
    """GradientAccumulation's replica-local slots are checkpointed as their sum and
    restored as equal shares under MirroredStrategy: a run stopped after 6 of 16
    micro-steps (window 4) and restored into a fresh model and optimizer ends where the
    uninterrupted run ends, and where one device does."""
    s = strategy()
    x, y = P.make_data(P.STEPS * 4)

    def run(lo, hi, model=None, opt=None):
        with s.scope():
            model = model if model is not None else P.make_model(keras)
            opt = opt if opt is not None else P.accumulating_adam(dm, keras, 4)
            opt.build(model.trainable_variables)
        ds = s.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x[lo * P.GLOBAL_BATCH:hi * P.GLOBAL_BATCH],
                                                y[lo * P.GLOBAL_BATCH:hi * P.GLOBAL_BATCH])).batch(P.GLOBAL_BATCH))

        @tf.function
        def step(xb, yb):
            def replica_step(xb, yb):
                def loss_fn():
                    per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                    return tf.nn.compute_average_loss(per_example, global_batch_size=P.GLOBAL_BATCH)
                opt.minimize(loss_fn, model.trainable_variables)
            s.run(replica_step, args=(xb, yb))

        for xb, yb in ds:
            step(xb, yb)
        return model, opt

    full, _ = run(0, 16)
    model, opt = run(0, 6)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "c"))
    with s.scope():
        fresh_model, fresh_opt = P.make_model(keras, seed=5), P.accumulating_adam(dm, keras, 4)
        fresh_opt.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh_opt).read(path).assert_existing_objects_matched()
    resumed, resumed_opt = run(6, 16, fresh_model, fresh_opt)
    assert int(resumed_opt.iterations.numpy()) == P.STEPS
    assert P.max_abs_diff(P.weights(full), P.weights(resumed)) <= 1e-6
    assert P.max_abs_diff(P.reference_accumulation(4), P.weights(resumed)) <= 1e-6


def test_mixed_dtype_variables_are_aggregated_and_match_single_device():
    """A float16 layer beside float32 ones: tf.distribute's list all-reduce packs one
    buffer and fails on two dtypes (stock Keras too); the strategy backend reduces each
    dtype on its own. The result matches one device on the same global batch."""
    x, y = P.make_data(steps=4)

    def train(s):
        with s.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((P.FEATURES,)),
                                      keras.layers.Dense(8, activation="tanh", dtype="float16"),
                                      keras.layers.Dense(1, dtype="float32")])
            model.compile(loss="mse", optimizer=dm.Optimizer(keras.optimizers.SGD(0.05)))
        start = P.weights(model)
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        return start, P.weights(model)

    start, one = train(tf.distribute.get_strategy())
    _, two = train(strategy())
    assert [w.dtype.name for w in two] == ["float16", "float16", "float32", "float32"]
    moved = P.max_abs_diff(start, one)
    assert moved > 0.5, moved  # large enough that a wrong scale (MEAN for SUM) shows
    assert P.max_abs_diff(one, two) < 1e-2, (P.max_abs_diff(one, two), moved)  # float16 rounding



def test_the_per_device_choice_does_not_look_at_classes():
    """Issue 23: no class inspection, no private flag: a user's wrapper with its own hooks,
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

