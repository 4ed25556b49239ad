"""`dm.horovod_keras.SyncBatchNormalization` on N Horovod ranks with b rows each equals
Keras's `BatchNormalization` on one device with the N*b rows: outputs, gradients of the
inputs, of gamma and of beta (summed over the ranks, as the optimizer's aggregation sums
them), the moving statistics and the inference outputs, within 1e-5 relative; also when
the mean (1000) is large against the spread (1), where a one-pass variance loses most
digits, and with unequal batches per rank. Jobs (tests/workers/sync_bn_worker.py):
horovodrun -np 2 and -np 4 (Gloo)."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import jobs
import proc
from dist_minimize import launcher
from conftest import requires_horovod

pytestmark = pytest.mark.distributed

WORKER = "tests/workers/sync_bn_worker.py"
COUNTS = {2: {"equal": [4, 4], "unequal": [5, 3]}, 4: {"equal": [2, 2, 2, 2], "unequal": [3, 1, 2, 2]}}
MEANS = {"large_mean": 1000.0, "centred": 0.0}


def cases(np_) -> dict:
    rng = np.random.default_rng(np_)
    out = {}
    for split, counts in COUNTS[np_].items():
        for kind, mean in MEANS.items():
            rows = sum(counts)
            out[f"{split}/{kind}"] = {"x": (mean + rng.normal(size=(rows, 4, 3))).tolist(), "counts": counts,
                                      "c": rng.normal(size=(rows, 4, 3)).tolist()}
    return out


def one_device(case) -> dict:
    """Keras's BatchNormalization on the whole batch, on one device, in float64 (the
    float32 inputs the ranks see, exactly)."""
    x = tf.constant(np.asarray(case["x"], "float32").astype("float64"))
    c = np.asarray(case["c"], "float32").astype("float64")
    layer = keras.layers.BatchNormalization(momentum=0.5, dtype="float64")
    layer.build(x.shape)
    layer.gamma.assign(np.linspace(0.5, 1.5, 3).astype("float32").astype("float64"))
    layer.beta.assign(np.linspace(-1, 1, 3).astype("float32").astype("float64"))
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layer(x, training=True)
        loss = tf.reduce_sum(outputs * c)
    dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return {"outputs": outputs.numpy(), "dx": dx.numpy(), "dgamma": dgamma.numpy(), "dbeta": dbeta.numpy(),
            "moving_mean": layer.moving_mean.numpy(), "moving_variance": layer.moving_variance.numpy(),
            "inference": layer(x, training=False).numpy()}


def ranks(np_, tmp_path_factory):
    def start():
        out = tmp_path_factory.mktemp(f"sync-bn-{np_}")
        with open(out / "cases.json", "w") as f:
            json.dump(cases(np_), f)
        log = out / "log.txt"
        with open(log, "w") as f:
            rc = launcher.launch("horovod-gloo", np_, [os.path.join(proc.ROOT, WORKER), str(out),
                                                       str(out / "cases.json")],
                                 timeout=proc.JOB_TIMEOUT, out=f, child_output=f)
        assert rc == 0, log.read_text()[-5000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]
    return jobs._once(("sync-bn", np_), start)


def assert_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    assert np.max(np.abs(got - want)) <= 1e-5 * scale, (what, np.max(np.abs(got - want)), scale)


@pytest.mark.parametrize("np_", [pytest.param(n, marks=requires_horovod, id=f"np{n}") for n in (2, 4)])
@pytest.mark.parametrize("case", [f"{s}/{k}" for s in ("equal", "unequal") for k in MEANS])
def test_sync_batch_norm_on_n_ranks_is_batch_norm_on_one_device_with_the_whole_batch(np_, case, tmp_path_factory):
    results = [r[case] for r in ranks(np_, tmp_path_factory)]
    want = one_device(cases(np_)[case])
    for key in ("outputs", "dx", "inference"):
        assert_close(np.concatenate([np.asarray(r[key]) for r in results]), want[key], key)
    for key in ("dgamma", "dbeta"):
        assert_close(np.sum([np.asarray(r[key]) for r in results], axis=0), want[key], key)
    for r in results:
        for key in ("moving_mean", "moving_variance"):
            assert_close(r[key], want[key], key)
    # the ranks' own batches have other statistics: a local normalisation would show
    local = keras.layers.BatchNormalization(momentum=0.5)
    first = np.asarray(cases(np_)[case]["x"], "float32")[:cases(np_)[case]["counts"][0]]
    local.build(first.shape)
    local(first, training=True)
    assert np.max(np.abs(local.moving_variance.numpy() - want["moving_variance"])) > 1e-3

