"""The complete example of docs/writing-a-wrapper.md (once the README's "Writing a
wrapper" example), exactly as printed there, under
MirroredStrategy (2 of the 4 logical CPUs, in the test process): `fit` against a NumPy
reference, a skipped step, evaluation with the averages swapped in, save and reload."""

import atexit
import importlib.util
import os
import re
import shutil
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy

pytestmark = pytest.mark.distributed

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                   "writing-a-wrapper.md")
DECAY = 0.5
LR = 0.05
STEPS = 4
GLOBAL_BATCH = 8


def readme_example():
    """Imports the first Python block of docs/writing-a-wrapper.md's "A complete example"
    section as a module (from a file, so that AutoGraph can read its source)."""
    text = open(DOC).read()
    section = text[text.index("## A complete example"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    where = tempfile.mkdtemp(prefix="dm-readme-")
    atexit.register(shutil.rmtree, where, True)  # kept while the tests run: AutoGraph reads it
    path = os.path.join(where, "readme_wrapper_example.py")
    with open(path, "w") as f:
        f.write(code)
    spec = importlib.util.spec_from_file_location("readme_wrapper_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WeightAverage = readme_example().WeightAverage


def data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")
    return x, y


def reference(w0, b0):
    """Plain NumPy: full-batch SGD on the mean squared error of each global batch, and
    the weights' moving average after each update."""
    x, y = data()
    w, b = w0.astype("float64"), b0.astype("float64")
    avg_w, avg_b = w.copy(), b.copy()
    for s in range(STEPS):
        xb, yb = x[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH], y[s * GLOBAL_BATCH:(s + 1) * GLOBAL_BATCH]
        err = xb @ w + b - yb
        w = w - LR * 2.0 * xb.T @ err / len(xb)
        b = b - LR * 2.0 * err.mean(axis=0)
        avg_w = DECAY * avg_w + (1 - DECAY) * w
        avg_b = DECAY * avg_b + (1 - DECAY) * b
    return w, b, avg_w, avg_b


def build(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        opt = WeightAverage(dm.Optimizer(keras.optimizers.SGD(LR)), decay=DECAY)
        model.compile(loss="mse", optimizer=opt)
    return model, opt


def test_readme_wrapper_under_mirrored_fit_matches_numpy(tmp_path):
    strategy = mirrored_strategy()
    assert strategy.num_replicas_in_sync == 2
    model, opt = build(strategy)
    w0, b0 = [np.array(v) for v in model.trainable_variables]
    x, y = data()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    w, b, avg_w, avg_b = reference(w0, b0)

    np.testing.assert_allclose(np.array(model.trainable_variables[0]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(model.trainable_variables[1]), b, rtol=1e-5, atol=1e-6)
    kernel, bias = model.trainable_variables
    for replica_value in strategy.experimental_local_results(opt.slot("average", kernel)):
        np.testing.assert_allclose(np.array(replica_value), avg_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(opt.slot("average", bias)), avg_b, rtol=1e-5, atol=1e-6)
    # Not a trivial average: it lags the weights.
    assert np.abs(avg_w - w).max() > 1e-3

    with opt.averaged_weights():
        for replica_value in strategy.experimental_local_results(kernel):
            np.testing.assert_allclose(np.array(replica_value), avg_w, rtol=1e-5, atol=1e-6)
        averaged_loss = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(np.array(kernel), w, rtol=1e-5, atol=1e-6)
    loss = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    assert averaged_loss != loss

    path = str(tmp_path / "example.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, WeightAverage) and loaded.optimizer.decay == DECAY
    loaded_kernel = loaded.trainable_variables[0]
    np.testing.assert_allclose(np.array(loaded.optimizer.slot("average", loaded_kernel)), avg_w, rtol=1e-5, atol=1e-6)


def test_readme_wrapper_keeps_the_average_on_a_skipped_step():
    strategy = mirrored_strategy()
    with strategy.scope():
        v = tf.Variable([1.0, 2.0])
        opt = WeightAverage(dm.Optimizer(keras.optimizers.SGD(0.5)), decay=DECAY)
        opt.build([v])

    @tf.function
    def step(poison):
        def replica_fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            g = tf.where(tf.logical_and(poison, tf.equal(rid, 1)), tf.constant([np.nan, 1.0]), tf.constant([1.0, 1.0]))
            opt.apply_gradients([(g, v)])
        strategy.run(replica_fn)

    step(tf.constant(False))
    # The two replicas' gradients are summed: v = [1, 2] - 0.5 * [2, 2]; average = mean of both.
    np.testing.assert_allclose(np.array(v), [0.0, 1.0])
    after_good = np.array(opt.slot("average", v))
    np.testing.assert_allclose(after_good, [0.5, 1.5])
    step(tf.constant(True))
    np.testing.assert_array_equal(np.array(opt.slot("average", v)), after_good)
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 1
