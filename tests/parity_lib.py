"""Shared problem and reference for the parity tests (also used by worker scripts).

The problem is built so that replicas' gradient norms differ a lot: the second half of
the global batch has targets 100x larger than the first, so under 2 replicas, replica 1's
gradient norm is ~100x replica 0's. Clipping is active on every step (clip_norm is below
every global norm seen).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

GLOBAL_BATCH = 16
STEPS = 4
FEATURES = 5
CLIP_NORM = 0.5


def make_data(steps: int = STEPS, global_batch: int = GLOBAL_BATCH, seed: int = 0):
    """x: (steps*global_batch, FEATURES), y: (steps*global_batch, 1), float32.

    Within each global batch, the second half has targets scaled by 100, so a replica
    holding it has gradients ~100x larger than a replica holding the first half.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch, FEATURES)).astype("float32")
    y = rng.normal(size=(steps * global_batch, 1)).astype("float32")
    half = global_batch // 2
    for s in range(steps):
        y[s * global_batch + half:(s + 1) * global_batch] *= 100.0
    return x, y


def make_model(keras, seed: int = 1):
    """A small MLP with deterministic initial weights."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])
    return model


def make_inner(keras, name: str):
    if name == "sgd":
        return keras.optimizers.SGD(0.1)
    if name == "adam":
        return keras.optimizers.Adam(0.01)
    if name == "momentum":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")


def weights(model) -> list:
    return [np.array(w) for w in model.get_weights()]


def max_abs_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))
