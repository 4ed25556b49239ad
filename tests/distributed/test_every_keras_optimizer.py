"""Every update rule the installed `keras.optimizers` exports, wrapped in
`dist_minimize.Optimizer`, trains on 2 replicas exactly as on one device: under
MirroredStrategy (2 logical CPUs, in this process), MultiWorkerMirroredStrategy (2 local
workers) and `horovodrun -np 2` (Gloo).

The classes are read from Keras, so a class a later Keras adds is covered without editing
this file (`parity_lib.keras_rule_names`). Two cases each:
* "tape/some": a custom loop with the cross-replica clip firing on 2 of the 4 steps,
  against dist_minimize on one device: a double aggregation or a wrong scale changes
  which steps clip and by how much (MultiOptimizer routes kernels to Adam, the rest to
  SGD, so both a scale-invariant and a scale-sensitive rule are in play);
* "fit/none": `model.fit` (through `dist_minimize.integrate` under
  MultiWorkerMirroredStrategy, where Keras's own `fit` fails) with no clipper, against
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
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import parity_lib as P
from conftest import mirrored_strategy, requires_horovod

pytestmark = pytest.mark.distributed

CASES = P.keras_rule_cases(keras)
# Keras's own trainer cannot run `fit` under MultiWorkerMirroredStrategy
# (test_multiworker.py's anchor): there it runs through `dist_minimize.integrate`.
MW_CASES = {case: case.replace("/fit/", "/fit_integrated/") for case in CASES}
MW_CASES.update({case: case for case in P.LAZY_CASES})
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


@pytest.mark.parametrize("case", CASES)
def test_mirrored(case):
    name, mode, clip = case.split("/")
    got, opt, _ = P.train(mirrored_strategy(), name, mode, clip=clip)
    check(case, "mirrored", got, int(opt.iterations.numpy()), P.clipped_steps(opt))


@pytest.fixture(scope="module")
def multiworker(tmp_path_factory):
    from test_multiworker import run_workers

    out = tmp_path_factory.mktemp("rules-mw")
    for i, (rc, output) in enumerate(run_workers(out, list(MW_CASES.values()))):
        assert rc == 0, f"worker {i} exited {rc}:\n{output[-5000:]}"
    return [json.loads((out / f"w{i}.json").read_text())["results"] for i in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_multiworker(multiworker, case):
    for worker in multiworker:
        r = worker[MW_CASES[case]]
        check(case, "multiworker", r["weights"], r["iterations"], r["clipped_steps"])
    assert multiworker[0][MW_CASES[case]]["weights"] == multiworker[1][MW_CASES[case]]["weights"]


@pytest.fixture(scope="module")
def horovod(tmp_path_factory):
    from test_horovod import job  # the shared, bounded horovodrun job of the Horovod tests

    return job("horovod-gloo", 2, "keras_rules", tmp_path_factory.mktemp("rules-hvd"))


@requires_horovod
@pytest.mark.parametrize("case", CASES)
def test_horovod(horovod, case):
    for rank in horovod:
        r = rank[case]
        check(case, "horovod", r["weights"], r["iterations"], r["clipped_steps"])
    assert horovod[0][case]["weights"] == horovod[1][case]["weights"]


def lazy_reference(case: str) -> list:
    """One device, built before the first step, for a "lazy:WRAP/MODE/CLIP" case."""
    if case not in _refs:
        wrap, mode, clip = case[len("lazy:"):].split("/")
        _refs[case], _, _ = P.train(DEFAULT, "sgd-0.01", mode, clip=clip, wrap=wrap, aggregate="none")
    return _refs[case]


def check_lazy(case: str, results: list) -> None:
    for r in results:
        diff = P.max_abs_diff(lazy_reference(case), [np.array(w, dtype=np.float32) for w in r[case]["weights"]])
        assert diff <= TOL, f"{case}: {diff:.3g} away from the built-first run on one device"
    assert results[0][case]["weights"] == results[1][case]["weights"]


@pytest.mark.parametrize("case", P.LAZY_CASES)
def test_lazy_build_multiworker(multiworker, case):
    """Issue 22: a stack not built before its first traced step builds there, as stock
    Keras does, and trains as the built-first run (loss scaling, accumulation, every weight
    wrapper, DP)."""
    check_lazy(case, multiworker)


@requires_horovod
@pytest.mark.parametrize("case", P.LAZY_CASES)
def test_lazy_build_horovod(horovod, case):
    check_lazy(case, horovod)


@requires_horovod
def test_horovod_refuses_what_would_aggregate_twice(horovod):
    """At the first trace, on every rank: a backend making two grouped allreduces where it
    plans one, and an update rule calling hvd.allreduce itself."""
    for rank in horovod:
        assert "planned 1 collective and made 2" in rank["twice_backend"]
        assert "HorovodGroupedAllreduce" in rank["twice_backend"]
        assert "made a collective: a Horovod HorovodAllreduce" in rank["allreducing_rule"]
        assert "AllReducingSGD" in rank["allreducing_rule"]


def test_parity_table():
    """Prints the table of the tests above (run with -s to see it); fails if one is missing."""
    backends = sorted({b for _, b in TABLE})
    print("\n| case | " + " | ".join(backends) + " |\n|---|" + "---|" * len(backends))
    for case in CASES:
        cells = [f"{TABLE[case, b]:.1e}" if (case, b) in TABLE else "-" for b in backends]
        print(f"| {case} | " + " | ".join(cells) + " |")
    assert "mirrored" in backends
