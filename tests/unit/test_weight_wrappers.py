"""MovingAverage, SWA, Lookahead and DecoupledWeightDecay against NumPy references of their
rules, over several steps, with SGD and Adam as the inner update rule."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm

STEPS = 9
RNG = np.random.default_rng(4)
GRADS = [RNG.normal(size=(3,)).astype("float32") for _ in range(STEPS)]
W0 = np.array([1.0, -2.0, 0.5], "float32")
INNER = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.05)}


def stock_trajectory(inner_name, grads=GRADS):
    """The weights after each update with the stock Keras rule on the same gradients."""
    v = tf.Variable(W0)
    opt = INNER[inner_name]()
    out = []
    for g in grads:
        opt.apply_gradients([(tf.constant(g), v)])
        out.append(v.numpy().astype("float64"))
    return out


def run(opt, grads=GRADS, use_function=True, nan_at=None):
    v = tf.Variable(W0)
    opt.build([v])

    def step(g):
        opt.apply_gradients([(g, v)])

    step = tf.function(step) if use_function else step
    for i, g in enumerate(grads):
        step(tf.constant(np.full(3, np.nan, "float32") if i == nan_at else g))
    return v, opt


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("dynamic,start", [(False, 0), (True, 0), (False, 3), (True, 2)])
def test_moving_average_rule(inner, dynamic, start):
    decay = 0.8
    v, opt = run(dm.MovingAverage(dm.Optimizer(INNER[inner]()), average_decay=decay, dynamic_decay=dynamic,
                                  start_step=start))
    avg = W0.astype("float64")
    for t, w in enumerate(stock_trajectory(inner), start=1):
        if t <= start:
            avg = w
        else:
            c = t - 1 - start  # averaging updates before this one (TF Addons' count)
            d = min(decay, (1 + c) / (10 + c)) if dynamic else decay
            avg = d * avg + (1 - d) * w
    np.testing.assert_allclose(opt.average_of(v).numpy(), avg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(v.numpy(), stock_trajectory(inner)[-1], rtol=1e-5, atol=1e-6)  # weights untouched


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("start,period", [(0, 1), (2, 3), (4, 2)])
def test_swa_rule(inner, start, period):
    v, opt = run(dm.SWA(dm.Optimizer(INNER[inner]()), start_averaging=start, average_period=period))
    avg, n = W0.astype("float64"), 0
    for t, w in enumerate(stock_trajectory(inner), start=1):
        if t >= start and (t - start) % period == 0:
            avg, n = (avg * n + w) / (n + 1), n + 1
    np.testing.assert_allclose(opt.average_of(v).numpy(), avg, rtol=1e-5, atol=1e-6)
    assert int(opt.num_averaged.numpy()) == n and n > 1


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("period,alpha", [(1, 0.5), (3, 0.5), (4, 1.0), (2, 0.25)])
def test_lookahead_rule(inner, period, alpha):
    v, opt = run(dm.Lookahead(dm.Optimizer(INNER[inner]()), sync_period=period, slow_step_size=alpha))
    # Reference: the stock rule step by step, synchronising by hand.
    ref = tf.Variable(W0)
    stock = INNER[inner]()
    slow = W0.astype("float64")
    for t, g in enumerate(GRADS, start=1):
        stock.apply_gradients([(tf.constant(g), ref)])
        if t % period == 0:
            slow = slow + alpha * (ref.numpy() - slow)
            ref.assign(slow.astype("float32"))
    np.testing.assert_allclose(v.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.slot("slow", v).numpy(), slow, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", ["sgd", "adam"])
@pytest.mark.parametrize("scale", [False, True])
def test_decoupled_weight_decay_rule(inner, scale):
    wd = 0.05
    v, opt = run(dm.DecoupledWeightDecay(dm.Optimizer(INNER[inner]()), wd, scale_by_learning_rate=scale))
    ref = tf.Variable(W0)
    stock = INNER[inner]()
    lr = float(stock.learning_rate.numpy())
    for g in GRADS:
        ref.assign(ref.numpy() - wd * (lr if scale else 1.0) * ref.numpy())
        stock.apply_gradients([(tf.constant(g), ref)])
    np.testing.assert_allclose(v.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_decoupled_weight_decay_is_keras_adamw_with_lr_scaling():
    """An independent reference: Keras's own AdamW decays exactly this way."""
    v, _ = run(dm.DecoupledWeightDecay(dm.Optimizer(keras.optimizers.Adam(0.05)), 0.1, scale_by_learning_rate=True))
    ref = tf.Variable(W0)
    adamw = keras.optimizers.AdamW(0.05, weight_decay=0.1)
    for g in GRADS:
        adamw.apply_gradients([(tf.constant(g), ref)])
    np.testing.assert_allclose(v.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_decay_is_not_seen_by_the_clipper_or_adam():
    """The decay never enters the gradient: with a clip that always fires, the step is
    the clipped step of the gradient alone, plus the decay."""
    v = tf.Variable(W0)
    opt = dm.DecoupledWeightDecay(dm.Optimizer(keras.optimizers.SGD(1.0), transform_gradients=dm.clip_by_global_norm(0.1)),
                                  0.5)
    g = np.array([3.0, 4.0, 0.0], "float32")  # norm 5, clipped to 0.1
    opt.apply_gradients([(tf.constant(g), v)])
    expected = W0 * 0.5 - g / 5.0 * 0.1
    np.testing.assert_allclose(v.numpy(), expected, rtol=1e-6)
    assert float(opt.gradient_stats()["global_norm"]) == pytest.approx(5.0)


def test_exclusions_decay_var_list_and_schedule():
    kernel = tf.Variable([1.0, 1.0], name="kernel")
    bias = tf.Variable([1.0], name="bias")
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    opt = dm.DecoupledWeightDecay(dm.Optimizer(keras.optimizers.SGD(0.0)), schedule, exclude_from_weight_decay=["bias"])
    zeros = [(tf.zeros([2]), kernel), (tf.zeros([1]), bias)]
    opt.apply_gradients(zeros)  # t = 0: decay 0.5, bias excluded
    np.testing.assert_allclose(kernel.numpy(), [0.5, 0.5])
    np.testing.assert_allclose(bias.numpy(), [1.0])
    opt.apply_gradients(zeros, decay_var_list=[bias])  # t = 1: decay 0.25, this step only the bias
    np.testing.assert_allclose(kernel.numpy(), [0.5, 0.5])
    np.testing.assert_allclose(bias.numpy(), [0.75])
    opt.apply_gradients(zeros)  # back to the default choice: decay 0.125
    np.testing.assert_allclose(kernel.numpy(), [0.4375, 0.4375])
    with pytest.raises(ValueError, match="does not train"):
        opt.apply_gradients(zeros, decay_var_list=[tf.Variable([0.0])])
    with pytest.raises(ValueError, match="needs a `dist_minimize.DecoupledWeightDecay`"):
        dm.Optimizer(keras.optimizers.SGD(0.1)).apply_gradients(zeros, decay_var_list=[bias])


@pytest.mark.parametrize("make", [
    lambda o: dm.MovingAverage(o, 0.5), lambda o: dm.SWA(o, 0, 1), lambda o: dm.Lookahead(o, 1, 0.5),
    lambda o: dm.DecoupledWeightDecay(o, 0.1)], ids=["ma", "swa", "lookahead", "decay"])
def test_a_skipped_step_changes_nothing(make):
    clean_v, clean = run(make(dm.Optimizer(keras.optimizers.SGD(0.1))), grads=GRADS[:3])
    v, opt = run(make(dm.Optimizer(keras.optimizers.SGD(0.1))), grads=GRADS[:2] + [GRADS[0]] + GRADS[2:3], nan_at=2)
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 3
    np.testing.assert_allclose(v.numpy(), clean_v.numpy(), rtol=1e-6)
    for a, b in zip(opt.variables, clean.variables):
        if a.name != "skipped_steps":  # every other state variable: as if the step never happened
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, err_msg=a.name)


def test_averaged_weights_swap_and_assign():
    v, opt = run(dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(0.1)), 0.5))
    trained, average = v.numpy(), opt.average_of(v).numpy()
    with opt.averaged_weights():
        np.testing.assert_array_equal(v.numpy(), average)
    np.testing.assert_array_equal(v.numpy(), trained)
    opt.assign_average_vars()
    np.testing.assert_array_equal(v.numpy(), average)
    with pytest.raises(ValueError, match="needs the optimizer built"):
        dm.SWA(dm.Optimizer(keras.optimizers.SGD(0.1))).averaged_weights()


@pytest.mark.parametrize("make", [
    lambda o: dm.MovingAverage(o, 0.7, True, 2), lambda o: dm.SWA(o, 1, 2), lambda o: dm.Lookahead(o, 3, 0.4),
    lambda o: dm.DecoupledWeightDecay(o, keras.optimizers.schedules.ExponentialDecay(0.1, 5, 0.9), ["bias"], True)],
    ids=["ma", "swa", "lookahead", "decay"])
def test_checkpoint_resume_and_config_round_trip(make, tmp_path):
    """Stopping after 4 of 9 steps and restoring into a fresh optimizer ends where the
    uninterrupted run ends (averages, slow weights, snapshot counts included); the
    config rebuilds the same wrapper."""
    full_v, full = run(make(dm.Optimizer(keras.optimizers.Adam(0.05))))
    v, opt = run(make(dm.Optimizer(keras.optimizers.Adam(0.05))), grads=GRADS[:4])
    path = tf.train.Checkpoint(v=v, optimizer=opt).write(str(tmp_path / "c"))
    v2 = tf.Variable(np.zeros(3, "float32"))
    again = make(dm.Optimizer(keras.optimizers.Adam(0.05)))
    again.build([v2])
    tf.train.Checkpoint(v=v2, optimizer=again).read(path).assert_consumed()
    step = tf.function(lambda g: again.apply_gradients([(g, v2)]))
    for g in GRADS[4:]:
        step(tf.constant(g))
    np.testing.assert_allclose(v2.numpy(), full_v.numpy(), rtol=1e-6)
    for a, b in zip(again.variables, full.variables):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
    rebuilt = type(opt).from_config(opt.get_config())
    assert rebuilt.get_config() == opt.get_config()


@pytest.mark.parametrize("make", [
    lambda o: dm.MovingAverage(o, 0.7, True, 2), lambda o: dm.SWA(o, 1, 2), lambda o: dm.Lookahead(o, 3, 0.4),
    lambda o: dm.DecoupledWeightDecay(o, 0.1, ["bias"], True)], ids=["ma", "swa", "lookahead", "decay"])
def test_keras_file_resumes_exactly(make, tmp_path):
    """`model.save` after 3 of 8 batches of `fit`, `keras.saving.load_model`, 5 more:
    the weights and every optimizer variable (averages, slow weights, snapshot counts,
    Adam's moments) end as in the uninterrupted run."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")

    def compiled():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer=make(dm.Optimizer(keras.optimizers.Adam(0.05))))
        return model

    ref = compiled()
    ref.fit(x, y, batch_size=8, shuffle=False, epochs=1, verbose=0)
    first = compiled()
    first.fit(x[:24], y[:24], batch_size=8, shuffle=False, epochs=1, verbose=0)
    first.save(tmp_path / "m.keras")
    restored = keras.saving.load_model(tmp_path / "m.keras")
    assert type(restored.optimizer) is type(ref.optimizer) and int(restored.optimizer.iterations.numpy()) == 3
    restored.fit(x[24:], y[24:], batch_size=8, shuffle=False, epochs=1, verbose=0)
    for a, r in zip(restored.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-7)
    assert len(restored.optimizer.variables) == len(ref.optimizer.variables)
    for a, r in zip(restored.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(np.array(a), np.array(r), rtol=1e-6, atol=1e-7, err_msg=a.path)


def test_update_batch_norm_recomputes_the_statistics():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.BatchNormalization()])
    x = np.random.default_rng(1).normal(loc=3.0, size=(64, 2)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices(x).batch(16)
    bn = model.layers[-1]
    used = dm.update_batch_norm(model, ds)
    assert used == 4 and bn.momentum == 0.99
    h = model.layers[0](x).numpy()
    batches = [h[i:i + 16] for i in range(0, 64, 16)]
    np.testing.assert_allclose(bn.moving_mean.numpy(), np.mean([b.mean(0) for b in batches], 0), rtol=1e-4)
    np.testing.assert_allclose(bn.moving_variance.numpy(), np.mean([b.var(0) for b in batches], 0), rtol=1e-3)
    assert dm.update_batch_norm(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), ds) == 0


@pytest.mark.parametrize("call,error,words", [
    (lambda o: dm.MovingAverage(o, average_decay=1.5), ValueError, "average_decay=1.5"),
    (lambda o: dm.MovingAverage(o, average_decay="0.9"), TypeError, "average_decay='0.9'"),
    (lambda o: dm.MovingAverage(o, start_step=-1), ValueError, "start_step=-1"),
    (lambda o: dm.MovingAverage(o, dynamic_decay=1), TypeError, "dynamic_decay=1"),
    (lambda o: dm.SWA(o, start_averaging=-2), ValueError, "start_averaging=-2"),
    (lambda o: dm.SWA(o, average_period=0), ValueError, "average_period=0"),
    (lambda o: dm.Lookahead(o, sync_period=0), ValueError, "sync_period=0"),
    (lambda o: dm.Lookahead(o, slow_step_size=0.0), ValueError, "slow_step_size=0.0"),
    (lambda o: dm.Lookahead(o, slow_step_size=1.5), ValueError, "slow_step_size=1.5"),
    (lambda o: dm.DecoupledWeightDecay(o, -0.1), ValueError, "weight_decay=-0.1"),
    (lambda o: dm.DecoupledWeightDecay(o, 0.1, exclude_from_weight_decay=[3]), TypeError, "exclude_from_weight_decay[0]=3"),
    (lambda o: dm.MovingAverage(dm.MovingAverage(o)), ValueError, "one MovingAverage per stack"),
    (lambda o: dm.Lookahead(dm.SWA(dm.Lookahead(o))), ValueError, "one Lookahead per stack"),
])
def test_bad_arguments_fail_at_construction(call, error, words):
    with pytest.raises(error, match=None) as e:
        call(dm.Optimizer(keras.optimizers.SGD(0.1)))
    assert words in str(e.value)


def test_averaged_weights_callback_evaluates_and_restores(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(0.05)), 0.5)
    model.compile(loss="mse", optimizer=opt)
    x = np.random.default_rng(2).normal(size=(32, 3)).astype("float32")
    y = x.sum(1, keepdims=True)
    path = str(tmp_path / "avg-{epoch}.keras")
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0,
                        callbacks=[dm.callbacks.AveragedWeights(validation_data=(x, y), filepath=path)])
    assert len(history.history["averaged_loss"]) == 2
    saved = keras.saving.load_model(str(tmp_path / "avg-2.keras"))
    np.testing.assert_allclose(saved.layers[0].kernel.numpy(), opt.average_of(model.layers[0].kernel).numpy(),
                               rtol=1e-6)
    assert not np.allclose(model.layers[0].kernel.numpy(), saved.layers[0].kernel.numpy())  # weights restored
    with pytest.raises(ValueError, match="needs `validation_data`, `filepath` or both"):
        dm.callbacks.AveragedWeights()
