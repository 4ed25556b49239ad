"""MovingAverage, SWA, Lookahead and DecoupledWeightDecay under MirroredStrategy (2 of
the 4 logical CPUs, in the test process) against one device on the same global
batches: `fit` and a custom loop, Adam with the clip firing on some steps."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import parity_lib as P
from conftest import mirrored_strategy

pytestmark = pytest.mark.distributed

WRAPPERS = {
    "moving_average": lambda o: dm.MovingAverage(o, average_decay=0.5, dynamic_decay=True),
    "swa": lambda o: dm.SWA(o, start_averaging=1, average_period=2),
    "lookahead": lambda o: dm.Lookahead(o, sync_period=2, slow_step_size=0.5),
    "weight_decay": lambda o: dm.DecoupledWeightDecay(o, 0.05, exclude_from_weight_decay=["bias"]),
    # The documented order, every wrapper at once (2 micro-steps per update).
    "stack": lambda o: dm.LossScaleOptimizer(dm.GradientAccumulation(dm.MovingAverage(dm.SWA(dm.Lookahead(
        dm.DecoupledWeightDecay(o, 0.05), sync_period=1), average_period=1), 0.5), steps=2), initial_scale=8.0),
}


def train(strategy, wrapper, mode):
    x, y = P.make_data()
    with strategy.scope():
        model = P.make_model(keras)
        opt = WRAPPERS[wrapper](P.build_optimizer(dm, keras, "adam", True, "some"))
    if mode == "fit":
        with strategy.scope():
            model.compile(loss="mse", optimizer=opt)
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    else:
        with strategy.scope():
            opt.build(model.trainable_variables)
        ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH))

        @tf.function
        def step(xb, yb):
            def replica_step(xb, yb):
                with tf.GradientTape() as tape:
                    per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=P.GLOBAL_BATCH)
                opt.minimize(loss, model.trainable_variables, tape=tape)
            strategy.run(replica_step, args=(xb, yb))

        for xb, yb in ds:
            step(xb, yb)
    state = [np.array(v) for v in opt.variables]
    for v in list(opt.variables) + list(model.trainable_variables):
        if "accumulated" in v.name:  # replica-local by design
            continue
        copies = [np.array(c) for c in strategy.experimental_local_results(v.value)]
        for c in copies[1:]:  # every replica holds the same averages, slow weights and weights
            np.testing.assert_array_equal(c, copies[0], err_msg=v.path)
    return P.weights(model), state, opt


@pytest.mark.parametrize("mode", ["fit", "tape"])
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_two_replicas_match_one_device(wrapper, mode):
    ref, ref_state, _ = train(tf.distribute.get_strategy(), wrapper, mode)
    got, state, opt = train(mirrored_strategy(), wrapper, mode)
    if wrapper == "stack":
        assert int(opt.iterations.numpy()) == P.STEPS // 2 and int(opt.find(dm.SWA).num_averaged.numpy()) == 2
    else:
        assert int(opt.iterations.numpy()) == P.STEPS and P.clipped_steps(opt) == P.CLIPPED_STEPS["some"]
    assert P.max_abs_diff(ref, got) <= 1e-6
    assert len(state) == len(ref_state)
    for a, b in zip(state, ref_state):  # averages, slow weights, counts, Adam's moments
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
