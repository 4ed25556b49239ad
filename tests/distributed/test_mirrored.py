"""Parity under MirroredStrategy on 2 and 4 logical CPU devices, fit and custom loops.

Each replica count runs in its own process (tf.distribute's collective group keys clash
when strategies of different sizes share one); the worker trains every case plus the
single-device reference on the same global batch and reports the max abs difference.
"""

import json

import pytest

import parity_lib as P
import proc

pytestmark = pytest.mark.distributed

CASES = P.MIRRORED_CASES
_cache = {}


def results(n: int) -> dict:
    if n not in _cache:
        [(rc, out)] = proc.run_all([proc.python("tests/workers/mirrored_worker.py", str(n))],
                                   [proc.env()], timeout=proc.JOB_TIMEOUT)
        assert rc == 0, f"mirrored worker (N={n}) exited {rc}:\n{out[-5000:]}"
        line = next(l for l in out.splitlines() if l.startswith("RESULTS "))
        _cache[n] = json.loads(line[len("RESULTS "):])
    return _cache[n]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_matches_single_device(n, case):
    """Same weights as one device on the same global batch, and the clipper clipped as
    many steps as it does there. "never"/"some" cases see the gradient's scale (an
    unclipped SGD step is proportional to it)."""
    r = results(n)[case]
    assert r["diff"] <= 1e-6, r
    assert r["iterations"] == P.STEPS
    assert r["clipped_steps"] == P.CLIPPED_STEPS[case.split("/")[2]], r
    assert r["copies_agree"], r  # every device's copy of every weight and slot, not only the first


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_matches_stock_keras_on_one_device(n, case):
    """Independent reference: stock Keras (global_clipnorm, no dist_minimize code) on one device."""
    r = results(n)[case]
    assert r["keras_diff"] <= 1e-6, r


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_exactly_one_all_reduce_per_replica_step(n, case):
    r = results(n)[case]
    # The custom "callable" loop runs eagerly: one call per replica per step (4 steps).
    # fit and "tape" are traced once: one call per replica in the traced step. A second
    # aggregation (Keras's own) would double these counts.
    expected = n * P.STEPS if case.split("/")[1] == "callable" else n
    assert r["all_reduce_calls"] == expected, r


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_keras_global_clipnorm_anchor_does_not_match(n, opt):
    """Stock Keras 3 clips per replica: far from single-device. Fails if Keras fixes it."""
    assert results(n)[f"{opt}/keras_anchor"]["diff"] > 1e-3


@pytest.mark.parametrize("mode", ["fit", "tape"])
@pytest.mark.parametrize("n, name", [(4, name) for name in sorted(P.WEIGHT_WRAPPERS)] + [(2, "stack"), (4, "stack")])
def test_weight_wrappers_match_single_device(n, name, mode):
    """MovingAverage, SWA, Lookahead, DecoupledWeightDecay, alone and stacked with
    LossScaleOptimizer and GradientAccumulation, on n replicas: the weights, every
    optimizer variable (averages, slow weights, counts, moments) and the clipped steps
    as on one device (SGD: a wrong gradient scale shows in every unclipped step), and every replica holding the same values."""
    r = results(n)[f"wrap/{name}/{mode}"]
    steps = P.STEPS // 2 if name == "stack" else P.STEPS  # GradientAccumulation(steps=2)
    assert r["iterations"] == steps, r
    assert r["clipped_steps"] == r["ref_clipped_steps"], r
    if name != "stack":  # (the stack's 2-micro-step means stay under the clip norm)
        assert 0 < r["clipped_steps"] < steps, r
    if name in ("swa", "stack"):
        assert r["num_averaged"] == (P.STEPS // 2 if name == "swa" else 2), r
    assert r["copies_agree"], r
    assert r["diff"] <= 1e-6 and r["state_diff"] is not None and r["state_diff"] <= 1e-5, r


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("wrap", sorted(P.PRIVACY_WRAPPERS))
@pytest.mark.parametrize("mode", ["tape", "fit_integrated"])
def test_differential_privacy_matches_single_device(n, wrap, mode):
    """DP-SGD on n replicas = one device on the same global batch: the clipped per-example
    (or per-pair) gradients summed across replicas and divided by the global count; with
    noise on, the same noise (drawn once, from the shared seed, at the global scale)."""
    r = results(n)[f"dp/{wrap}/{mode}"]
    assert r["iterations"] == P.STEPS and r["draws"] == P.STEPS
    assert r["copies_agree"]
    assert r["diff"] <= 1e-6, r


@pytest.mark.parametrize("n", [2, 4])
def test_differential_privacy_noise_does_not_grow_with_replicas(n):
    """The noise reaching the weights has sd lr * noise_multiplier * C / global examples on
    every replica count (noise added per replica before a SUM would be sqrt(n) larger),
    is the one-device draw exactly, identical on every replica, and fresh every step."""
    r = results(n)["dp/noise"]
    expected = P.PROBE_LR * P.DP_NOISE * P.DP_CLIP / P.GLOBAL_BATCH
    for std, mean in zip(r["std"], r["mean"]):
        assert abs(std / expected - 1) < 0.03, r  # 20000 draws: the estimate's sd is 0.5%
        assert abs(mean) < 0.03 * expected
    assert r["diff"] <= 1e-7 and r["agree"] and r["draws"] == 2
    assert abs(r["step_corr"]) < 0.03
