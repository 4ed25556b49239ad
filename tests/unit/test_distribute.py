"""`dist_minimize/distribute.py`: counts, sums across replicas, agreed branches and deferred
updates, in the contexts a step runs in (no strategy; MirroredStrategy on 2 of the test
process's logical CPUs, in this process). References are plain arithmetic on the
replicas' values."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import mirrored_strategy
from dist_minimize import distribute


def per_replica(fn):
    """`fn(replica_id)` on each of the 2 replicas, traced; each replica's result."""
    s = mirrored_strategy()

    @tf.function
    def step():
        return s.run(lambda: fn(tf.distribute.get_replica_context().replica_id_in_sync_group))

    return [tf.nest.map_structure(np.array, r) for r in s.experimental_local_results(step())]


def test_counts_with_and_without_a_strategy():
    assert (distribute.strategy_replicas(), distribute.num_replicas(), distribute.horovod_size()) == (1, 1, 1)
    s = mirrored_strategy()
    with s.scope():
        assert distribute.strategy_replicas() == distribute.num_replicas() == 2
        assert distribute.worker_device_types() == {"CPU"}
        assert distribute.uses_merge_call()
    assert not distribute.uses_merge_call()


def test_sum_and_mean_across_replicas():
    sums = per_replica(lambda r: distribute.sum_across(tf.cast(r, tf.float32) + 1.0))
    means = per_replica(lambda r: distribute.mean_across(tf.cast(r, tf.float32) + 1.0))
    assert [float(v) for v in sums] == [3.0, 3.0]
    assert [float(v) for v in means] == [1.5, 1.5]
    # a list comes back as a list; integer sums are exact
    both = per_replica(lambda r: distribute.sum_across([tf.cast(r, tf.int64) + 2**40, tf.ones([2]) * 2.0]))
    for total, vector in both:
        assert int(total) == 2 * 2**40 + 1
        np.testing.assert_array_equal(vector, [4.0, 4.0])


def test_sum_across_without_a_strategy_is_the_value():
    assert float(distribute.sum_across(tf.constant(2.5))) == 2.5
    assert [float(v) for v in distribute.mean_across([tf.constant(1.0), tf.constant(3.0)])] == [1.0, 3.0]


def test_sum_across_in_the_cross_replica_context_names_the_fix():
    with mirrored_strategy().scope():
        with pytest.raises(RuntimeError, match=r"`sum_across` must run in a replica context"):
            distribute.sum_across(tf.constant(1.0))


@pytest.mark.parametrize("take", [True, False])
def test_run_if_runs_on_every_replica_or_the_otherwise_once(take):
    s = mirrored_strategy()
    with s.scope():
        hits = tf.Variable(0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        misses = tf.Variable(0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    seen = tf.Variable(tf.zeros([2]), trainable=False)  # outside the scope: one copy

    def replica():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group

        def on_every_replica(rid):
            seen.scatter_nd_add([[rid]], [1.0])
            hits.assign_add(1)

        distribute.run_if(tf.constant(take), on_every_replica, args=(r,), otherwise=lambda: misses.assign_add(1))

    tf.function(lambda: s.run(replica))()
    if take:
        np.testing.assert_array_equal(seen.numpy(), [1.0, 1.0])  # each replica, with its own argument
        assert (int(hits.numpy()), int(misses.numpy())) == (1, 0)
    else:
        np.testing.assert_array_equal(seen.numpy(), [0.0, 0.0])
        assert (int(hits.numpy()), int(misses.numpy())) == (0, 1)


def test_run_if_without_a_strategy_eager_and_traced():
    v = tf.Variable(0.0)
    distribute.run_if(tf.constant(True), lambda: v.assign_add(1.0), otherwise=lambda: v.assign_add(10.0))
    distribute.run_if(tf.constant(False), lambda: v.assign_add(1.0), otherwise=lambda: v.assign_add(10.0))
    tf.function(lambda c: distribute.run_if(c, lambda: v.assign_add(100.0)))(tf.constant(True))
    assert float(v.numpy()) == 111.0


def _deferred_counter_step():
    """A MirroredStrategy step (2 replicas) that adds 1 to a replicated counter through
    `assign_replicated`; each replica returns the counter as read after that call."""
    s = mirrored_strategy()
    with s.scope():
        counter = tf.Variable(5.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def replica():
        with distribute.deferred_updates() as pending:
            distribute.assign_replicated(counter, tf.convert_to_tensor(counter) + 1.0)
            before = tf.convert_to_tensor(counter)
        distribute.run_if(tf.constant(True), lambda: None, updates=pending)
        return before

    return s, counter, tf.function(lambda: s.run(replica))


def test_assign_replicated_is_deferred_to_the_steps_one_synchronisation():
    """Inside `deferred_updates`, under a merge-call strategy, the assign waits for the
    step's `run_if(updates=...)`: reads before it see the old value; after it every copy
    holds the new value."""
    s, counter, step = _deferred_counter_step()
    seen = s.experimental_local_results(step())
    assert [float(b) for b in seen] == [5.0, 5.0]
    assert [float(c.numpy()) for c in s.experimental_local_results(counter)] == [6.0, 6.0]


def test_assign_replicated_writes_each_copy_from_its_own_replica():
    """Nothing crosses devices: each device's copy is written from the value its own
    replica computed (copying replica 0's value to every device cost 2.5% of a
    20-variable MirroredStrategy step), as each worker writes its own copies."""
    s, counter, step = _deferred_counter_step()
    assigns = [op for op in step.get_concrete_function().graph.get_operations() if op.type == "AssignVariableOp"]
    assert len(assigns) == 2
    devices = [(tf.DeviceSpec.from_string(op.device), tf.DeviceSpec.from_string(op.inputs[1].op.device))
               for op in assigns]
    assert sorted(d.device_index for d, _ in devices) == [0, 1]
    assert all(written == computed for written, computed in devices), devices
    step()
    assert [float(c.numpy()) for c in s.experimental_local_results(counter)] == [6.0, 6.0]


def test_note_and_known_all_finite_hold_within_one_step_only():
    grads = [tf.constant([1.0]), None, tf.constant([2.0])]
    assert distribute.known_all_finite(grads) is None
    with distribute.deferred_updates():
        distribute.note_all_finite(grads, tf.constant(True))
        assert bool(distribute.known_all_finite(grads))
        assert distribute.known_all_finite([tf.constant([1.0])]) is None  # other tensors
    assert distribute.known_all_finite(grads) is None


def test_note_and_known_scaled_hold_within_one_step_for_dense_tensors_only():
    inputs = [tf.constant([1.0, 2.0]), None, tf.constant([4.0])]
    factor = tf.constant(0.5)
    outputs = [None if g is None else distribute.scale(g, factor) for g in inputs]
    with distribute.deferred_updates():
        distribute.note_scaled(outputs, inputs, factor)
        got, f = distribute.known_scaled(outputs)
        assert got[0] is inputs[0] and got[1] is None and got[2] is inputs[2] and f is factor
        assert [distribute.scale(g, f).numpy().tolist() for g in (got[0], got[2])] == [[0.5, 1.0], [2.0]]
        assert distribute.known_scaled(inputs) is None  # other tensors
        sparse = [tf.IndexedSlices(tf.constant([1.0]), tf.constant([0]), tf.constant([2]))]
        distribute.note_scaled(sparse, sparse, factor)
        assert distribute.known_scaled(sparse) is None  # only dense products are made elsewhere
    assert distribute.known_scaled(outputs) is None

def test_check_agreed_fails_when_replicas_disagree():
    s = mirrored_strategy()

    def replica(disagree):
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        condition = tf.logical_or(tf.logical_not(disagree), tf.equal(r, 0))
        assertion = distribute.check_agreed(condition, "test condition")
        with tf.control_dependencies([assertion]):
            return tf.identity(condition)

    step = tf.function(lambda d: s.run(replica, args=(d,)))
    step(tf.constant(False))
    with pytest.raises(tf.errors.InvalidArgumentError, match="The test condition differs across replicas"):
        step(tf.constant(True))


def test_refuse_xla_only_in_an_xla_compiled_step():
    distribute.refuse_xla("this", "why")  # eagerly: nothing

    @tf.function(jit_compile=True)
    def compiled(x):
        distribute.refuse_xla("A thing", "it cannot")
        return x

    with pytest.raises(RuntimeError, match=r"A thing cannot run in an XLA-compiled step: it cannot. Compile without"):
        compiled(tf.constant(1.0))


def test_copies_per_device():
    s = mirrored_strategy()
    with s.scope():
        mirrored = tf.Variable(1.0)
        assert distribute.has_copy_per_device([mirrored])
    outside = tf.Variable(1.0)
    with s.scope():
        assert not distribute.has_copy_per_device([outside])
