"""`dm.integrate(model)`: `fit` through every stage; XLA refused or turned off with a reason."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import parity_lib as P

X, Y = P.make_data()


def fit(opt, integrate=True, jit_compile="auto", epochs=1):
    keras.utils.set_random_seed(1)
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=opt, jit_compile=jit_compile)
    if integrate:
        dm.integrate(model)
    history = model.fit(X, Y, batch_size=P.GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return P.weights(model), history.history["loss"], model


def sgd_dm(transform_gradients=None):
    return dm.Optimizer(keras.optimizers.SGD(0.01), transform_gradients=transform_gradients)


@pytest.mark.parametrize("clip", ["never", "some"])
def test_integrated_fit_matches_keras_fit_and_its_loss_metric(clip):
    ref, ref_loss, _ = fit(P.build_optimizer(dm, keras, "sgd-0.01", True, clip, "auto", None), integrate=False)
    got, loss, _ = fit(P.build_optimizer(dm, keras, "sgd-0.01", True, clip, "auto", None))
    assert P.max_abs_diff(ref, got) <= 1e-6
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


class DoubledGradients(dm.OptimizerWrapper):
    """Overrides get_gradients (what plain fit never calls) and counts transform_loss calls."""

    def build_state(self, var_list):
        self.loss_calls = self.add_variable(shape=(), dtype="int64", initializer="zeros",
                                            aggregation="only_first_replica", name="loss_calls")

    def transform_loss(self, loss):
        self.loss_calls.assign_add(1)
        return super().transform_loss(loss)

    def get_gradients(self, loss, variables, tape):
        return [(None if g is None else 2.0 * g, v) for g, v in super().get_gradients(loss, variables, tape)]


def test_get_gradients_override_runs_under_integrated_fit():
    with pytest.raises(RuntimeError, match="never calls it"):
        fit(DoubledGradients(sgd_dm()), integrate=False)
    opt = DoubledGradients(sgd_dm())
    got, _, _ = fit(opt)
    # SGD: doubled gradients are the same step as a doubled learning rate.
    ref, _, _ = fit(dm.Optimizer(keras.optimizers.SGD(0.02)), integrate=False)
    assert P.max_abs_diff(ref, got) <= 1e-6
    steps = len(X) // P.GLOBAL_BATCH
    assert int(opt.loss_calls.numpy()) == steps and int(opt.iterations.numpy()) == steps


def test_xla_fit_matches_non_xla_without_a_strategy():
    ref, _, _ = fit(sgd_dm(dm.clip_by_global_norm(P.CLIPS["some"])), jit_compile=False)
    got, _, model = fit(sgd_dm(dm.clip_by_global_norm(P.CLIPS["some"])), jit_compile=True)
    assert model.jit_compile is True  # nothing in this stack needs XLA off
    assert P.max_abs_diff(ref, got) <= 1e-6


def test_assertion_checks_refuse_xla_and_integrate_turns_it_off(caplog):
    def stack():
        return dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.SGD(0.01), transform_gradients=[
            dm.limit_nonfinite_steps(3), dm.check_consistency(2)]))

    with pytest.raises(RuntimeError, match=r"limit_nonfinite_steps cannot run in an XLA-compiled step.*"
                                           r"jit_compile=False"):
        fit(stack(), integrate=False, jit_compile=True)
    with caplog.at_level(logging.WARNING, logger="dist_minimize"):
        _, _, model = fit(stack(), jit_compile=True)
    assert model.jit_compile is False
    text = caplog.text
    assert "jit_compile turned off" in text and "LimitNonFiniteSteps" in text and "ConsistencyCheck" in text


def test_xla_refusals_name_what_and_why():
    @tf.function(jit_compile=True)
    def checked():
        dm.distribute.refuse_xla("my check", "because")
        return tf.constant(1)

    with pytest.raises(RuntimeError, match="my check cannot run in an XLA-compiled step: because. Compile without XLA"):
        checked()
    assert dm.distribute.in_xla() is False


def test_integrate_rejects_what_it_cannot_integrate():
    with pytest.raises(TypeError, match="must be a Keras model"):
        dm.integrate("model")
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="Received: optimizer=SGD"):
        dm.integrate(model)


def test_integrate_after_a_fit_takes_effect(monkeypatch):
    """Keras caches its train function at the first fit; integrate must replace it."""
    import dist_minimize.fit as fit_module

    traced = []
    original = fit_module.train_step

    def counting(model, data):
        traced.append(1)
        return original(model, data)

    monkeypatch.setattr(fit_module, "train_step", counting)
    keras.utils.set_random_seed(1)
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=sgd_dm())
    model.fit(X[:P.GLOBAL_BATCH], Y[:P.GLOBAL_BATCH], batch_size=P.GLOBAL_BATCH, verbose=0)
    assert model.train_function is not None and not traced
    dm.integrate(model)
    model.fit(X[:P.GLOBAL_BATCH], Y[:P.GLOBAL_BATCH], batch_size=P.GLOBAL_BATCH, verbose=0)
    assert traced  # the integrated step, not Keras's cached one
