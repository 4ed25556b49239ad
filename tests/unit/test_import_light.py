"""`import dist_minimize` imports no TensorFlow (dist_minimize/__init__.py says how): the
launcher and its CLI start at once, the first use of the API loads all of it, and a
`.keras` file holding the package's classes loads right after `import dist_minimize`
with no attribute of the package touched first. Each case runs in a fresh interpreter
(this process has imported TensorFlow already)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "v0_1", "model.keras")
TIMEOUT = 120  # seconds; importing TensorFlow on a busy 2-core machine takes 5-15

HEAVY = "sorted({m.split('.')[0] for m in sys.modules} & {'tensorflow', 'keras'})"


def fresh(code: str) -> list[str]:
    """Runs `code` in a new interpreter on this checkout; returns its stdout's lines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def test_the_launcher_imports_no_tensorflow_and_the_first_use_loads_the_api():
    lines = fresh(f"""
import sys
import dist_minimize.launcher
import dist_minimize as dm
assert dm.__file__.startswith({ROOT!r}), dm.__file__
dm.launcher.plan("mpirun", 2, ["t.py"], python="py")
from dist_minimize import launcher
print({HEAVY})
from dist_minimize import Optimizer
print({HEAVY})
assert dm.wrappers.Lookahead and dm.aggregation.get and Optimizer is dm.Optimizer
assert set(dm.__all__) <= set(dir(dm)), set(dm.__all__) - set(dir(dm))
print(all(getattr(dm, name) is not None for name in dm.__all__))
""")
    assert lines == ["[]", "['keras', 'tensorflow']", "True"]


def test_launch_help_imports_no_tensorflow():
    lines = fresh(f"""
import runpy, sys
sys.argv = ["launch/launch.py", "--help"]
try:
    runpy.run_path({os.path.join(ROOT, "launch", "launch.py")!r}, run_name="__main__")
except SystemExit as e:
    assert e.code in (0, None), e.code
print({HEAVY})
""")
    assert "--launcher {horovod-gloo,horovod-mpi,mpirun,multiworker,mirrored}" in " ".join(lines)
    assert lines[-1] == "[]"


@pytest.mark.parametrize("load", [
    "import keras; model = keras.saving.load_model(MODEL)",
    "import tensorflow as tf; model = tf.keras.models.load_model(MODEL)",
], ids=["keras", "tf.keras"])
def test_a_keras_file_loads_right_after_import_dist_minimize(load):
    """No attribute of the package is used before the load: Keras finds the classes
    because the package registered them when Keras was imported."""
    lines = fresh(f"""
import sys
import dist_minimize
MODEL = {MODEL!r}
{load}
print(type(model.optimizer).__module__, type(model.optimizer).__name__)
print(any(type(f).__name__ == "_AfterImport" for f in sys.meta_path))
""")
    assert lines == ["dist_minimize.wrappers.loss_scale LossScaleOptimizer", "False"]
