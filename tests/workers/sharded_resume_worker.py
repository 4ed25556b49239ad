"""One process of a sharded-checkpoint job (tests/distributed/test_sharded_state.py).

Usage: sharded_resume_worker.py OUT_DIR MODE CKPT_DIR
  save    (horovodrun, any np)  the full stack (LossScaleOptimizer, DecoupledWeightDecay,
          Adam + clip) with shard_optimizer_state=True: STEPS steps under a Checkpointer
          saving at step STEPS // 2 into CKPT_DIR, then the rest without saving; writes
          the uninterrupted run's weights and state, and rank 0 OUT_DIR/model.keras
  resume  (horovodrun, any np)  the same stack, sharded, restored from CKPT_DIR and
          trained to STEPS
  one     (plain python, one process, no Horovod)  the same stack UNSHARDED, restored
          from CKPT_DIR and trained to STEPS
  mw-save, mw-resume  save and resume as above, on MultiWorkerMirroredStrategy workers
          (TF_CONFIG set by the caller) instead of Horovod; no .keras file
Each process writes OUT_DIR/rank{R}.json: weights, the optimizer state it holds by
checkpoint key, the step it started from.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402
import parity_lib as P  # noqa: E402
from dist_minimize.sharding import sharded_checkpoint  # noqa: E402

STEPS = 8
out_dir, mode, ckpt_dir = sys.argv[1:4]
multiworker = mode.startswith("mw-")
mode = mode[len("mw-"):] if multiworker else mode
hvd = dm.horovod_keras.init() if mode != "one" and not multiworker else None
if multiworker:
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=60))
    rank, size = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
else:
    strategy = tf.distribute.get_strategy()
    rank, size = (hvd.rank(), hvd.size()) if hvd is not None else (0, 1)
local = P.GLOBAL_BATCH // size
# tf.distribute sums the replicas' gradients, Horovod averages them
denominator = P.GLOBAL_BATCH if multiworker else local
x, y = P.make_data(STEPS)
xs, ys = P.shard_rows(x, y, rank, size)

with strategy.scope():
    model = P.make_model(keras)
    optimizer = P.SHARD_WRAPS["stack"](dm, P.build_optimizer(dm, keras, "adam", clip="some", shard=mode != "one"))
    optimizer.build(model.trainable_variables)


@tf.function
def step(xb, yb):
    def replica(xb, yb):
        def loss_fn():
            losses = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
            return tf.nn.compute_average_loss(losses, global_batch_size=denominator)
        optimizer.minimize(loss_fn, model.trainable_variables)
    strategy.run(replica, args=(xb, yb))


def train(lo, hi, checkpointer=None):
    for s in range(lo, hi):
        step(xs[s * local:(s + 1) * local], ys[s * local:(s + 1) * local])
        if checkpointer is not None:
            checkpointer.step_done()


with strategy.scope():
    ckpt = dm.Checkpointer(ckpt_dir, model, optimizer, every=STEPS // 2 if mode == "save" else 10 ** 6)
    start = ckpt.restore()
if mode == "save":
    train(0, STEPS // 2, ckpt)  # saved at STEPS // 2
    ckpt.close()
    train(STEPS // 2, STEPS)  # the uninterrupted run goes on, saving nothing
    if rank == 0 and not multiworker:  # and rank 0 saves a .keras file (its share of the optimizer state: a warning)
        model.compile(optimizer=optimizer, loss="mse")
        model.save(os.path.join(out_dir, "model.keras"))
else:
    train(start, STEPS)
    ckpt.close()
held = sharded_checkpoint.held_by_key(optimizer, model.trainable_variables)
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"start": start, "weights": [w.tolist() for w in P.weights(model)],
               "state": {k: np.asarray(v).tolist() for k, v in held.items()},
               "iterations": int(optimizer.iterations.numpy())}, f)
