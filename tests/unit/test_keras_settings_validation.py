"""Keras settings on a wrapped Keras optimizer: invalid values are errors (issue 22 A),
and the clipping settings may be changed on a built optimizer between steps (issue 22 C)."""

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
        dm.Optimizer(_keras_optimizer(setting, value))


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
    opt = dm.Optimizer(_keras_optimizer(setting, value))
    assert math.isclose(float(getattr(opt, setting)), float(value))


def test_none_is_off():
    opt = dm.Optimizer(keras.optimizers.SGD(0.1, clipnorm=None, gradient_accumulation_steps=None,
                                            loss_scale_factor=None, use_ema=True, ema_overwrite_frequency=None))
    assert opt.clipnorm is None and opt.gradient_accumulation_steps is None and opt.loss_scale_factor is None
    assert opt.use_ema and opt.ema_overwrite_frequency is None
