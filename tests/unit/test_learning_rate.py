"""Horovod's learning-rate callbacks (`dm.horovod_keras.LearningRateWarmupCallback`,
`LearningRateScheduleCallback`) set Horovod's rates at every batch, their momentum
correction gives Horovod's corrected SGD step, and `EpochSchedule` gives the same rates
as a Keras schedule (custom loops, MirroredStrategy). The expected rates are Horovod's
formulas written out here (horovod/_keras/callbacks.py): warmup
`lr / size * ((epoch + batch / spe + 1 / spe) * (size - 1) / warmup_epochs + 1)`, a
schedule `lr * multiplier(epoch)` (a number m: `m ** (epoch - start_epoch)`), staircase at each epoch's
first batch; outside its epochs a callback sets nothing."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy

hk = dm.horovod_keras
SPE, LR = 4, 0.1


class Rates(keras.callbacks.Callback):
    """The learning rate each batch runs with (read after the callbacks before it)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))


def fit(callbacks, epochs, optimizer=None, seed=0, strategy=None):
    keras.utils.set_random_seed(seed)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
        model.compile(optimizer=optimizer or dm.Optimizer(keras.optimizers.SGD(LR)),
                      loss=lambda y, p: tf.reduce_mean(p, axis=-1))
    x = np.random.default_rng(seed).normal(size=(SPE * 2, 3)).astype("float32")
    rates = Rates()
    history = model.fit(x, np.zeros((SPE * 2, 1), "float32"), batch_size=2, epochs=epochs, shuffle=False,
                        verbose=0, callbacks=[*callbacks, rates])
    return model, rates.rates, history, x


def horovod_warmup(epoch, batch, size, warmup_epochs, lr=LR):
    e = epoch + batch / SPE + 1.0 / SPE
    return lr / size * (e * (size - 1) / warmup_epochs + 1)


def test_warmup_rises_per_batch_from_lr_over_size_to_lr_then_stays():
    _, rates, history, _ = fit([hk.LearningRateWarmupCallback(LR, warmup_epochs=2, size=4)], epochs=3)
    expected = [horovod_warmup(e, b, 4, 2) for e in range(2) for b in range(SPE)]
    expected += [expected[-1]] * SPE  # after the warmup the rate stays where it ended: lr
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
    assert abs(expected[-1] - LR) < 1e-12 and abs(expected[0] - LR / 4 * (0.25 * 3 / 2 + 1)) < 1e-12
    np.testing.assert_allclose(history.history["lr"], [expected[SPE - 1], LR, LR], rtol=1e-6)


def test_schedule_staircase_with_a_number_is_exponential_per_epoch_inside_its_epochs():
    _, rates, _, _ = fit([hk.LearningRateScheduleCallback(LR, 0.5, start_epoch=1, end_epoch=3)], epochs=5)
    per_epoch = [LR, LR, LR * 0.5, LR * 0.5, LR * 0.5]  # m ** (epoch - start_epoch); epoch 0: the optimizer's own
    np.testing.assert_allclose(rates, np.repeat(per_epoch, SPE), rtol=1e-6)


def test_schedule_without_staircase_uses_the_fractional_epoch():
    callback = hk.LearningRateScheduleCallback(LR, lambda e: 1.0 / (1.0 + e), start_epoch=1, staircase=False,
                                               steps_per_epoch=SPE)
    _, rates, _, _ = fit([callback], epochs=3)
    expected = [LR] * SPE + [LR / (1.0 + e + b / SPE) for e in (1, 2) for b in range(SPE)]
    np.testing.assert_allclose(rates, expected, rtol=1e-6)


def callbacks_of_a_real_job():
    """Horovod's ImageNet pattern, small: warm up, then steps down, then a decay."""
    return [hk.LearningRateWarmupCallback(LR, warmup_epochs=2, size=4, momentum_correction=False),
            hk.LearningRateScheduleCallback(LR, 1.0, start_epoch=2, end_epoch=3, momentum_correction=False),
            hk.LearningRateScheduleCallback(LR, lambda e: 0.1, start_epoch=3, end_epoch=4, momentum_correction=False),
            hk.LearningRateScheduleCallback(LR, lambda e: 0.5 ** e, start_epoch=4, staircase=False,
                                            steps_per_epoch=SPE, momentum_correction=False)]


def overlapping_callbacks():
    """A staircase schedule inside a warmup: at each epoch's first batch both act and the
    later one in the list wins; at the other batches only the warmup acts."""
    return [hk.LearningRateWarmupCallback(LR, warmup_epochs=3, size=4, momentum_correction=False),
            hk.LearningRateScheduleCallback(LR, 0.5, start_epoch=1, end_epoch=3, momentum_correction=False)]


@pytest.mark.parametrize("make", [callbacks_of_a_real_job, overlapping_callbacks], ids=["in-turn", "overlapping"])
def test_epoch_schedule_gives_the_rates_the_callbacks_set_at_every_step(make):
    _, rates, _, _ = fit(make(), epochs=6)
    schedule = hk.EpochSchedule(make(), steps_per_epoch=SPE)
    got = [float(schedule(tf.constant(s, tf.int64))) for s in range(len(rates))]
    np.testing.assert_allclose(got, rates, rtol=1e-6)
    assert len(set(np.round(rates, 9))) > 8  # the rates do change (warmup, steps, decay)


def test_epoch_schedule_in_a_custom_loop_under_mirrored_strategy():
    strategy = mirrored_strategy()
    callbacks = callbacks_of_a_real_job()
    schedule = hk.EpochSchedule(callbacks, steps_per_epoch=SPE)
    expected = [float(schedule(tf.constant(s, tf.int64))) for s in range(SPE * 6)]
    with strategy.scope():
        v = keras.Variable(np.zeros(2, "float32"))
        opt = dm.Optimizer(keras.optimizers.SGD(hk.EpochSchedule(callbacks_of_a_real_job(), steps_per_epoch=SPE)))
        opt.build([v])

    @tf.function
    def step():
        def replica():
            opt.apply_gradients([(tf.ones([2]), v)])
        strategy.run(replica)

    total = 0.0
    for s in range(SPE * 6):
        step()
        total += expected[s] * 2  # two replicas' ones, summed
    np.testing.assert_allclose(v.numpy(), [-total, -total], rtol=1e-5)


def test_warmup_under_mirrored_strategy_takes_the_strategys_size():
    """Keras runs callbacks outside the strategy's scope; the warmup's size is the model's
    strategy's replicas (2 here), not 1."""
    strategy = mirrored_strategy()
    with strategy.scope():
        optimizer = dm.Optimizer(keras.optimizers.SGD(LR))
        _, rates, _, _ = fit([hk.LearningRateWarmupCallback(LR, warmup_epochs=2)], epochs=1, optimizer=optimizer,
                             strategy=strategy)
    np.testing.assert_allclose(rates, [horovod_warmup(0, b, 2, 2) for b in range(SPE)], rtol=1e-6)


def test_momentum_correction_is_horovods_corrected_sgd_step():
    """Horovod multiplies the momentum by new / old for the step where the rate changes;
    the callback rescales the slot instead: the same SGD step."""
    optimizer = dm.Optimizer(keras.optimizers.SGD(LR, momentum=0.9))
    model, rates, _, x = fit([hk.LearningRateWarmupCallback(LR, warmup_epochs=2, size=4)], epochs=3,
                             optimizer=optimizer)
    keras.utils.set_random_seed(0)
    w = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)]).get_weights()[0][:, 0]
    w = w.astype(np.float64)
    velocity, old = np.zeros(3), LR
    for epoch in range(3):
        for b in range(SPE):
            new = rates[epoch * SPE + b]
            g = x[2 * b:2 * b + 2].mean(axis=0)  # d mean(x @ w) / dw over the batch of 2
            velocity = 0.9 * (new / old) * velocity - new * g
            w = w + velocity
            old = new
    np.testing.assert_allclose(model.get_weights()[0][:, 0], w, rtol=1e-5, atol=1e-6)
    plain, _, _, _ = fit([hk.LearningRateWarmupCallback(LR, warmup_epochs=2, size=4, momentum_correction=False)],
                         epochs=3, optimizer=dm.Optimizer(keras.optimizers.SGD(LR, momentum=0.9)))
    assert np.max(np.abs(plain.get_weights()[0][:, 0] - w)) > 1e-3  # the correction matters here


def test_momentum_correction_leaves_a_rule_without_momentum_alone():
    """As Horovod's: only a rule with a `momentum` is corrected (Adam has none)."""
    _, rates, _, _ = fit([hk.LearningRateWarmupCallback(LR, warmup_epochs=2, size=4)], epochs=1,
                         optimizer=dm.Optimizer(keras.optimizers.Adam(LR)))
    np.testing.assert_allclose(rates, [horovod_warmup(0, b, 4, 2) for b in range(SPE)], rtol=1e-6)


def test_momentum_correction_is_refused_for_nesterov_naming_the_way_out():
    with pytest.raises(ValueError, match=r"Nesterov SGD.*momentum_correction=False"):
        fit([hk.LearningRateWarmupCallback(LR, warmup_epochs=2, size=4)], epochs=1,
            optimizer=dm.Optimizer(keras.optimizers.SGD(LR, momentum=0.9, nesterov=True)))


@pytest.mark.parametrize("make,error,needle", [
    (lambda: hk.LearningRateScheduleCallback(None, 0.5), ValueError, "initial_lr"),
    (lambda: hk.LearningRateScheduleCallback(LR, "fast"), TypeError, "multiplier='fast'"),
    (lambda: hk.LearningRateScheduleCallback(LR, 0.5, steps_per_epoch=0), ValueError, "steps_per_epoch=0"),
    (lambda: hk.EpochSchedule([], steps_per_epoch=4), TypeError, "callbacks=[]"),
    (lambda: hk.EpochSchedule(callbacks_of_a_real_job(), steps_per_epoch=2.5), ValueError, "steps_per_epoch=2.5"),
    (lambda: hk.EpochSchedule(callbacks_of_a_real_job(), steps_per_epoch=4).get_config(), TypeError, "not saved"),
])
def test_bad_arguments_are_named(make, error, needle):
    with pytest.raises(error) as raised:
        make()
    assert needle in str(raised.value)
