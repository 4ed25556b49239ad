"""`shard_optimizer_state=True` in one process: the partition (dist_minimize/sharding/shards.py),
what is refused with which message, the one-process no-op, the settings round trip and
`optimizer_state_bytes`. Parity across processes: tests/distributed/test_sharded_state.py."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy, requires_horovod
from dist_minimize.sharding.shards import Partition


def model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def test_partition_balances_whole_variables_largest_first():
    sizes = [40, 8, 8, 1, 300, 7, 64, 64]
    for n in (1, 2, 3, 4, 8, 11):
        parts = [Partition.balanced(sizes, n, r) for r in range(n)]
        assert all(p.owner == parts[0].owner for p in parts)  # every process computes the same
        assert sorted(i for p in parts for i in p.mine) == list(range(len(sizes)))  # each once
        loads = parts[0].loads()
        assert sum(loads) == sum(sizes)
        assert max(loads) <= sum(sizes) / n + max(sizes)
    # 2 processes: the 300-element variable alone on one, the other 192 on the other.
    assert Partition.balanced(sizes, 2, 0).loads() == [300, 192]


def test_more_processes_than_variables_leaves_some_without_state():
    p = Partition.balanced([5, 3], 4, 3)
    assert p.loads() == [5, 3, 0, 0] and p.mine == []


def test_one_process_is_a_no_op_with_a_log_line(caplog):
    x = np.random.default_rng(0).normal(size=(16, 5)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
    results = []
    for shard in (False, True):
        m = model()
        opt = dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(0.5),
                           shard_optimizer_state=shard)
        with caplog.at_level(logging.INFO, logger="dist_minimize"):
            for _ in range(3):
                opt.minimize(lambda: tf.reduce_mean(tf.square(m(x) - y)), m.trainable_variables)
        results.append(([w.copy() for w in m.get_weights()], dm.optimizer_state_bytes(opt)))
    assert all(np.array_equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert results[0][1] == results[1][1]
    assert "shard_optimizer_state=True with one process" in caplog.text


def test_optimizer_state_bytes_counts_every_variable_of_the_stack():
    m = model()
    opt = dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.Adam(0.01),
                                             transform_gradients=dm.clip_by_global_norm(1.0)))
    opt.build(m.trainable_variables)
    weights = sum(int(np.prod(v.shape)) for v in m.trainable_variables)
    # Adam: 2 float32 slots per weight, plus counters and statistics.
    assert 8 * weights < dm.optimizer_state_bytes(opt) < 8 * weights + 200


def test_refused_without_a_sharding_backend():
    with pytest.raises(ValueError, match="shard_optimizer_state=True.*aggregate_gradients='none'"):
        dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="none", shard_optimizer_state=True)


def test_the_strategy_backend_shards_and_with_one_replica_does_nothing():
    """aggregate_gradients='strategy' shards under MultiWorkerMirroredStrategy
    (tests/distributed/test_sharded_state.py); with one replica it holds the whole state."""
    m = model()
    opt = dm.Optimizer(keras.optimizers.Adam(0.1), aggregate_gradients="strategy", shard_optimizer_state=True)
    opt.build(m.trainable_variables)
    assert opt.shard(m.trainable_variables) == m.trainable_variables
    assert len(opt.inner_optimizer.variables) == 2 + 2 * len(m.trainable_variables)


def test_refused_as_a_non_bool():
    with pytest.raises(TypeError, match="shard_optimizer_state=1"):
        dm.Optimizer(keras.optimizers.SGD(0.1), shard_optimizer_state=1)


@requires_horovod
@pytest.mark.parametrize("options", [{"reduction": "adasum"}, {"compression": "fp16"}])
def test_refused_with_horovod_settings_it_cannot_keep(options):
    with pytest.raises(ValueError, match="reduce-scatters the gradients"):
        dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients=dm.aggregation.HorovodAggregator(**options),
                     shard_optimizer_state=True)


def test_refused_under_mirrored_strategy_naming_it():
    strategy = mirrored_strategy()
    with strategy.scope():
        m = model()
        opt = dm.Optimizer(keras.optimizers.SGD(0.1), shard_optimizer_state=True)
        with pytest.raises(ValueError, match="under MirroredStrategy with 2 replicas.*Run one process per device: "
                                             "MultiWorkerMirroredStrategy with one device per worker, or horovodrun"):
            opt.build(m.trainable_variables)


class UsersWrapper(dm.OptimizerWrapper):
    """A wrapper of one's own, which has not said it works on a share."""


def test_refused_with_a_wrapper_that_does_not_declare_shards_state():
    m = model()
    opt = UsersWrapper(dm.Optimizer(keras.optimizers.SGD(0.1), shard_optimizer_state=True))
    with pytest.raises(ValueError, match="UsersWrapper does not declare `shards_state = True`"):
        opt.build(m.trainable_variables)


def clip_by_my_own_global_norm(grads_and_vars):
    """A user's plain `transform_gradients` callable: clips by the norm of the pairs it gets."""
    grads, norm = tf.clip_by_global_norm([g for g, _ in grads_and_vars], 1.0)
    return list(zip(grads, [v for _, v in grads_and_vars]))


class MyGlobalClip(dm.GradientTransform):
    def __call__(self, grads_and_vars):
        return clip_by_my_own_global_norm(grads_and_vars)


@pytest.mark.parametrize("transform", [clip_by_my_own_global_norm, MyGlobalClip()], ids=["function", "transform"])
def test_a_transform_that_does_not_declare_shards_state_is_refused_at_construction_naming_it(transform):
    """Sharded, each process's `transform_gradients` gets its own share of the pairs: a
    global norm computed over them would be silently wrong, so the stack is refused."""
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True: the `transform_gradients` callable\(s\) "
                                         r"(clip_by_my_own_global_norm|MyGlobalClip) do not declare "
                                         r"`shards_state = True`.*own share"):
        dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=[dm.clip_by_value(1.0), transform],
                     shard_optimizer_state=True)
    dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=transform)  # unsharded: every pair, correct


def test_a_declared_transform_and_every_built_in_one_are_taken_sharded():
    def per_pair(grads_and_vars):
        return [(2.0 * g, v) for g, v in grads_and_vars]

    per_pair.shards_state = True
    built_in = [dm.clip_by_global_norm(1.0), dm.clip_by_norm(1.0), dm.clip_by_value(1.0), dm.limit_nonfinite_steps(3)]
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=[*built_in, per_pair], shard_optimizer_state=True)
    assert opt.shard_optimizer_state
    dm.Optimizer(keras.optimizers.SGD(0.1, global_clipnorm=1.0), shard_optimizer_state=True)  # Keras's, translated
    with pytest.raises(ValueError, match="ConsistencyCheck do not declare"):  # it compares each process's share
        dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=dm.check_consistency(2), shard_optimizer_state=True)


def test_every_built_in_wrapper_shards_its_state():
    wrappers = [dm.LossScaleOptimizer, dm.DecoupledWeightDecay, dm.SAM, dm.GradientAccumulation, dm.MovingAverage,
                dm.SWA, dm.Lookahead, dm.DifferentialPrivacy]
    assert all(w.shards_state is True for w in wrappers)


def test_the_setting_survives_get_config():
    opt = dm.Optimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    again = dm.Optimizer.from_config(opt.get_config())
    assert again.shard_optimizer_state and not dm.Optimizer(keras.optimizers.Adam(0.01)).shard_optimizer_state


def test_buckets_bound_each_collective_and_hold_each_variable_once():
    """The sharded step's collectives go bucket by bucket: every variable in exactly one
    bucket, in its owner's segment; a bucket's buffer (processes x the largest segment)
    within the bound unless one variable alone exceeds it; dtypes apart; None skipped."""
    from dist_minimize.sharding.shards import Partition
    from dist_minimize.aggregation import sharded

    sizes = [4096, 4096, 4096, 4096, 100, 10, 50000, 7]
    items = [tf.zeros([n]) for n in sizes[:-1]] + [tf.zeros([sizes[-1]], tf.float16), None]
    owners = Partition.balanced(sizes + [1], 2, 0).owner
    bound = 4 * 2 * 4096  # bytes: two segments of 4096 float32
    buckets = sharded._buckets(owners, items, 2, bucket_bytes=bound)
    assert sorted(i for _, segs, _ in buckets for seg in segs for i in seg) == list(range(8))
    for dtype, segs, width in buckets:
        assert width == max(sum(sizes[i] for i in seg) for seg in segs)
        assert all(owners[i] == r and items[i].dtype == dtype for r, seg in enumerate(segs) for i in seg)
        largest = max(sizes[i] for seg in segs for i in seg)
        assert 2 * width * dtype.size <= bound or width == largest, (segs, width)
    # process 0 owns the 50000 alone, process 1 the rest: one float32 bucket as long as
    # the 50000 (process 1's 16494 beside it), and the float16 one
    assert [(segs, width) for _, segs, width in buckets] == [([[6], [0, 1, 2, 3, 4, 5]], 50000), ([[], [7]], 7)]
    assert sharded.planned(items, owners, 2) == len(buckets)
    # equal variables dealt out in turn: buckets of the bound, one variable per process each
    equal = [tf.zeros([4096]) for _ in range(8)]
    split = sharded._buckets(Partition.balanced([4096] * 8, 2, 0).owner, equal, 2, bucket_bytes=bound)
    assert [width for _, _, width in split] == [4096] * 4 and all(len(seg) == 1 for _, s, _ in split for seg in s)


def _ancestors(tensor) -> set:
    """Every op `tensor` waits for: its inputs and control inputs, transitively."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_buckets_go_in_order_so_only_one_buffer_lives_at_once():
    """Bucket k's buffer is built after bucket k - 1's collective has returned (the
    gather's after its writes): otherwise TensorFlow may build every buffer, a copy of
    all the gradients, before the first collective runs, and the peak memory a sharded
    step saves is spent again. The reduced values: each process keeps its segment."""
    from dist_minimize.sharding.shards import Partition
    from dist_minimize.aggregation import sharded

    sizes = [64] * 12
    variables = [tf.Variable(tf.fill([n], float(i))) for i, n in enumerate(sizes)]
    owners = Partition.balanced(sizes, 2, 0).owner
    seen = {"reduce": [], "gather": []}

    @tf.function
    def step(grads):
        def reduce(buffer, k):  # two processes with equal gradients: the sum, process 0's half
            out = tf.identity(2.0 * buffer[:buffer.shape[0] // 2])
            seen["reduce"].append((buffer, out))
            return out

        def gather(segment, k):  # the order only (the values: tests/distributed/test_sharded_state.py)
            out = tf.identity(tf.concat([segment, segment], 0))
            seen["gather"].append((segment, out))
            return out
        mine = sharded.reduce_scatter(list(zip(grads, variables)), owners, 2, 0, reduce)
        sharded.all_gather(variables, [True] * len(variables), owners, 2, 0, gather)
        return [g for g, _ in mine]

    grads = [tf.fill([n], float(i) + 0.5) for i, n in enumerate(sizes)]
    sharded.BUCKET_BYTES, saved = 2 * 4 * 64, sharded.BUCKET_BYTES  # one variable per process per bucket
    try:
        out = step(grads)
    finally:
        sharded.BUCKET_BYTES = saved
    mine = [i for i, o in enumerate(owners) if o == 0]
    assert [float(o[0]) for o in out] == [2 * (i + 0.5) for i in mine]
    for kind, calls in seen.items():
        assert len(calls) == 6, kind
        for k, (buffer, _) in enumerate(calls):
            before = _ancestors(buffer)
            for j, (_, result) in enumerate(calls):
                # after every earlier bucket's collective, before every later one
                assert (result.op in before) == (j < k), (kind, k, j)


def test_a_segment_kept_from_an_all_reduce_is_a_copy_not_a_view():
    """`own_segment` copies: a slice would share the reduced buffer's memory and keep the
    whole of it alive until the update has run (the step would hold the whole aggregated
    gradient, as an unsharded step does)."""
    from dist_minimize.aggregation import sharded

    reduced = tf.range(4 * 1024, dtype=tf.float32)  # 4 processes, a 1024-element segment each
    segment = sharded.own_segment(reduced, 4, 2)
    np.testing.assert_array_equal(segment, np.arange(2048, 3072, dtype=np.float32))
    assert not np.shares_memory(np.asarray(reduced), np.asarray(segment))
    assert np.shares_memory(np.asarray(reduced), np.asarray(reduced[2048:3072]))  # what a slice does


def test_a_kept_segment_compiles_with_xla():
    """The copy has no XLA kernel; under XLA the segment is the slice (XLA's compiler
    places the buffers)."""
    from dist_minimize.aggregation import sharded

    step = tf.function(lambda reduced: sharded.own_segment(reduced, 4, 1) * 2.0, jit_compile=True)
    np.testing.assert_array_equal(step(tf.range(4 * 8, dtype=tf.float32)), 2.0 * np.arange(8, 16, dtype=np.float32))


def test_sharded_accumulators_need_a_sharded_stack_and_a_bool():
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True.*Received: shard_accumulators=True"):
        dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(0.1)), 2, shard_accumulators=True)
    with pytest.raises(TypeError, match="shard_accumulators='yes'"):
        dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(0.1)), 2, shard_accumulators="yes")
    opt = dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(0.1), shard_optimizer_state=True), 2,
                                  shard_accumulators=True)
    assert dm.GradientAccumulation.from_config(opt.get_config()).shard_accumulators is True


def test_sharded_accumulators_in_one_process_accumulate_every_variable():
    """One process (nothing to shard over; a merge-call strategy is refused with sharded
    state): the option changes nothing, every variable is accumulated as without it."""
    results = []
    for option in (False, True):
        w, b = tf.Variable(np.zeros(3, np.float32)), tf.Variable(np.zeros(2, np.float32))
        opt = dm.GradientAccumulation(dm.Optimizer(keras.optimizers.SGD(1.0), shard_optimizer_state=True), 2,
                                      shard_accumulators=option)
        opt.build([w, b])

        @tf.function
        def step(t):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * tf.stack([t, 2.0, 3.0])) + tf.reduce_sum(b * t)
            opt.minimize(loss, [w, b], tape=tape)

        for t in range(4):
            step(tf.constant(1.0 + t))
        results.append((w.numpy(), b.numpy()))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(results[0][1], [-5.0, -5.0])  # the means of (1, 2) and (3, 4)
