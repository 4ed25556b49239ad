"""Horovod: parity with a single device under horovodrun (Gloo and MPI), the backend's
options, Keras 3 integration, mpi4py, and failing workers. Each job is bounded by a
timeout and its processes are killed when it ends."""

import json
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import parity_lib as P
import proc

from conftest import requires_horovod  # noqa: E402
from dist_minimize import launcher  # noqa: E402

pytestmark = [pytest.mark.distributed, requires_horovod]
DEFAULT = tf.distribute.get_strategy()
_jobs = {}
_failed = {}


def job(launcher_name: str, np_: int, scenario: str, tmp_root) -> list:
    """The ranks' results of one shared job, started by the first test that needs it.

    A job that failed is not started again: every test that needs it fails with its log.
    """
    key = (launcher_name, np_, scenario)
    if key in _failed:
        pytest.fail(_failed[key])
    if key not in _jobs:
        out = tmp_root / f"{launcher_name}-{np_}-{scenario}"
        out.mkdir()
        log = out / "log.txt"
        try:
            with open(log, "w") as f:
                rc = launcher.launch(launcher_name, np_,
                                     [os.path.join(proc.ROOT, "tests/workers/horovod_worker.py"),
                                      str(out), scenario], timeout=proc.JOB_TIMEOUT, out=f, child_output=f)
        except BaseException:
            _failed[key] = f"{launcher_name} job was interrupted:\n{log.read_text()[-5000:]}"
            raise
        if rc != 0:
            _failed[key] = f"{launcher_name} job exited {rc}:\n{log.read_text()[-5000:]}"
            pytest.fail(_failed[key])
        _jobs[key] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]
    return _jobs[key]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("horovod")


def arrays(ws):
    return [np.array(w, dtype=np.float32) for w in ws]


_refs = {}


def reference(opt_name, mode, clip="always"):
    """dist_minimize on one device (no aggregation) on the global batches."""
    key = (opt_name, mode, clip)
    if key not in _refs:
        _refs[key], _, _ = P.train(DEFAULT, opt_name, mode, aggregate="none", clip=clip)
    return _refs[key]


def split_case(case):
    opt_name, mode, clip = (case.split("/") + ["always"])[:3]
    return opt_name, mode.split("_")[0], clip


@pytest.mark.parametrize("launcher_name,scenario", [("horovod-gloo", "parity"), ("horovod-mpi", "mpi")])
@pytest.mark.parametrize("case", P.HOROVOD_MPI_CASES)
def test_parity_with_single_device(tmp_root, launcher_name, scenario, case):
    """Same weights as one device on the global batches, clipping the same number of
    steps; the "never"/"some" cases see the gradient's scale."""
    ranks = job(launcher_name, 2, scenario, tmp_root)
    opt_name, mode, clip = split_case(case)
    ref = reference(opt_name, mode, clip)
    for r in ranks:
        assert P.max_abs_diff(ref, arrays(r[case]["weights"])) <= 1e-6
        assert r[case]["clipped_steps"] == P.CLIPPED_STEPS[clip]
    assert ranks[0][case]["weights"] == ranks[1][case]["weights"]


@pytest.mark.parametrize("clip", ["never", "some"])
def test_parity_with_stock_keras_on_one_device(tmp_root, clip):
    """Independent reference: stock Keras SGD (its own global_clipnorm) on one device."""
    ref, _, _ = P.train(DEFAULT, "sgd-0.01", "fit", clip=clip, use_dm=False)
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        for mode in ("fit", "callable"):
            assert P.max_abs_diff(ref, arrays(r[f"sgd-0.01/{mode}/{clip}"]["weights"])) <= 1e-6


def test_xla_fit_is_refused_with_the_fix_and_integrate_turns_it_off(tmp_root):
    """Defect: Keras's jit_compile (True by default on GPU machines without a strategy)
    made fit under horovodrun fail with InvalidArgumentError at HorovodGroupedAllreduce."""
    ref = reference("sgd-0.01", "fit", "some")
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        error = r["xla_plain"]["error"]
        assert error is not None and "The Horovod backend cannot run in an XLA-compiled step" in error
        assert "jit_compile=False" in error and "dist_minimize.integrate(model)" in error
        integrated = r["xla_integrated"]
        assert integrated["jit_compile"] is False and integrated["iterations"] == P.STEPS
        assert integrated["clipped_steps"] == P.CLIPPED_STEPS["some"]
        assert P.max_abs_diff(ref, arrays(integrated["weights"])) <= 1e-6


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_eager_custom_loop_parity(tmp_root, opt_name):
    ranks = job("horovod-gloo", 2, "parity", tmp_root)
    ref = reference(opt_name, "callable")
    for r in ranks:
        assert P.max_abs_diff(ref, arrays(r[f"{opt_name}/callable_eager"]["weights"])) <= 1e-6


@pytest.mark.parametrize("case", P.HOROVOD_CASES)
def test_one_grouped_allreduce_per_step(tmp_root, case):
    """Executed collectives are counted (a variable incremented by each call as it runs)."""
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        assert r[case]["calls"] == {"grouped_allreduce": P.STEPS, "allreduce": 0}, r[case]["calls"]
        assert r[case]["iterations"] == P.STEPS


@pytest.mark.parametrize("bad", [0, 1])
def test_inf_on_one_rank_is_skipped_by_all(tmp_root, bad):
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        c = r[f"lso_inf/{bad}"]
        assert all(np.isfinite(np.array(w)).all() for w in c["weights"])
        assert c["skipped"] == 1 and c["iterations"] == P.STEPS - 1 and c["loss_scale"] == 32.0
        assert c["clipped_steps"] == P.STEPS - 1  # every applied step (norms >> 0.5)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_parity_and_one_allreduce_per_update(tmp_root, k):
    ref = P.reference_accumulation(k)
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        c = r[f"accumulate/{k}"]
        assert c["iterations"] == P.STEPS
        assert c["calls"] == {"grouped_allreduce": P.STEPS, "allreduce": 0}  # not STEPS * k
        assert c["clipped_steps"] == P.STEPS  # once per update
        assert P.max_abs_diff(ref, arrays(c["weights"])) <= 1e-6


@pytest.mark.parametrize("mode", ["fit", "tape"])
@pytest.mark.parametrize("name", sorted(P.WEIGHT_WRAPPERS))
def test_weight_wrappers_match_one_device(tmp_root, name, mode):
    """MovingAverage, SWA, Lookahead, DecoupledWeightDecay under horovodrun -np 2:
    weights and every state variable (averages, slow weights, counts) as on one device."""
    ref_w, ref_opt, _ = P.train(DEFAULT, "adam", mode, aggregate="none", clip="some", wrap=name)
    ref_state = [np.array(v) for v in ref_opt.variables]
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        got = r[f"wrap/{name}/{mode}"]
        assert got["iterations"] == P.STEPS
        assert P.max_abs_diff(ref_w, arrays(got["weights"])) <= 1e-6
        assert len(got["state"]) == len(ref_state)
        for a, b in zip(got["state"], ref_state):
            np.testing.assert_allclose(np.array(a), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["fit_integrated", "tape"])
@pytest.mark.parametrize("name", sorted(P.PRIVACY_WRAPPERS))
def test_differential_privacy_matches_one_device(tmp_root, name, mode):
    """DP-SGD under horovodrun -np 2 (Horovod averages the processes' clipped sums) = one
    device on the same global batch, noise included when it is drawn from a fixed seed."""
    ref, _, _ = P.train(DEFAULT, "sgd", mode, aggregate="none", clip=False, wrap=name)
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        got = r[f"dp/{name}/{mode}"]
        assert got["iterations"] == P.STEPS and got["draws"] == P.STEPS
        assert P.max_abs_diff(ref, arrays(got["weights"])) <= 1e-6


def test_differential_privacy_noise_under_horovod(tmp_root):
    """The noise has the global-batch standard deviation on each process and is the
    one-device draw; without a seed, rank 0's random seed is broadcast, so both ranks
    draw the same noise and keep the same weights."""
    ref = P.privacy_noise(DEFAULT)
    expected = P.PROBE_LR * P.DP_NOISE * P.DP_CLIP / P.GLOBAL_BATCH
    ranks = job("horovod-gloo", 2, "parity", tmp_root)
    for r in ranks:
        for std, head, ref_move in zip(r["dp/noise"]["std"], r["dp/noise"]["head"], ref["moves"]):
            assert abs(std / expected - 1) < 0.03
            np.testing.assert_allclose(head, ref_move[:500], rtol=0, atol=1e-7)
    a, b = (r["dp/unseeded"] for r in ranks)
    assert a["seed"] == b["seed"]
    assert P.max_abs_diff(arrays(a["weights"]), arrays(b["weights"])) == 0.0


def test_accumulation_resumes_exactly_from_rank_0_checkpoint(tmp_root):
    """Defect: each process accumulates its own micro-batches, and a checkpoint written by
    rank 0 alone held rank 0's partial sums only. With share_accumulators() before the
    write, a run restored from it on every rank ends where the uninterrupted run does."""
    ref = P.reference_accumulation(4)
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        shared = r["accumulate_resumed/share=True"]
        assert shared["iterations"] == P.STEPS
        assert P.max_abs_diff(ref, arrays(shared["weights"])) <= 1e-6
        # Without sharing, rank 1's partial sums are lost: the result differs.
        assert P.max_abs_diff(ref, arrays(r["accumulate_resumed/share=False"]["weights"])) > 1e-4


def test_accumulation_through_fit(tmp_root):
    ref = P.reference_accumulation(2)
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        c = r["accumulate_fit/2"]
        assert c["iterations"] == P.STEPS and c["clipped_steps"] == P.STEPS
        assert P.max_abs_diff(ref, arrays(c["weights"])) <= 1e-6


def test_consistency_check_catches_divergence_on_every_rank(tmp_root):
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        assert r["consistency"]["error"] is not None
        assert "diverged at step 4: first differing: weight w" in r["consistency"]["error"]


def test_nccl_refused_when_horovod_lacks_it(tmp_root):
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        assert "HOROVOD_GPU_OPERATIONS=NCCL" in r["nccl_error"] and "nccl_built()=0" in r["nccl_error"]


def test_sum_reduction_with_global_batch_loss(tmp_root):
    ref = reference("sgd-0.01", "callable", "never")
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        assert P.max_abs_diff(ref, arrays(r["sum"]["weights"])) <= 1e-6


def test_predivide_factor_keeps_the_average(tmp_root):
    ref = reference("sgd-0.01", "callable", "never")
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        assert P.max_abs_diff(ref, arrays(r["predivide"]["weights"])) <= 1e-6


def test_packed_and_unpacked_aggregation_agree(tmp_root):
    """The default aggregator packs every gradient into one buffer; bytes_per_pack=0 sends
    each alone, 64 bytes makes several buffers. Sum and mean act element by element, so
    on 2 processes the three are bitwise equal, and each matches one device (clip never
    fires, so a scale error shows)."""
    ref = reference("sgd-0.01", "callable", "never")
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        packed = r["sgd-0.01/callable/never"]["weights"]
        assert r["unpacked"]["weights"] == packed and r["pack64"]["weights"] == packed
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


def test_fp16_compression_within_its_bound_and_not_skipped(tmp_root):
    ranks = job("horovod-gloo", 2, "parity", tmp_root)
    ref = reference("sgd-0.01", "callable", "never")
    bound = fp16_bound([r["fp16"]["local_max_abs"] for r in ranks])
    diffs = [P.max_abs_diff(ref, arrays(r["fp16"]["weights"])) for r in ranks]
    assert max(diffs) <= bound, (diffs, bound)
    assert ranks[0]["fp16"]["weights"] == ranks[1]["fp16"]["weights"]
    # Compression really ran: the same run without it differs.
    uncompressed = arrays(ranks[0]["sgd-0.01/callable/never"]["weights"])
    assert P.max_abs_diff(uncompressed, arrays(ranks[0]["fp16"]["weights"])) > 1e-6, "fp16 changed nothing"
    print(f"fp16: max diff {max(diffs):.3g}, bound {bound:.3g}")


@pytest.mark.parametrize("dense", [False, True])
def test_sparse_gradients_allgathered_or_densified(tmp_root, dense):
    ids, y = P.embedding_data()
    ref = P.train_embedding(DEFAULT, tf.data.Dataset.from_tensor_slices((ids, y)).batch(P.GLOBAL_BATCH),
                            aggregate="none")
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        assert P.max_abs_diff(ref, arrays(r[f"embedding/dense={dense}"]["weights"])) <= 1e-6


def test_broadcast_puts_rank0_weights_everywhere_before_the_first_step(tmp_root):
    ranks = job("horovod-gloo", 2, "parity", tmp_root)
    rank0_initial = ranks[0]["broadcast"]["rank0_initial"]
    for r in ranks:
        assert r["broadcast"]["first_step_weights"] == rank0_initial
    ref = reference("adam", "fit")
    for r in ranks:
        assert P.max_abs_diff(ref, arrays(r["broadcast"]["weights"])) <= 1e-6


def test_metric_average_is_the_global_mean(tmp_root):
    for r in job("horovod-gloo", 2, "parity", tmp_root):
        m = r["metric_average"]
        assert m["rank_value"] == 0.5
        assert m["loss"] == pytest.approx(float(np.mean(m["all_local_losses"])), rel=1e-6)


def test_mpi_init_from_mpi4py_subcommunicator_and_same_library(tmp_root):
    ranks = job("horovod-mpi", 2, "mpi", tmp_root)
    for i, r in enumerate(ranks):
        assert r["init"]["hvd_rank"] == i and r["init"]["hvd_size"] == 2 and r["init"]["mpi_enabled"]
        assert "libmpi.so" in r["init"]["same_mpi"]
        assert r["discover"] == {"rank": i, "size": 2, "local_rank": i, "local_size": 2, "launcher": "openmpi"}


def test_adasum_on_two_processes_matches_its_formula(tmp_root):
    ranks = job("horovod-mpi", 2, "mpi", tmp_root)
    a, b = (np.array(r["adasum"]["local"], np.float64) for r in ranks)
    dot = a @ b
    want = (1 - dot / (2 * a @ a)) * a + (1 - dot / (2 * b @ b)) * b
    for r in ranks:
        np.testing.assert_allclose(r["adasum"]["result"], want, rtol=1e-5)


def test_adasum_refuses_sparse_gradients(tmp_root):
    for r in job("horovod-mpi", 2, "mpi", tmp_root):
        assert "sparse gradients" in r["adasum_sparse_error"] and "sparse_as_dense=True" in r["adasum_sparse_error"]


def test_rank_helpers_under_horovodrun_gloo(tmp_root):
    for i, r in enumerate(job("horovod-gloo", 2, "parity", tmp_root)):
        h = r["helpers"]
        assert h["discover"] == {"rank": i, "size": 2, "local_rank": i, "local_size": 2, "launcher": "horovod"}
        assert h["shard"] == [i, i + 2, i + 4, i + 6]
        assert (h["verbosity"], h["root_only"], h["is_root"]) == ((2, 1, True) if i == 0 else (0, 0, False))


def test_adasum_refused_on_three_and_process_set_parity(tmp_root):
    ranks = job("horovod-mpi", 3, "three", tmp_root)
    for r in ranks:
        assert "power-of-two" in r["adasum_error"] and "3 processes" in r["adasum_error"]
    assert ranks[0]["process_set"]["ranks"] == [0, 1] and ranks[2]["process_set"]["ranks"] == [2]
    ref = reference("adam", "callable")
    for r in ranks[:2]:
        assert P.max_abs_diff(ref, arrays(r["process_set"]["weights"])) <= 1e-6


@pytest.mark.parametrize("launcher_name", ["horovod-gloo", "horovod-mpi"])
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_worker_ends_the_job_quickly(tmp_path, launcher_name, mode):
    log = tmp_path / "log.txt"
    start = time.monotonic()
    with open(log, "w") as f:
        rc = launcher.launch(launcher_name, 2, [os.path.join(proc.ROOT, "tests/workers/failing_worker.py"), mode],
                             timeout=120, out=f, child_output=f)
    elapsed = time.monotonic() - start
    text = log.read_text()
    assert rc not in (0, 124), text[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "exited with status" in text
    if mode == "raise":
        assert "planted failure on rank 1" in text


def test_auto_without_hvd_init_under_horovodrun_stops_with_the_fix(tmp_path):
    """Defect: with "auto" and no hvd.init(), 2 ranks trained 2 independent models
    (kernels 0.4 and -1.4 after an epoch) without a word."""
    script = tmp_path / "no_init.py"
    script.write_text(
        "import os\n"
        "import numpy as np, keras\n"
        "import dist_minimize as dm\n"
        "rank = int(os.environ['HOROVOD_RANK'])\n"
        "model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])\n"
        "model.compile(loss='mse', optimizer=dm.Optimizer(keras.optimizers.SGD(0.1)))\n"
        "model.fit(np.ones((8, 1)), np.full((8, 1), 1.0 - 2.0 * rank), verbose=0)\n"
        "print('TRAINED WITHOUT AGGREGATION', flush=True)\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("horovod-gloo", 2, [str(script)], timeout=120, out=f, child_output=f)
    text = log.read_text()
    assert rc not in (0, 124), text[-3000:]
    assert "TRAINED WITHOUT AGGREGATION" not in text
    assert "dist_minimize.horovod_keras.init()" in text and "horovod started 2 processes" in text
