"""Horovod's `examples/tensorflow2/tensorflow2_keras_mnist.py`, ported to dist_minimize line
by line (docs/from-horovod.md): the same model, learning-rate scaling, warmup, callbacks
and steps, on Keras 3.

    python launch/launch.py --launcher horovod-gloo -np 2 -- launch/examples/tensorflow2_keras_mnist.py

Horovod's example downloads MNIST; this one draws MNIST-shaped data (28x28 images, 10
classes, labels from a fixed random teacher, so there is something to learn) and
downloads nothing. `--epochs` and `--steps-per-epoch` shorten it (the tests run 1 x 4).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=24)
p.add_argument("--steps-per-epoch", type=int, default=None, help="default: 500 // size, as Horovod's")
p.add_argument("--checkpoint-dir", default=None, help="rank 0 saves ./checkpoint-{epoch}.keras there")
args = p.parse_args()

# Horovod: initialize Horovod.
hvd = dm.horovod_keras.init()

rng = np.random.default_rng(hvd.rank())
images = rng.random((2048, 28, 28, 1), dtype=np.float32)
teacher = np.random.default_rng(0).normal(size=(28 * 28, 10))
labels = np.argmax(images.reshape(len(images), -1) @ teacher, axis=1).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().shuffle(10000).batch(128)

mnist_model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(32, [3, 3], activation="relu"),
    keras.layers.Conv2D(64, [3, 3], activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Dropout(0.25),
    keras.layers.Flatten(),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.5),
    keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = dm.horovod_keras.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

mnist_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])
dm.integrate(mnist_model)  # every stage under fit (XLA off: Horovod's collectives have no XLA kernels)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    dm.horovod_keras.BroadcastVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    dm.horovod_keras.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    dm.horovod_keras.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0 and args.checkpoint_dir:
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.keras")))

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
history = mnist_model.fit(dataset, steps_per_epoch=args.steps_per_epoch or 500 // hvd.size(), callbacks=callbacks,
                          epochs=args.epochs, verbose=verbose)
if hvd.rank() == 0:
    print(f"[mnist] final loss {history.history['loss'][-1]:.4f} lr {history.history['lr'][-1]:.9g}", flush=True)
