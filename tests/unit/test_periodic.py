"""dist_minimize/wrappers/_periodic.py: the schedules of SWA, Lookahead and MovingAverage."""

import tensorflow as tf

from dist_minimize.wrappers._periodic import on_period


def test_on_period_is_the_modulo_schedule_from_start():
    steps = tf.range(0, 40, dtype=tf.int64)
    for period in (1, 2, 3, 7):
        for start in (0, 1, 5, 50):
            got = [bool(on_period(t, period, start)) for t in steps]
            want = [int(t) >= start and (int(t) - start) % period == 0 for t in steps]
            assert got == want, (period, start)


def test_on_period_uses_no_floormod():
    """An int64 FloorMod has no GPU kernel, and would keep a device's update out of one
    unlowered If there (`_compat.ops_without_kernel`)."""
    graph = tf.function(lambda t: on_period(t, 3, 1)).get_concrete_function(tf.TensorSpec([], tf.int64)).graph
    types = {op.type for op in graph.get_operations()}
    assert "FloorDiv" in types and not types & {"FloorMod", "Mod", "TruncateMod"}
