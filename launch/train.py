"""The main job: data-parallel training with dist_minimize and global-norm clipping.

Trains a small MLP on scikit-learn's handwritten digits (1,797 8x8 images shipped inside
the scikit-learn package: nothing is downloaded) with `model.fit` under
`MirroredStrategy` over N logical CPU devices (default 2), clipping the aggregated
gradients to a global norm. Prints Keras progress and, per epoch, the mean pre-clip
norm and the share of clipped steps; then the test accuracy.

Usage:
  python launch/train.py [--replicas 2] [--epochs 5] [--clip-norm 1.0] [--optimizer adam]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="replicas (logical CPU devices or GPUs)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be >= 1. Received: --replicas={args.replicas}")
    if args.global_batch % args.replicas:
        p.error(f"--global-batch must be divisible by --replicas. Received: "
                f"--global-batch={args.global_batch}, --replicas={args.replicas}")
    return args


def load_digits(seed: int):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_strategy(replicas: int):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= replicas:
        return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def main(argv=None) -> int:
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    import dist_minimize as dm

    strategy = make_strategy(args.replicas)
    print(f"[train] {strategy.num_replicas_in_sync} replicas "
          f"({', '.join(strategy.extended.worker_devices)}), global batch {args.global_batch}, "
          f"clip_by_global_norm({args.clip_norm}) after aggregation", flush=True)
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    keras.utils.set_random_seed(args.seed)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        lr = args.learning_rate or (1e-2 if args.optimizer == "adam" else 0.2)
        inner = keras.optimizers.Adam(lr) if args.optimizer == "adam" else keras.optimizers.SGD(lr)
        model.compile(
            optimizer=dm.Optimizer(inner, transform_gradients=dm.clip_by_global_norm(args.clip_norm)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
        len(x_train), seed=args.seed).batch(args.global_batch)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.global_batch)
    model.fit(train, epochs=args.epochs, verbose=2, shuffle=False, callbacks=[dm.callbacks.GradientStatsLogger()])
    loss, accuracy = model.evaluate(test, verbose=0)
    print(f"[train] test loss {loss:.4f}, test accuracy {accuracy:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
