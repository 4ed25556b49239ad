"""`import dist_minimize` installs nothing in Python's import machinery and registers
the package's classes with Keras, so that a `.keras` file holding them loads right after
the import, with no attribute of the package touched first; the launcher's CLI works
from a checkout. Each case runs in a fresh interpreter (this process has imported
TensorFlow already)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "v0_1", "model.keras")
TIMEOUT = 120  # seconds; importing TensorFlow on a busy 2-core machine takes 5-15


def fresh(code: str) -> list[str]:
    """Runs `code` in a new interpreter on this checkout; returns its stdout's lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def test_import_adds_no_import_hook_and_every_public_name_resolves():
    lines = fresh(f"""
import sys
import tensorflow, keras  # they add finders of their own (absl, six)
before = list(sys.meta_path), list(sys.path_hooks)
import dist_minimize as dm
assert dm.__file__.startswith({ROOT!r}), dm.__file__
print((list(sys.meta_path), list(sys.path_hooks)) == before)
print(sorted(set(dm.__all__) - set(dir(dm))))
print(dm.wrappers.Lookahead is dm.Lookahead and dm.aggregation.get is not None)
""")
    assert lines == ["True", "[]", "True"]


def test_importing_dist_minimize_first_installs_no_finder_of_its_own():
    lines = fresh("""
import sys
import dist_minimize
print([type(f).__module__ for f in sys.meta_path + sys.path_hooks if "dist_minimize" in str(type(f).__module__)])
""")
    assert lines == ["[]"]


def test_launch_help_runs_from_a_checkout():
    lines = fresh(f"""
import runpy, sys
sys.argv = ["launch/launch.py", "--help"]
try:
    runpy.run_path({os.path.join(ROOT, "launch", "launch.py")!r}, run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
""")
    assert "--launcher {horovod-gloo,horovod-mpi,mpirun,multiworker,mirrored}" in " ".join(lines)


@pytest.mark.parametrize("load", [
    "import keras; model = keras.saving.load_model(MODEL)",
    "import tensorflow as tf; model = tf.keras.models.load_model(MODEL)",
], ids=["keras", "tf.keras"])
def test_a_keras_file_loads_right_after_import_dist_minimize(load):
    """No attribute of the package is used before the load: Keras finds the classes
    because importing the package registered them."""
    lines = fresh(f"""
import dist_minimize
MODEL = {MODEL!r}
{load}
print(type(model.optimizer).__module__, type(model.optimizer).__name__)
""")
    assert lines == ["dist_minimize.wrappers.loss_scale LossScaleOptimizer"]
