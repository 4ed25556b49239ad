"""Loss scaling, accumulation and the non-finite limit in one process (one device)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import parity_lib as P


def base(opt_name="sgd", clip=True, **kw):
    return dm.Optimizer(P.make_inner(keras, opt_name),
                        transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM) if clip else None, **kw)


def fit(opt, micro_batch=P.GLOBAL_BATCH, steps=P.STEPS, data_steps=None, epochs=1):
    x, y = P.make_data(data_steps or steps)
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=opt)
    model.fit(x, y, batch_size=micro_batch, epochs=epochs, verbose=0, shuffle=False)
    return model


def test_loss_scaling_by_a_power_of_two_changes_nothing():
    ref = fit(base("adam"))
    scaled = dm.LossScaleOptimizer(base("adam"), initial_scale=2.0 ** 10)
    got = fit(scaled)
    assert P.max_abs_diff(P.weights(ref), P.weights(got)) == 0.0
    assert float(scaled.loss_scale.numpy()) == 2.0 ** 10


def test_clipper_sees_unscaled_gradients():
    clip = dm.clip_by_global_norm(1e9)
    opt = dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=clip), initial_scale=256.0)
    v = tf.Variable([3.0, 4.0])
    opt.minimize(lambda: 0.5 * tf.reduce_sum(v * v), [v])
    assert float(clip.stats()["global_norm"]) == pytest.approx(5.0)


@pytest.mark.parametrize("use_function", [False, True])
def test_dynamic_scale_backs_off_on_skip_and_grows_after_interval(use_function):
    opt = dm.LossScaleOptimizer(base("adam", clip=False), initial_scale=8.0, growth_interval=2)
    v = tf.Variable([1.0, 2.0])

    def step(g):
        opt.apply_gradients([(g, v)])

    if use_function:
        step = tf.function(step)
    step(tf.constant([np.inf, 0.0]))
    assert float(opt.loss_scale.numpy()) == 4.0 and int(opt.skipped_steps.numpy()) == 1
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert int(opt.iterations.numpy()) == 0
    step(tf.constant([4.0, 4.0]))
    assert float(opt.loss_scale.numpy()) == 4.0
    step(tf.constant([4.0, 4.0]))
    assert float(opt.loss_scale.numpy()) == 8.0  # 2 good steps in a row
    assert int(opt.iterations.numpy()) == 2


def test_fixed_scale_never_changes_but_still_skips():
    opt = dm.LossScaleOptimizer(base(clip=False), initial_scale=16.0, dynamic=False, growth_interval=1)
    v = tf.Variable([1.0])
    for g in ([np.nan], [1.0], [1.0]):
        opt.apply_gradients([(tf.constant(g), v)])
    assert float(opt.loss_scale.numpy()) == 16.0
    assert int(opt.skipped_steps.numpy()) == 1
    assert np.isfinite(v.numpy()).all()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_fit(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        opt = dm.LossScaleOptimizer(base("adam"))
        model = P.make_model(keras)
        model.compile(loss="mse", optimizer=opt, auto_scale_loss=False)
        x, y = P.make_data()
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False)
        assert model.layers[0].compute_dtype == policy.split("_")[1]
        assert all(np.isfinite(w).all() for w in model.get_weights())
        assert int(opt.iterations.numpy()) + int(opt.skipped_steps.numpy()) == 2 * P.STEPS
        assert int(opt.iterations.numpy()) >= P.STEPS
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_keras_auto_loss_scale_wrapping_is_refused():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = P.make_model(keras)
        with pytest.raises(TypeError, match="auto_scale_loss=False"):
            model.compile(loss="mse", optimizer=base())
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_accumulation_equals_one_step_on_the_larger_batch(k, opt_name):
    ref = fit(base(opt_name), micro_batch=P.GLOBAL_BATCH * k, data_steps=P.STEPS * k)
    acc = dm.GradientAccumulation(base(opt_name), k)
    got = fit(acc, micro_batch=P.GLOBAL_BATCH, data_steps=P.STEPS * k)
    assert P.max_abs_diff(P.weights(ref), P.weights(got)) <= 1e-6
    assert int(acc.iterations.numpy()) == P.STEPS
    assert int(acc.micro_step.numpy()) == P.STEPS * k


def test_clipping_acts_on_the_accumulated_gradient():
    clip = dm.clip_by_global_norm(100.0)
    acc = dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(1.0), transform_gradients=clip), 2)
    v = tf.Variable([0.0])
    acc.apply_gradients([(tf.constant([3.0]), v)])
    assert float(clip.stats()["steps"]) == 0.0  # no update yet
    np.testing.assert_array_equal(v.numpy(), [0.0])
    acc.apply_gradients([(tf.constant([5.0]), v)])
    assert float(clip.stats()["global_norm"]) == pytest.approx(4.0)  # mean of 3 and 5
    np.testing.assert_allclose(v.numpy(), [-4.0])


def test_accumulation_with_average_false_updates_with_the_sum_of_the_micro_steps_gradients():
    clip = dm.clip_by_global_norm(100.0)
    acc = dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(1.0), transform_gradients=clip), 3,
                                  average=False)
    v = tf.Variable([0.0, 0.0])
    for g in ([3.0, 1.0], [5.0, -2.0], [-1.0, 0.5]):
        acc.apply_gradients([(tf.constant(g), v)])
    np.testing.assert_allclose(v.numpy(), [-7.0, 0.5])  # minus the sum, not the mean
    assert float(clip.stats()["global_norm"]) == pytest.approx(np.hypot(7.0, 0.5))
    assert int(acc.iterations.numpy()) == 1 and int(acc.micro_step.numpy()) == 3
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(acc))
    assert again.average is False and again.steps == 3
    with pytest.raises(TypeError, match="average='no'"):
        dm.GradientAccumulation(base(), 2, average="no")


@pytest.mark.parametrize("order", ["lso(acc(opt))", "acc(lso(opt))"])
def test_stacking_orders_give_the_same_result(order):
    k = 2
    ref = fit(base("adam"), micro_batch=P.GLOBAL_BATCH * k, data_steps=P.STEPS * k)
    if order == "lso(acc(opt))":
        opt = dm.LossScaleOptimizer(dm.GradientAccumulation(base("adam"), k), initial_scale=1024.0)
    else:
        opt = dm.GradientAccumulation(dm.LossScaleOptimizer(base("adam"), initial_scale=1024.0), k)
    got = fit(opt, data_steps=P.STEPS * k)
    assert P.max_abs_diff(P.weights(ref), P.weights(got)) <= 1e-6


@pytest.mark.parametrize("make,needle", [
    (lambda: dm.LossScaleOptimizer(dm.LossScaleOptimizer(base())), "one LossScaleOptimizer per stack"),
    (lambda: dm.GradientAccumulation(dm.LossScaleOptimizer(dm.GradientAccumulation(base(), 2)), 2),
     "one GradientAccumulation per stack"),
    (lambda: dm.GradientAccumulation(base(), 0), "steps=0"),
    (lambda: dm.GradientAccumulation(base(), 2.5), "steps=2.5"),
    (lambda: dm.LossScaleOptimizer(base(), initial_scale=0), "initial_scale=0"),
    (lambda: dm.LossScaleOptimizer(base(), growth_interval=0), "growth_interval=0"),
    (lambda: dm.LossScaleOptimizer(base(), growth_factor=1.0), "growth_factor=1.0"),
    (lambda: dm.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "type SGD"),
    (lambda: dm.limit_nonfinite_steps(0), "max_consecutive=0"),
])
def test_refused_stacks_and_arguments(make, needle):
    with pytest.raises((ValueError, TypeError)) as info:
        make()
    assert needle in str(info.value)


def test_limit_needs_the_guard():
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), skip_nonfinite=False,
                       transform_gradients=dm.limit_nonfinite_steps(2))
    with pytest.raises(ValueError, match="skip_nonfinite=False"):
        opt.build([tf.Variable(1.0)])


@pytest.mark.parametrize("use_function", [False, True])
def test_consecutive_nonfinite_limit_stops_training(use_function):
    limit = dm.limit_nonfinite_steps(2)
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=limit)
    v = tf.Variable([1.0])

    def step(g):
        opt.apply_gradients([(g, v)])

    if use_function:
        step = tf.function(step)
    nan, one = tf.constant([np.nan]), tf.constant([1.0])
    for g in (nan, nan, one, nan, nan):  # a finite step resets the count
        step(g)
    assert int(limit.stats()["consecutive_nonfinite_steps"].numpy()) == 2
    with pytest.raises(tf.errors.InvalidArgumentError, match="more than 2 consecutive steps"):
        step(nan)
    assert np.isfinite(v.numpy()).all()


def test_wrapper_configs_round_trip():
    opt = dm.GradientAccumulation(dm.LossScaleOptimizer(base("adam"), initial_scale=64.0, growth_interval=7), 3)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is dm.GradientAccumulation and again.steps == 3
    assert type(again.wrapped) is dm.LossScaleOptimizer and again.wrapped.growth_interval == 7
    assert again.get_config() == opt.get_config()


def test_resume_mid_accumulation_continues_exactly(tmp_path):
    x, y = P.make_data(steps=6)

    def make():
        model = P.make_model(keras)
        opt = dm.GradientAccumulation(dm.LossScaleOptimizer(base("adam"), initial_scale=512.0, growth_interval=2), 2)
        opt.build(model.trainable_variables)
        return model, opt

    def train(model, opt, batches):
        P.train_batches(model, opt, x, y, batches)

    model_a, opt_a = make()
    train(model_a, opt_a, [0, 1, 2])  # 1.5 updates: mid-accumulation
    path = tf.train.Checkpoint(model=model_a, optimizer=opt_a).save(os.path.join(tmp_path, "ckpt"))
    train(model_a, opt_a, [3, 4, 5])

    model_b, opt_b = make()
    tf.train.Checkpoint(model=model_b, optimizer=opt_b).restore(path).assert_consumed()
    assert int(opt_b.micro_step.numpy()) == 3
    train(model_b, opt_b, [3, 4, 5])
    assert P.max_abs_diff(P.weights(model_a), P.weights(model_b)) == 0.0
    assert float(opt_b.wrapped.loss_scale.numpy()) == float(opt_a.wrapped.loss_scale.numpy()) == 1024.0
    for a, b in zip(opt_a.variables, opt_b.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_stats_logger_writes_fit_logs_and_tensorboard(tmp_path):
    opt = dm.LossScaleOptimizer(base("sgd"), initial_scale=8.0, growth_interval=2)
    x, y = P.make_data()
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=opt)
    history = model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                        callbacks=[dm.callbacks.GradientStatsLogger(log_dir=str(tmp_path))])
    # 4 finite steps per epoch, growth every 2: 8 -> 32 -> 128.
    assert history.history["loss_scale"] == [32.0, 128.0]
    assert history.history["clipped_share"] == [1.0, 1.0]
    events = {}
    for path in tmp_path.iterdir():
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                events.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert events["gradients/loss_scale"] == [32.0, 128.0]
    assert events["gradients/grad_norm"] == pytest.approx(history.history["grad_norm"])
    assert set(events) >= {"gradients/clipped_share", "gradients/skipped_steps"}


@pytest.mark.parametrize("use_function", [False, True])
def test_none_gradient_at_the_boundary_keeps_its_window(use_function):
    """Defect: a variable whose gradient was None at the update's micro-step lost the
    whole window's accumulated gradient (b stayed at 2.0)."""
    a, b, never = tf.Variable([1.0]), tf.Variable([2.0]), tf.Variable([5.0])
    opt = dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(1.0)), steps=2)

    def full():
        opt.apply_gradients([(tf.constant([1.0]), a), (tf.constant([4.0]), b), (None, never)])

    def partial():
        opt.apply_gradients([(tf.constant([3.0]), a), (None, b), (None, never)])

    if use_function:
        full, partial = tf.function(full), tf.function(partial)
    full()
    partial()
    assert float(a.numpy()[0]) == -1.0  # 1 - (1 + 3) / 2
    assert float(b.numpy()[0]) == 0.0  # 2 - (4 + nothing) / 2
    assert float(never.numpy()[0]) == 5.0  # never had a gradient: not updated
    assert int(opt.iterations.numpy()) == 1


def test_share_accumulators_callback_counts_batches_across_epochs(monkeypatch):
    """It shares every N batches counted over the whole run (as ModelCheckpoint(save_freq=N)
    counts), and at each epoch end; it finds the accumulation anywhere in the stack."""
    calls = []
    monkeypatch.setattr(dm.GradientAccumulation, "share_accumulators", lambda self: calls.append(self))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    accumulation = dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(0.1)), steps=2)
    model.compile(loss="mse", optimizer=dm.LossScaleOptimizer(accumulation))
    x = np.ones((6, 2), "float32")  # 3 batches an epoch
    callback = dm.horovod_keras.ShareAccumulatorsCallback(every_n_batches=2)
    model.fit(x, x[:, :1], batch_size=2, epochs=2, verbose=0, callbacks=[callback])
    # batches 2, 4, 6 of the run (one falls in epoch 2's middle) + 2 epoch ends
    assert len(calls) == 5 and all(c is accumulation for c in calls)
    with pytest.raises(ValueError, match="every_n_batches=0"):
        dm.horovod_keras.ShareAccumulatorsCallback(every_n_batches=0)
