"""One rank of a broadcast job (tests/distributed/test_broadcast.py), under horovodrun or
mpirun, any np.

Usage: broadcast_worker.py OUT_DIR SAVED_MODEL SAVED_PLAIN
Cases, in order, in one job (a refused broadcast raises on every rank before anything is
sent, so the ranks stay in step for the next case):
  resume       Horovod's resume pattern: rank 0 loads SAVED_MODEL (a dm.Optimizer(SGD with
               momentum) that has trained, its slots non-zero), the other ranks build a
               fresh model; `broadcast_model_and_optimizer`; then STEPS steps, each rank
               on its own rows
  resume_fit   the same through `model.fit` and `BroadcastVariablesCallback(0)`
  other_model  rank 1 builds a wider layer: refused
  other_stack  rank 1 wraps the optimizer in Lookahead: refused
  sharded      Adam with shard_optimizer_state=True, every rank fresh from its own seed:
               the broadcast sends the model and what every rank holds; then STEPS steps
  sharded_refused  the sharded stack trained STEPS steps on every rank, then rank 1
               starts a fresh one (another step count): refused, naming Checkpointer
  load_model   every rank: `dm.horovod_keras.load_model(SAVED_PLAIN)` (a plain Keras SGD
               with momentum in the file), then `fit` on its own rows
Each rank writes OUT_DIR/rank{R}.json: per case, the weights and every optimizer variable
it holds (by structural key) after the broadcast and after the steps, or the error.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402
from dist_minimize.sharding import sharded_checkpoint  # noqa: E402

STEPS = 3
out_dir, saved, saved_plain = sys.argv[1:4]
hvd = dm.horovod_keras.init()
rank, size = hvd.rank(), hvd.size()
rng = np.random.default_rng(100 + rank)  # each rank's own rows
x = rng.normal(size=(STEPS * 4, 6)).astype("float32")
y = rng.normal(size=(STEPS * 4, 3)).astype("float32")


def fresh_model(seed, width=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(width)])


def sgd():
    return dm.Optimizer(keras.optimizers.SGD(0.1, momentum=0.9))


def state(model, optimizer):
    held = sharded_checkpoint.held_by_key(optimizer, list(model.trainable_variables))
    return {"weights": [np.asarray(w).tolist() for w in model.get_weights()],
            "optimizer": {k: np.asarray(v).tolist() for k, v in held.items()},
            "iterations": int(optimizer.iterations.numpy())}


def train(model, optimizer):
    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)

    for s in range(STEPS):
        step(x[4 * s:4 * s + 4], y[4 * s:4 * s + 4])


def resume(fit):
    if rank == 0:
        model = keras.saving.load_model(saved)
    else:
        model = fresh_model(seed=7 + rank)
        model.compile(optimizer=sgd(), loss="mse")
    if fit:
        callback = dm.horovod_keras.BroadcastVariablesCallback(0)
        seen = {}

        class Record(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 0:
                    seen.update(state(model, model.optimizer))

        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[callback, Record()])
        return {"after_broadcast": seen, "after_steps": state(model, model.optimizer)}
    dm.horovod_keras.broadcast_model_and_optimizer(model, model.optimizer, root_rank=0)
    after = state(model, model.optimizer)
    train(model, model.optimizer)
    return {"after_broadcast": after, "after_steps": state(model, model.optimizer)}


def refused(build):
    model, optimizer = build()
    start = time.monotonic()
    try:
        dm.horovod_keras.broadcast_model_and_optimizer(model, optimizer)
    except ValueError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


def other_model():
    model = fresh_model(seed=3, width=4 if rank == 1 else 3)
    return model, sgd()


def other_stack():
    model = fresh_model(seed=3)
    return model, dm.Lookahead(sgd()) if rank == 1 else sgd()


def sharded_stack():
    return dm.Optimizer(keras.optimizers.Adam(0.05), shard_optimizer_state=True)


def sharded():
    model, optimizer = fresh_model(seed=11 + rank), sharded_stack()
    dm.horovod_keras.broadcast_model_and_optimizer(model, optimizer)
    after = state(model, optimizer)
    train(model, optimizer)
    return {"after_broadcast": after, "after_steps": state(model, optimizer)}


def sharded_trained_then_fresh_on_rank_1():
    model, optimizer = fresh_model(seed=11), sharded_stack()
    optimizer.build(model.trainable_variables)
    train(model, optimizer)
    if rank == 1:
        model, optimizer = fresh_model(seed=11), sharded_stack()
    return model, optimizer


def load_model():
    model = dm.horovod_keras.load_model(saved_plain)
    before = state(model, model.optimizer)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return {"optimizer": type(model.optimizer).__name__, "after_load": before,
            "after_steps": state(model, model.optimizer)}


results = {"load_model": load_model(), "resume": resume(fit=False), "resume_fit": resume(fit=True),
           "other_model": refused(other_model), "other_stack": refused(other_stack),
           "sharded": sharded(), "sharded_refused": refused(sharded_trained_then_fresh_on_rank_1)}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
