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
