"""Parity: a distributed run ends with the weights of one device trained on the same
global batches (max abs difference <= 1e-6 after 4 steps), clipping the same steps.

The strategy is the `run` parameter:
* "mirrored-2", "mirrored-4": MirroredStrategy on 2 and 4 logical CPUs, fit and custom
  loops (the shared job `jobs.mirrored(n)`: the worker reports each case's difference from
  one device, from stock Keras on one device, and whether every device's copy agrees);
* "mirrored": MirroredStrategy on 2 of the test process's 4 logical CPUs, in this process;
* "multiworker": 2 MultiWorkerMirroredStrategy workers on 127.0.0.1 (`jobs.multiworker`);
* "horovod-gloo", "horovod-mpi": `horovodrun -np 2` over Gloo and MPI (`jobs.horovod`).

"never"/"some" clip cases (SGD 0.01) see the gradient's scale; see tests/parity_lib.py.
The Keras anchors at the end record what stock Keras gets wrong (they fail when Keras
fixes it)."""

import pytest
import tensorflow as tf

import jobs
import parity_lib as P
from conftest import mirrored_strategy
from jobs import DEFAULT, arrays, run_param

pytestmark = pytest.mark.distributed

PARITY_CASES = ([run_param(f"mirrored-{n}", case) for n in (2, 4) for case in P.MIRRORED_CASES_ON[n]]
                + [run_param("multiworker", case) for case in jobs.MULTIWORKER_PARITY]
                + [run_param(launcher, case) for launcher in ("horovod-gloo", "horovod-mpi")
                   for case in P.HOROVOD_MPI_CASES])
HOROVOD_SCENARIO = {"horovod-gloo": "parity", "horovod-mpi": "mpi"}


def processes(run: str, case: str, tmp_path_factory) -> tuple[list, bool]:
    """Per process of the run (one for MirroredStrategy): (max abs difference from one
    device, iterations or None where the job does not record them, clipped steps); and
    whether every process's (every device's) copy of the weights agrees."""
    opt_name, mode, clip = (case.split("/") + ["always"])[:3]
    if run.startswith("mirrored-"):
        r = jobs.mirrored(int(run.split("-")[1]))[case]
        return [(r["diff"], r["iterations"], r["clipped_steps"])], r["copies_agree"]
    if run == "multiworker":
        ref, _, _ = P.train(DEFAULT, opt_name, mode, clip=clip)
        workers = [w[case] for w in jobs.multiworker("parity", tmp_path_factory)]
        return ([(P.max_abs_diff(ref, arrays(w["weights"])), w["iterations"], w["clipped_steps"]) for w in workers],
                workers[0]["weights"] == workers[1]["weights"])
    ranks = [r[case] for r in jobs.horovod(run, 2, HOROVOD_SCENARIO[run], tmp_path_factory)]
    ref = jobs.horovod_reference(*jobs.split_case(case))
    return ([(P.max_abs_diff(ref, arrays(r["weights"])), None, r["clipped_steps"]) for r in ranks],
            ranks[0]["weights"] == ranks[1]["weights"])


@pytest.mark.parametrize("run,case", PARITY_CASES)
def test_matches_single_device(tmp_path_factory, run, case):
    """Same weights as one device on the same global batch (dist_minimize there, without
    aggregation), the clipper clipping as many steps as it does there, and every process's
    (under MirroredStrategy: every device's copy of every weight and slot) identical."""
    clip = (case.split("/") + ["always"])[2]
    observed, agree = processes(run, case, tmp_path_factory)
    for diff, iterations, clipped in observed:
        assert diff <= 1e-6, (run, case, observed)
        assert iterations in (None, P.STEPS), (run, case, observed)
        assert clipped == P.CLIPPED_STEPS[clip], (run, case, observed)
    assert agree, (run, case)


STOCK_KERAS_CASES = ([run_param(f"mirrored-{n}", case) for n in (2, 4) for case in P.MIRRORED_CASES_ON[n]]
                     + [run_param("multiworker", f"sgd-0.01/{mode}/{clip}")
                        for clip in ("never", "some") for mode in ("fit_integrated", "tape")]
                     + [run_param("horovod-gloo", f"sgd-0.01/{mode}/{clip}")
                        for clip in ("never", "some") for mode in ("fit", "callable")])


@pytest.mark.parametrize("run,case", STOCK_KERAS_CASES)
def test_matches_stock_keras_on_one_device(tmp_path_factory, run, case):
    """Independent reference: stock Keras (its own global_clipnorm, no dist_minimize code)
    on one device, so that a bug shared by dist_minimize's reference and its distributed
    run cannot cancel out."""
    if run.startswith("mirrored-"):
        r = jobs.mirrored(int(run.split("-")[1]))[case]
        assert r["keras_diff"] <= 1e-6, r
        return
    ref, _, _ = P.train(DEFAULT, "sgd-0.01", "fit", clip=case.split("/")[2], use_dm=False)
    results = (jobs.multiworker("parity", tmp_path_factory) if run == "multiworker"
               else jobs.horovod(run, 2, "parity", tmp_path_factory))
    for process in results:
        assert P.max_abs_diff(ref, arrays(process[case]["weights"])) <= 1e-6


@pytest.mark.parametrize("run,opt_name", [run_param("horovod-gloo", o) for o in ("sgd", "adam")])
def test_eager_custom_loop_matches_single_device(tmp_path_factory, run, opt_name):
    for r in jobs.horovod(run, 2, "parity", tmp_path_factory):
        assert P.max_abs_diff(jobs.horovod_reference(opt_name, "callable"),
                              arrays(r[f"{opt_name}/callable_eager"]["weights"])) <= 1e-6


@pytest.mark.parametrize("run,how", [run_param("mirrored", "sparse"), run_param("horovod-gloo", "allgathered"),
                                     run_param("horovod-gloo", "densified")])
def test_embedding_sparse_gradients_match_single_device(tmp_path_factory, run, how):
    """An Embedding's sparse gradients: under MirroredStrategy aggregated and still sparse;
    under Horovod allgathered, or densified (sparse_as_dense)."""
    ids, y = P.embedding_data()
    ds = tf.data.Dataset.from_tensor_slices((ids, y)).batch(P.GLOBAL_BATCH)
    if run == "mirrored":
        seen = []

        def record(gv):
            seen.append(type(gv[0][0]).__name__)
            return gv

        ref = P.train_embedding(DEFAULT, ds)
        got = P.train_embedding(mirrored_strategy(), ds, transforms=[record])
        assert P.max_abs_diff(ref, got) <= 1e-6
        assert seen and set(seen) == {"IndexedSlices"}  # aggregated, still sparse
        return
    ref = P.train_embedding(DEFAULT, ds, aggregate="none")
    for r in jobs.horovod(run, 2, "parity", tmp_path_factory):
        assert P.max_abs_diff(ref, arrays(r[f"embedding/dense={how == 'densified'}"]["weights"])) <= 1e-6


def test_mixed_dtype_variables_are_aggregated_and_match_single_device():
    """A float16 layer beside float32 ones, under MirroredStrategy: tf.distribute's list
    all-reduce packs one buffer and fails on two dtypes (stock Keras too); the strategy
    backend reduces each dtype on its own. The result matches one device on the same
    global batch."""
    import keras

    import dist_minimize as dm

    x, y = P.make_data(steps=4)

    def train(s):
        with s.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((P.FEATURES,)),
                                      keras.layers.Dense(8, activation="tanh", dtype="float16"),
                                      keras.layers.Dense(1, dtype="float32")])
            model.compile(loss="mse", optimizer=dm.Optimizer(keras.optimizers.SGD(0.05)))
        start = P.weights(model)
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        return start, P.weights(model)

    start, one = train(DEFAULT)
    _, two = train(mirrored_strategy())
    assert [w.dtype.name for w in two] == ["float16", "float16", "float32", "float32"]
    moved = P.max_abs_diff(start, one)
    assert moved > 0.5, moved  # large enough that a wrong scale (MEAN for SUM) shows
    assert P.max_abs_diff(one, two) < 1e-2, (P.max_abs_diff(one, two), moved)  # float16 rounding


# Anchors: what stock Keras does under the same strategies.


@pytest.mark.parametrize("run,opt", [run_param(f"mirrored-{n}", o) for n in (2, 4) for o in ("sgd", "adam")])
def test_keras_global_clipnorm_anchor_does_not_match(run, opt):
    """Stock Keras 3 clips per replica: far from single-device. Fails if Keras fixes it."""
    assert jobs.mirrored(int(run.split("-")[1]))[f"{opt}/keras_anchor"]["diff"] > 1e-3


def test_keras_fit_fails_in_its_trainer_under_multiworker(tmp_path_factory):
    """Anchor: Keras 3's trainer (not the optimizer) breaks `fit` under MWMS.

    `Trainer._maybe_symbolic_build` reduces the first PerReplica input batch with
    `strategy.reduce`, which MultiWorkerMirroredStrategy rejects, before any optimizer
    code runs; this fails with a stock Keras optimizer (`dm.integrate(model)` makes fit
    work: the fit_integrated cases). If this starts passing, Keras fixed it: add plain
    `fit` parity cases under MWMS and update the README.
    """
    anchor = jobs.multiworker("parity", tmp_path_factory)[0]["sgd/fit_anchor"]
    assert anchor["error"] is not None and "PerReplica" in anchor["error"]
    assert "_maybe_symbolic_build" in anchor["frames"]

