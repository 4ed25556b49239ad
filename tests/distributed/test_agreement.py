"""Agreement: every replica and every process holds the same weights and state after
every step, and a decision (skip a non-finite step, halve the loss scale, stop on a
divergence) is made by all of them together.

The strategy is the `run` parameter: "mirrored-eager"/"mirrored-traced" and "mirrored"
(MirroredStrategy on 2 logical CPUs, in this process), "multiworker" and "horovod-gloo"
(the shared process jobs of jobs.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import jobs
import parity_lib as P
from conftest import mirrored_strategy
from inprocess import good_then_poisoned_step, local_values
from jobs import arrays, run_param

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("run", [run_param("multiworker")])
def test_processes_hold_identical_weights(tmp_path_factory, run):
    workers = jobs.multiworker("parity", tmp_path_factory)
    for case in jobs.MULTIWORKER_JOBS["parity"]:
        if "anchor" in case:
            continue
        a, b = (w[case]["weights"] for w in workers)
        assert a == b, case


def mirrored_loss_scale_skip(bad_replica, use_function):
    """LossScaleOptimizer on 2 replicas, inf planted on one replica at the second step."""
    s = mirrored_strategy()
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

    good_then_poisoned_step(replica_fn, v, use_function)  # (the weights: unchanged, finite)
    loss_scales = [float(x.numpy()) for x in s.experimental_local_results(opt.loss_scale.value)]
    return loss_scales, int(opt.skipped_steps.numpy()), int(opt.iterations.numpy())


@pytest.mark.parametrize("run,bad", [run_param(r, bad) for r in ("mirrored-eager", "mirrored-traced", "multiworker",
                                                                 "horovod-gloo") for bad in (0, 1)])
def test_inf_on_one_replica_or_process_is_skipped_by_all(tmp_path_factory, run, bad):
    """Loss scaling with inf planted on one replica (MirroredStrategy, the second of 2
    steps) or one process (at one of the 4 steps): every replica and process skips that
    step, halves the loss scale once (64 -> 32) and keeps finite weights."""
    if run.startswith("mirrored"):
        loss_scales, skipped, iterations = mirrored_loss_scale_skip(bad, run == "mirrored-traced")
        assert loss_scales == [32.0, 32.0]
        assert skipped == 1 and iterations == 1
        return
    results = (jobs.multiworker("parity", tmp_path_factory) if run == "multiworker"
               else jobs.horovod(run, 2, "parity", tmp_path_factory))
    for process in results:
        r = process[f"lso_inf/{bad}"]
        assert all(np.isfinite(np.array(w)).all() for w in r["weights"])
        assert r["skipped"] == 1 and r["iterations"] == P.STEPS - 1
        assert r["loss_scale"] == 32.0  # halved once, on every worker
        assert r["clipped_steps"] == P.STEPS - 1  # every applied step (norms >> 0.5)


@pytest.mark.parametrize("bad_replica", [0, 1])
@pytest.mark.parametrize("use_function", [False, True])
def test_nonfinite_on_one_replica_is_skipped_by_all(bad_replica, use_function):
    """MirroredStrategy: a NaN/inf gradient on one replica skips the step on both."""
    s = mirrored_strategy()
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


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_loss_scaling_with_mixed_precision_fit_keeps_replicas_identical(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        s = mirrored_strategy()
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
def test_consistency_check_passes_in_sync_and_catches_a_planted_divergence(use_function):
    s = mirrored_strategy()
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


@pytest.mark.parametrize("use_function", [False, True])
def test_consistency_check_catches_gradients_that_differ_at_that_step(use_function):
    """Defect: run_if ran replica 0's closure on every replica, so the check compared
    replica 0's captured gradients with themselves; with a do-nothing aggregator, gradients
    that differ across replicas passed step 1 (only the weights' divergence was seen, a step
    later)."""
    s = mirrored_strategy()
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


@pytest.mark.parametrize("run", [run_param("horovod-gloo")])
def test_consistency_check_catches_divergence_on_every_rank(tmp_path_factory, run):
    for r in jobs.horovod(run, 2, "parity", tmp_path_factory):
        assert r["consistency"]["error"] is not None
        assert "diverged at step 4: first differing: weight w" in r["consistency"]["error"]


def test_run_if_check_refuses_a_condition_that_differs_across_replicas():
    s = mirrored_strategy()
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


@pytest.mark.parametrize("use_function", [False, True])
def test_distribute_helpers_across_two_replicas(use_function):
    s = mirrored_strategy()

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


@pytest.mark.parametrize("run", [run_param("horovod-gloo")])
def test_broadcast_puts_rank0_weights_everywhere_before_the_first_step(tmp_path_factory, run):
    ranks = jobs.horovod(run, 2, "parity", tmp_path_factory)
    rank0_initial = ranks[0]["broadcast"]["rank0_initial"]
    for r in ranks:
        assert r["broadcast"]["first_step_weights"] == rank0_initial
    ref = jobs.horovod_reference("adam", "fit")
    for r in ranks:
        assert P.max_abs_diff(ref, arrays(r["broadcast"]["weights"])) <= 1e-6


@pytest.mark.parametrize("run", [run_param("horovod-gloo")])
def test_metric_average_is_the_global_mean(tmp_path_factory, run):
    for r in jobs.horovod(run, 2, "parity", tmp_path_factory):
        m = r["metric_average"]
        assert m["rank_value"] == 0.5
        assert m["loss"] == pytest.approx(float(np.mean(m["all_local_losses"])), rel=1e-6)
