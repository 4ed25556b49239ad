"""One rank of a SyncBatchNormalization job (tests/distributed/test_sync_batch_norm.py),
under horovodrun, any np.

Usage: sync_bn_worker.py OUT_DIR CASES_JSON
CASES_JSON: {case: {"x": the global batch (rows, 4, 3), "counts": rows per rank, "c": the
loss weights}}. Each rank takes its rows of x (in rank order), runs a SyncBatchNormalization
(axis -1, momentum 0.5) in training on them under a GradientTape with loss
sum(outputs * c_rows), then in inference, and writes OUT_DIR/rank{R}.json: per case its
outputs, the gradient of its inputs, its gradients of gamma and beta, the moving
statistics, the inference outputs.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402

out_dir, cases_file = sys.argv[1:3]
hvd = dm.horovod_keras.init()
rank = hvd.rank()
with open(cases_file) as f:
    cases = json.load(f)
results = {}
for name, case in cases.items():
    x, c = np.asarray(case["x"], "float32"), np.asarray(case["c"], "float32")
    lo = sum(case["counts"][:rank])
    rows = slice(lo, lo + case["counts"][rank])
    layer = dm.horovod_keras.SyncBatchNormalization(momentum=0.5, gamma_initializer="ones")
    layer.build(x.shape)
    layer.gamma.assign(np.linspace(0.5, 1.5, 3).astype("float32"))
    layer.beta.assign(np.linspace(-1, 1, 3).astype("float32"))
    mine = tf.constant(x[rows])

    @tf.function
    def train(inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            outputs = layer(inputs, training=True)
            loss = tf.reduce_sum(outputs * c[rows])
        return outputs, tape.gradient(loss, [inputs, layer.gamma, layer.beta])

    outputs, (dx, dgamma, dbeta) = train(mine)
    results[name] = {"outputs": outputs.numpy().tolist(), "dx": dx.numpy().tolist(),
                     "dgamma": dgamma.numpy().tolist(), "dbeta": dbeta.numpy().tolist(),
                     "moving_mean": layer.moving_mean.numpy().tolist(),
                     "moving_variance": layer.moving_variance.numpy().tolist(),
                     "inference": layer(mine, training=False).numpy().tolist()}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
