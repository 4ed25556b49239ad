"""Keras settings on a wrapped Keras optimizer: invalid values are errors,
and the clipping settings may be changed on a built optimizer between steps."""

import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm

NAN, INF = float("nan"), float("inf")
CLIP_RULE = "a positive finite number (or None to turn clipping off)"
RULES = {
    "clipnorm": CLIP_RULE,
    "clipvalue": CLIP_RULE,
    "global_clipnorm": CLIP_RULE,
    "gradient_accumulation_steps": "an integer >= 2 (or None to turn accumulation off)",
    "ema_momentum": "a number in [0, 1]",
    "ema_overwrite_frequency": "an integer >= 1 (or None to never overwrite)",
    "loss_scale_factor": "a positive finite number (or None for no scaling)",
}
# (setting, invalid value, exception). Keras 3.15's constructor itself refuses some
# (gradient_accumulation_steps=1, ema_momentum=1.5, ...): those are set on the built
# Keras optimizer, which is what reaches dist_minimize.
INVALID = (
    [(s, v, ValueError) for s in ("clipnorm", "clipvalue", "global_clipnorm")
     for v in (-1, 0, 0.0, -0.5, NAN, INF, -INF, True)]
    + [(s, "1.0", TypeError) for s in ("clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")]
    + [("gradient_accumulation_steps", v, ValueError) for v in (1, 0, -3, 2.5, 2.0, True, NAN, INF)]
    + [("ema_momentum", v, ValueError) for v in (-0.1, 1.5, NAN, INF)]
    + [("ema_momentum", "0.9", TypeError)]
    + [("ema_overwrite_frequency", v, ValueError) for v in (0, -1, 2.0, NAN, INF)]
    + [("loss_scale_factor", v, ValueError) for v in (0.0, -1.0, NAN, INF, -INF)]
)


def _keras_optimizer(setting, value):
    """SGD with `setting=value`: through Keras's constructor when it takes the value,
    else assigned on the constructed optimizer."""
    extra = {"use_ema": True} if setting.startswith("ema_") else {}
    try:
        return keras.optimizers.SGD(0.1, **{setting: value}, **extra)
    except (TypeError, ValueError):
        k = keras.optimizers.SGD(0.1, **extra)
        setattr(k, setting, value)
        return k


@pytest.mark.parametrize("setting,value,error", INVALID, ids=[f"{s}={v!r}" for s, v, _ in INVALID])
def test_an_invalid_translated_setting_is_refused_in_keras_style(setting, value, error):
    message = f"`{setting}` must be {RULES[setting]}. Received: {setting}={value!r} on SGD"
    with pytest.raises(error, match=re.escape(message)):
        dm.Optimizer.from_keras(_keras_optimizer(setting, value))


@pytest.mark.parametrize("setting,value,error", [
    ("clipnorm", -1.0, ValueError), ("clipvalue", 0.0, ValueError), ("gradient_accumulation_steps", 0, ValueError),
    ("loss_scale_factor", NAN, ValueError), ("ema_overwrite_frequency", 0, ValueError)])
def test_an_invalid_setting_in_a_config_is_refused_too(setting, value, error):
    # (Keras's own deserialisation refuses what its constructor refuses.)
    k = _keras_optimizer(setting, value)
    config = {"optimizer": keras.saving.serialize_keras_object(k)}
    with pytest.raises(error, match=re.escape(f"`{setting}` must be {RULES[setting]}.")):
        dm.Optimizer.from_config(config)


@pytest.mark.parametrize("setting,value", [
    ("clipnorm", 0.5), ("clipvalue", np.float32(2.0)), ("global_clipnorm", 1), ("gradient_accumulation_steps", 2),
    ("gradient_accumulation_steps", np.int64(3)), ("ema_momentum", 0.0), ("ema_momentum", 1.0),
    ("ema_overwrite_frequency", 1), ("loss_scale_factor", 1e-3)])
def test_valid_values_are_translated(setting, value):
    opt = dm.Optimizer.from_keras(_keras_optimizer(setting, value))
    assert math.isclose(float(getattr(opt, setting)), float(value))


def test_none_is_off():
    opt = dm.Optimizer.from_keras(keras.optimizers.SGD(0.1, clipnorm=None, gradient_accumulation_steps=None,
                                                       loss_scale_factor=None, use_ema=True,
                                                       ema_overwrite_frequency=None))
    assert opt.clipnorm is None and opt.gradient_accumulation_steps is None and opt.loss_scale_factor is None
    assert opt.use_ema and opt.ema_overwrite_frequency is None


# -- C: clipnorm, clipvalue, global_clipnorm set on a built optimizer, between steps ------

from conftest import mirrored_strategy  # noqa: E402
from parity_lib import GLOBAL_BATCH, make_data, make_model, max_abs_diff, train_batches, weights  # noqa: E402

CLIP_KINDS = [("clipnorm", "ClipByNorm", "clip_norm"), ("clipvalue", "ClipByValue", "clip_value"),
              ("global_clipnorm", "ClipByGlobalNorm", "clip_norm")]
FIRST, SECOND = 0.5, 2.0  # the data's gradients exceed both, elementwise and in norm


def _sgd(setting, value):
    return dm.Optimizer(keras.optimizers.SGD(0.05, **({setting: value} if value is not None else {})))


@pytest.mark.parametrize("setting,_cls,_attr", CLIP_KINDS, ids=[k[0] for k in CLIP_KINDS])
@pytest.mark.parametrize("new", [SECOND, None], ids=["to_2.0", "to_None"])
def test_a_clip_set_between_steps_of_a_traced_loop_applies_from_the_next_step(setting, _cls, _attr, new):
    x, y = make_data(4)
    model = make_model(keras)
    opt = _sgd(setting, FIRST)
    step = train_batches(model, opt, x, y, [0, 1])
    traces = step.experimental_get_tracing_count()
    setattr(opt, setting, new)
    assert getattr(opt, setting) == new
    train_batches(model, opt, x, y, [2, 3], step)
    assert step.experimental_get_tracing_count() == traces  # the same trace saw the new bound

    # Reference: 2 steps with FIRST, then an optimizer built with `new` (SGD has no state).
    ref_model = make_model(keras)
    train_batches(ref_model, _sgd(setting, FIRST), x, y, [0, 1])
    train_batches(ref_model, _sgd(setting, new), x, y, [2, 3])
    assert max_abs_diff(weights(model), weights(ref_model)) == 0.0
    # ... and the change mattered: FIRST kept on gives other weights.
    unchanged = make_model(keras)
    train_batches(unchanged, _sgd(setting, FIRST), x, y, [0, 1, 2, 3])
    assert max_abs_diff(weights(model), weights(unchanged)) > 1e-3


def _fit_twice(strategy, setting, first, second, change_between: bool):
    x, y = make_data(4)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = make_model(keras)
        model.compile(loss="mse", optimizer=_sgd(setting, first))
    model.fit(ds.take(2), epochs=1, verbose=0, shuffle=False)
    train_function = model.train_function
    if change_between:
        setattr(model.optimizer, setting, second)
        model.fit(ds.skip(2), epochs=1, verbose=0, shuffle=False)
        assert model.train_function is train_function  # not rebuilt, not retraced
    else:  # reference: a new optimizer built with `second` (SGD has no state)
        with strategy.scope():
            model.compile(loss="mse", optimizer=_sgd(setting, second))
        model.fit(ds.skip(2), epochs=1, verbose=0, shuffle=False)
    return weights(model)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
@pytest.mark.parametrize("setting", ["clipnorm", "global_clipnorm"])
def test_a_clip_set_between_two_fits_applies_to_the_second(setting, strategy_name):
    strategy = mirrored_strategy() if strategy_name == "mirrored" else tf.distribute.get_strategy()
    got = _fit_twice(strategy, setting, FIRST, SECOND, change_between=True)
    want = _fit_twice(strategy, setting, FIRST, SECOND, change_between=False)
    assert max_abs_diff(got, want) <= 1e-7  # same ops; measured 0.0
    unchanged = _fit_twice(strategy, setting, FIRST, FIRST, change_between=False)
    assert max_abs_diff(got, unchanged) > 1e-3


def test_the_config_holds_the_current_bound_and_checkpoints_do_not(tmp_path):
    opt = _sgd("global_clipnorm", FIRST)
    v = tf.Variable([3.0, 4.0])
    opt.apply_gradients([(tf.constant([30.0, 40.0]), v)])
    before = [name for name, _ in tf.train.list_variables(tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "c1")))]
    opt.global_clipnorm = SECOND
    clipper = opt.transforms[-1]
    assert clipper.clip_norm == SECOND and float(clipper.bound_variable.numpy()) == SECOND
    again = dm.Optimizer.from_config(opt.get_config())
    assert again.global_clipnorm == SECOND and again.transforms[-1].clip_norm == SECOND
    after = [name for name, _ in tf.train.list_variables(tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "c2")))]
    assert before == after  # the bound is configuration, not checkpointed state
    assert clipper.bound_variable not in opt.variables
    assert all(w is not clipper.bound_variable for w in opt.statistics_variables())
    opt.global_clipnorm = None
    assert opt.global_clipnorm is None and opt.get_config()["transform_gradients"][-1]["config"] == {"clip_norm": None}
    off = dm.Optimizer.from_config(opt.get_config())
    assert off.global_clipnorm is None
    # Off is exactly no clipping.
    w0 = tf.Variable([3.0, 4.0])
    w1 = tf.Variable([3.0, 4.0])
    off.apply_gradients([(tf.constant([30.0, 40.0]), w0)])
    dm.Optimizer(keras.optimizers.SGD(0.05)).apply_gradients([(tf.constant([30.0, 40.0]), w1)])
    np.testing.assert_array_equal(w0.numpy(), w1.numpy())


def test_setting_a_clip_reaches_the_clipper_through_wrappers_and_before_build_adds_one():
    opt = dm.MovingAverage(dm.Optimizer(keras.optimizers.SGD(0.05)), average_decay=0.5)
    assert opt.clipnorm is None
    opt.clipnorm = FIRST  # not built: appended, as the Keras setting's translation does
    core = opt.stack()[-1]
    assert isinstance(core.transforms[-1], dm.transforms.ClipByNorm) and opt.clipnorm == FIRST
    opt.clipnorm = None  # an existing clipper is turned off, and stays (its bound can come back)
    assert opt.clipnorm is None and isinstance(core.transforms[-1], dm.transforms.ClipByNorm)
    opt.clipnorm = SECOND
    assert core.clipnorm == SECOND
    opt.global_clipnorm = None  # no such clipper, nothing clips: nothing to do
    with pytest.raises(ValueError, match=r"ClipByGlobalNorm next to the ClipByNorm.*Keep one"):
        opt.global_clipnorm = 1.0
    x, y = make_data(2)
    model = make_model(keras)
    train_batches(model, opt, x, y, [0])
    with pytest.raises(TypeError, match=r"Setting `clipvalue` on a built optimizer whose `transform_gradients` holds "
                                        r"no ClipByValue would change nothing.*clip_by_value\(1.0\).*Received: "
                                        r"clipvalue=1.0 on a built MovingAverage"):
        opt.clipvalue = 1.0


@pytest.mark.parametrize("value,error", [(-1, ValueError), (0.0, ValueError), (NAN, ValueError), (INF, ValueError),
                                         ("2", TypeError)])
def test_an_invalid_clip_set_on_a_stack_is_refused_in_keras_style(value, error):
    opt = _sgd("clipnorm", FIRST)
    message = f"`clipnorm` must be {CLIP_RULE}. Received: clipnorm={value!r} on Optimizer"
    with pytest.raises(error, match=re.escape(message)):
        opt.clipnorm = value
    assert opt.clipnorm == FIRST


def test_two_clippers_of_the_kind_set_is_ambiguous():
    opt = dm.Optimizer(keras.optimizers.SGD(0.05), transform_gradients=[dm.clip_by_norm(1.0), dm.clip_by_norm(2.0)])
    with pytest.raises(ValueError, match=r"holds 2 ClipByNorm transforms"):
        opt.clipnorm = 3.0
