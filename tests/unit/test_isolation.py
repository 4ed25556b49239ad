"""Using dist_minimize changes nothing outside its own step: after a dist_minimize step
under MirroredStrategy, no attribute of TensorFlow's or Keras's distribution, optimizer
and training modules (or of their classes) is another object than before, and a stock
Keras model trained in the same process ends with the same weights, bit for bit.

Runs in a fresh interpreter: TensorFlow and Keras are imported and snapshotted before
dist_minimize is."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 240  # seconds: TensorFlow's import and three small trainings on a busy 2-core machine

SCRIPT = r"""
import importlib, inspect, sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras

MODULES = [
    "tensorflow.python.distribute.distribute_lib", "tensorflow.python.distribute.mirrored_strategy",
    "tensorflow.python.distribute.mirrored_run", "tensorflow.python.distribute.values",
    "tensorflow.python.distribute.collective_all_reduce_strategy", "tensorflow.python.ops.cond_v2",
    "tensorflow.python.framework.ops", "keras.src.optimizers.base_optimizer", "keras.src.optimizers.adam",
    "keras.src.backend.tensorflow.optimizer", "keras.src.backend.tensorflow.trainer",
    "keras.src.trainers.trainer", "keras.src.models.model", "keras.src.saving.serialization_lib",
    "keras.src.backend.common.variables",
]


def snapshot():
    seen = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            seen[(name, attr)] = value
            if inspect.isclass(value) and value.__module__ == name:
                for member, inner in vars(value).items():
                    if member != "__annotations__":  # (Python makes a class's on its first read)
                        seen[(name, attr, member)] = inner
    return seen


strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # one for all (collective keys)


def stock_training():
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = x @ np.linspace(-1, 1, 8, dtype="float32")[:, None]
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=1.0), loss="mse")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    return [w.copy() for w in model.get_weights()]


before, path = snapshot(), list(sys.meta_path)
reference = stock_training()

import dist_minimize as dm

with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    opt = dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(1.0))
    model.compile(optimizer=opt, loss="mse")
    dm.integrate(model)
model.fit(np.ones((32, 8), "float32"), np.zeros((32, 4), "float32"), batch_size=16, epochs=1, verbose=0)

@tf.function
def custom_step():
    def replica():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([4, 8])))
        opt.minimize(loss, model.trainable_variables, tape=tape)
    strategy.run(replica)

custom_step()
after = snapshot()
changed = sorted(str(k) for k in before.keys() | after.keys() if before.get(k, None) is not after.get(k, None))
print("changed", changed)
print("meta_path", sys.meta_path == path)
again = stock_training()
print("same weights", all(np.array_equal(a, b) for a, b in zip(reference, again)) and len(reference) == len(again))
"""


def test_a_dist_minimize_step_changes_no_tensorflow_or_keras_attribute_and_no_stock_result():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[-3:] == ["changed []", "meta_path True", "same weights True"], done.stdout[-4000:]
