"""Section 6: peak RSS of one `model.fit` run, in a fresh process (run by benchmarks/run.py).

Usage: python benchmarks/memory_worker.py dm|keras STEPS  -> prints one JSON line.
MirroredStrategy on 2 logical CPUs, MLP 50 x Dense(128), Adam, global batch 256;
`dm`: dist_minimize.Optimizer(Adam, clip_by_global_norm(1.0)); `keras`: stock Keras
Adam(global_clipnorm=1.0).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main(argv):
    kind, steps = argv[0], int(argv[1])
    import numpy as np
    import tensorflow as tf

    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import dist_minimize as dm
    from benchmarks import _steps

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _steps.mlp(50, 128)()
        if kind == "dm":
            opt = dm.Optimizer(keras.optimizers.Adam(_steps.LR), transform_gradients=dm.clip_by_global_norm(_steps.CLIP))
        else:
            opt = keras.optimizers.Adam(_steps.LR, global_clipnorm=_steps.CLIP)
        model.compile(loss="mse", optimizer=opt)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 128)).astype("float32")
    y = rng.normal(size=(2048, 128)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(256, drop_remainder=True).repeat()
    before = status_kb("VmRSS")
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
    print(json.dumps({"kind": kind, "rss_before_fit_mb": before / 1024, "peak_rss_mb": status_kb("VmHWM") / 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
