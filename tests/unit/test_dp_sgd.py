"""DifferentialPrivacy (DP-SGD) against a NumPy reference of its rule, its noise, its
stacks, its state and its errors, on one device (replicas: tests/distributed)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm

BATCH, FEATURES, OUTPUTS, STEPS = 8, 3, 2, 5
RNG = np.random.default_rng(11)
X = RNG.normal(size=(STEPS, BATCH, FEATURES)).astype("float32")
Y = (RNG.normal(size=(STEPS, BATCH, OUTPUTS)) * np.geomspace(0.05, 8.0, BATCH)[None, :, None]).astype("float32")
W0 = (0.1 * RNG.normal(size=(FEATURES, OUTPUTS))).astype("float32")
B0 = np.zeros(OUTPUTS, "float32")
CLIP = 1.5
INNER = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.05)}


def per_example_losses(w, b, x, y):
    return tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y), axis=1)


def reference(inner, microbatches):
    """NumPy: per-example gradients of the linear model's MSE, microbatch means, joint
    L2 clip, sum, divide by the microbatches; then the stock Keras rule on that gradient.
    Returns the weights and how many microbatch gradients were / were not clipped."""
    w, b = tf.Variable(W0), tf.Variable(B0)
    stock = INNER[inner]()
    clipped = unclipped = 0
    for s in range(STEPS):
        x, y = X[s].astype("float64"), Y[s].astype("float64")
        r = x @ w.numpy() + b.numpy() - y                        # (batch, out)
        gw = 2.0 / OUTPUTS * x[:, :, None] * r[:, None, :]       # (batch, in, out)
        gb = 2.0 / OUTPUTS * r
        m = microbatches or BATCH
        gw = gw.reshape(m, -1, FEATURES, OUTPUTS).mean(axis=1)
        gb = gb.reshape(m, -1, OUTPUTS).mean(axis=1)
        norms = np.sqrt((gw ** 2).sum(axis=(1, 2)) + (gb ** 2).sum(axis=1))
        f = np.minimum(1.0, CLIP / norms)
        clipped += int((f < 1).sum())
        unclipped += int((f == 1).sum())
        grads = [(f[:, None, None] * gw).sum(0) / m, (f[:, None] * gb).sum(0) / m]
        stock.apply_gradients([(tf.constant(grads[0], tf.float32), w), (tf.constant(grads[1], tf.float32), b)])
    return [w.numpy(), b.numpy()], clipped, unclipped


def make_step(opt, w, b, callable_loss=False, use_function=True):
    """One DP step of the linear model on a batch: `minimize` with the per-example losses
    and their tape (or as a callable)."""
    def step(x, y):
        if callable_loss:
            opt.minimize(lambda: per_example_losses(w, b, x, y), [w, b])
        else:
            with tf.GradientTape() as tape:
                loss = per_example_losses(w, b, x, y)
            opt.minimize(loss, [w, b], tape=tape)

    return tf.function(step) if use_function else step


def train(opt, steps=range(STEPS), callable_loss=False, variables=None, use_function=True):
    w, b = variables or (tf.Variable(W0), tf.Variable(B0))
    step = make_step(opt, w, b, callable_loss, use_function)
    for s in steps:
        step(tf.constant(X[s]), tf.constant(Y[s]))
    return [w.numpy(), b.numpy()], opt, (w, b)


def dp(inner="sgd", noise=0.0, microbatches=None, seed=7, **kwargs):
    return dm.DifferentialPrivacy(dm.Optimizer(INNER[inner](), **kwargs), l2_norm_clip=CLIP,
                                  noise_multiplier=noise, num_microbatches=microbatches, seed=seed)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("microbatches", [None, 2, 4])
@pytest.mark.parametrize("callable_loss", [False, True])
def test_rule_matches_numpy(inner, microbatches, callable_loss):
    ref, clipped, unclipped = reference(inner, microbatches)
    assert clipped > 0 and unclipped > 0  # the clip decides, both ways
    got, opt, _ = train(dp(inner, microbatches=microbatches), callable_loss=callable_loss)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(opt.iterations.numpy()) == STEPS and int(opt.noise_draws.numpy()) == STEPS


def test_eager_matches_function():
    ref, _, _ = reference("adam", 2)
    got, _, _ = train(dp("adam", microbatches=2), use_function=False)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def noise_run(noise, microbatches=None, seed=7, steps=2, size=20000, lr=0.5):
    """Per-example losses that do not depend on `v`: each update of `v` is the noise alone,
    -lr * noise_multiplier * C / microbatches * N(0, 1)."""
    v, u = tf.Variable(tf.zeros([size])), tf.Variable(tf.zeros([size]))
    opt = dm.DifferentialPrivacy(dm.Optimizer(keras.optimizers.SGD(lr)), l2_norm_clip=CLIP,
                                 noise_multiplier=noise, num_microbatches=microbatches, seed=seed)
    w = tf.Variable(W0)
    updates = []

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_losses(w, B0, x, y) + 0.0 * tf.reduce_sum(v) + 0.0 * tf.reduce_sum(u)
        opt.minimize(loss, [w, v, u], tape=tape)

    for s in range(steps):
        before = v.numpy()
        step(tf.constant(X[s]), tf.constant(Y[s]))
        updates.append(v.numpy() - before)
    if noise:  # each variable draws its own noise
        assert abs(np.corrcoef(v.numpy(), u.numpy())[0, 1]) < 0.03
    return updates, opt


@pytest.mark.parametrize("microbatches", [None, 2])
def test_noise_has_the_documented_standard_deviation(microbatches):
    noise, lr = 1.3, 0.5
    updates, _ = noise_run(noise, microbatches, lr=lr)
    expected = lr * noise * CLIP / (microbatches or BATCH)
    for u in updates:
        assert abs(u.std() / expected - 1) < 0.03  # 20000 draws: the estimate's sd is 0.5%
        assert abs(u.mean()) < 0.03 * expected
    assert abs(np.corrcoef(updates[0], updates[1])[0, 1]) < 0.03  # a fresh draw every step


def test_noise_is_reproducible_from_the_seed_and_differs_between_seeds():
    a, _ = noise_run(1.0, seed=3)
    b, _ = noise_run(1.0, seed=3)
    c, _ = noise_run(1.0, seed=4)
    np.testing.assert_array_equal(a[0], b[0])
    assert abs(np.corrcoef(a[0], c[0])[0, 1]) < 0.03


def test_unseeded_runs_draw_different_noise():
    a, opt_a = noise_run(1.0, seed=None, steps=1)
    b, opt_b = noise_run(1.0, seed=None, steps=1)
    assert int(opt_a.noise_seed.numpy()) != int(opt_b.noise_seed.numpy())
    assert abs(np.corrcoef(a[0], b[0])[0, 1]) < 0.03


def test_noise_off_is_exactly_the_clipped_mean():
    updates, _ = noise_run(0.0)
    assert all(np.all(u == 0) for u in updates)


def test_per_example_gradients_are_vectorised():
    """tf.GradientTape.jacobian with pfor: one batched computation (a fallback to a while
    loop over the examples would show as While ops in the traced step)."""
    step = make_step(dp("sgd"), tf.Variable(W0), tf.Variable(B0))
    graph = step.get_concrete_function(tf.constant(X[0]), tf.constant(Y[0])).graph
    ops = [op.type for op in graph.get_operations()]
    functions = [f for f in graph._functions.values()] if hasattr(graph, "_functions") else []
    for f in functions:
        ops += [n.op for n in f.definition.node_def]
    assert not [o for o in ops if "While" in o], sorted(set(ops))
    assert "BatchMatMulV2" in ops or "MatMul" in ops


# -- stacks ----------------------------------------------------------------------------


def test_loss_scaling_inside_changes_nothing():
    """DP(LSO(...)): the clip norm is measured on unscaled gradients and the noise is added
    in scaled units before the unscaling, so the run equals DP without loss scaling."""
    ref, _, _ = train(dp("adam", noise=0.7, microbatches=4))
    got, opt, _ = train(dm.DifferentialPrivacy(dm.LossScaleOptimizer(dm.Optimizer(INNER["adam"]()), initial_scale=1024.0),
                                               l2_norm_clip=CLIP, noise_multiplier=0.7, num_microbatches=4, seed=7))
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert float(opt.find(dm.LossScaleOptimizer).loss_scale.numpy()) == 1024.0


def test_overflow_under_loss_scaling_skips_the_step():
    opt = dm.DifferentialPrivacy(dm.LossScaleOptimizer(dm.Optimizer(INNER["sgd"]()), initial_scale=1e38),
                                 l2_norm_clip=CLIP, noise_multiplier=1.0, seed=7)
    got, opt, _ = train(opt, steps=[0])
    np.testing.assert_array_equal(got[0], W0)
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 0
    assert float(opt.find(dm.LossScaleOptimizer).loss_scale.numpy()) == pytest.approx(5e37)


def test_accumulation_inside_equals_the_larger_batch_noise_included():
    """DP(GradientAccumulation(2)) over two half batches = DP on the whole batch: the clipped
    sums add up, and the noise, added once per update, is divided by all 8 microbatches."""
    whole = dp("adam", noise=0.9)
    ref, _, _ = train(whole, steps=[0, 1])
    halves = dm.DifferentialPrivacy(dm.GradientAccumulation(dm.Optimizer(INNER["adam"]()), steps=2),
                                    l2_norm_clip=CLIP, noise_multiplier=0.9, seed=7)
    w, b = tf.Variable(W0), tf.Variable(B0)
    step = make_step(halves, w, b)
    for s in (0, 1):
        for part in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            step(tf.constant(X[s][part]), tf.constant(Y[s][part]))
    np.testing.assert_allclose(w.numpy(), ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), ref[1], rtol=1e-5, atol=1e-6)
    assert int(halves.iterations.numpy()) == 2 and int(halves.noise_draws.numpy()) == 2


def test_clipper_after_the_noise():
    """transform_gradients of the wrapped optimizer (a global-norm clip) acts on the noised mean."""
    got, opt, _ = train(dp("sgd", noise=5.0, transform_gradients=dm.clip_by_global_norm(0.01)), steps=[0])
    step = np.concatenate([(got[0] - W0).ravel(), got[1].ravel()])
    assert np.linalg.norm(step) == pytest.approx(0.1 * 0.01, rel=1e-4)  # lr * clip
    assert int(opt.gradient_stats()["clipped_steps"]) == 1


@pytest.mark.parametrize("outer", ["accumulation", "loss_scale"])
def test_wrappers_around_it_are_refused(outer):
    inner = dp("sgd")
    with pytest.raises(ValueError, match="must sit inside DifferentialPrivacy"):
        if outer == "accumulation":
            dm.GradientAccumulation(inner, steps=2)
        else:
            dm.LossScaleOptimizer(inner)


def test_two_are_refused_and_weight_wrappers_combine():
    with pytest.raises(ValueError, match="already holds a DifferentialPrivacy"):
        dm.DifferentialPrivacy(dp("sgd"), l2_norm_clip=1.0, noise_multiplier=0.0)
    opt = dm.MovingAverage(dm.DifferentialPrivacy(dm.DecoupledWeightDecay(dm.Optimizer(INNER["sgd"]()), 0.01),
                                                  l2_norm_clip=CLIP, noise_multiplier=0.0), 0.9)
    train(opt, steps=[0, 1])
    assert int(opt.iterations.numpy()) == 2


def test_inner_get_gradients_override_is_refused():
    class Custom(dm.OptimizerWrapper):
        def get_gradients(self, loss, variables, tape):
            return super().get_gradients(loss, variables, tape)

    with pytest.raises(ValueError, match="get_gradients` override of the wrapped Custom would never run"):
        dm.DifferentialPrivacy(Custom(dm.Optimizer("sgd")), l2_norm_clip=1.0, noise_multiplier=0.0)


# -- fit -------------------------------------------------------------------------------


def linear_model():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(OUTPUTS)])
    model.layers[0].kernel.assign(W0)
    model.layers[0].bias.assign(B0)
    return model


def test_fit_through_integrate_equals_the_custom_loop_noise_included():
    model = linear_model()
    model.compile(loss=keras.losses.MeanSquaredError(reduction=None), optimizer=dp("adam", noise=0.8, microbatches=2))
    dm.integrate(model)
    history = model.fit(X.reshape(-1, FEATURES), Y.reshape(-1, OUTPUTS), batch_size=BATCH, shuffle=False,
                        epochs=1, verbose=0)
    ref, _, _ = train(dp("adam", noise=0.8, microbatches=2))
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.layers[0].bias.numpy(), ref[1], rtol=1e-5, atol=1e-6)
    assert np.isfinite(history.history["loss"][0])


def test_fit_logs_the_mean_per_example_loss():
    model = linear_model()
    model.compile(loss=keras.losses.MeanSquaredError(reduction=None),
                  optimizer=dm.DifferentialPrivacy(dm.Optimizer(keras.optimizers.SGD(0.0)), 1.0, 0.0))
    dm.integrate(model)
    history = model.fit(X[0], Y[0], batch_size=BATCH, epochs=1, verbose=0)
    expected = float(np.mean(per_example_losses(W0, B0, X[0], Y[0])))
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-5)


def test_plain_fit_is_refused_with_the_fix():
    model = linear_model()
    model.compile(loss=keras.losses.MeanSquaredError(reduction=None), optimizer=dp("sgd"))
    with pytest.raises(RuntimeError, match="dist_minimize.integrate"):
        model.fit(X[0], Y[0], batch_size=BATCH, epochs=1, verbose=0)


def test_a_reduced_loss_under_fit_names_the_fix():
    model = linear_model()
    model.compile(loss="mse", optimizer=dp("sgd"))
    dm.integrate(model)
    with pytest.raises(ValueError, match=r"reduction=None.*Received: loss of shape \(\)"):
        model.fit(X[0], Y[0], batch_size=BATCH, epochs=1, verbose=0)


# -- state -----------------------------------------------------------------------------


def test_checkpoint_resumes_exactly_noise_included(tmp_path):
    ref, _, _ = train(dp("adam", noise=1.1, microbatches=2))
    first = dp("adam", noise=1.1, microbatches=2)
    _, _, variables = train(first, steps=range(2))
    path = tf.train.Checkpoint(optimizer=first, w=variables[0], b=variables[1]).write(str(tmp_path / "c"))
    w, b = tf.Variable(tf.zeros_like(W0)), tf.Variable(tf.zeros_like(B0))
    second = dp("adam", noise=1.1, microbatches=2, seed=None)  # the seed comes from the checkpoint
    second.build([w, b])
    tf.train.Checkpoint(optimizer=second, w=w, b=b).read(path).assert_consumed()
    assert int(second.noise_seed.numpy()) == 7 and int(second.noise_draws.numpy()) == 2
    got, _, _ = train(second, steps=range(2, STEPS), variables=(w, b))
    for a, r in zip(got, ref):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-7)


def test_keras_file_resumes_exactly_noise_included(tmp_path):
    x, y = X.reshape(-1, FEATURES), Y.reshape(-1, OUTPUTS)

    def compiled():
        model = linear_model()
        model.compile(loss=keras.losses.MeanSquaredError(reduction=None), optimizer=dp("adam", noise=1.1))
        return dm.integrate(model)

    ref = compiled()
    ref.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    first = compiled()
    first.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    first.save(tmp_path / "m.keras")
    restored = dm.integrate(keras.saving.load_model(tmp_path / "m.keras"))
    opt = restored.optimizer
    assert isinstance(opt, dm.DifferentialPrivacy) and int(opt.noise_draws.numpy()) == 2
    restored.fit(x[2 * BATCH:], y[2 * BATCH:], batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
    for a, r in zip(restored.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-7)


def test_config_round_trip():
    opt = dm.DifferentialPrivacy(dm.Optimizer(keras.optimizers.Adam(0.01)), l2_norm_clip=0.7, noise_multiplier=1.2,
                                 num_microbatches=4, seed=99, name="private")
    config = opt.get_config()
    again = dm.DifferentialPrivacy.from_config(config)
    assert again.get_config() == config
    assert (again.l2_norm_clip, again.noise_multiplier, again.num_microbatches, again.seed) == (0.7, 1.2, 4, 99)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert isinstance(restored, dm.DifferentialPrivacy) and restored.get_config() == config


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    ({"l2_norm_clip": 0.0}, ValueError, r"`l2_norm_clip` must be a positive finite number. Received: l2_norm_clip=0.0"),
    ({"l2_norm_clip": -1.0}, ValueError, r"l2_norm_clip=-1.0"),
    ({"l2_norm_clip": float("inf")}, ValueError, r"l2_norm_clip=inf"),
    ({"l2_norm_clip": "1"}, TypeError, r"l2_norm_clip='1'"),
    ({"noise_multiplier": -0.1}, ValueError, r"`noise_multiplier` must be a finite number >= 0. Received: noise_multiplier=-0.1"),
    ({"noise_multiplier": float("nan")}, ValueError, r"noise_multiplier=nan"),
    ({"num_microbatches": 0}, ValueError, r"`num_microbatches` must be an integer >= 1. Received: num_microbatches=0"),
    ({"num_microbatches": 2.0}, ValueError, r"num_microbatches=2.0"),
    ({"seed": -1}, ValueError, r"`seed` must be an integer in \[0, 2\*\*63\) or None. Received: seed=-1"),
    ({"seed": 2 ** 63}, ValueError, r"seed=9223372036854775808"),
    ({"seed": "7"}, TypeError, r"seed='7'"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = {"l2_norm_clip": 1.0, "noise_multiplier": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        dm.DifferentialPrivacy(dm.Optimizer("sgd"), **args)


def test_a_keras_optimizer_is_refused():
    with pytest.raises(TypeError, match="must be a dist_minimize optimizer"):
        dm.DifferentialPrivacy(keras.optimizers.SGD(), l2_norm_clip=1.0, noise_multiplier=1.0)


def test_microbatches_that_do_not_divide_the_batch_at_the_first_step():
    with pytest.raises(ValueError, match="`num_microbatches` must divide the batch on each replica. "
                                         "Received: num_microbatches=3 for a batch of 8"):
        train(dp("sgd", microbatches=3), steps=[0])


def test_microbatches_that_do_not_divide_a_batch_of_unknown_size():
    opt = dp("sgd", microbatches=3)
    w, b = tf.Variable(W0), tf.Variable(B0)

    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES]), tf.TensorSpec([None, OUTPUTS])])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = per_example_losses(w, b, x, y)
        opt.minimize(loss, [w, b], tape=tape)

    step(tf.constant(X[0][:6]), tf.constant(Y[0][:6]))  # 6 = 3 x 2: fine
    with pytest.raises(tf.errors.InvalidArgumentError, match="`num_microbatches`=3 must divide the batch"):
        step(tf.constant(X[0]), tf.constant(Y[0]))


def test_a_scalar_loss_is_refused():
    """(A loss [batch, ...] is accepted, its trailing axes averaged: test_ported_semantics.py.)"""
    w = tf.Variable(1.0)
    opt = dp("sgd")
    with tf.GradientTape() as tape:
        loss = tf.ones(()) * w
    with pytest.raises(ValueError, match=r"per-example losses of the batch.*Received: loss of shape \(\)"):
        opt.minimize(loss, [w], tape=tape)


def test_apply_gradients_with_outside_gradients_is_refused():
    w = tf.Variable(W0)
    opt = dp("sgd")
    with pytest.raises(RuntimeError, match="computes the gradients itself"):
        opt.apply_gradients([(tf.ones_like(W0), w)])
