"""What users porting from TF Addons and TF Privacy expect, against NumPy
references written from those libraries' documented rules (neither library is
installable here):

* MovingAverage: TF Addons' decay rule (`dynamic_decay` counts the averaging updates
  made BEFORE the current one; `num_updates` caps the decay at (1 + n) / (10 + n));
* SWA / MovingAverage `assign_average_vars(model.variables)`: variables without an
  average (BatchNormalization statistics) are skipped with one warning;
* DecoupledWeightDecay: a number, a schedule, a callable of the count, or a
  zero-argument callable; `weight_decay` reads the wrapper's own setting;
* DifferentialPrivacy: a per-example loss [batch, ...] is reduced by the mean of its
  trailing axes (TF Privacy's reshape to [microbatches, -1] and mean over axis 1).
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy

STEPS = 9
RNG = np.random.default_rng(22)
GRADS = [RNG.normal(size=(3,)).astype("float32") for _ in range(STEPS)]
W0 = np.array([1.0, -2.0, 0.5], "float32")
LR = 0.1


def sgd_trajectory(w0=W0, grads=GRADS, lr=LR):
    """The weights after each plain SGD update, in float64 (NumPy)."""
    w, out = w0.astype("float64"), []
    for g in grads:
        w = w - lr * g.astype("float64")
        out.append(w)
    return out


def run(opt, grads=GRADS, w0=W0, between=None):
    """Applies `grads` one update at a time in a tf.function; `between(i)` runs eagerly
    before update i (to change a variable the optimizer reads)."""
    v = tf.Variable(w0)
    opt.build([v])
    step = tf.function(lambda g: opt.apply_gradients([(g, v)]))
    for i, g in enumerate(grads):
        if between is not None:
            between(i)
        step(tf.constant(g))
    return v, opt


# -- 1. MovingAverage: TF Addons' decay ---------------------------------------------------


def tfa_moving_average(w0, trajectory, average_decay, start_step=0, dynamic_decay=False, num_updates=None):
    """TF Addons' MovingAverage, written from its source (optimizers/moving_average.py):
    `average_decay = min(average_decay, (1 + n) / (10 + n))` with `num_updates` n;
    `_get_decay(step)` with step = the optimizer's `iterations` BEFORE this update
    (`_prepare_local` runs before Keras increments them): 0 if step < start_step, else
    with `dynamic_decay` min(average_decay, (1 + c) / (10 + c)) with c = step -
    start_step; then `moving_average_update(average, var, d)`: average -= (1 - d) *
    (average - var), var being the updated weights. `num_updates` may be a list (its
    value at each update). The average starts as the initial weights."""
    average = np.asarray(w0, "float64")
    for step, w in enumerate(trajectory):
        d = average_decay
        if num_updates is not None:
            n = num_updates[step] if isinstance(num_updates, list) else num_updates
            d = min(d, (1.0 + n) / (10.0 + n))
        if step < start_step:
            d = 0.0
        elif dynamic_decay:
            c = step - start_step
            d = min(d, (1.0 + c) / (10.0 + c))
        average = average - (1.0 - d) * (average - w)
    return average


@pytest.mark.parametrize("updates,expected", [(1, [0.82, 1.82]), (2, [0.64, 1.64])])
def test_moving_average_dynamic_decay_is_tf_addons_worked_example(updates, expected):
    """TF Addons' own `test_dynamic_decay`: weights [1, 2], gradient [0.1, 0.1], SGD(2.0),
    average_decay 0.5, dynamic: [0.64, 1.64] after TWO updates (the first update uses
    decay 0.1: [0.82, 1.82]; the old count, starting at 1, gave 2/11: [0.836, 1.836]).
    Tolerance rtol 1e-6: float32 arithmetic on values of order 1 (0.82 is 0.8199999)."""
    v = tf.Variable([1.0, 2.0])
    opt = dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(2.0)), average_decay=0.5, dynamic_decay=True)
    for _ in range(updates):
        opt.apply_gradients([(tf.constant([0.1, 0.1]), v)])
    assert expected == pytest.approx(list(tfa_moving_average([1.0, 2.0], sgd_trajectory(
        np.array([1.0, 2.0], "float32"), [np.array([0.1, 0.1], "float32")] * updates, 2.0), 0.5,
        dynamic_decay=True)), rel=1e-6)  # the reference reproduces TF Addons' numbers
    np.testing.assert_allclose(opt.average_of(v).numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("decay,start,dynamic,num_updates", [
    (0.8, 0, True, None), (0.95, 2, True, None), (0.8, 3, False, None), (0.99, 0, False, 4),
    (0.99, 1, True, 30), (0.5, 0, True, 0)])
def test_moving_average_matches_tf_addons_rule_over_steps(decay, start, dynamic, num_updates):
    """Nine SGD updates, against the NumPy TF Addons reference. Tolerance rtol 1e-5 /
    atol 1e-6: float32 state against a float64 reference over nine updates."""
    kwargs = {} if num_updates is None else {"num_updates": num_updates}
    v, opt = run(dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(LR)), average_decay=decay,
                                  dynamic_decay=dynamic, start_step=start, **kwargs))
    expected = tfa_moving_average(W0, sgd_trajectory(), decay, start, dynamic, num_updates)
    np.testing.assert_allclose(opt.average_of(v).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_moving_average_num_updates_variable_is_read_at_each_update():
    """A variable `num_updates` (a global step the user keeps, here moved by hand) is read
    at every update, also inside tf.function; it is not optimizer state. Tolerance as above."""
    counter = tf.Variable(0, dtype=tf.int64)
    values = [0, 0, 1, 5, 5, 2, 9, 40, 40]
    v, opt = run(dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(LR)), average_decay=0.9, num_updates=counter),
                 between=lambda i: counter.assign(values[i]))
    expected = tfa_moving_average(W0, sgd_trajectory(), 0.9, num_updates=values)
    np.testing.assert_allclose(opt.average_of(v).numpy(), expected, rtol=1e-5, atol=1e-6)
    assert opt.num_updates is counter
    assert not any(x is counter for x in opt.variables)
    assert opt.get_config()["num_updates"] is None  # a variable is not serialisable


def test_moving_average_num_updates_config_round_trip():
    opt = dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(LR)), 0.9, num_updates=np.int64(7))
    config = opt.get_config()
    assert config["num_updates"] == 7 and type(config["num_updates"]) is int
    rebuilt = dm.MovingAverage.from_config(config)
    assert rebuilt.num_updates == 7 and rebuilt.get_config() == config
    assert dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(LR))).get_config()["num_updates"] is None


@pytest.mark.parametrize("value", [1, np.int32(3), tf.Variable(1), tf.constant(2, tf.int64)],
                         ids=["int", "numpy", "variable", "tensor"])
def test_moving_average_num_updates_accepted(value):
    dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(LR)), num_updates=value)


@pytest.mark.parametrize("value,error", [
    (1.0, TypeError), (True, TypeError), ("a", TypeError), (tf.Variable(1.0), TypeError),
    (tf.constant([1, 2]), TypeError), (-1, ValueError)],
    ids=["float", "bool", "str", "float-variable", "vector", "negative"])
def test_moving_average_num_updates_refused(value, error):
    """As TF Addons (typeguard, `tf.debugging.assert_integer`): not a float, a string or a
    float variable; here also not a bool, a non-scalar or a negative count."""
    with pytest.raises(error, match=r"`num_updates` must be None, an integer >= 0, or an integer variable or "
                                    r"tensor .*Received: num_updates="):
        dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(LR)), num_updates=value)


# -- 2. assign_average_vars(model.variables) skips what it does not average ---------------


@pytest.mark.parametrize("make", [lambda o: dm.SWA(o, 0, 1), lambda o: dm.MovingAverage(o, 0.5)],
                         ids=["swa", "moving_average"])
def test_assign_average_vars_skips_batch_norm_statistics_with_one_warning(make, caplog):
    """TF Addons' usage `opt.assign_average_vars(model.variables)` on a model with a
    BatchNormalization layer: the trained variables get their averages (exactly: an
    assignment), the moving statistics stay as they are, and one warning names them."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    opt = make(dm.Optimizer(keras.optimizers.SGD(0.05)))
    model.compile(loss="mse", optimizer=opt)
    x = RNG.normal(size=(32, 3)).astype("float32")
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=1, verbose=0)
    bn = model.layers[1]
    statistics = [bn.moving_mean, bn.moving_variance]
    before = [s.numpy().copy() for s in statistics]
    averages = [opt.average_of(v).numpy() for v in model.trainable_variables]
    assert any(not np.array_equal(a, v.numpy()) for a, v in zip(averages, model.trainable_variables))
    with caplog.at_level(logging.WARNING, logger="dist_minimize"):
        skipped = opt.assign_average_vars(model.variables)
    for v, a in zip(model.trainable_variables, averages):
        np.testing.assert_array_equal(v.numpy(), a)
    for s, b in zip(statistics, before):
        np.testing.assert_array_equal(s.numpy(), b)
    assert [id(v) for v in skipped] == [id(s) for s in statistics]
    records = [r for r in caplog.records if r.name == "dist_minimize" and "assign_average_vars" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert bn.moving_mean.path in records[0].getMessage() and bn.moving_variance.path in records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dist_minimize"):
        assert opt.assign_average_vars(model.trainable_variables) == []
    assert not [r for r in caplog.records if r.name == "dist_minimize"]


# -- 3. DecoupledWeightDecay: every form of weight_decay ----------------------------------


class ZeroArgumentDecay:
    """A callable object with no argument (Keras's convention for a dynamic hyperparameter)."""

    def __call__(self):
        return 0.03


class UnreadableSignature:
    """A callable whose signature `inspect.signature` cannot read: called with the count."""

    __signature__ = "not a signature"

    def __call__(self, step):
        return 0.1 / (1.0 + tf.cast(step, tf.float32))


SCHEDULE = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=2, decay_rate=0.5)
DECAY_VARIABLE = tf.Variable(0.05)
DECAY_VALUES = [0.05, 0.05, 0.0, 0.2, 0.2, 0.1, 0.1, 0.01, 0.3]


def set_decay_variable(i):
    DECAY_VARIABLE.assign(DECAY_VALUES[i])


# name: (weight_decay, the rate at update t (t = updates before it), what runs before update i)
FORMS = {
    "number": (0.05, lambda t: 0.05, None),
    "schedule": (SCHEDULE, lambda t: 0.2 * 0.5 ** (t / 2), None),
    "one_argument": (lambda step: 0.1 * 0.8 ** tf.cast(step, tf.float32), lambda t: 0.1 * 0.8 ** t, None),
    "zero_argument": (lambda: 0.04, lambda t: 0.04, None),
    "zero_argument_object": (ZeroArgumentDecay(), lambda t: 0.03, None),
    "zero_argument_reads_a_variable": (lambda: DECAY_VARIABLE, lambda t: DECAY_VALUES[t], set_decay_variable),
    "unreadable_signature": (UnreadableSignature(), lambda t: 0.1 / (1.0 + t), None),
}


@pytest.mark.parametrize("scale", [False, True], ids=["unscaled", "lr_scaled"])
@pytest.mark.parametrize("form", list(FORMS))
def test_decoupled_weight_decay_forms_match_numpy(form, scale):
    """NumPy reference of the wrapper's rule: before update t (t = updates applied before
    it), w <- w - wd_t * s * w with s = 1 or the learning rate, then SGD: w <- w - lr * g.
    Tolerance rtol 1e-5 / atol 1e-6: float32 against float64 over nine updates."""
    weight_decay, rate, between = FORMS[form]
    v, opt = run(dm.DecoupledWeightDecay(dm.Optimizer(keras.optimizers.SGD(LR)), weight_decay,
                                         scale_by_learning_rate=scale), between=between)
    w = W0.astype("float64")
    for t, g in enumerate(GRADS):
        w = w - rate(t) * (LR if scale else 1.0) * w
        w = w - LR * g
    np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-6)


def test_decoupled_weight_decay_property_is_its_own_setting():
    """`weight_decay` on the wrapper is its setting (it read the Keras update rule's, None),
    and setting it replaces that setting, never the update rule's."""
    inner = keras.optimizers.SGD(LR, weight_decay=0.5)
    opt = dm.DecoupledWeightDecay(dm.Optimizer(inner), 0.1)
    assert opt.weight_decay == 0.1
    assert dm.DecoupledWeightDecay(dm.Optimizer(keras.optimizers.SGD(LR)), SCHEDULE).weight_decay is SCHEDULE
    opt.weight_decay = 0.25
    assert opt.weight_decay == 0.25 and inner.weight_decay == 0.5
    v = tf.Variable([2.0])
    opt.apply_gradients([(tf.constant([0.0]), v)])  # eager: decay 0.25, then the rule's own 0.5 * lr
    np.testing.assert_allclose(v.numpy(), [2.0 * 0.75 * (1 - 0.5 * LR)], rtol=1e-6)
    with pytest.raises(ValueError, match="weight_decay=-1"):
        opt.weight_decay = -1
    with pytest.raises(TypeError, match="weight_decay='x'"):
        dm.DecoupledWeightDecay(dm.Optimizer(keras.optimizers.SGD(LR)), "x")


# -- 4. DifferentialPrivacy: per-example losses [batch, ...] ------------------------------

BATCH, FEATURES, HEADS, DP_STEPS = 8, 4, 3, 4
DX = RNG.normal(size=(DP_STEPS, BATCH, FEATURES)).astype("float32")
DY = (RNG.normal(size=(DP_STEPS, BATCH, HEADS)) * np.geomspace(0.1, 6.0, BATCH)[None, :, None]).astype("float32")
DW0 = (0.2 * RNG.normal(size=(FEATURES, HEADS))).astype("float32")
CLIP = 1.0


def per_head_losses(w, x, y):
    """Per-example, per-head squared errors: shape [batch, 3]."""
    return tf.square(tf.matmul(x, w) - y)


def dp_optimizer(microbatches=None, noise=0.0):
    return dm.DifferentialPrivacy(dm.Optimizer(keras.optimizers.SGD(0.5)), l2_norm_clip=CLIP,
                                  noise_multiplier=noise, num_microbatches=microbatches, seed=3)


def dp_numpy(microbatches=None):
    """TF Privacy's rule in NumPy on the linear model: per-example loss = mean of the 3
    heads' squared errors; microbatch mean; each microbatch gradient clipped to CLIP;
    summed; divided by the number of microbatches; SGD(0.5)."""
    w = DW0.astype("float64")
    m = microbatches or BATCH
    for s in range(DP_STEPS):
        x, y = DX[s].astype("float64"), DY[s].astype("float64")
        r = x @ w - y                                              # (batch, heads)
        g = 2.0 / HEADS * x[:, :, None] * r[:, None, :]            # d(mean over heads)/dw
        g = g.reshape(m, -1, FEATURES, HEADS).mean(axis=1)
        f = np.minimum(1.0, CLIP / np.sqrt((g ** 2).sum(axis=(1, 2))))
        w = w - 0.5 * (f[:, None, None] * g).sum(0) / m
    return w


def dp_run(make_opt, reduce_first, replicas=1):
    """DP steps of the linear model with the [batch, 3] losses (or their mean over the
    heads, `reduce_first`), on one device or the global batch split over `replicas`;
    the optimizer is `make_opt()`, made in the strategy's scope."""
    strategy = mirrored_strategy() if replicas > 1 else tf.distribute.get_strategy()
    with strategy.scope():
        w = tf.Variable(DW0)
        opt = make_opt()
        opt.build([w])
    per_replica = BATCH // replicas

    def replica_step(x, y):
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        x, y = x[rid * per_replica:(rid + 1) * per_replica], y[rid * per_replica:(rid + 1) * per_replica]
        with tf.GradientTape() as tape:
            loss = per_head_losses(w, x, y)
            if reduce_first:
                loss = tf.reduce_mean(loss, axis=1)
        opt.minimize(loss, [w], tape=tape)

    step = tf.function(lambda x, y: strategy.run(replica_step, args=(x, y)))
    for s in range(DP_STEPS):
        step(tf.constant(DX[s]), tf.constant(DY[s]))
    return np.concatenate([np.array(c) for c in strategy.experimental_local_results(w)]).reshape(
        -1, FEATURES, HEADS) if replicas > 1 else w.numpy()[None]


@pytest.mark.parametrize("microbatches", [None, 2])
def test_dp_per_example_loss_with_trailing_axis_is_reduced_by_its_mean(microbatches):
    """[batch, 3] losses give the weights of their [batch] means (the same computation:
    rtol 1e-6), and both match the NumPy TF Privacy rule (float32 against float64 over
    four steps: rtol 1e-5, atol 1e-6). With noise, the same noise on both."""
    wide = dp_run(lambda: dp_optimizer(microbatches), reduce_first=False)[0]
    narrow = dp_run(lambda: dp_optimizer(microbatches), reduce_first=True)[0]
    np.testing.assert_allclose(wide, narrow, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(wide, dp_numpy(microbatches), rtol=1e-5, atol=1e-6)
    noisy = [dp_run(lambda: dp_optimizer(microbatches, noise=0.8), reduce_first=r)[0] for r in (False, True)]
    np.testing.assert_allclose(noisy[0], noisy[1], rtol=1e-6, atol=1e-7)


def test_dp_per_example_loss_with_trailing_axis_under_mirrored_strategy():
    """MirroredStrategy over 2 logical CPUs, 4 examples per replica: [batch, 3] losses give
    every replica the weights of the one-device run with the [batch] means (rtol 1e-5 /
    atol 1e-6: the cross-replica sum adds the clipped gradients in another order)."""
    copies = dp_run(dp_optimizer, reduce_first=False, replicas=2)
    one_device = dp_run(dp_optimizer, reduce_first=True)[0]
    assert len(copies) == 2
    for copy in copies:
        np.testing.assert_allclose(copy, one_device, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_device, dp_numpy(), rtol=1e-5, atol=1e-6)


def test_dp_fit_with_a_per_timestep_loss_equals_the_flattened_loss():
    """Under `fit` (integrate): outputs [batch, 3, 2] with MSE(reduction=None) give
    per-example losses [batch, 3]; the weights equal those of the same model with the
    outputs flattened to [batch, 6] (per-example losses [batch], the mean over 6).
    Tolerance rtol 1e-6 / atol 1e-7: the same means, summed in another order."""
    x = RNG.normal(size=(32, FEATURES)).astype("float32")
    y = RNG.normal(size=(32, 6)).astype("float32") * np.geomspace(0.1, 5.0, 32)[:, None].astype("float32")

    def fitted(shaped):
        keras.utils.set_random_seed(1)
        layers = [keras.Input((FEATURES,)), keras.layers.Dense(6)]
        model = keras.Sequential(layers + ([keras.layers.Reshape((3, 2))] if shaped else []))
        model.compile(loss=keras.losses.MeanSquaredError(reduction=None),
                      optimizer=dp_optimizer(microbatches=4, noise=0.5))
        dm.integrate(model)
        model.fit(x, y.reshape(-1, 3, 2) if shaped else y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0)
        return model.get_weights()

    for a, b in zip(fitted(True), fitted(False)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_dp_scalar_loss_still_refused():
    w = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = w * 2.0
    with pytest.raises(ValueError, match=r"per-example losses .*reduction=None.*Received: loss of shape \(\)"):
        dp_optimizer().minimize(loss, [w], tape=tape)
