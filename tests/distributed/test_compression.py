"""CompressedAggregation under horovodrun -np 2 (Gloo) and MultiWorkerMirroredStrategy (2
workers): the error-feedback identity with each backend's aggregation (Horovod's average,
the strategy's sum), and rank 0's checkpoint made to hold what every rank needs. The jobs
are the shared "parity" ones of jobs.py (tests/workers/horovod_worker.py,
tests/workers/multiworker_worker.py)."""

import numpy as np
import pytest

import jobs
from conftest import requires_horovod

pytestmark = [pytest.mark.distributed]
U16 = 2.0 ** -11  # float16's unit roundoff


@pytest.mark.parametrize("codec", ["fp16", "powersgd:2"])
def test_multiworker_applied_plus_residual_is_the_exact_sum(codec, tmp_path_factory):
    """The residuals read back as their sum over the workers (a SyncOnRead SUM), which is
    what the strategy's SUM aggregation sends of them: exact to float32 rounding."""
    workers = jobs.multiworker("parity", tmp_path_factory)
    case = f"compress/{codec}"
    assert workers[0][case]["weights"] == workers[1][case]["weights"]
    got = workers[0][case]
    residual = np.array(got["residual"])
    assert np.abs(residual).max() > 0
    np.testing.assert_allclose(-np.array(got["weights"][0]) + residual, np.array(got["exact"]), rtol=0, atol=5e-5)


def ranks(tmp_path_factory):
    return [r["compression"] for r in jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory)]


@requires_horovod
def test_the_same_gradient_on_both_ranks_is_applied_exactly_over_time(tmp_path_factory):
    """Both ranks send the same 16-bit value, so Horovod's average of them is exact: what
    is applied plus the residual is the sum of the gradients, to float32 rounding."""
    for r in ranks(tmp_path_factory):
        total = np.sum(np.array(r["grads"], np.float32), axis=0)
        w, residual = np.array(r["same"]["w"]), np.array(r["same"]["residual"])
        assert np.abs(residual).max() > 0
        np.testing.assert_allclose(-w + residual, total, rtol=0, atol=1e-5)


@requires_horovod
def test_different_gradients_keep_the_identity_up_to_the_rounding_of_the_16_bit_sum(tmp_path_factory):
    """Rank r sends g * (1 + r): the applied average plus the mean residual is the mean
    gradient, up to float16's rounding of each step's sum (no rank sees that rounding)."""
    r0, r1 = ranks(tmp_path_factory)
    grads = np.array(r0["grads"], np.float32)
    assert r0["different"]["w"] == r1["different"]["w"]  # every rank applied the same
    w = np.array(r0["different"]["w"])
    mean_residual = (np.array(r0["different"]["residual"]) + np.array(r1["different"]["residual"])) / 2
    expected = 1.5 * grads.sum(axis=0)
    bound = U16 * (1 + U16) * 1.5 * np.abs(grads).sum(axis=0) * 1.01 + 1e-6
    assert np.abs(mean_residual).max() > 0
    assert np.all(np.abs(-w + mean_residual - expected) <= bound)


@requires_horovod
def test_a_checkpoint_evens_the_residuals_out_without_changing_their_average(tmp_path_factory):
    r0, r1 = ranks(tmp_path_factory)
    before = (np.array(r0["different"]["residual"]) + np.array(r1["different"]["residual"])) / 2
    assert r0["different"]["residual"] != r1["different"]["residual"]
    assert r0["different"]["residual_saved"] == r1["different"]["residual_saved"]
    np.testing.assert_allclose(np.array(r0["different"]["residual_saved"]), before, rtol=0, atol=1e-7)


@requires_horovod
def test_low_rank_keeps_the_identity_exactly_under_horovods_average(tmp_path_factory):
    """powersgd:1 on a 32 x 4 kernel, rank r's gradient (1 + r)(g_t [1 2 3 4] + roll(g_t)
    [1 -1 1 -1]) (rank 2, so rank 1 drops part of every step's): the applied
    average plus the mean residual is the mean gradient (float32 rounding), the two
    aggregations of each update (P, then Q) agreeing on every rank."""
    r0, r1 = ranks(tmp_path_factory)
    grads = np.array(r0["grads"], np.float32)
    assert r0["powersgd"]["w"] == r1["powersgd"]["w"]
    w = np.array(r0["powersgd"]["w"]).reshape(32, 4)
    mean_residual = (np.array(r0["powersgd"]["residual"]) + np.array(r1["powersgd"]["residual"])).reshape(32, 4) / 2
    expected = 1.5 * sum(np.outer(g, np.arange(1, 5)) + np.outer(np.roll(g, 1), (-1.0) ** np.arange(4)) for g in grads)
    assert np.abs(mean_residual).max() > 0.1  # the rank dropped part of each step's
    np.testing.assert_allclose(-w + mean_residual, expected, rtol=0, atol=5e-5)
