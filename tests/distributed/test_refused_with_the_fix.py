"""What cannot work is refused, at once, naming the fix: an XLA-compiled step (under
MirroredStrategy on CPUs and under Horovod; `dist_minimize.integrate` turns XLA off and
the run then matches one device), NCCL where Horovod lacks it, sparse gradients with
Adasum, and the Horovod backend without `hvd.init()` under horovodrun.

The strategy is the `run` parameter: "mirrored" (2 logical CPUs in this process) and
"horovod-gloo" (the shared horovodrun job of jobs.py, or a job of the test's own)."""

import logging
import re

import keras
import pytest
import tensorflow as tf

import dist_minimize as dm
import jobs
import parity_lib as P
from conftest import mirrored_strategy, requires_horovod
from dist_minimize import launcher
from jobs import arrays, run_param

pytestmark = pytest.mark.distributed


def mirrored_xla(caplog):
    """jit_compile=True under MirroredStrategy on CPU devices fails in TensorFlow itself
    (stock Keras too, at run time); dist_minimize refuses at the first trace naming the
    fix, and dm.integrate turns XLA off (saying so) and trains as without it."""
    s = mirrored_strategy()
    x, y = P.make_data()

    def fit(integrate):
        with s.scope():
            model = P.make_model(keras)
            opt = P.build_optimizer(dm, keras, "sgd-0.01", True, "some", "auto", None)
            model.compile(loss="mse", optimizer=opt, jit_compile=True)
        if integrate:
            dm.integrate(model)
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, shuffle=False, verbose=0)
        return model, opt

    with pytest.raises(RuntimeError) as refused:
        fit(False)
    assert re.search("cannot run in an XLA-compiled step.*jit_compile=False", str(refused.value)), refused.value
    with caplog.at_level(logging.WARNING, logger="dist_minimize"):
        model, opt = fit(True)
    assert "merge_call" in caplog.text
    ref, _, _ = P.train(tf.distribute.get_strategy(), "sgd-0.01", "fit", clip="some")
    return [(model.jit_compile, None, P.clipped_steps(opt), P.max_abs_diff(ref, P.weights(model)))]


def horovod_xla(tmp_path_factory):
    """Defect: Keras's jit_compile (True by default on GPU machines without a strategy)
    made fit under horovodrun fail with InvalidArgumentError at HorovodGroupedAllreduce."""
    ref = jobs.horovod_reference("sgd-0.01", "fit", "some")
    observed = []
    for r in jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory):
        error = r["xla_plain"]["error"]
        assert error is not None and "The Horovod backend cannot run in an XLA-compiled step" in error
        assert "jit_compile=False" in error and "dist_minimize.integrate(model)" in error
        integrated = r["xla_integrated"]
        observed.append((integrated["jit_compile"], integrated["iterations"], integrated["clipped_steps"],
                         P.max_abs_diff(ref, arrays(integrated["weights"]))))
    return observed


@pytest.mark.parametrize("run", [run_param("mirrored"), run_param("horovod-gloo")])
def test_xla_fit_is_refused_with_the_fix_and_integrate_turns_it_off(caplog, tmp_path_factory, run):
    observed = mirrored_xla(caplog) if run == "mirrored" else horovod_xla(tmp_path_factory)
    for jit_compile, iterations, clipped, diff in observed:
        assert jit_compile is False
        assert iterations in (None, P.STEPS)  # (None: not recorded in this process)
        assert clipped == P.CLIPPED_STEPS["some"]
        assert diff <= 1e-6


@requires_horovod
def test_nccl_refused_when_horovod_lacks_it(tmp_path_factory):
    for r in jobs.horovod("horovod-gloo", 2, "parity", tmp_path_factory):
        assert "HOROVOD_GPU_OPERATIONS=NCCL" in r["nccl_error"] and "nccl_built()=0" in r["nccl_error"]


@requires_horovod
def test_adasum_refuses_sparse_gradients(tmp_path_factory):
    for r in jobs.horovod("horovod-mpi", 2, "mpi", tmp_path_factory):
        assert "sparse gradients" in r["adasum_sparse_error"] and "sparse_as_dense=True" in r["adasum_sparse_error"]


@requires_horovod
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
