"""How far Keras's `BatchNormalization(synchronized=True)` (one-pass variance across
replicas) and its float32 layer on one device are from the exact batch statistics, on
data whose mean is large against its spread; beside `dm.horovod_keras.SyncBatchNormalization`
in one process (its two-pass float64 statistics; across ranks: tests/distributed/
test_sync_batch_norm.py).

    python benchmarks/sync_batch_norm.py   # MirroredStrategy on 2 logical CPUs

Prints a Markdown table: per data mean (spread 1), the largest relative error of the
batch variance (read from the moving variance after one training call with momentum 0)
and of the training outputs, against float64 on the whole batch.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402

import dist_minimize as dm  # noqa: E402

ROWS, CHANNELS = 64, 8


def run(layer, x, strategy=None):
    """Moving variance (momentum 0: the batch variance) and outputs of one training call."""
    if strategy is None:
        out = layer(x, training=True)
        return layer.moving_variance.numpy().astype(np.float64), np.asarray(out, np.float64)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(ROWS))
    outs = []
    for batch in dataset:
        result = strategy.run(lambda b: layer(b, training=True), args=(batch,))
        outs = [np.asarray(t, np.float64) for t in strategy.experimental_local_results(result)]
    return layer.moving_variance.numpy().astype(np.float64), np.concatenate(outs)


def relative(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def main():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    lines = ["| data mean (spread 1) | Keras float32, one device: variance / outputs | Keras synchronized=True, "
             "MirroredStrategy 2 replicas: variance / outputs | dm SyncBatchNormalization, one process: "
             "variance / outputs |", "|---|---|---|---|"]
    for mean in (0.0, 100.0, 1000.0, 10000.0):
        x = (mean + np.random.default_rng(0).normal(size=(ROWS, CHANNELS))).astype("float32")
        exact = keras.layers.BatchNormalization(momentum=0.0, dtype="float64")
        want_var, want_out = run(exact, x.astype("float64"))
        cells = []
        for make, strat in ((lambda: keras.layers.BatchNormalization(momentum=0.0), None),
                            (lambda: keras.layers.BatchNormalization(momentum=0.0, synchronized=True), strategy),
                            (lambda: dm.horovod_keras.SyncBatchNormalization(momentum=0.0), None)):
            if strat is not None:
                with strat.scope():
                    layer = make()
                    layer.build((None, CHANNELS))
            else:
                layer = make()
            var, out = run(layer, x, strat)
            cells.append(f"{relative(var, want_var):.1e} / {relative(out, want_out):.1e}")
        lines.append(f"| {mean:g} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
