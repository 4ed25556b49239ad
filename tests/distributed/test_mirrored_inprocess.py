"""MirroredStrategy on 2 of the 4 logical CPUs, in the test process: agreement on
non-finite steps planted on one replica, and sparse (Embedding) gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import parity_lib as P

pytestmark = pytest.mark.distributed

STRATEGY = None


def strategy():
    global STRATEGY
    if STRATEGY is None:
        STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return STRATEGY


def local_values(var):
    return [np.array(v) for v in strategy().experimental_local_results(var)]


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
    assert int(opt.skipped_steps.numpy()) == 1
    assert int(opt.iterations.numpy()) == 1
    step(False)
    assert int(opt.iterations.numpy()) == 2
    a, b = local_values(v)
    np.testing.assert_array_equal(a, b)


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


def test_horovod_backend_inside_a_strategy_is_refused():
    pytest.importorskip("horovod.tensorflow", reason="Horovod is not installed (bash ci/setup.sh builds it)")
    s = strategy()
    with s.scope():
        v = tf.Variable([1.0])
        opt = dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="horovod")
        opt.build([v])
    with pytest.raises(ValueError, match="aggregated twice"):
        s.run(lambda: opt.apply_gradients([(tf.constant([1.0]), v)]))
