"""Limits under MirroredStrategy that used to fail deep inside TensorFlow, now refused
early with an error naming the limit and the fix."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy
from parity_lib import GLOBAL_BATCH, make_data, make_model, max_abs_diff, weights


def _fit(strategy, steps_per_execution: int, integrate: bool = True):
    x, y = make_data(4)
    with strategy.scope():
        model = make_model(keras)
        model.compile(loss="mse", optimizer=dm.Optimizer(keras.optimizers.Adam(0.01),
                                                         transform_gradients=dm.clip_by_global_norm(1.0)),
                      steps_per_execution=steps_per_execution)
    if integrate:
        dm.integrate(model)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=1, verbose=0, shuffle=False)
    return weights(model)


def test_steps_per_execution_under_mirrored_cpus_is_refused_at_integrate():
    # Keras's multi-step function fails there at its first step (stock Keras too):
    # "You must feed a value for placeholder tensor 'while/.../Placeholder'".
    with pytest.raises(ValueError, match=r"`steps_per_execution=2` cannot run under MirroredStrategy on CPU devices "
                                         r"\(2 replicas\).*Compile with `steps_per_execution=1`.*Received: "
                                         r"steps_per_execution=2 for model"):
        _fit(mirrored_strategy(), 2)


def test_steps_per_execution_without_a_strategy_is_not_refused_and_keeps_parity():
    strategy = tf.distribute.get_strategy()
    assert max_abs_diff(_fit(strategy, 2), _fit(strategy, 1)) <= 1e-7


def test_steps_per_execution_one_under_mirrored_still_integrates():
    _fit(mirrored_strategy(), 1)


@pytest.mark.parametrize("kind", ["tf_variable", "keras_variable"])
@pytest.mark.parametrize("built", [False, True], ids=["lazy_build", "built_in_scope"])
@pytest.mark.parametrize("call", ["minimize", "apply_gradients"])
def test_a_variable_created_outside_the_scope_is_named_with_the_fix(kind, built, call):
    strategy = mirrored_strategy()
    outside = tf.Variable([1.0, 2.0], name="made_outside") if kind == "tf_variable" else keras.Variable(
        [1.0, 2.0], name="made_outside")
    with strategy.scope():
        inside = tf.Variable([3.0, 4.0], name="made_inside")
        opt = dm.Optimizer(keras.optimizers.SGD(0.1))
        if built:
            opt.build([inside, outside])
    variables = [inside, outside]

    @tf.function
    def step():
        def replica():
            loss = lambda: tf.reduce_sum(variables[0] * variables[1])  # noqa: E731
            if call == "minimize":
                opt.minimize(loss, variables)
            else:
                with tf.GradientTape() as tape:
                    value = loss()
                opt.apply_gradients(zip(tape.gradient(value, variables), variables))

        strategy.run(replica)

    message = (r"Variable `made_outside.*` was created outside `strategy.scope\(\)` of the MirroredStrategy in use "
               r"\(2 replicas\).*Create it .* inside `with strategy.scope\(\):`")
    with pytest.raises(ValueError, match=message):
        step()


def test_variables_made_in_the_scope_pass_the_check():
    strategy = mirrored_strategy()
    with strategy.scope():
        v = keras.Variable([1.0, 2.0])
        opt = dm.Optimizer(keras.optimizers.SGD(0.5))

    @tf.function
    def step():
        strategy.run(lambda: opt.minimize(lambda: tf.reduce_sum(v) / 2.0, [v]))

    step()
    np.testing.assert_allclose(v.numpy(), [0.5, 1.5])  # the 2 replicas' gradients summed: 1.0 each
