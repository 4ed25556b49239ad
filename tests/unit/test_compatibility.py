"""What users of dist_minimize 0.1.0 hold keeps working after the package was split into
layers: every public name, and the `.keras` files and checkpoints it wrote,
which load and resume exactly.

The files in tests/fixtures/v0_1 were written by the package as it stood at commit
1344a7e (tests/fixtures/make_v0_1_files.py says how): a model trained by `fit` for 3 of 8
batches with every wrapper of the documented stack around Adam and a clip, and the
weights and optimizer variables of the uninterrupted run of all 8 batches.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf

import dist_minimize as dm

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
sys.path.insert(0, FIXTURES)
import compat_problem as C  # noqa: E402

V0_1 = os.path.join(FIXTURES, "v0_1")

# dist_minimize.__all__ and dist_minimize.aggregation.__all__ of 0.1.0 (commit 1344a7e).
PUBLIC_0_1 = [
    "ClipByGlobalNorm", "ClipByNorm", "ClipByValue", "ConsistencyCheck", "DecoupledWeightDecay",
    "DifferentialPrivacy", "GradientAccumulation", "GradientTransform", "LimitNonFiniteSteps", "Lookahead",
    "LossScaleOptimizer", "MissingDependencyError", "MovingAverage", "Optimizer", "OptimizerWrapper", "SWA",
    "StagedOptimizer", "aggregation", "all_finite", "callbacks", "check_consistency", "clip_by_global_norm",
    "clip_by_norm", "clip_by_value", "cluster", "distribute", "global_norm", "horovod_keras", "integrate",
    "launcher", "limit_nonfinite_steps", "privacy", "swap_values", "update_batch_norm"]
AGGREGATION_0_1 = ["Aggregator", "AutoAggregator", "BACKEND_NAMES", "HorovodAggregator", "IdentityAggregator",
                   "NcclAggregator", "StrategyAggregator", "auto_choice", "get", "nccl_plan"]
DISTRIBUTE_0_1 = ["assign_replicated", "check_agreed", "deferred_updates", "flush_updates", "has_copy_per_device",
                  "horovod", "horovod_size", "in_xla", "known_all_finite", "mean_across", "note_all_finite",
                  "num_replicas", "refuse_xla", "run_if", "run_if_per_device", "strategy_replicas", "sum_across",
                  "uses_merge_call", "worker_device_types"]


def test_every_public_name_of_0_1_still_resolves():
    assert set(PUBLIC_0_1) <= set(dm.__all__)
    for name in PUBLIC_0_1:
        assert getattr(dm, name) is not None, name
    assert set(AGGREGATION_0_1) <= set(dm.aggregation.__all__)
    for name in AGGREGATION_0_1:
        getattr(dm.aggregation, name)
    for name in DISTRIBUTE_0_1:
        assert callable(getattr(dm.distribute, name)), name
    # Where the classes used to be imported from.
    from dist_minimize.optimizer import Optimizer, StagedOptimizer, all_finite  # noqa: F401
    from dist_minimize.wrappers.base import OptimizerWrapper, swap_values  # noqa: F401


def uninterrupted():
    with np.load(os.path.join(V0_1, "uninterrupted.npz")) as f:
        weights = [f[f"w{i}"] for i in range(sum(k.startswith("w") for k in f.files))]
        variables = [f[f"o{i}"] for i in range(sum(k.startswith("o") for k in f.files))]
    return weights, variables


def finish_and_compare(model):
    """The last 5 batches, then the same weights and optimizer variables as 0.1.0's
    uninterrupted run. Tolerance 1e-6: the same operations in the same order (measured:
    equal to the last bit, or within a float32 rounding)."""
    x, y = C.data()
    model.fit(x[C.SPLIT:], y[C.SPLIT:], batch_size=C.BATCH, shuffle=False, epochs=1, verbose=0)
    weights, variables = uninterrupted()
    for a, r in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6)
    assert len(model.optimizer.variables) == len(variables)
    for a, r in zip(model.optimizer.variables, variables):
        np.testing.assert_allclose(np.array(a), r, rtol=1e-6, atol=1e-6, err_msg=a.path)


def test_a_keras_file_of_0_1_loads_and_resumes_exactly():
    model = keras.saving.load_model(os.path.join(V0_1, "model.keras"))
    assert type(model.optimizer) is dm.LossScaleOptimizer
    assert [type(o).__name__ for o in model.optimizer.stack()] == [
        "LossScaleOptimizer", "GradientAccumulation", "MovingAverage", "SWA", "Lookahead",
        "DecoupledWeightDecay", "Optimizer"]
    assert int(model.optimizer.find(dm.GradientAccumulation).micro_step.numpy()) == C.SPLIT // C.BATCH
    finish_and_compare(model)


def test_a_checkpoint_of_0_1_restores_and_resumes_exactly():
    model = C.compiled(dm, keras)
    model.optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(os.path.join(V0_1, "ckpt"))
    status.assert_existing_objects_matched()
    assert int(model.optimizer.find(dm.GradientAccumulation).micro_step.numpy()) == C.SPLIT // C.BATCH
    finish_and_compare(model)


def test_the_files_were_written_by_0_1():
    """The uninterrupted run differs from a fresh start (the files hold training)."""
    fresh = C.compiled(dm, keras)
    weights, _ = uninterrupted()
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(fresh.get_weights(), weights)) > 1e-2
