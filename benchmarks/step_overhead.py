"""Benchmark: the cost of dist_minimize's pipeline per training step, as ratios.

Measures steps/s of `model.fit` on a small MLP under MirroredStrategy over N logical CPU
devices (or GPUs if present) for: stock Keras (the anchor, no clipping), dist_minimize with
cross-replica global-norm clipping, and with loss scaling + a consistency check every 100
steps. Reports each as a ratio to the anchor measured in the same run; it asserts
nothing (targets belong here, not in unit tests).

Usage: python benchmarks/step_overhead.py [--replicas 2] [--steps 200] [--width 256]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args(argv)
    import numpy as np
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= args.replicas:
        devices = [f"/gpu:{i}" for i in range(args.replicas)]
    else:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas)
        devices = [f"/cpu:{i}" for i in range(args.replicas)]
    import keras

    import dist_minimize as dm

    strategy = tf.distribute.MirroredStrategy(devices)
    batch = 32 * args.replicas
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 8, args.width)).astype("float32")
    y = rng.normal(size=(batch * 8, 1)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()

    def optimizer(kind):
        if kind == "keras":
            return keras.optimizers.Adam(1e-3)
        base = dm.Optimizer(keras.optimizers.Adam(1e-3), transform_gradients=[
            dm.clip_by_global_norm(1.0), *([dm.check_consistency(100)] if kind == "full" else [])])
        return dm.LossScaleOptimizer(base) if kind == "full" else base

    def steps_per_second(kind):
        with strategy.scope():
            model = keras.Sequential([keras.Input((args.width,)), keras.layers.Dense(args.width, activation="relu"),
                                      keras.layers.Dense(args.width, activation="relu"), keras.layers.Dense(1)])
            model.compile(loss="mse", optimizer=optimizer(kind))
        model.fit(ds, steps_per_epoch=10, epochs=1, verbose=0)  # trace and warm up
        start = time.perf_counter()
        model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0)
        return args.steps / (time.perf_counter() - start)

    anchor = steps_per_second("keras")
    print(f"[bench] {len(devices)} replicas on {devices[0].split(':')[0][1:]}, width {args.width}, "
          f"{args.steps} steps", flush=True)
    print(f"[bench] stock Keras Adam (anchor): {anchor:.1f} steps/s", flush=True)
    for kind, label in (("clip", "dist_minimize + global-norm clip"),
                        ("full", "dist_minimize + loss scaling + clip + consistency check/100")):
        sps = steps_per_second(kind)
        print(f"[bench] {label}: {sps:.1f} steps/s, ratio to anchor {sps / anchor:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
