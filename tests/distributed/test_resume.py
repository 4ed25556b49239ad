"""Resume: a run stopped mid-way, checkpointed and restored into a fresh model and
optimizer ends exactly where the uninterrupted run ends, and where one device does.

GradientAccumulation's partial sums are the hard case: replica-local (each replica or
process accumulates its own micro-batches). The strategy is the `run` parameter:
"mirrored" (2 logical CPUs in this process) and "horovod-gloo" (the shared horovodrun
job of jobs.py)."""

import keras
import pytest
import tensorflow as tf

import dist_minimize as dm
import jobs
import parity_lib as P
from conftest import mirrored_strategy
from jobs import arrays, run_param

pytestmark = pytest.mark.distributed


def mirrored_resumed(tmp_path):
    """Under MirroredStrategy the replica-local slots are checkpointed as their sum and
    restored as equal shares: a run stopped after 6 of 16 micro-steps (window 4) and
    restored. Returns [(iterations, weights)] of the resumed run."""
    s = mirrored_strategy()
    x, y = P.make_data(P.STEPS * 4)

    def run(lo, hi, model=None, opt=None):
        with s.scope():
            model = model if model is not None else P.make_model(keras)
            opt = opt if opt is not None else P.accumulating_adam(dm, keras, 4)
            opt.build(model.trainable_variables)
        ds = s.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x[lo * P.GLOBAL_BATCH:hi * P.GLOBAL_BATCH],
                                                y[lo * P.GLOBAL_BATCH:hi * P.GLOBAL_BATCH])).batch(P.GLOBAL_BATCH))

        @tf.function
        def step(xb, yb):
            def replica_step(xb, yb):
                def loss_fn():
                    per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                    return tf.nn.compute_average_loss(per_example, global_batch_size=P.GLOBAL_BATCH)
                opt.minimize(loss_fn, model.trainable_variables)
            s.run(replica_step, args=(xb, yb))

        for xb, yb in ds:
            step(xb, yb)
        return model, opt

    full, _ = run(0, 16)
    model, opt = run(0, 6)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "c"))
    with s.scope():
        fresh_model, fresh_opt = P.make_model(keras, seed=5), P.accumulating_adam(dm, keras, 4)
        fresh_opt.build(fresh_model.trainable_variables)
    tf.train.Checkpoint(model=fresh_model, optimizer=fresh_opt).read(path).assert_existing_objects_matched()
    resumed, resumed_opt = run(6, 16, fresh_model, fresh_opt)
    assert P.max_abs_diff(P.weights(full), P.weights(resumed)) <= 1e-6  # where the uninterrupted run ends
    return [(int(resumed_opt.iterations.numpy()), P.weights(resumed))]


def horovod_resumed(tmp_path_factory):
    """Each process accumulates its own micro-batches, and a checkpoint written by rank 0
    alone held rank 0's partial sums only (the defect). With share_accumulators() before
    the write, a run restored from it on every rank ends where the uninterrupted run does.
    Returns [(iterations, weights)] of each rank's resumed run."""
    ranks = jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory)
    ref = P.reference_accumulation(4)
    for r in ranks:
        # Without sharing, rank 1's partial sums are lost: the result differs.
        assert P.max_abs_diff(ref, arrays(r["accumulate_resumed/share=False"]["weights"])) > 1e-4
    return [(r["accumulate_resumed/share=True"]["iterations"], arrays(r["accumulate_resumed/share=True"]["weights"]))
            for r in ranks]


@pytest.mark.parametrize("run", [run_param("mirrored"), run_param("horovod-gloo")])
def test_accumulation_resumes_exactly(tmp_path, tmp_path_factory, run):
    resumed = mirrored_resumed(tmp_path) if run == "mirrored" else horovod_resumed(tmp_path_factory)
    for iterations, weights in resumed:
        assert iterations == P.STEPS
        assert P.max_abs_diff(P.reference_accumulation(4), weights) <= 1e-6
