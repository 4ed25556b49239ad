"""Parity of Keras's own update rules and settings through dist_minimize: every update
rule the installed `keras.optimizers` exports, wrapped in `dist_minimize.Optimizer`,
trains on 2 replicas exactly as on one device. The strategy is the `run` parameter:
"mirrored" (MirroredStrategy on 2 logical CPUs, in this process), "multiworker" (2 local
MultiWorkerMirroredStrategy workers) and "horovod-gloo" (`horovodrun -np 2`), the last
two one shared job each (jobs.py: `multiworker("keras_rules")`, `horovod(..., "keras_rules")`).

The classes are read from Keras, so a class a later Keras adds is covered without editing
this file (`parity_lib.keras_rule_names`). Two cases each:
* "tape/some": a custom loop with the cross-replica clip firing on 2 of the 4 steps,
  against dist_minimize on one device: a double aggregation or a wrong scale changes
  which steps clip and by how much (MultiOptimizer routes kernels to Adam, the rest to
  SGD, so both a scale-invariant and a scale-sensitive rule are in play);
* "fit/none" (under MirroredStrategy and horovodrun; MultiWorkerMirroredStrategy's `fit`,
  through `dist_minimize.integrate`, is test_parity.py's): `model.fit` with no clipper, against
  STOCK Keras's `fit` on one device (an independent reference). The stock reference is
  built before `fit`: Keras 3.15.1 without a strategy builds ScheduleFreeAdamW lazily
  inside the traced train function and loses its build-time `assign` (its momentum starts
  at 0 instead of the weights: 0.70 away after 4 steps, against 0.022 when built first).
  dist_minimize builds on first use outside the traced function, so under horovodrun
  (no strategy, built by `fit` on first use) it matches the built-first reference.
Tolerance 1e-6: float32 sums over 2 replicas differ from one device's in the last bits
(measured at most 1.2e-7 here); a double aggregation moves the weights by 1e-2 or more.

The process tests also build three stacks on first use (`parity_lib.LAZY_CASES`: every
wrapper at once, dynamic loss scaling, DP), against the built-first run on one device.

Keras's clipping settings on the wrapped optimizer (`clipnorm`, `global_clipnorm`), on 2
MirroredStrategy replicas in this process, are translated into post-aggregation clippers:
`fit` gives the weights of one device (dist_minimize's, and stock Keras's with the same
setting), where stock Keras on the same 2 replicas clips each replica's gradients before
the all-reduce and must NOT match (so a pre-aggregation translation would fail here).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import jobs
import parity_lib as P
from conftest import default_profile_only, mirrored_strategy
from jobs import run_param

pytestmark = pytest.mark.distributed

CASES = jobs.KERAS_RULE_CASES
MW_CASES = jobs.MULTIWORKER_RULE_CASES
TOL = 1e-6
DEFAULT = tf.distribute.get_strategy()
_refs: dict = {}
TABLE: dict = {}  # (case, backend) -> max abs difference, printed by test_parity_table


def reference(case: str) -> list:
    if case not in _refs:
        name, mode, clip = case.split("/")
        if clip == "none":
            _refs[case], _, _ = P.train(DEFAULT, name, mode, clip=clip, use_dm=False, build_first=True)
        else:
            _refs[case], _, _ = P.train(DEFAULT, name, mode, clip=clip, aggregate="none")
    return _refs[case]


def check(case: str, backend: str, weights, iterations: int, clipped) -> None:
    diff = P.max_abs_diff(reference(case), [np.array(w, dtype=np.float32) for w in weights])
    TABLE[case, backend] = diff
    assert diff <= TOL, f"{case} under {backend}: {diff:.3g} away from one device"
    assert iterations == P.STEPS
    clip = case.split("/")[2]
    assert clipped == (None if clip == "none" else P.CLIPPED_STEPS[clip])


def test_every_exported_class_is_covered():
    """Each class `keras.optimizers` exports is a case, or named with its reason."""
    exported = {n for n in dir(keras.optimizers)
                if isinstance(getattr(keras.optimizers, n), type)
                and issubclass(getattr(keras.optimizers, n), keras.optimizers.Optimizer)}
    rules = set(P.keras_rule_names(keras))
    assert exported == rules | set(P.NOT_UPDATE_RULES)
    assert {"SGD", "Adam", "MultiOptimizer"} <= rules
    assert len(CASES) == 2 * len(rules)


# The multiworker job of every rule runs on the default profile only (the test-time
# budget): on TensorFlow 2.21 every rule runs under MirroredStrategy, and
# MultiWorkerMirroredStrategy's parity job (test_parity.py) runs there too.
ONCE = {"multiworker": [default_profile_only]}


def processes(run: str, tmp_path_factory) -> list:
    """Each process's results of the run's shared job, by case."""
    if run == "multiworker":
        return jobs.multiworker("keras_rules", tmp_path_factory)
    return jobs.horovod(run, 2, "keras_rules", tmp_path_factory)


def _once(run: str, case: str) -> list:
    """The marks of (run, case): see ONCE; and on TensorFlow 2.21 MirroredStrategy takes each
    rule in the custom loop with the clip firing (`fit` without a clipper: default profile)."""
    if run == "mirrored" and case.endswith("/fit/none"):
        return [default_profile_only]
    return ONCE.get(run, [])


@pytest.mark.parametrize("run,case", [run_param(r, case, marks=_once(r, case))
                                      for r in ("mirrored", "multiworker", "horovod-gloo") for case in CASES
                                      if r != "multiworker" or case in MW_CASES])
def test_every_keras_rule_matches_one_device(tmp_path_factory, run, case):
    """Weights, iterations and clipped steps as on one device (every process's), and both
    processes' weights identical."""
    if run == "mirrored":
        name, mode, clip = case.split("/")
        got, opt, _ = P.train(mirrored_strategy(), name, mode, clip=clip)
        check(case, run, got, int(opt.iterations.numpy()), P.clipped_steps(opt))
        return
    results = processes(run, tmp_path_factory)
    key = MW_CASES[case] if run == "multiworker" else case
    for process in results:
        r = process[key]
        check(case, run.split("-")[0], r["weights"], r["iterations"], r["clipped_steps"])
    assert results[0][key]["weights"] == results[1][key]["weights"]


def lazy_reference(case: str) -> list:
    """One device, built before the first step, for a "lazy:WRAP/MODE/CLIP" case."""
    if case not in _refs:
        wrap, mode, clip = case[len("lazy:"):].split("/")
        _refs[case], _, _ = P.train(DEFAULT, "sgd-0.01", mode, clip=clip, wrap=wrap, aggregate="none")
    return _refs[case]


@pytest.mark.parametrize("run,case", [run_param(r, case, marks=ONCE.get(r, ()))
                                      for r in ("multiworker", "horovod-gloo") for case in P.LAZY_CASES])
def test_lazy_build_matches_the_built_first_run(tmp_path_factory, run, case):
    """A stack not built before its first traced step builds there, as stock
    Keras does, and trains as the built-first run (loss scaling, accumulation, every weight
    wrapper, DP)."""
    results = processes(run, tmp_path_factory)
    for r in results:
        diff = P.max_abs_diff(lazy_reference(case), [np.array(w, dtype=np.float32) for w in r[case]["weights"]])
        assert diff <= TOL, f"{case}: {diff:.3g} away from the built-first run on one device"
    assert results[0][case]["weights"] == results[1][case]["weights"]


def test_parity_table():
    """Prints the table of the tests above (run with -s to see it); fails if one is missing."""
    backends = sorted({b for _, b in TABLE})
    print("\n| case | " + " | ".join(backends) + " |\n|---|" + "---|" * len(backends))
    for case in CASES:
        cells = [f"{TABLE[case, b]:.1e}" if (case, b) in TABLE else "-" for b in backends]
        print(f"| {case} | " + " | ".join(cells) + " |")
    assert "mirrored" in backends


# Keras's clipping settings (`clipnorm`, `global_clipnorm`) under MirroredStrategy.

SETTINGS = {"clipnorm": 30.0, "global_clipnorm": P.CLIPS["some"]}


def fit(strategy, make_optimizer):
    x, y = P.make_data()
    with strategy.scope():
        model = P.make_model(keras)
        model.compile(loss="mse", optimizer=make_optimizer())
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH)
    model.fit(ds, epochs=1, verbose=0, shuffle=False, steps_per_epoch=P.STEPS)
    return P.weights(model)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_keras_clipping_translated_after_aggregation_matches_one_device(setting):
    c = SETTINGS[setting]

    def keras_opt():
        return keras.optimizers.SGD(0.01, **{setting: c})

    one = tf.distribute.get_strategy()
    two = mirrored_strategy()
    assert two.num_replicas_in_sync == 2
    got = fit(two, lambda: dm.Optimizer(keras_opt()))
    ref = fit(one, lambda: dm.Optimizer(keras_opt()))
    stock_one = fit(one, keras_opt)
    assert P.max_abs_diff(got, ref) <= 1e-6
    assert P.max_abs_diff(got, stock_one) <= 1e-6
    unclipped = fit(one, lambda: keras.optimizers.SGD(0.01))
    assert P.max_abs_diff(stock_one, unclipped) > 1e-2  # the clip fired
    stock_two = fit(two, keras_opt)  # Keras: each replica clipped with its own norm
    assert P.max_abs_diff(stock_two, stock_one) > 1e-3
