"""Parity of the wrappers: MovingAverage, SWA, Lookahead, DecoupledWeightDecay (alone and
stacked with loss scaling and accumulation), DifferentialPrivacy and GradientAccumulation
on several processes or replicas end where one device ends on the same global batches.

The strategy is the `run` parameter (see test_parity.py): "mirrored-2"/"mirrored-4" (the
shared MirroredStrategy worker jobs), "mirrored" (2 logical CPUs in this process),
"multiworker" and "horovod-gloo" (the shared process jobs of jobs.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import jobs
import parity_lib as P
from conftest import mirrored_strategy
from jobs import DEFAULT, arrays, run_param

pytestmark = pytest.mark.distributed

# MirroredStrategy: each wrapper alone on 4 replicas in a custom loop, the stack on 2 and 4
# in fit and a custom loop; horovodrun: each alone in both.
WEIGHT_CASES = ([run_param(f"mirrored-{n}", name, mode) for mode in ("fit", "tape")
                 for n, name in [(4, "stack"), (2, "stack")]]
                + [run_param("mirrored-4", name, "tape") for name in sorted(P.WEIGHT_WRAPPERS)]
                + [run_param("horovod-gloo", name, mode) for mode in ("fit", "tape") for name in sorted(P.WEIGHT_WRAPPERS)])


@pytest.mark.parametrize("run,name,mode", WEIGHT_CASES)
def test_weight_wrappers_match_single_device(tmp_path_factory, run, name, mode):
    """The weights, every optimizer variable (averages, slow weights, counts, moments) and,
    under MirroredStrategy, the clipped steps as on one device (SGD: a wrong gradient
    scale shows in every unclipped step), and every replica holding the same values."""
    steps = P.STEPS // 2 if name == "stack" else P.STEPS  # GradientAccumulation(steps=2)
    if run.startswith("mirrored-"):
        r = jobs.mirrored(int(run.split("-")[1]))[f"wrap/{name}/{mode}"]
        assert r["iterations"] == steps, r
        assert r["clipped_steps"] == r["ref_clipped_steps"], r
        if name != "stack":  # (the stack's 2-micro-step means stay under the clip norm)
            assert 0 < r["clipped_steps"] < steps, r
        if name in ("swa", "stack"):
            assert r["num_averaged"] == (P.STEPS // 2 if name == "swa" else 2), r
        assert r["copies_agree"], r
        assert r["diff"] <= 1e-6 and r["state_diff"] is not None and r["state_diff"] <= 1e-5, r
        return
    ref_w, ref_opt, _ = P.train(DEFAULT, "adam", mode, aggregate="none", clip="some", wrap=name)
    ref_state = [np.array(v) for v in ref_opt.variables]
    for r in jobs.horovod(run, 2, "parity", tmp_path_factory):
        got = r[f"wrap/{name}/{mode}"]
        assert got["iterations"] == steps
        assert P.max_abs_diff(ref_w, arrays(got["weights"])) <= 1e-6
        assert len(got["state"]) == len(ref_state)
        for a, b in zip(got["state"], ref_state):
            np.testing.assert_allclose(np.array(a), b, rtol=1e-5, atol=1e-6)


PRIVACY_CASES = ([run_param(f"mirrored-{n}", wrap, mode) for mode in ("tape", "fit_integrated")
                  for wrap in sorted(P.PRIVACY_WRAPPERS) for n in (2, 4)]
                 + [run_param("horovod-gloo", wrap, mode) for wrap in sorted(P.PRIVACY_WRAPPERS)
                    for mode in ("fit_integrated", "tape")])


@pytest.mark.parametrize("run,wrap,mode", PRIVACY_CASES)
def test_differential_privacy_matches_single_device(tmp_path_factory, run, wrap, mode):
    """DP-SGD on n replicas or processes = one device on the same global batch: the clipped
    per-example (or per-pair) gradients summed across replicas and divided by the global
    count (Horovod averages the processes' clipped sums); with noise on, the same noise
    (drawn once, from the shared seed, at the global scale)."""
    if run.startswith("mirrored-"):
        r = jobs.mirrored(int(run.split("-")[1]))[f"dp/{wrap}/{mode}"]
        assert r["iterations"] == P.STEPS and r["draws"] == P.STEPS
        assert r["copies_agree"]
        assert r["diff"] <= 1e-6, r
        return
    ref, _, _ = P.train(DEFAULT, "sgd", mode, aggregate="none", clip=False, wrap=wrap)
    for r in jobs.horovod(run, 2, "parity", tmp_path_factory):
        got = r[f"dp/{wrap}/{mode}"]
        assert got["iterations"] == P.STEPS and got["draws"] == P.STEPS
        assert P.max_abs_diff(ref, arrays(got["weights"])) <= 1e-6


@pytest.mark.parametrize("run", [run_param("mirrored-2"), run_param("mirrored-4"), run_param("horovod-gloo")])
def test_differential_privacy_noise_does_not_grow_with_replicas(tmp_path_factory, run):
    """The noise reaching the weights has sd lr * noise_multiplier * C / global examples on
    every replica or process count (noise added per replica before a SUM would be sqrt(n)
    larger), is the one-device draw exactly, identical on every replica, and fresh every
    step. Under Horovod, without a seed, rank 0's random seed is broadcast, so both ranks
    draw the same noise and keep the same weights."""
    expected = P.PROBE_LR * P.DP_NOISE * P.DP_CLIP / P.GLOBAL_BATCH
    if run.startswith("mirrored-"):
        r = jobs.mirrored(int(run.split("-")[1]))["dp/noise"]
        for std, mean in zip(r["std"], r["mean"]):
            assert abs(std / expected - 1) < 0.03, r  # 20000 draws: the estimate's sd is 0.5%
            assert abs(mean) < 0.03 * expected
        assert r["diff"] <= 1e-7 and r["agree"] and r["draws"] == 2
        assert abs(r["step_corr"]) < 0.03
        return
    ref = P.privacy_noise(DEFAULT)
    ranks = jobs.horovod(run, 2, "parity", tmp_path_factory)
    for r in ranks:
        for std, head, ref_move in zip(r["dp/noise"]["std"], r["dp/noise"]["head"], ref["moves"]):
            assert abs(std / expected - 1) < 0.03
            np.testing.assert_allclose(head, ref_move[:500], rtol=0, atol=1e-7)
    a, b = (r["dp/unseeded"] for r in ranks)
    assert a["seed"] == b["seed"]
    assert P.max_abs_diff(arrays(a["weights"]), arrays(b["weights"])) == 0.0


def _accumulation_run(strat, k, mode, count):
    """SGD+clip with accumulation K under `strat`; returns weights and all-reduce calls."""
    x, y = P.make_data(P.STEPS * k)
    with strat.scope():
        model = P.make_model(keras)
        opt = dm.GradientAccumulation(
            dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM)), k)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH)
    count["n"] = 0
    if mode == "fit":
        with strat.scope():
            model.compile(loss="mse", optimizer=opt)
        model.fit(ds, epochs=1, verbose=0, shuffle=False)
    else:  # eager custom loop: counts every executed call
        with strat.scope():
            opt.build(model.trainable_variables)

        def replica_step(xb, yb):
            opt.minimize(lambda: tf.nn.compute_average_loss(
                tf.reduce_mean(tf.square(model(xb) - yb), axis=-1), global_batch_size=P.GLOBAL_BATCH),
                model.trainable_variables)

        for batch in strat.experimental_distribute_dataset(ds):
            strat.run(replica_step, args=batch)
    return P.weights(model), opt


def mirrored_accumulation(monkeypatch, k, mode):
    """[(weights, iterations, clipped steps)], the reference, and the all-reduces (eager)."""
    from tensorflow.python.distribute import distribute_lib

    count = {"n": 0}
    original = distribute_lib.ReplicaContextBase.all_reduce

    def counting(self, *a, **kw):
        count["n"] += 1
        return original(self, *a, **kw)

    monkeypatch.setattr(distribute_lib.ReplicaContextBase, "all_reduce", counting)
    x, y = P.make_data(P.STEPS * k)
    ref_model = P.make_model(keras)
    ref_model.compile(loss="mse", optimizer=dm.Optimizer(
        keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM)))
    ref_model.fit(x, y, batch_size=P.GLOBAL_BATCH * k, epochs=1, verbose=0, shuffle=False)
    got, opt = _accumulation_run(mirrored_strategy(), k, mode, count)
    return [(got, int(opt.iterations.numpy()), P.clipped_steps(opt))], P.weights(ref_model), count["n"]


ACCUMULATION_CASES = ([run_param("mirrored", mode, k) for mode in ("fit", "eager") for k in (1, 2, 4)]
                      + [run_param("multiworker", "custom", k) for k in (2, 4)]
                      + [run_param("horovod-gloo", "custom", k) for k in (2, 4)]
                      + [run_param("horovod-gloo", "fit", 2)])


@pytest.mark.parametrize("run,mode,k", ACCUMULATION_CASES)
def test_accumulation_matches_one_device_with_one_aggregation_per_update(tmp_path_factory, monkeypatch,
                                                                         run, mode, k):
    """GradientAccumulation over k micro-steps = one device on batches k times larger
    (Adam, clipped): clipped once per update, not per micro-step, and aggregated once per
    update where the run counts its collectives (MirroredStrategy's eager loop: one
    all-reduce per replica per update; Horovod's custom loop: one grouped allreduce)."""
    if run == "mirrored":
        observed, ref, all_reduces = mirrored_accumulation(monkeypatch, k, mode)
        if mode == "eager":
            # One all-reduce per replica per UPDATE (STEPS updates of K micro-steps each).
            assert all_reduces == 2 * P.STEPS
    else:
        ref = P.reference_accumulation(k)
        key = f"accumulate_fit/{k}" if mode == "fit" else f"accumulate/{k}"
        results = (jobs.multiworker("parity", tmp_path_factory) if run == "multiworker"
                   else jobs.horovod(run, 2, "parity", tmp_path_factory))
        observed = [(arrays(r[key]["weights"]), r[key]["iterations"], r[key]["clipped_steps"]) for r in results]
        if run.startswith("horovod") and mode == "custom":
            for r in results:
                assert r[key]["calls"] == {"grouped_allreduce": P.STEPS, "allreduce": 0}  # not STEPS * k
    for weights, iterations, clipped in observed:
        assert iterations == P.STEPS
        assert clipped == P.STEPS  # clipped once per update, not per micro-step
        assert P.max_abs_diff(ref, weights) <= 1e-6
