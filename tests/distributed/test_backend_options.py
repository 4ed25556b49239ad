"""The Horovod backend's options keep the average, each checked under `horovodrun -np 2`
(Gloo) or `mpirun` (2 and 3 processes) against one device or its formula: a SUM
reduction with a global-batch loss, gradient_predivide_factor, packing into buffers,
fp16 compression (within its derived bound, and not skipped), Adasum, process sets,
mpi4py sub-communicators and the rank helpers. The jobs are the shared ones of jobs.py."""

import numpy as np
import pytest

import jobs
import parity_lib as P
from conftest import requires_horovod
from jobs import arrays

pytestmark = [pytest.mark.distributed, requires_horovod]


def test_sum_reduction_with_global_batch_loss(tmp_path_factory):
    ref = jobs.horovod_reference("sgd-0.01", "callable", "never")
    for r in jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory):
        assert P.max_abs_diff(ref, arrays(r["sum"]["weights"])) <= 1e-6


def test_predivide_factor_keeps_the_average(tmp_path_factory):
    ref = jobs.horovod_reference("sgd-0.01", "callable", "never")
    for r in jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory):
        assert P.max_abs_diff(ref, arrays(r["predivide"]["weights"])) <= 1e-6


def test_packed_and_unpacked_aggregation_agree(tmp_path_factory):
    """The default aggregator packs every gradient of this model into one buffer;
    bytes_per_pack=0 sends each alone, 64 bytes makes several buffers, pack_below=100
    sends the 160-byte kernel alone and packs the rest. Sum and mean act element by
    element, so on 2 processes the four are bitwise equal, and each matches one device
    (clip never fires, so a scale error shows)."""
    ref = jobs.horovod_reference("sgd-0.01", "callable", "never")
    for r in jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory):
        packed = r["sgd-0.01/callable/never"]["weights"]
        assert r["unpacked"]["weights"] == packed and r["pack64"]["weights"] == packed
        assert r["pack_below"]["weights"] == packed
        assert P.max_abs_diff(ref, arrays(packed)) <= 1e-6


def fp16_bound(local_max_abs) -> float:
    """The largest weight error fp16 compression can cause in the "fp16" run.

    Horovod's fp16 compressor rounds each rank's gradient to float16 (relative error
    <= u = 2**-11), sums the float16 values (the sum rounded again, <= u of it) and
    scales by 1/2 (exact). So each element of the averaged gradient is off by at most
    u * (|g0| + |g1|) * (1 + u) <= 2u(1 + u) * M_t, where M_t is the largest absolute
    element of any rank's gradient at step t (recorded by the worker). SGD (lr 0.01, no
    clipping) moves each weight by lr times that element, so after the steps the weights
    are off by at most lr * 2u(1 + u) * sum_t M_t, plus what the earlier errors change in
    later gradients: at most lr * |Hessian| times an error that is already lr * 2u * M
    small, bounded here by a factor 1.5 over the first-order term.
    """
    u = 2.0 ** -11
    m = np.max(np.array(local_max_abs, dtype=np.float64), axis=0)  # max over ranks, per step
    return 1.5 * 0.01 * 2 * u * (1 + u) * float(np.sum(m))


def test_fp16_compression_within_its_bound_and_not_skipped(tmp_path_factory):
    ranks = jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory)
    ref = jobs.horovod_reference("sgd-0.01", "callable", "never")
    bound = fp16_bound([r["fp16"]["local_max_abs"] for r in ranks])
    diffs = [P.max_abs_diff(ref, arrays(r["fp16"]["weights"])) for r in ranks]
    assert max(diffs) <= bound, (diffs, bound)
    assert ranks[0]["fp16"]["weights"] == ranks[1]["fp16"]["weights"]
    # Compression really ran: the same run without it differs.
    uncompressed = arrays(ranks[0]["sgd-0.01/callable/never"]["weights"])
    assert P.max_abs_diff(uncompressed, arrays(ranks[0]["fp16"]["weights"])) > 1e-6, "fp16 changed nothing"
    print(f"fp16: max diff {max(diffs):.3g}, bound {bound:.3g}")


def test_mpi_init_from_mpi4py_subcommunicator_and_same_library(tmp_path_factory):
    ranks = jobs.horovod("horovod-mpi", 2, "mpi", tmp_path_factory)
    for i, r in enumerate(ranks):
        assert r["init"]["hvd_rank"] == i and r["init"]["hvd_size"] == 2 and r["init"]["mpi_enabled"]
        assert "libmpi.so" in r["init"]["same_mpi"]
        assert r["discover"] == {"rank": i, "size": 2, "local_rank": i, "local_size": 2, "launcher": "openmpi"}


def test_adasum_on_two_processes_matches_its_formula(tmp_path_factory):
    ranks = jobs.horovod("horovod-mpi", 2, "mpi", tmp_path_factory)
    a, b = (np.array(r["adasum"]["local"], np.float64) for r in ranks)
    dot = a @ b
    want = (1 - dot / (2 * a @ a)) * a + (1 - dot / (2 * b @ b)) * b
    for r in ranks:
        np.testing.assert_allclose(r["adasum"]["result"], want, rtol=1e-5)


def test_adasum_refused_on_three_and_process_set_parity(tmp_path_factory):
    ranks = jobs.horovod("horovod-mpi", 3, "three", tmp_path_factory)
    for r in ranks:
        assert "power-of-two" in r["adasum_error"] and "3 processes" in r["adasum_error"]
    assert ranks[0]["process_set"]["ranks"] == [0, 1] and ranks[2]["process_set"]["ranks"] == [2]
    ref = jobs.horovod_reference("adam", "callable")
    for r in ranks[:2]:
        assert P.max_abs_diff(ref, arrays(r["process_set"]["weights"])) <= 1e-6


def test_rank_helpers_under_horovodrun_gloo(tmp_path_factory):
    for i, r in enumerate(jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory)):
        h = r["helpers"]
        assert h["discover"] == {"rank": i, "size": 2, "local_rank": i, "local_size": 2, "launcher": "horovod"}
        assert h["shard"] == [i, i + 2, i + 4, i + 6]
        assert (h["verbosity"], h["root_only"], h["is_root"]) == ((2, 1, True) if i == 0 else (0, 0, False))
