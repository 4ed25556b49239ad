"""Horovod's `examples/tensorflow2/tensorflow2_synthetic_benchmark.py`, ported to
dist_minimize (docs/from-horovod.md): a `keras.applications` model on synthetic data, a
custom loop, images per second per process and in total.

    python launch/launch.py --launcher horovod-gloo -np 2 -- launch/examples/tensorflow2_synthetic_benchmark.py

Where Horovod's loop wraps the tape (`hvd.DistributedGradientTape`), the dist_minimize
optimizer aggregates (`opt.minimize(loss, variables, tape=tape)`); the broadcast comes
before the first step (`broadcast_model_and_optimizer` builds the optimizer), where
Horovod's comes after it. `--image-size` (not in Horovod's) makes it small enough for a
CPU test.
"""

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402

parser = argparse.ArgumentParser(description="TensorFlow Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="ResNet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="input height and width")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--eager", action="store_true", default=False, help="enables eager execution")
args = parser.parse_args()

hvd = dm.horovod_keras.init()

# Set up standard model.
model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.image_size, args.image_size, 3))
opt = dm.Optimizer(keras.optimizers.SGD(0.01), aggregate_gradients=dm.aggregation.HorovodAggregator(
    compression="fp16" if args.fp16_allreduce else "none"))

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)
loss_fn = keras.losses.SparseCategoricalCrossentropy()


def benchmark_step():
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = loss_fn(target, probs)
    opt.minimize(loss, model.trainable_variables, tape=tape)


if not args.eager:
    benchmark_step = tf.function(benchmark_step)

# Horovod: broadcast initial variable states from rank 0 to all other processes.
dm.horovod_keras.broadcast_model_and_optimizer(model, opt, root_rank=0)


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
log(f"Number of {device}s: {hvd.size()}")

# Warm-up
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
