"""dist_minimize/wrappers/sam.py and the public form it is written with: `get_gradients`'s
`loss_fn`, declared extra aggregations, and the wrapper contract's checks."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm

RHO, LR, STEPS = 0.05, 0.1, 4


def problem(seed=0, batch=16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, 3)).astype("float32")
    y = rng.normal(size=(batch, 2)).astype("float32")
    w = rng.normal(size=(3, 2)).astype("float32")
    b = rng.normal(size=(2,)).astype("float32")
    return x, y, w, b


def grad(x, y, w, b):
    r = x @ w + b - y
    return 2.0 * x.T @ r / len(x), 2.0 * r.sum(0) / len(x)


def numpy_sam(x, y, w, b, steps, adaptive=False, rule="sgd"):
    """SAM (ASAM) in float64: e from the batch's gradient, g' at w + e, the rule applied to g'."""
    w, b = w.astype("float64"), b.astype("float64")
    m = [np.zeros_like(w), np.zeros_like(b)]
    v = [np.zeros_like(w), np.zeros_like(b)]
    for t in range(1, steps + 1):
        g = grad(x, y, w, b)
        scale = [np.abs(w), np.abs(b)] if adaptive else [1.0, 1.0]
        norm = np.sqrt(sum(np.sum((s * gi) ** 2) for s, gi in zip(scale, g)))
        e = [RHO * (s ** 2) * gi / (norm + 1e-12) for s, gi in zip(scale, g)]
        g2 = grad(x, y, w + e[0], b + e[1])
        params = [w, b]
        for i, gi in enumerate(g2):
            if rule == "sgd":
                params[i] = params[i] - LR * gi
            else:  # Keras Adam
                m[i] = 0.9 * m[i] + 0.1 * gi
                v[i] = 0.999 * v[i] + 0.001 * gi ** 2
                alpha = LR * np.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
                params[i] = params[i] - alpha * m[i] / (np.sqrt(v[i]) + 1e-7)
        w, b = params
    return w, b


def inner(rule):
    return keras.optimizers.SGD(LR) if rule == "sgd" else keras.optimizers.Adam(LR)


@pytest.mark.parametrize("rule", ["sgd", "adam"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("use_function", [False, True])
def test_sam_matches_numpy_in_a_custom_loop(rule, adaptive, use_function):
    x, y, w0, b0 = problem()
    w, b = tf.Variable(w0), tf.Variable(b0)
    opt = dm.SAM(dm.Optimizer(inner(rule)), rho=RHO, adaptive=adaptive)

    def step():
        opt.minimize(lambda: tf.reduce_mean(tf.reduce_sum(tf.square(x @ w + b - y), axis=-1)), [w, b])

    step = tf.function(step) if use_function else step
    for _ in range(STEPS):
        step()
    want_w, want_b = numpy_sam(x, y, w0, b0, STEPS, adaptive, rule)
    tol = 2e-6 if rule == "sgd" else 1e-5  # float32 against float64; Adam divides by small moments
    np.testing.assert_allclose(w.numpy(), want_w, atol=tol)
    np.testing.assert_allclose(b.numpy(), want_b, atol=tol)
    assert int(opt.iterations.numpy()) == STEPS


def test_sam_differs_from_the_plain_rule_and_asam_from_sam():
    """The test problem is one where the perturbation shows (else parity proves nothing)."""
    x, y, w0, b0 = problem()
    sam, _ = numpy_sam(x, y, w0, b0, STEPS)
    asam, _ = numpy_sam(x, y, w0, b0, STEPS, adaptive=True)
    w = w0.astype("float64")
    b = b0.astype("float64")
    for _ in range(STEPS):
        gw, gb = grad(x, y, w, b)
        w, b = w - LR * gw, b - LR * gb
    assert np.abs(sam - w).max() > 1e-3 and np.abs(asam - sam).max() > 1e-3


def test_sam_under_fit_through_integrate_matches_numpy():
    x, y, w0, b0 = problem()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.set_weights([w0, b0])
    model.compile(optimizer=dm.SAM(dm.Optimizer(keras.optimizers.SGD(LR)), rho=RHO),
                  loss=lambda yt, yp: tf.reduce_sum(tf.square(yp - yt), axis=-1))
    dm.integrate(model)
    model.fit(x, y, batch_size=len(x), epochs=STEPS, shuffle=False, verbose=0)
    want_w, want_b = numpy_sam(x, y, w0, b0, STEPS)
    np.testing.assert_allclose(model.get_weights()[0], want_w, atol=2e-6)
    np.testing.assert_allclose(model.get_weights()[1], want_b, atol=2e-6)


def test_sam_refuses_a_tensor_loss_without_loss_fn():
    w = tf.Variable([1.0])
    opt = dm.SAM(dm.Optimizer(keras.optimizers.SGD(0.1)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * w)
    with pytest.raises(ValueError, match="SAM evaluates the loss a second time.*integrate"):
        opt.minimize(loss, [w], tape=tape)


def test_plain_fit_error_names_every_route():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=dm.SAM(dm.Optimizer(keras.optimizers.SGD(LR))), loss="mse")
    x, y, _, _ = problem()
    with pytest.raises(RuntimeError) as info:
        model.fit(x, y, epochs=1, verbose=0)
    for route in ("dist_minimize.integrate(model)", "train_step", "optimizer.minimize(loss_fn",
                  "transform_unaggregated_gradients"):
        assert route in str(info.value)


class OwnStep(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x, y, self(x, training=True))

        def loss_fn():
            return self.compute_loss(x, y, self(x, training=True))

        self.optimizer.minimize(loss, self.trainable_variables, tape=tape, loss_fn=loss_fn)
        return {"loss": loss}


def test_integrate_refuses_to_replace_a_users_train_step_and_that_step_works():
    x, y, w0, b0 = problem()
    inp = keras.Input((3,))
    model = OwnStep(inp, keras.layers.Dense(2)(inp))
    model.set_weights([w0, b0])
    model.compile(optimizer=dm.SAM(dm.Optimizer(keras.optimizers.SGD(LR)), rho=RHO),
                  loss=lambda yt, yp: tf.reduce_sum(tf.square(yp - yt), axis=-1))
    with pytest.raises(ValueError, match="OwnStep defines its own `train_step`"):
        dm.integrate(model)
    model.fit(x, y, batch_size=len(x), epochs=STEPS, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0], numpy_sam(x, y, w0, b0, STEPS)[0], atol=2e-6)


class KeepsLossOnSelf(dm.OptimizerWrapper):
    """The trap: state kept on the shared wrapper between stages."""

    def get_gradients(self, loss, variables, tape, loss_fn=None):
        self.last_loss_fn = loss_fn
        return super().get_gradients(loss, variables, tape, loss_fn=loss_fn)


def test_state_kept_on_self_during_a_step_is_refused_naming_the_rule():
    w = tf.Variable([1.0])
    opt = KeepsLossOnSelf(dm.Optimizer(keras.optimizers.SGD(0.1)))
    opt.build([w])
    with pytest.raises(dm.ContractError, match="KeepsLossOnSelf.last_loss_fn.*every replica"):
        tf.function(lambda: opt.minimize(lambda: tf.reduce_sum(w * w), [w]))()


class AggregatesTwice(dm.OptimizerWrapper):
    """Aggregates the gradient in `get_gradients` (as SAM does), with or without declaring it."""

    def __init__(self, optimizer, declared, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.extra_aggregations = 1 if declared else 0

    def get_gradients(self, loss, variables, tape, loss_fn=None):
        out = super().get_gradients(loss, variables, tape, loss_fn=loss_fn)
        self.aggregate_gradients(out)
        return out


@pytest.mark.parametrize("declared", [False, True])
def test_an_extra_aggregation_counts_only_when_declared(declared):
    w = tf.Variable([1.0])
    opt = AggregatesTwice(dm.Optimizer(keras.optimizers.SGD(0.1)), declared)
    step = tf.function(lambda: opt.minimize(lambda: tf.reduce_sum(w * w), [w]))
    if declared:
        step()
        np.testing.assert_allclose(w.numpy(), [0.8])
    else:
        with pytest.raises(dm.aggregation.AggregationError, match="ran 2 times in one step.*1 declared"):
            step()


def test_sam_saves_and_loads():
    opt = dm.SAM(dm.Optimizer(keras.optimizers.Adam(0.01)), rho=0.1, adaptive=True, per_replica=True)
    again = dm.SAM.from_config(opt.get_config())
    assert (again.rho, again.adaptive, again.per_replica, again.extra_aggregations) == (0.1, True, True, 0)
    with pytest.raises(ValueError, match="rho"):
        dm.SAM(dm.Optimizer(keras.optimizers.SGD(0.1)), rho=0.0)


class Centralize(dm.OptimizerWrapper):
    """Gradient centralization: a user's `transform_gradients` wrapper."""

    def transform_gradients(self, grads_and_vars):
        return super().transform_gradients([(g - tf.reduce_mean(g), v) for g, v in grads_and_vars])


def test_a_custom_stage_traces_without_autograph_warnings_from_the_package(caplog):
    """Every run with a custom stage printed "AutoGraph could not transform <function
    discover ...>: for/else statement not yet supported"."""
    import logging

    w = tf.Variable([1.0, 2.0])
    opt = Centralize(dm.Optimizer(keras.optimizers.SGD(0.1)))

    @tf.function
    def step():
        opt.minimize(lambda: tf.reduce_sum(w * w), [w])

    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        step()
    assert not [r for r in caplog.records if "AutoGraph could not transform" in r.getMessage()], caplog.text
    np.testing.assert_allclose(w.numpy(), [1.1, 1.9])


def numpy_sam_accumulated(x, y, w, b, updates, k):
    """SGD + SAM under accumulation over k micro-batches: a perturbation per micro-step
    (from that micro-batch's gradient), the second gradients averaged over the k."""
    w, b = w.astype("float64"), b.astype("float64")
    n = len(x) // (updates * k)
    for u in range(updates):
        total = [np.zeros_like(w), np.zeros_like(b)]
        for m in range(k):
            rows = slice((u * k + m) * n, (u * k + m + 1) * n)
            g = grad(x[rows], y[rows], w, b)
            norm = np.sqrt(sum(np.sum(t ** 2) for t in g))
            e = [RHO * t / (norm + 1e-12) for t in g]
            total = [a + c / k for a, c in zip(total, grad(x[rows], y[rows], w + e[0], b + e[1]))]
        w, b = w - LR * total[0], b - LR * total[1]
    return w, b


@pytest.mark.parametrize("outside", [False, True])
def test_sam_under_accumulation_perturbs_at_every_micro_step(outside):
    """Either order of SAM and GradientAccumulation: one perturbation per micro-step, from
    that micro-batch's gradient; one update per k micro-steps."""
    x, y, w0, b0 = problem(batch=32)
    w, b = tf.Variable(w0), tf.Variable(b0)
    base = dm.Optimizer(keras.optimizers.SGD(LR))
    opt = (dm.SAM(dm.GradientAccumulation(base, steps=2), rho=RHO) if outside
           else dm.GradientAccumulation(dm.SAM(base, rho=RHO), steps=2))

    @tf.function
    def step(xb, yb):
        opt.minimize(lambda: tf.reduce_mean(tf.reduce_sum(tf.square(xb @ w + b - yb), axis=-1)), [w, b])

    for m in range(4):
        step(x[m * 8:(m + 1) * 8], y[m * 8:(m + 1) * 8])
    want_w, want_b = numpy_sam_accumulated(x, y, w0, b0, updates=2, k=2)
    np.testing.assert_allclose(w.numpy(), want_w, atol=2e-6)
    np.testing.assert_allclose(b.numpy(), want_b, atol=2e-6)
    assert int(opt.iterations.numpy()) == 2


def test_loss_scaling_cancels_in_the_perturbation():
    """The perturbation uses the gradient's direction: a loss scale of 1024 around SAM
    gives SAM's weights (the second gradient is unscaled as any other)."""
    x, y, w0, b0 = problem()
    out = []
    for scaled in (False, True):
        w, b = tf.Variable(w0), tf.Variable(b0)
        opt = dm.SAM(dm.Optimizer(keras.optimizers.SGD(LR)), rho=RHO)
        if scaled:
            opt = dm.LossScaleOptimizer(opt, initial_scale=1024.0, dynamic=False)
        step = tf.function(lambda: opt.minimize(
            lambda: tf.reduce_mean(tf.reduce_sum(tf.square(x @ w + b - y), axis=-1)), [w, b]))
        for _ in range(STEPS):
            step()
        out.append((w.numpy(), b.numpy()))
    np.testing.assert_allclose(out[1][0], out[0][0], atol=1e-6)
    np.testing.assert_allclose(out[0][0], numpy_sam(x, y, w0, b0, STEPS)[0], atol=2e-6)


@keras.saving.register_keras_serializable(package="test_sam")
def squared_error(yt, yp):
    return tf.reduce_sum(tf.square(yp - yt), axis=-1)


@pytest.mark.parametrize("form", ["keras", "checkpoint"])
def test_a_stack_with_sam_resumes_exactly(tmp_path, form):
    """MovingAverage(DecoupledWeightDecay(SAM(Adam + clip))): 3 steps, saved, loaded into a
    fresh model and optimizer, 3 more steps == 6 steps without a break, bit for bit."""
    x, y, w0, b0 = problem()

    def build():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.set_weights([w0, b0])
        opt = dm.MovingAverage(dm.DecoupledWeightDecay(dm.SAM(dm.Optimizer(
            keras.optimizers.Adam(LR), transform_gradients=dm.clip_by_global_norm(0.5)), rho=RHO, adaptive=True),
            weight_decay=0.01), average_decay=0.9)
        model.compile(optimizer=opt, loss=squared_error)
        dm.integrate(model)
        return model

    def fit(model, epochs):
        model.fit(x, y, batch_size=len(x), epochs=epochs, shuffle=False, verbose=0)

    straight = build()
    fit(straight, 6)
    first = build()
    fit(first, 3)
    if form == "keras":
        first.save(tmp_path / "m.keras")
        second = keras.models.load_model(tmp_path / "m.keras")
        dm.integrate(second)
    else:
        tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(str(tmp_path / "ckpt"))
        second = build()
        second.optimizer.build(second.trainable_variables)
        tf.train.Checkpoint(model=second, optimizer=second.optimizer).read(str(tmp_path / "ckpt")).assert_consumed()
    fit(second, 3)
    for a, c in zip(straight.get_weights(), second.get_weights()):
        np.testing.assert_array_equal(a, c)
    for a, c in zip(straight.optimizer.variables, second.optimizer.variables):
        np.testing.assert_array_equal(np.array(a), np.array(c))
