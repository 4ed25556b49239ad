"""CompressedAggregation: 16-bit aggregation with error feedback (dist_minimize/wrappers/compression.py).

The invariant is the error-feedback identity: what is applied plus the new residuals
equals the exact aggregated gradient plus the old residuals. With SGD(learning_rate=1)
from zero weights, `-weights` after T steps is the sum of what was applied, so
`-w_T + R_T == sum of exact gradients + R_0`, checked to float32 rounding where the
16-bit sum itself is exact (one device; two replicas sending the same value).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy

F16_EPS = 2.0 ** -10


def sgd_stack(compression="fp16", **kw):
    return dm.CompressedAggregation(dm.Optimizer(keras.optimizers.SGD(1.0), **kw), compression=compression)


def run(opt, grads, strategy=None, w=None):
    """Steps of `loss = sum(w * g_t)` (gradient g_t on every replica); returns w."""
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        w = w if w is not None else tf.Variable(np.zeros(grads[0].shape, np.float32))
        if not opt.built:
            opt.build([w])

    @tf.function
    def step(g):
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * g)
            opt.minimize(loss, [w], tape=tape)
        strategy.run(replica)

    for g in grads:
        step(tf.constant(g))
    return w


def residual(opt, w):
    return opt.slot("residual", w).numpy()  # read outside the replicas: the SUM of their copies


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_applied_plus_residual_is_the_exact_gradient_at_every_step(compression):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(64,)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(6)]
    opt = sgd_stack(compression)
    w = run(opt, grads[:1])
    applied, exact = -w.numpy(), grads[0]
    assert np.abs(residual(opt, w)).max() > 0  # the rounding is kept: the test is not vacuous
    np.testing.assert_allclose(applied + residual(opt, w), exact, rtol=0, atol=1e-6)
    run(opt, grads[1:], w=w)
    total = np.sum(grads, axis=0)
    np.testing.assert_allclose(-w.numpy() + residual(opt, w), total, rtol=0, atol=1e-5)
    # Without the feedback the rounding of each step would add up; with it, what is still
    # owed is within one rounding of the last value sent.
    eps = F16_EPS if compression == "fp16" else 2.0 ** -7
    assert np.all(np.abs(residual(opt, w)) <= eps * np.abs(grads[-1] + residual(opt, w)) + 1e-7)


def test_values_below_float16_are_delivered_over_time():
    tiny = np.full((4,), 1e-8, np.float32)  # below float16's smallest subnormal (6e-8): sent as 0
    opt = sgd_stack("fp16")
    w = run(opt, [tiny] * 20)
    np.testing.assert_allclose(-w.numpy() + residual(opt, w), 20 * tiny, rtol=1e-5)
    assert np.all(-w.numpy() > 0)  # what no single step could send arrived


def test_a_float16_overflow_is_clipped_and_the_rest_sent_later():
    big = np.array([2.0e5, -2.0e5, 1.0], np.float32)  # each beyond float16's 65504
    opt = sgd_stack("fp16")
    w = run(opt, [big])
    assert int(opt.skipped_steps.numpy()) == 0
    assert np.all(np.abs(w.numpy()) <= 65504.0)
    run(opt, [np.zeros(3, np.float32)] * 4, w=w)  # nothing new: the residual drains
    np.testing.assert_allclose(-w.numpy(), big, rtol=0, atol=0.0)
    assert np.all(residual(opt, w) == 0)


def test_a_non_finite_step_is_skipped_and_leaves_the_residual():
    rng = np.random.default_rng(1)
    g = rng.normal(size=(8,)).astype(np.float32) * np.float32(1 + 1e-3)
    opt = sgd_stack("fp16")
    w = run(opt, [g])
    before_w, before_r = w.numpy(), residual(opt, w)
    bad = g.copy()
    bad[3] = np.inf
    run(opt, [bad], w=w)
    assert int(opt.skipped_steps.numpy()) == 1
    np.testing.assert_array_equal(w.numpy(), before_w)
    np.testing.assert_array_equal(residual(opt, w), before_r)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_two_replicas_sum_the_16_bit_values_and_keep_both_residuals(compression):
    """Both replicas send the same value, so the 16-bit sum (a doubling) is exact and the
    identity holds to float32 rounding; aggregation is the strategy's SUM."""
    strategy = mirrored_strategy()
    rng = np.random.default_rng(2)
    grads = [rng.normal(size=(32,)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(4)]
    opt = None
    with strategy.scope():
        opt = sgd_stack(compression)
    w = run(opt, grads, strategy=strategy)
    r = residual(opt, w)
    assert np.abs(r).max() > 0
    np.testing.assert_allclose(-w.numpy() + r, 2 * np.sum(grads, axis=0), rtol=0, atol=2e-5)


def test_residuals_are_checkpointed_and_a_resumed_run_continues_exactly(tmp_path):
    rng = np.random.default_rng(3)
    grads = [rng.normal(size=(16,)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(6)]
    whole = sgd_stack("fp16")
    w_whole = run(whole, grads)
    first = sgd_stack("fp16")
    w = run(first, grads[:3])
    path = tf.train.Checkpoint(w=w, opt=first).write(str(tmp_path / "ckpt"))
    again = sgd_stack("fp16")
    w2 = tf.Variable(np.zeros(16, np.float32))
    again.build([w2])
    tf.train.Checkpoint(w=w2, opt=again).read(path).assert_consumed()
    np.testing.assert_array_equal(residual(again, w2), residual(first, w))
    run(again, grads[3:], w=w2)
    np.testing.assert_array_equal(w2.numpy(), w_whole.numpy())


def test_saved_in_a_keras_file_with_its_residuals(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(loss="mse", optimizer=dm.CompressedAggregation(dm.Optimizer(keras.optimizers.Adam(1e-3)), "bf16"))
    x = np.random.default_rng(4).normal(size=(8, 3)).astype(np.float32)
    model.fit(x, x[:, :2] * 3.0, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert isinstance(loaded.optimizer, dm.CompressedAggregation) and loaded.optimizer.compression == "bf16"
    for a, b in zip(loaded.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(loaded.optimizer.slot("residual", a).numpy(),
                                      model.optimizer.slot("residual", b).numpy())


def test_bad_settings_and_stacks_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"compression.*Received: compression='int8'"):
        sgd_stack("int8")
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        dm.CompressedAggregation(dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.SGD(1.0))))
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        dm.LossScaleOptimizer(sgd_stack())
    with pytest.raises(ValueError, match="shard_optimizer_state=True"):
        sgd_stack(shard_optimizer_state=True)
    with pytest.raises(ValueError, match="one CompressedAggregation per stack"):
        dm.CompressedAggregation(sgd_stack())


def test_bf16_under_horovod_is_refused_naming_fp16(monkeypatch):
    from dist_minimize import distribute

    monkeypatch.setattr(distribute, "horovod", lambda: object())  # as if Horovod were initialised
    opt = sgd_stack("bf16")
    with pytest.raises(ValueError, match=r"no bfloat16 kernel.*compression='fp16'"):
        run(opt, [np.ones(2, np.float32)])


# -- low rank ("powersgd:R") ------------------------------------------------------------


def run_per_replica(opt, variables, grads_per_replica, strategy):
    """Steps of `loss = sum(w * g)` where replica k's gradient is grads_per_replica[t][k]."""
    n = strategy.num_replicas_in_sync

    @tf.function
    def step(values):
        def replica(g):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(v * tf.reshape(g[..., :int(np.prod(v.shape))], v.shape))
                                 for v in variables])
            opt.minimize(loss, variables, tape=tape)
        strategy.run(replica, args=(values,))

    for per_replica in grads_per_replica:
        step(strategy.experimental_distribute_values_from_function(
            lambda ctx, p=per_replica: tf.constant(p[ctx.replica_id_in_sync_group % n])))


@pytest.mark.parametrize("replicas", [1, 2])
def test_low_rank_applied_plus_residual_is_the_exact_gradient(replicas):
    """Each replica's own gradient (different on each): the identity is exact, to float32
    rounding, whatever the rank drops, since P P^T M is linear in M."""
    strategy = mirrored_strategy() if replicas == 2 else tf.distribute.get_strategy()
    rng = np.random.default_rng(5)
    steps = [[rng.normal(size=(16 * 12,)).astype(np.float32) for _ in range(replicas)] for _ in range(5)]
    with strategy.scope():
        w = tf.Variable(np.zeros((16, 12), np.float32))
        opt = sgd_stack("powersgd:2")
        opt.build([w])
    run_per_replica(opt, [w], steps, strategy)
    exact = np.sum([np.sum(s, axis=0) for s in steps], axis=0).reshape(16, 12)
    r = residual(opt, w)
    assert np.abs(r).max() > 1.0  # rank 2 of a 16 x 12 random matrix leaves most of it
    np.testing.assert_allclose(-w.numpy() + r, exact, rtol=0, atol=2e-5)


def test_a_gradient_of_the_rank_is_sent_whole_and_q_is_kept():
    u, v = np.arange(1, 9, dtype=np.float32), np.linspace(-1, 1, 6).astype(np.float32)
    g = np.outer(u, v)  # rank 1
    w = tf.Variable(np.zeros((8, 6), np.float32))
    opt = sgd_stack("powersgd:1")
    opt.build([w])
    run(opt, [g], w=w)
    np.testing.assert_allclose(-w.numpy(), g, rtol=0, atol=1e-5)
    assert np.abs(residual(opt, w)).max() <= 1e-5
    p, q = [x for x in opt.variables if x.path.endswith(("_p", "_q"))]
    np.testing.assert_allclose(p.numpy() @ q.numpy().T, g, rtol=0, atol=1e-5)  # Q kept: the next warm start


def test_low_rank_sends_vectors_and_small_matrices_as_they_are():
    w = tf.Variable(np.zeros((3, 2), np.float32))  # rank 2 would send 10 values for 6
    b = tf.Variable(np.zeros((5,), np.float32))
    opt = sgd_stack("powersgd:2")
    opt.build([w, b])
    assert not [x for x in opt.variables if x.path.endswith(("_p", "_q"))]
    rng = np.random.default_rng(6)
    gw, gb = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * gw) + tf.reduce_sum(b * gb)
        opt.minimize(loss, [w, b], tape=tape)

    step()
    np.testing.assert_array_equal(-w.numpy(), gw)
    np.testing.assert_array_equal(-b.numpy(), gb)


def test_low_rank_skips_a_non_finite_step_and_resumes_exactly(tmp_path):
    rng = np.random.default_rng(7)
    grads = [rng.normal(size=(10, 8)).astype(np.float32) for _ in range(4)]
    bad = grads[1].copy()
    bad[2, 3] = np.nan
    whole = sgd_stack("powersgd:2")
    w_whole = run(whole, [grads[0], bad, *grads[1:]])
    assert int(whole.skipped_steps.numpy()) == 1
    first = sgd_stack("powersgd:2")
    w = run(first, [grads[0], bad, grads[1]])
    path = tf.train.Checkpoint(w=w, opt=first).write(str(tmp_path / "ckpt"))
    again = sgd_stack("powersgd:2")
    w2 = tf.Variable(np.zeros((10, 8), np.float32))
    again.build([w2])
    tf.train.Checkpoint(w=w2, opt=again).read(path).assert_consumed()
    run(again, grads[2:], w=w2)
    np.testing.assert_array_equal(w2.numpy(), w_whole.numpy())


@pytest.mark.parametrize("bad", ["powersgd:0", "powersgd:x", "powersgd", "int8", 16])
def test_an_unknown_compression_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"powersgd:R.*Received: compression="):
        sgd_stack(bad)


@pytest.mark.parametrize("compression", ["fp16", "powersgd:2"])
def test_a_non_finite_gradient_sent_whole_also_leaves_the_residuals(compression):
    """A NaN in a vector's gradient (sent as it is): the step is skipped, so the matrix's
    residual (and Q) must not move either."""
    w = tf.Variable(np.zeros((10, 8), np.float32))
    b = tf.Variable(np.zeros((8,), np.float32))
    opt = sgd_stack(compression)
    opt.build([w, b])
    rng = np.random.default_rng(9)
    gw = tf.constant(rng.normal(size=(10, 8)).astype(np.float32) * np.float32(1 + 1e-3))

    @tf.function
    def step(gb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * gw) + tf.reduce_sum(b * gb)
        opt.minimize(loss, [w, b], tape=tape)

    step(tf.ones(8))
    state = [v.numpy() for v in opt.variables]
    step(tf.constant([np.nan] + [1.0] * 7))
    assert int(opt.skipped_steps.numpy()) == 1
    for before, after in zip(state, [v.numpy() for v in opt.variables]):
        np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize("outside", [False, True])
def test_with_accumulation_the_mean_of_each_window_is_compressed_once(outside):
    """GradientAccumulation(CompressedAggregation(...)) and the other order: one compression
    per update, of the window's mean, so after every update the weights plus the
    residual are the sum of the means (SGD, learning rate 1, from zero)."""
    rng = np.random.default_rng(10)
    grads = [rng.normal(size=(6, 5)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(6)]
    core = dm.Optimizer(keras.optimizers.SGD(1.0))
    opt = (dm.CompressedAggregation(dm.GradientAccumulation(core, 3), "fp16") if outside
           else dm.GradientAccumulation(dm.CompressedAggregation(core, "fp16"), 3))
    w = run(opt, grads)
    compression = opt.find(dm.CompressedAggregation)
    r = compression.slot("residual", w).numpy()
    assert int(opt.iterations.numpy()) == 2 and np.abs(r).max() > 0
    means = (np.sum(grads[:3], axis=0) / 3, np.sum(grads[3:], axis=0) / 3)
    np.testing.assert_allclose(-w.numpy() + r, means[0] + means[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("compression", ["fp16", "bf16", "powersgd:2"])
def test_a_step_compiled_with_xla_keeps_the_identity(compression):
    w = tf.Variable(np.zeros((10, 8), np.float32))
    opt = sgd_stack(compression)
    opt.build([w])
    rng = np.random.default_rng(12)
    grads = [rng.normal(size=(10, 8)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(3)]

    @tf.function(jit_compile=True)
    def step(g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * g)
        opt.minimize(loss, [w], tape=tape)

    for g in grads:
        step(tf.constant(g))
    r = residual(opt, w)
    assert np.abs(r).max() > 0
    np.testing.assert_allclose(-w.numpy() + r, np.sum(grads, axis=0), rtol=0, atol=1e-5)
