"""How far Keras's `BatchNormalization(synchronized=True)` (one-pass variance across
replicas) and its float32 layer on one device are from the exact batch statistics, on
data whose mean is large against its spread; beside `dm.horovod_keras.SyncBatchNormalization`
in one process (its two-pass float64 statistics; across ranks: tests/distributed/
test_sync_batch_norm.py).

    python benchmarks/sync_batch_norm.py   # MirroredStrategy on 2 logical CPUs, and
                                           # MultiWorkerMirroredStrategy on 2 local processes

Prints a Markdown table: per data mean (spread 1), the largest relative error of the
batch variance (read from the moving variance after one training call with momentum 0)
and of the training outputs, against float64 on the whole batch. Under
MultiWorkerMirroredStrategy each of two worker processes (TF_CONFIG on 127.0.0.1) holds
half of the batch, as under `dm.integrate` or the main job's multiworker backend.
"""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

WORKER = "--mwms-worker" in sys.argv
if not WORKER:
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


def data(mean):
    return (mean + np.random.default_rng(0).normal(size=(ROWS, CHANNELS))).astype("float32")


MEANS = (0.0, 100.0, 1000.0, 10000.0)


def mwms_worker(out_file):
    """One of two MultiWorkerMirroredStrategy workers: its half of each data set through a
    `synchronized=True` layer; writes the moving variances and its outputs."""
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result = {}
    for mean in MEANS:
        with strategy.scope():
            layer = keras.layers.BatchNormalization(momentum=0.0, synchronized=True)
            layer.build((None, CHANNELS))
        half = data(mean)[index * ROWS // 2:(index + 1) * ROWS // 2]
        out = strategy.run(lambda b: layer(b, training=True), args=(tf.constant(half),))
        result[f"var{mean:g}"] = layer.moving_variance.numpy().astype(np.float64)
        result[f"out{mean:g}"] = np.asarray(strategy.experimental_local_results(out)[0], np.float64)
    np.savez(out_file, **result)


def mwms_results(timeout=180):
    """{mean: (moving variance, outputs of the whole batch)} from two local workers."""
    from dist_minimize.launch.plan import free_ports, tf_config

    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"w{i}.npz") for i in range(2)]
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--mwms-worker", files[i]],
                                  env={**os.environ, "TF_CONFIG": tf_config(workers, i)}) for i in range(2)]
        try:
            for p in procs:
                if p.wait(timeout=timeout) != 0:
                    raise RuntimeError(f"a MultiWorkerMirroredStrategy worker exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        parts = [np.load(f) for f in files]
        return {mean: (parts[0][f"var{mean:g}"], np.concatenate([q[f"out{mean:g}"] for q in parts]))
                for mean in MEANS}


def relative(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def main():
    multiworker = mwms_results()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    lines = ["| data mean (spread 1) | Keras float32, one device: variance / outputs | Keras synchronized=True, "
             "MirroredStrategy 2 replicas: variance / outputs | Keras synchronized=True, MultiWorkerMirrored"
             "Strategy 2 workers: variance / outputs | dm SyncBatchNormalization, one process: "
             "variance / outputs |", "|---|---|---|---|---|"]
    for mean in MEANS:
        x = data(mean)
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
            if strat is not None:
                var, out = multiworker[mean]
                cells.append(f"{relative(var, want_var):.1e} / {relative(out, want_out):.1e}")
        lines.append(f"| {mean:g} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    if WORKER:
        mwms_worker(sys.argv[sys.argv.index("--mwms-worker") + 1])
    else:
        main()
