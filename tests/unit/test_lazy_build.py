"""An optimizer not built before its first step builds there, under MirroredStrategy too,
in a traced step, for every wrapper: the same weights as when `build` was
called first.

Before, building inside the traced replica function failed under MirroredStrategy with
"You must feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder'" (TensorFlow
could not lift out of the function the initial values of the replicas' copies computed
there); `minimize`/`apply_gradients` now build in the cross-replica context, outside the
function (`dist_minimize._slots.build_on_first_use`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy
from parity_lib import (GLOBAL_BATCH, PRIVACY_WRAPPERS, WEIGHT_STACK, WEIGHT_WRAPPERS, make_data, make_model,
                        max_abs_diff, weights)

STEPS = 3

STACKS = {
    "optimizer": lambda o: o,
    **{name: (lambda make: lambda o: make(dm, o))(make) for name, make in WEIGHT_WRAPPERS.items()},
    **{name: (lambda make: lambda o: make(dm, o))(make) for name, make in PRIVACY_WRAPPERS.items()},
    "loss_scale": lambda o: dm.LossScaleOptimizer(o, initial_scale=8.0),
    "dynamic_loss_scale": lambda o: dm.LossScaleOptimizer(o, initial_scale=8.0, dynamic=True, growth_interval=1),
    "accumulation": lambda o: dm.GradientAccumulation(o, steps=2),
    "weight_stack": lambda o: WEIGHT_STACK(dm, o),
}


def _train(stack: str, build_first: bool, traced: bool = True, inner: str = "sgd", call: str = "minimize"):
    strategy = mirrored_strategy()
    per_example = stack in PRIVACY_WRAPPERS
    x, y = make_data(STEPS)
    with strategy.scope():
        model = make_model(keras)
        rule = keras.optimizers.SGD(0.1) if inner == "sgd" else keras.optimizers.Adam(0.01)
        opt = STACKS[stack](dm.Optimizer(rule, transform_gradients=dm.clip_by_global_norm(5.0)))
        if build_first:
            opt.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))

    def replica_step(xb, yb):
        def loss_fn():
            losses = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
            return losses if per_example else tf.nn.compute_average_loss(losses, global_batch_size=GLOBAL_BATCH)

        if call == "minimize":
            opt.minimize(loss_fn, model.trainable_variables)
        else:
            with tf.GradientTape() as tape:
                loss = loss_fn()
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    def step(batch):
        strategy.run(replica_step, args=batch)

    if traced:
        step = tf.function(step)
    for batch in dataset:
        step(batch)
    assert opt.built
    # (An unseeded DifferentialPrivacy draws its noise seed at construction: a run's own.)
    state = [np.array(v) for o in opt.stack() for v in o.variables
             if not (isinstance(o, dm.DifferentialPrivacy) and o.seed is None and v is o.noise_seed)]
    return weights(model), state, opt


@pytest.mark.parametrize("stack", list(STACKS))
def test_lazy_build_in_a_traced_mirrored_step_matches_build_first(stack):
    lazy, lazy_state, opt = _train(stack, build_first=False)
    eager_built, built_state, _ = _train(stack, build_first=True)
    assert max_abs_diff(lazy, eager_built) == 0.0  # bitwise (measured: 0.0 for every stack)
    assert len(lazy_state) == len(built_state)
    for a, b in zip(lazy_state, built_state):
        np.testing.assert_array_equal(a, b)
    # The state is mirrored as if `build` had been called in the scope.
    counter = opt.stack()[-1].skipped_steps
    assert len(mirrored_strategy().experimental_local_results(getattr(counter, "value", counter))) == 2


@pytest.mark.parametrize("case", ["adam-apply_gradients-traced", "adam-minimize-eager"])
def test_lazy_build_with_slots_and_other_entry_points(case):
    inner, call, mode = case.split("-")
    traced = mode == "traced"
    lazy, lazy_state, _ = _train("moving_average", build_first=False, traced=traced, inner=inner, call=call)
    built, built_state, _ = _train("moving_average", build_first=True, traced=traced, inner=inner, call=call)
    assert max_abs_diff(lazy, built) == 0.0
    for a, b in zip(lazy_state, built_state):
        np.testing.assert_array_equal(a, b)
