"""One rank of a rank-local-variables job (tests/distributed/test_local_variables.py),
under horovodrun -np N.

Usage: local_worker.py OUT_DIR [sharded]
A shared Dense(3) and a per-rank head Dense(1) (registered through
`dm.horovod_keras.PartialDistributedOptimizer(dm.Optimizer(SGD(LR, MOMENTUM), clip by
global norm CLIP, a poison multiplier before aggregation), local_layers=[head])`); each
rank starts its head from its own seed and gets its own rows. With `sharded`, the same
with `shard_optimizer_state=True` (the shared kernel's momentum on one rank, each head's
on its own rank).
1. the broadcast: shared weights from rank 0, each head kept;
2. STEPS steps; before each, the expected new weights from an independent reference
   (a plain GradientTape on this rank, every rank's gradients gathered with
   `allgather_object`, Horovod's rule in NumPy: shared gradient the mean over ranks, a
   local one divided by the rank count, the clip factor from the norm of both with every
   rank's local part, SGD's momentum);
3. a step whose local gradient is inf on the last rank only: skipped on every rank.
Writes OUT_DIR/rank{R}.json.
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

STEPS, LR, CLIP, MOMENTUM = 3, 0.5, 0.3, 0.5
out_dir = sys.argv[1]
SHARDED = sys.argv[2:] == ["sharded"]
hvd = dm.horovod_keras.init()
rank, size = hvd.rank(), hvd.size()
rng = np.random.default_rng(10 + rank)
x = rng.normal(size=(STEPS + 1, 4, 4)).astype("float32")
y = rng.normal(size=(STEPS + 1, 4, 1)).astype("float32")

keras.utils.set_random_seed(100 + rank)  # every rank its own shared and head weights
shared = keras.layers.Dense(3, use_bias=False, name="shared")
head = keras.layers.Dense(1, use_bias=False, name="head")
model = keras.Sequential([keras.Input((4,)), shared, head])
poison = tf.Variable(1.0)  # multiplies the local gradient before aggregation


def poisoned(grads_and_vars):
    return [(g * poison if v is head.kernel else g, v) for g, v in grads_and_vars]


stack = dm.Optimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM), transform_unaggregated_gradients=poisoned,
                     aggregate_gradients="horovod", transform_gradients=dm.clip_by_global_norm(CLIP),
                     shard_optimizer_state=SHARDED)
optimizer = dm.horovod_keras.PartialDistributedOptimizer(stack, local_layers=[head])
head_before = head.kernel.numpy().copy()
dm.horovod_keras.broadcast_model_and_optimizer(model, optimizer)
results = {"broadcast": {"shared": shared.kernel.numpy().tolist(), "head_before": head_before.tolist(),
                         "head_after": head.kernel.numpy().tolist()}}


def loss_of(xb, yb):
    return tf.reduce_mean(tf.square(model(xb) - yb))


@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_of(xb, yb)
    optimizer.minimize(loss, model.trainable_variables, tape=tape)


velocity = {"shared": 0.0, "head": 0.0}  # Keras SGD: m = MOMENTUM * m - LR * g; w += m


def expected(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_of(xb, yb)
    g_shared, g_head = [g.numpy().astype(np.float64) for g in tape.gradient(loss, [shared.kernel, head.kernel])]
    everyone = hvd.allgather_object((g_shared, g_head))
    mean_shared = np.mean([s for s, _ in everyone], axis=0)
    locals_ = [h / size for _, h in everyone]
    norm = np.sqrt(np.sum(mean_shared ** 2) + sum(np.sum(h ** 2) for h in locals_))
    factor = min(1.0, CLIP / norm)
    velocity["shared"] = MOMENTUM * velocity["shared"] - LR * factor * mean_shared
    velocity["head"] = MOMENTUM * velocity["head"] - LR * factor * locals_[rank]
    return shared.kernel.numpy() + velocity["shared"], head.kernel.numpy() + velocity["head"], factor


errors, factors = [], []
for s in range(STEPS):
    want_shared, want_head, factor = expected(x[s], y[s])
    step(x[s], y[s])
    errors.append(max(float(np.max(np.abs(shared.kernel.numpy() - want_shared))),
                      float(np.max(np.abs(head.kernel.numpy() - want_head)))))
    factors.append(factor)
results["steps"] = {"errors": errors, "factors": factors, "shared": shared.kernel.numpy().tolist(),
                    "head": head.kernel.numpy().tolist(), "iterations": int(optimizer.iterations.numpy()),
                    "state_bytes": dm.optimizer_state_bytes(optimizer)}

before = {"shared": shared.kernel.numpy().copy(), "head": head.kernel.numpy().copy()}
if rank == size - 1:
    poison.assign(float("inf"))
step(x[STEPS], y[STEPS])
results["inf_on_last_rank"] = {
    "shared_unchanged": bool(np.array_equal(before["shared"], shared.kernel.numpy())),
    "head_unchanged": bool(np.array_equal(before["head"], head.kernel.numpy())),
    "iterations": int(optimizer.iterations.numpy()), "skipped": int(optimizer.skipped_steps.numpy()),
    "shared": shared.kernel.numpy().tolist()}
# a checkpoint holds each rank's local head (and its rule's state), beside the shared file
poison.assign(1.0)
ckpt_dir = os.path.join(out_dir, "ckpt")
saved = [w.copy() for w in model.get_weights()]
held = dm.sharding.sharded_state.held_variables(optimizer)
saved_state = [v.numpy().copy() for v in held]
checkpointer = dm.Checkpointer(ckpt_dir, model, optimizer, every=10 ** 6)
checkpointer.step = 4
checkpointer.save()
hvd.allgather_object(0)  # (rank 0 has published)
for w in list(model.variables) + held:
    w.assign(tf.zeros_like(w))
restored_step = dm.Checkpointer(ckpt_dir, model, optimizer, every=10 ** 6).restore()
results["checkpoint"] = {"step": restored_step,
                         "restored": all(np.array_equal(a, b) for a, b in zip(saved, model.get_weights())),
                         "state_restored": all(np.array_equal(a, v.numpy()) for a, v in zip(saved_state, held)),
                         "head": head.kernel.numpy().tolist()}

# the same without a clip (whose norm would carry the inf to every rank): the guard's
# own decision must be agreed
if rank == size - 1:
    poison.assign(float("inf"))
keras.utils.set_random_seed(7)
head2 = keras.layers.Dense(1, use_bias=False)
model2 = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False), head2])
opt2 = dm.horovod_keras.PartialDistributedOptimizer(
    dm.Optimizer(keras.optimizers.SGD(LR), transform_unaggregated_gradients=lambda gv: [
        (g * poison if v is head2.kernel else g, v) for g, v in gv], aggregate_gradients="horovod"),
    local_layers=[head2])


@tf.function
def step2(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model2(xb) - yb))
    opt2.minimize(loss, model2.trainable_variables, tape=tape)


weights = [w.copy() for w in model2.get_weights()]
step2(x[0], y[0])
results["inf_on_last_rank_no_clip"] = {
    "unchanged": all(np.array_equal(a, b) for a, b in zip(weights, model2.get_weights())),
    "skipped": int(opt2.skipped_steps.numpy())}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
