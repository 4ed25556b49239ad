"""Keras 3's own optimizer tests, run with every Keras optimizer replaced by
`dist_minimize.Optimizer(<that optimizer>)` (the plugin tests/keras_suite/dm_keras_substitute.py).

The test files are the ones installed with Keras (`keras/src/optimizers/*_test.py`),
run in a subprocess from where they are; none is copied here. Every test must pass,
except those in EXPECTED_FAILURES: each reads or patches a Keras-private attribute
(the entry names it, and this test checks that the test's source does use it).

Out of scope, with the reason (README, "Keras's own optimizer tests"):
  loss_scale_optimizer_test.py: Keras's LossScaleOptimizer itself (its arguments, its
    stateless path, its config); dist_minimize refuses it by design and has its own
    `dist_minimize.LossScaleOptimizer`.
  multi_optimizer_test.py: Keras's MultiOptimizer, which routes variables to several
    Keras optimizers; dist_minimize has no such router.
"""

import fnmatch
import json
import os
import re
import subprocess
import sys

import keras
import pytest

import dist_minimize

KERAS_TESTS = os.path.join(os.path.dirname(keras.__file__), "src", "optimizers")
OUT_OF_SCOPE = {"loss_scale_optimizer_test.py", "multi_optimizer_test.py"}
PLUGIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "keras_suite")

# nodeid (or fnmatch pattern for a parameterized family) -> the Keras-private name it uses.
EXPECTED_FAILURES = {
    "adam_test.py::AdamTest::test_ema": "_model_variables_moving_average",
    "adam_test.py::AdamTest::test_ema_overwrite_frequency": "_model_variables_moving_average",
    "optimizer_test.py::OptimizerTest::test_ema": "_model_variables_moving_average",
    "optimizer_test.py::OptimizerTest::test_ema_with_model_fit": "_model_variables_moving_average",
    "optimizer_test.py::OptimizerTest::test_gradient_accumulation": "_accumulated_gradients",
    "optimizer_test.py::OptimizerTest::test_overwrite_with_gradient_with_gradient_accumulation":
        "_accumulated_gradients",
    "muon_test.py::MuonTest::test_should_use_adamw": "_should_use_adamw",
    "muon_test.py::MuonTest::test_adamw_weight_decay": "_apply_weight_decay",
    "nadam_test.py::NadamTest::test_build_with_empty_var_list": "_u_product",
    # Patches the private `_apply_weight_decay` and the optimizer object's own `assign`
    # methods, then expects that object to make the update (a dist_minimize optimizer has
    # its wrapped Keras optimizer make it). The `scatter_update` case passes: its class is
    # defined by the test and captured in a table at import, so it runs unsubstituted.
    "optimizer_sparse_test.py::OptimizerSparseTest::test_sparse_gradients_*": "_apply_weight_decay",
}


def expected(nodeid):
    return next((p for p in EXPECTED_FAILURES if fnmatch.fnmatchcase(nodeid, p)), None)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keras_suite")
    files = sorted(f for f in os.listdir(KERAS_TESTS) if f.endswith("_test.py") and f not in OUT_OF_SCOPE)
    assert len(files) >= 10, files
    (tmp / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
    out = tmp / "outcomes.json"
    repo = os.path.dirname(os.path.dirname(dist_minimize.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, PLUGIN_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(tmp / "pytest.ini"), "--rootdir", KERAS_TESTS,
         "-p", "no:cacheprovider", "-p", "dm_keras_substitute", f"--dm-outcomes={out}", "-q", *files],
        cwd=KERAS_TESTS, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1) and out.exists(), proc.stdout[-5000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), proc.stdout


def test_keras_optimizer_tests_pass_on_dist_minimize(outcomes):
    results, log = outcomes
    assert len(results) >= 150, len(results)  # the suite ran (185 tests on Keras 3.15.1)
    unexpected = sorted(n for n, o in results.items() if o != "passed" and expected(n) is None)
    assert not unexpected, f"failed without an entry in EXPECTED_FAILURES: {unexpected}\n{log[-8000:]}"
    stale = sorted(p for p in EXPECTED_FAILURES
                   if not any(fnmatch.fnmatchcase(n, p) and o == "failed" for n, o in results.items())
                   and any(fnmatch.fnmatchcase(n, p) for n in results))
    assert not stale, f"listed as expected failures but passing now: {stale}"


def test_each_expected_failure_uses_the_private_name_it_is_listed_for(outcomes):
    results, _ = outcomes
    for pattern, private in EXPECTED_FAILURES.items():
        file, _, rest = pattern.partition("::")
        path = os.path.join(KERAS_TESTS, file)
        if not os.path.exists(path):
            continue  # another Keras version: the entry does not apply
        function = rest.split("::")[-1].rstrip("*").rstrip("_")
        source = open(path).read()
        match = re.search(rf"\n    def ({re.escape(function)}\w*)\(.*?(?=\n    def |\n\S|\Z)", source, re.S)
        if match is None:
            continue
        assert f".{private}" in match.group(0) or f'"{private}"' in match.group(0), (pattern, private)
