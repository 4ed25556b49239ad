"""Keras optimizer settings on a wrapped Keras optimizer, translated into dist_minimize.

Keras 3 applies `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`,
`gradient_accumulation_steps` and `loss_scale_factor` inside the Keras optimizer's
`apply`, on each replica, before any aggregation. `dist_minimize.Optimizer` turns
each one into the dist_minimize feature with the same single-device rule, made after
aggregation, and switches the Keras optimizer's own copy off (it then provides only its
update rule):

==============================  =================================================
Keras setting                   dist_minimize equivalent
==============================  =================================================
`clipnorm=c`                    `transform_gradients += clip_by_norm(c)`
`clipvalue=c`                   `transform_gradients += clip_by_value(c)`
`global_clipnorm=c`             `transform_gradients += clip_by_global_norm(c)`
`use_ema=True`, `ema_momentum`, `MovingAverage(average_decay=ema_momentum,
`ema_overwrite_frequency`       start_step=1, overwrite_frequency=...,
                                assign_on_finalize=True)` around the optimizer
`gradient_accumulation_steps`   `GradientAccumulation(steps=...)` around it
`loss_scale_factor=s`           `LossScaleOptimizer(initial_scale=s,
                                dynamic=False)` around it
==============================  =================================================

The clipper goes LAST in `transform_gradients`: Keras clips the final gradients right
before its update rule (after unscaling), so it runs after the user's own transforms.
A Keras clipping setting together with a dist_minimize clipper in
`transform_gradients` is refused (which applies first would be a guess); so is
`use_ema` with `gradient_accumulation_steps`, whose Keras rule (the average moves on
every micro-step, toward weights that change every K-th) `MovingAverage` does not
have.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import keras
import numpy as np

from dist_minimize._keras_surface import CLIP_SETTINGS  # each setting is named once, there
from dist_minimize.transforms import ClipByGlobalNorm, ClipByNorm, ClipByValue

logger = logging.getLogger("dist_minimize")

WRAPPER_SETTINGS = ("use_ema", "gradient_accumulation_steps", "loss_scale_factor")

# What each translated setting must hold (None always means "off"). Stricter than
# Keras 3.15 where Keras silently ignores a value: it skips clipping for a clip <= 0
# (a negative or zero clip is a mistake, not a way to say "off", which is None), and
# takes `gradient_accumulation_steps=0` and `ema_overwrite_frequency=0` as "off" though
# its own messages state the rules ">= 2" and ">= 1 or None". NaN and inf are refused.
RULES = {
    "clipnorm": "a positive finite number (or None to turn clipping off)",
    "clipvalue": "a positive finite number (or None to turn clipping off)",
    "global_clipnorm": "a positive finite number (or None to turn clipping off)",
    "gradient_accumulation_steps": "an integer >= 2 (or None to turn accumulation off)",
    "ema_momentum": "a number in [0, 1]",
    "ema_overwrite_frequency": "an integer >= 1 (or None to never overwrite)",
    "loss_scale_factor": "a positive finite number (or None for no scaling)",
}


def check_setting(setting: str, value: Any, optimizer_name: str) -> Any:
    """Validates the value of a translated Keras setting, in Keras's style.

    Args:
      setting: a key of `RULES`.
      value: its value (None, meaning "off", is returned as it is, except for
        `ema_momentum`, which has no "off").
      optimizer_name: the class name of the optimizer it is set on, for the message.

    Returns:
      The value as the equivalent takes it: a float, an int, or None.

    Raises:
      TypeError: a string (or an object that is no number) where a number is needed.
      ValueError: any other value outside the rule (NaN and inf included), e.g.
        "`clipnorm` must be a positive finite number (or None to turn clipping off).
        Received: clipnorm=-1 on SGD".
    """
    from dist_minimize.transforms.base import check_positive_finite, check_positive_int, check_unit_interval

    if value is None and setting != "ema_momentum":
        return None
    if isinstance(value, np.integer):
        value = int(value)
    checks = {
        "gradient_accumulation_steps": lambda n, v: check_positive_int(n, v, minimum=2),
        "ema_momentum": check_unit_interval,
        "ema_overwrite_frequency": check_positive_int,
    }
    try:
        return checks.get(setting, check_positive_finite)(setting, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"`{setting}` must be {RULES[setting]}. Received: {setting}={value!r} on "
                      f"{optimizer_name}") from None


def clipper_classes() -> dict:
    """The dist_minimize clipper class of each Keras clipping setting."""
    return {"clipnorm": ClipByNorm, "clipvalue": ClipByValue, "global_clipnorm": ClipByGlobalNorm}


class Translation:
    """What `translate` decided for one Keras optimizer: clippers to append, wrappers
    to build around the `Optimizer` (innermost first), and the log line."""

    def __init__(self):
        self.clippers: list = []
        self.wrappers: list = []  # (wrapper class, keyword arguments), innermost first
        self.parts: list = []
        self.wrapper_settings: list = []  # "use_ema=True", ... as the user set them
        self.disable: dict = {}  # attribute of the Keras optimizer -> the value that turns it off

    def log(self, optimizer: keras.optimizers.Optimizer) -> None:
        if self.parts:
            logger.info("dist_minimize.Optimizer(%s %r): %s.", type(optimizer).__name__, optimizer.name,
                        "; ".join(self.parts))


def translate(optimizer: keras.optimizers.Optimizer, gradient_fns: Sequence) -> Translation:
    """Decides the dist_minimize equivalent of every setting of `optimizer`; changes nothing.

    Raises:
      ValueError: a Keras clipping setting next to a dist_minimize clipper in
        `transform_gradients`, `use_ema` with `gradient_accumulation_steps`, or a
        setting whose value breaks its rule (`RULES`, `check_setting`).
      TypeError: a setting that must be a number holds a string or another object.
    """
    t = Translation()
    _translate_clipping(optimizer, gradient_fns, t)
    _translate_wrappers(optimizer, t)
    return t


def _translate_clipping(optimizer, gradient_fns: Sequence, t: Translation) -> None:
    """clipnorm, clipvalue, global_clipnorm: clippers after aggregation."""
    name = type(optimizer).__name__
    clippers = clipper_classes()
    for setting in CLIP_SETTINGS:
        value = getattr(optimizer, setting, None)
        if value is None:
            continue
        check_setting(setting, value, name)
        t.disable[setting] = None
        given = [fn for fn in gradient_fns if isinstance(fn, tuple(clippers.values()))]
        if given:
            raise ValueError(
                f"The inner optimizer sets `{setting}={value!r}` and `transform_gradients` already holds "
                f"{', '.join(type(fn).__name__ for fn in given)}: both would clip, and which first is a guess. "
                f"Keep one: remove `{setting}` from the Keras optimizer, or the clipper from "
                f"`transform_gradients`. Received: optimizer={name}({setting}={value!r})")
        t.clippers.append(_make(clippers[setting], value, setting, name))
        t.parts.append(f"{setting}={value!r} -> transform_gradients += dist_minimize."
                       f"{_factory_name(setting)}({value!r}) (after aggregation, last)")


def _translate_wrappers(optimizer, t: Translation) -> None:
    """use_ema, gradient_accumulation_steps, loss_scale_factor: wrappers around the Optimizer."""
    from dist_minimize.wrappers import GradientAccumulation, LossScaleOptimizer, MovingAverage

    name = type(optimizer).__name__
    ema = bool(getattr(optimizer, "use_ema", False))
    steps = check_setting("gradient_accumulation_steps", getattr(optimizer, "gradient_accumulation_steps", None), name)
    scale = check_setting("loss_scale_factor", getattr(optimizer, "loss_scale_factor", None), name)
    if ema and steps:
        raise ValueError(
            "The inner optimizer sets both `use_ema` and `gradient_accumulation_steps`: Keras then moves the "
            "average on every micro-step, toward weights that change every K-th, a rule "
            "`dist_minimize.MovingAverage` (one move per applied update) does not have. Build the stack you "
            "mean yourself, e.g. `dist_minimize.GradientAccumulation(dist_minimize.MovingAverage("
            "dist_minimize.Optimizer(keras_optimizer), average_decay=m, start_step=1), steps=K)`. Received: "
            f"optimizer={name}(use_ema=True, gradient_accumulation_steps={steps!r})")
    if ema:
        momentum = check_setting("ema_momentum", optimizer.ema_momentum, name)
        frequency = check_setting("ema_overwrite_frequency", optimizer.ema_overwrite_frequency, name)
        kwargs = dict(average_decay=momentum, start_step=1, overwrite_frequency=frequency,
                      assign_on_finalize=True)
        t.wrappers.append((MovingAverage, kwargs))
        t.wrapper_settings.append("use_ema=True")
        t.disable.update(use_ema=False, ema_overwrite_frequency=None)
        t.parts.append(f"use_ema=True, ema_momentum={momentum!r}, ema_overwrite_frequency={frequency!r} -> "
                       f"dist_minimize.MovingAverage(average_decay={momentum!r}, start_step=1, "
                       f"overwrite_frequency={frequency!r}, assign_on_finalize=True) around it")
    if steps:
        t.wrappers.append((GradientAccumulation, dict(steps=steps)))
        t.wrapper_settings.append(f"gradient_accumulation_steps={steps!r}")
        t.disable["gradient_accumulation_steps"] = None
        t.parts.append(f"gradient_accumulation_steps={steps!r} -> dist_minimize.GradientAccumulation("
                       f"steps={steps!r}) around it")
    if scale is not None:
        t.wrappers.append((LossScaleOptimizer, dict(initial_scale=scale, dynamic=False)))
        t.wrapper_settings.append(f"loss_scale_factor={scale!r}")
        t.disable["loss_scale_factor"] = None
        t.parts.append(f"loss_scale_factor={scale!r} -> dist_minimize.LossScaleOptimizer(initial_scale={scale!r}, "
                       "dynamic=False) around it (a non-finite step is skipped, not applied)")


def disable(optimizer: keras.optimizers.Optimizer, translation: Translation) -> None:
    """Switches off the Keras optimizer's own copy of every translated setting."""
    if translation.disable and getattr(optimizer, "built", False) and (
            "use_ema" in translation.disable or "gradient_accumulation_steps" in translation.disable):
        raise ValueError(
            "The inner optimizer is already built with `use_ema` or `gradient_accumulation_steps`: its "
            "averages or accumulators exist and would be left unused. Give dist_minimize.Optimizer the Keras "
            f"optimizer before it is built. Received: a built {type(optimizer).__name__}")
    for attribute, value in translation.disable.items():
        setattr(optimizer, attribute, value)


def take_wrappers(optimizer: keras.optimizers.Optimizer) -> list:
    """The wrappers `optimizer`'s settings become (`(class, kwargs)`, innermost first),
    with the Keras optimizer's own copy of those settings switched off and logged."""
    t = Translation()
    _translate_wrappers(optimizer, t)
    disable(optimizer, t)
    t.log(optimizer)
    return t.wrappers


def wrap(core, wrappers: Sequence) -> Any:
    """Builds the wrappers around `core`, innermost first."""
    stack = core
    for cls, kwargs in wrappers:
        stack = cls(stack, **kwargs)
    return stack


def _make(cls, value, setting: str, optimizer_name: str):
    try:
        return cls(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"The inner optimizer's `{setting}` has no dist_minimize equivalent: {e} "
                         f"Received: optimizer={optimizer_name}({setting}={value!r})") from None


def _factory_name(setting: str) -> str:
    return {"clipnorm": "clip_by_norm", "clipvalue": "clip_by_value", "global_clipnorm": "clip_by_global_norm"}[setting]


# -- setting the clip settings on a dist_minimize optimizer ------------------------------


def assign_clip(optimizer, setting: str, value: Any) -> None:
    """`optimizer.clipnorm = value` (or `clipvalue`, `global_clipnorm`) on a dist_minimize
    stack, as tf-keras allows between steps.

    The clipper of that kind in the `transform_gradients` of the stack's `Optimizer`
    (from the Keras setting, or given there) gets the new bound, which the next step
    reads, traced or not (`dist_minimize.transforms.clipping._Bound`); None turns it
    off. Where the stack holds no such clipper, one is appended last (as the Keras
    setting's translation does) while the optimizer is not built; after `build` that is
    refused: a traced step would not see a new transform.

    Args:
      optimizer: any optimizer of a dist_minimize stack.
      setting: "clipnorm", "clipvalue" or "global_clipnorm".
      value: a positive finite number, or None to turn clipping off.

    Raises:
      ValueError: an invalid value (`check_setting`); two clippers of that kind in the
        stack (which one is meant is a guess); no such clipper and another clipper is
        on.
      TypeError: no such clipper and the optimizer is built (naming how to build it
        with one); a value that is no number; a stack whose innermost optimizer is not
        a `dist_minimize.Optimizer`.
    """
    name = type(optimizer).__name__
    value = check_setting(setting, value, name)
    core = optimizer.stack()[-1]
    classes = clipper_classes()
    cls = classes[setting]
    attribute = "clip_value" if setting == "clipvalue" else "clip_norm"
    found = [fn for fn in core._gradient_fns if isinstance(fn, cls)]
    if len(found) > 1:
        raise ValueError(
            f"The optimizer's `transform_gradients` holds {len(found)} {cls.__name__} transforms: which one "
            f"`{setting}` means is a guess. Set the bound on the one you mean: `clipper.{attribute} = ...` "
            f"(`optimizer.stack()[-1].transforms`). Received: {setting}={value!r} on {name}")
    if found:
        setattr(found[0], attribute, value)
        return
    if value is None:
        return  # nothing of that kind clips: already off
    if optimizer.built or core.built:
        raise TypeError(
            f"Setting `{setting}` on a built optimizer whose `transform_gradients` holds no {cls.__name__} "
            "would change nothing: a step already traced would not run a new transform. Set it before the "
            f"first step (or `build`), or build the optimizer with it: `dist_minimize.Optimizer(keras_optimizer, "
            f"transform_gradients=dist_minimize.{_factory_name(setting)}({value!r}))`, or `{setting}={value!r}` "
            f"on the Keras optimizer given to `dist_minimize.Optimizer`. Received: {setting}={value!r} on a "
            f"built {name}")
    active = [fn for fn in core._gradient_fns if isinstance(fn, tuple(classes.values()))
              and getattr(fn, "clip_value" if isinstance(fn, classes["clipvalue"]) else "clip_norm") is not None]
    if active:
        raise ValueError(
            f"`{setting}={value!r}` would add a {cls.__name__} next to the "
            f"{', '.join(type(fn).__name__ for fn in active)} of `transform_gradients`: both would clip, and "
            f"which first is a guess. Keep one (set the other's bound to None first). Received: "
            f"{setting}={value!r} on {name}")
    core._gradient_fns = core._gradient_fns + (_make(cls, value, setting, name),)
    logger.info("%s %r: %s=%r -> transform_gradients += dist_minimize.%s(%r) (after aggregation, last).",
                name, optimizer.name, setting, value, _factory_name(setting), value)
