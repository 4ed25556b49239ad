"""Test set-up: 4 logical CPU devices (for MirroredStrategy) before TensorFlow starts."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)

import importlib.util  # noqa: E402

import pytest  # noqa: E402

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None
HOROVOD_REASON = (
    f"Horovod 0.28.1 (its last release) does not build against TensorFlow {tf.__version__} "
    "(xla_mpi_ops.cc; it builds against TF <= 2.18)"
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 19)
    else "Horovod is not installed: bash ci/setup.sh builds it")
requires_horovod = pytest.mark.skipif(not HAVE_HOROVOD, reason=HOROVOD_REASON)

_MIRRORED = []


def mirrored_strategy() -> "tf.distribute.MirroredStrategy":
    """The test process's one MirroredStrategy over 2 of its logical CPUs.

    Shared: several strategies in one process can reuse collective instance keys
    (TensorFlow 2.21 then fails with a shape mismatch between unrelated all-reduces).
    """
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _MIRRORED[0]


# Tests run by the default profile only (ci/test.sh deselects them on the others with
# `-m "not default_profile_only"`): those of the project's own process and file handling
# (launcher, supervision, restarts, what a job listens on, repository tooling and
# checks), which no TensorFlow version
# changes, and every case on 4 MirroredStrategy replicas (`jobs.run_param`): the
# replica count's effect is checked once, TensorFlow's MirroredStrategy on each profile
# with 2 replicas. The checkpoint's TensorFlow side runs on every profile
# (tests/unit/test_checkpoint.py).
DEFAULT_PROFILE_ONLY = ("tests/tooling/", "tests/distributed/test_process_lifecycle.py",
                        "tests/distributed/test_restarts.py", "tests/unit/test_launcher_restarts.py",
                        "tests/unit/test_launcher_cluster.py", "tests/unit/test_launcher_elastic.py",
                        "tests/distributed/test_security.py", "tests/distributed/test_elastic_resize.py",
                        "tests/distributed/test_repository_checks.py",
                        # the main job (launcher and script: its TensorFlow side is the parity
                        # tests'), and Keras's own optimizer tests (the same Keras on both)
                        "tests/distributed/test_main_job.py", "tests/unit/test_keras_own_suite.py")
default_profile_only = pytest.mark.default_profile_only
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if os.path.relpath(str(item.path), _ROOT).startswith(DEFAULT_PROFILE_ONLY):
            item.add_marker(default_profile_only)
