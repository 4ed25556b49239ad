"""Helpers of the in-process MirroredStrategy tests (2 of the test process's 4 logical
CPUs: tests/conftest.py's `mirrored_strategy()`)."""

import numpy as np
import tensorflow as tf

from conftest import mirrored_strategy


def local_values(var):
    """Each replica's copy of `var`, as NumPy arrays."""
    return [np.array(v) for v in mirrored_strategy().experimental_local_results(var)]


def good_then_poisoned_step(replica_fn, v, use_function):
    """Runs a clean step, then a step with `poison=True`; asserts the poisoned step
    changed no replica's copy of `v` and left it finite. Returns the step function."""
    s = mirrored_strategy()

    def step(poison):
        s.run(replica_fn, args=(tf.constant(poison),))

    if use_function:
        step = tf.function(step)
    step(False)
    good = local_values(v)
    step(True)
    after = local_values(v)
    for a, b in zip(after, good):
        np.testing.assert_array_equal(a, b)
    assert all(np.all(np.isfinite(a)) for a in after)
    return step
