"""The staged Optimizer in one process: stages, transforms, state, serialisation."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm
import parity_lib as P
from conftest import requires_horovod


def quadratic_problem():
    """Two variables and a loss whose gradient is known: d/dw sum(c*w^2) = 2*c*w."""
    a = tf.Variable([1.0, -2.0], name="a")
    b = tf.Variable([[3.0]], name="b")
    coef = [tf.constant([1.0, 10.0]), tf.constant([[100.0]])]

    def loss():
        return tf.reduce_sum(coef[0] * a * a) + tf.reduce_sum(coef[1] * b * b)

    return [a, b], loss


class Recorder(dm.Optimizer):
    """Records the order in which the stages run."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def transform_loss(self, loss):
        self.calls.append("transform_loss")
        return super().transform_loss(loss)

    def get_gradients(self, loss, variables, tape):
        self.calls.append("get_gradients")
        return super().get_gradients(loss, variables, tape)

    def transform_unaggregated_gradients(self, gv):
        self.calls.append("transform_unaggregated_gradients")
        return super().transform_unaggregated_gradients(gv)

    def aggregate_gradients(self, gv):
        self.calls.append("aggregate_gradients")
        return super().aggregate_gradients(gv)

    def transform_gradients(self, gv):
        self.calls.append("transform_gradients")
        return super().transform_gradients(gv)

    def apply_updates(self, gv):
        self.calls.append("apply_updates")
        return super().apply_updates(gv)


ALL_STAGES = ["transform_loss", "get_gradients", "transform_unaggregated_gradients",
              "aggregate_gradients", "transform_gradients", "apply_updates"]


def test_minimize_runs_the_six_stages_in_order():
    v, loss = quadratic_problem()
    opt = Recorder(keras.optimizers.SGD(0.1))
    opt.minimize(loss, v)
    assert opt.calls == ALL_STAGES


def test_apply_gradients_runs_the_last_four_and_aggregate_false_skips_two():
    v, _ = quadratic_problem()
    opt = Recorder(keras.optimizers.SGD(0.1))
    opt.apply_gradients([(tf.ones_like(x), x) for x in v])
    assert opt.calls == ALL_STAGES[2:]
    opt.calls.clear()
    opt.apply_gradients([(tf.ones_like(x), x) for x in v], aggregate=False)
    assert opt.calls == ["transform_gradients", "apply_updates"]


@pytest.mark.parametrize("use_function", [False, True])
@pytest.mark.parametrize("with_tape", [False, True])
def test_minimize_matches_keras_update_rule(use_function, with_tape):
    """Without transforms, one step equals the bare Keras optimizer's step."""
    v, loss = quadratic_problem()
    v_ref = [tf.Variable(x) for x in v]
    opt = dm.Optimizer(keras.optimizers.Adam(0.1))
    ref = keras.optimizers.Adam(0.1)

    def step():
        if with_tape:
            with tf.GradientTape() as tape:
                value = loss()
            opt.minimize(value, v, tape=tape)
        else:
            opt.minimize(loss, v)

    if use_function:
        step = tf.function(step)
    for _ in range(3):
        step()
        ref_grads = [2 * c * x for c, x in zip([tf.constant([1.0, 10.0]), tf.constant([[100.0]])], v_ref)]
        ref.apply_gradients(zip(ref_grads, v_ref))
    for x, y in zip(v, v_ref):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=0, atol=1e-6)
    assert int(opt.iterations.numpy()) == 3


def test_transform_loss_is_recorded_by_the_tape_and_sequences_apply_in_order():
    order = []

    def double(loss):
        order.append("double")
        return loss * 2.0

    def plus_one(loss):
        order.append("plus_one")
        return loss + 1.0

    v = tf.Variable(1.0)
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_loss=[double, plus_one])
    opt.minimize(lambda: v * v, [v])
    assert order == ["double", "plus_one"]
    # d/dv (2 v^2 + 1) = 4 v = 4 -> v = 1 - 0.1 * 4
    assert float(v.numpy()) == pytest.approx(0.6, abs=1e-7)


def test_none_gradients_pass_through():
    used, unused = tf.Variable(1.0), tf.Variable(5.0)
    seen = []

    def look(gv):
        seen.append([g is None for g, _ in gv])
        return gv

    opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=[look, dm.clip_by_global_norm(10.0)])
    opt.minimize(lambda: used * 3.0, [used, unused])
    assert seen == [[False, True]]
    assert float(unused.numpy()) == 5.0
    assert float(used.numpy()) == pytest.approx(0.7)


def test_global_norm_clipping_matches_numpy():
    v, loss = quadratic_problem()
    grads = [2 * np.array([1.0, 10.0]) * np.array([1.0, -2.0]), 2 * 100.0 * np.array([[3.0]])]
    norm = np.sqrt(sum(np.sum(g * g) for g in grads))
    clip = dm.clip_by_global_norm(1.0)
    opt = dm.Optimizer(keras.optimizers.SGD(1.0), transform_gradients=clip)
    before = [x.numpy().copy() for x in v]
    opt.minimize(loss, v)
    for x, b, g in zip(v, before, grads):
        np.testing.assert_allclose(x.numpy(), b - g / norm, rtol=1e-6)
    stats = clip.stats()
    assert float(stats["global_norm"]) == pytest.approx(norm, rel=1e-6)
    assert float(stats["clipped"]) == 1.0
    assert float(stats["clipped_steps"]) == 1.0


def test_global_norm_not_clipped_below_threshold():
    v = tf.Variable([0.3, 0.4])
    clip = dm.clip_by_global_norm(10.0)
    opt = dm.Optimizer(keras.optimizers.SGD(1.0), transform_gradients=clip)
    opt.apply_gradients([(tf.constant([0.3, 0.4]), v)])
    np.testing.assert_allclose(v.numpy(), [0.0, 0.0], atol=1e-7)
    assert float(clip.stats()["clipped"]) == 0.0
    assert float(clip.stats()["global_norm"]) == pytest.approx(0.5)


def test_global_norm_accumulates_half_precision_in_float32():
    g16 = tf.constant([300.0, 400.0], tf.float16)  # squares overflow float16 (max 65504)
    assert not np.isfinite(float(tf.reduce_sum(tf.square(g16))))
    norm = dm.global_norm([g16, None, tf.constant([0.0], tf.bfloat16)])
    assert norm.dtype == tf.float32
    assert float(norm) == pytest.approx(500.0)
    out = dm.clip_by_global_norm(50.0)([(g16, tf.Variable([0.0, 0.0], dtype=tf.float16))])
    assert out[0][0].dtype == tf.float16
    np.testing.assert_allclose(out[0][0].numpy().astype(np.float32), [30.0, 40.0], rtol=1e-3)


def test_indexed_slices_norm_and_clipping_equal_the_dense_gradient():
    # Repeated index 1, as after an all-gather of two replicas' sparse gradients.
    sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                              tf.constant([1, 3, 1]), tf.constant([4, 2]))
    dense = tf.convert_to_tensor(sparse)
    assert float(dm.global_norm([sparse])) == pytest.approx(float(tf.norm(dense)))
    var = tf.Variable(tf.zeros([4, 2]))
    for transform in (dm.clip_by_global_norm(2.0), dm.clip_by_norm(2.0), dm.clip_by_value(3.0)):
        [(got, _)] = transform([(sparse, var)])
        [(want, _)] = transform([(dense, var)])
        assert isinstance(got, tf.IndexedSlices)
        np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), want.numpy(), rtol=1e-6)


def test_per_tensor_clips():
    var = tf.Variable([0.0, 0.0])
    [(g, _)] = dm.clip_by_norm(1.0)([(tf.constant([3.0, 4.0]), var)])
    np.testing.assert_allclose(g.numpy(), [0.6, 0.8], rtol=1e-6)
    [(g, _)] = dm.clip_by_value(2.0)([(tf.constant([-3.0, 1.0]), var)])
    np.testing.assert_allclose(g.numpy(), [-2.0, 1.0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("use_function", [False, True])
def test_nonfinite_step_is_skipped_not_written(bad, use_function):
    v = tf.Variable([1.0, 2.0])
    clip = dm.clip_by_global_norm(1.0)
    opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=clip)

    def step(g):
        opt.apply_gradients([(g, v)])

    if use_function:
        step = tf.function(step)
    step(tf.constant([0.5, 0.5]))
    after_good = v.numpy().copy()
    slots = [s.numpy().copy() for s in opt.inner_optimizer.variables]
    step(tf.constant([bad, 0.5]))
    np.testing.assert_array_equal(v.numpy(), after_good)
    for s, before in zip(opt.inner_optimizer.variables, slots):
        np.testing.assert_array_equal(s.numpy(), before)
    assert int(opt.iterations.numpy()) == 1
    assert int(opt.skipped_steps.numpy()) == 1
    stats = clip.stats()
    assert float(stats["nonfinite_steps"]) == 1.0 and float(stats["steps"]) == 1.0


def test_guarded_update_without_a_strategy_is_one_unlowered_if():
    """On one device (no strategy; each Horovod process), the guarded update is one If
    op that TensorFlow keeps whole: one kernel, not a Switch and an Identity per input
    (the guard cost 11% under Horovod when lowered). Wrappers' own schedules
    (SWA's snapshot, inside it) do not change that."""
    v = tf.Variable([1.0, 2.0])
    opt = dm.SWA(dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=dm.clip_by_global_norm(1.0)),
                 average_period=2)

    @tf.function
    def step(g):
        opt.apply_gradients([(g, v)])

    step(tf.constant([0.5, 0.5]))
    graph = step.get_concrete_function(tf.constant([0.5, 0.5])).graph
    ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert [op.get_attr("_lower_using_switch_merge") for op in ifs] == [False]
    after_good = v.numpy().copy()
    step(tf.constant([float("nan"), 0.5]))
    np.testing.assert_array_equal(v.numpy(), after_good)
    assert int(opt.iterations.numpy()) == 1 and int(opt.skipped_steps.numpy()) == 1


def test_nonfinite_written_only_when_asked():
    v = tf.Variable([1.0])
    opt = dm.Optimizer(keras.optimizers.SGD(0.1), skip_nonfinite=False)
    opt.apply_gradients([(tf.constant([float("nan")]), v)])
    assert np.isnan(v.numpy()[0])


def test_keras_surface_delegates_to_inner():
    inner = keras.optimizers.SGD(0.1)
    opt = dm.Optimizer(inner)
    assert opt.iterations is inner.iterations
    opt.learning_rate = 0.5
    assert float(inner.learning_rate.numpy()) == 0.5
    v = [tf.Variable([1.0])]
    opt.build(v)
    assert all(any(x is y for y in opt.variables) for x in inner.variables)


def test_config_round_trip():
    opt = dm.Optimizer(
        keras.optimizers.Adam(0.003, beta_1=0.8),
        transform_unaggregated_gradients=dm.clip_by_value(5.0),
        aggregate_gradients="strategy",
        transform_gradients=[dm.clip_by_norm(3.0), dm.clip_by_global_norm(1.5)],
        skip_nonfinite=False,
        name="my_opt",
    )
    config = opt.get_config()
    again = dm.Optimizer.from_config(config)
    assert again.get_config() == config
    assert isinstance(again.inner_optimizer, keras.optimizers.Adam)
    assert again.inner_optimizer.beta_1 == 0.8
    assert [type(t).__name__ for t in again.transforms] == [
        "ClipByValue", "StrategyAggregator", "ClipByNorm", "ClipByGlobalNorm"]
    assert again.transforms[-1].clip_norm == 1.5
    assert again.skip_nonfinite is False
    # Through Keras's generic serialisation too.
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is dm.Optimizer and restored.get_config() == config


def _fit_model(opt, epochs=1):
    x, y = P.make_data()
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=opt)
    model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=epochs, verbose=0, shuffle=False)
    return model, x, y


def test_keras_model_save_and_load(tmp_path):
    opt = dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(0.5))
    model, x, y = _fit_model(opt)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is dm.Optimizer
    assert loaded.optimizer.get_config() == opt.get_config()
    want, got = opt.variables, loaded.optimizer.variables
    assert len(want) == len(got)
    assert int(loaded.optimizer.iterations.numpy()) == P.STEPS
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.name)
    # Training continues identically from the loaded model.
    model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    assert P.max_abs_diff(P.weights(model), P.weights(loaded)) == 0.0


def test_checkpoint_resume_continues_exactly(tmp_path):
    x, y = P.make_data(steps=4)

    def make():
        model = P.make_model(keras)
        clip = dm.clip_by_global_norm(0.5)
        opt = dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=clip)
        opt.build(model.trainable_variables)
        return model, opt, clip

    def train(model, opt, batches):
        P.train_batches(model, opt, x, y, batches)

    model_a, opt_a, clip_a = make()
    train(model_a, opt_a, [0, 1])
    ckpt = tf.train.Checkpoint(model=model_a, optimizer=opt_a)
    path = ckpt.save(os.path.join(tmp_path, "ckpt"))
    opt_a.apply_gradients([(tf.fill(v.shape, np.nan), v) for v in model_a.trainable_variables])  # skipped
    train(model_a, opt_a, [2, 3])

    model_b, opt_b, clip_b = make()
    tf.train.Checkpoint(model=model_b, optimizer=opt_b).restore(path).assert_consumed()
    assert int(opt_b.iterations.numpy()) == 2
    assert float(clip_b.stats()["steps"]) == 2.0
    opt_b.apply_gradients([(tf.fill(v.shape, np.nan), v) for v in model_b.trainable_variables])
    train(model_b, opt_b, [2, 3])

    assert P.max_abs_diff(P.weights(model_a), P.weights(model_b)) == 0.0
    for va, vb in zip(opt_a.variables, opt_b.variables):
        np.testing.assert_array_equal(va.numpy(), vb.numpy())
    assert int(opt_b.skipped_steps.numpy()) == 1


def test_wrappers_stack_outermost_first_and_delegate_state():
    order = []

    class Tag(dm.OptimizerWrapper):
        def __init__(self, optimizer, tag, **kw):
            super().__init__(optimizer, **kw)
            self.tag = tag

        def transform_loss(self, loss):
            order.append(self.tag)
            return super().transform_loss(loss)

        def transform_gradients(self, gv):
            order.append(self.tag + ":g")
            return super().transform_gradients(gv)

    base = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=dm.clip_by_global_norm(1.0))
    stack = Tag(Tag(base, "inner"), "outer")
    v = tf.Variable(3.0)
    stack.minimize(lambda: v * v, [v])
    assert order == ["outer", "inner", "outer:g", "inner:g"]
    assert stack.iterations is base.iterations
    assert float(v.numpy()) == pytest.approx(2.9)  # grad 6 clipped to 1
    assert set(stack.gradient_stats()) >= {"global_norm", "skipped_steps"}


def test_wrapper_config_round_trip():
    stack = dm.OptimizerWrapper(dm.Optimizer(keras.optimizers.SGD(0.2)), name="w")
    again = keras.optimizers.deserialize(keras.optimizers.serialize(stack))
    assert type(again) is dm.OptimizerWrapper
    assert type(again.wrapped) is dm.Optimizer
    assert again.get_config() == stack.get_config()


def test_gradient_stats_logger_reports_epoch_means(capsys):
    clip = dm.clip_by_global_norm(0.5)
    opt = dm.Optimizer(keras.optimizers.SGD(0.01), transform_gradients=clip)
    x, y = P.make_data()
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=opt)
    history = model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                        callbacks=[dm.callbacks.GradientStatsLogger(verbose=True)])
    logs = history.history
    assert logs["clipped_share"] == [1.0, 1.0]
    assert logs["skipped_steps"] == [0, 0]
    total = float(clip.stats()["norm_sum"])
    assert sum(logs["grad_norm"]) * P.STEPS == pytest.approx(total, rel=1e-6)
    assert "grad_norm=" in capsys.readouterr().out


@pytest.mark.parametrize("use_function", [False, True])
def test_overflowing_global_norm_is_skipped_and_counted(use_function):
    """Defect: finite float32 gradients whose norm overflows (elements ~1e19) gave a clip
    factor 0 and an APPLIED all-zero step (iterations advanced, Adam's moments decayed)."""
    v = tf.Variable([1.0, 2.0])
    clip = dm.clip_by_global_norm(1.0)
    opt = dm.Optimizer(keras.optimizers.Adam(0.1), transform_gradients=clip)
    opt.build([v])
    step = (lambda g: opt.apply_gradients([(g, v)]))
    if use_function:
        step = tf.function(step)
    step(tf.constant([0.5, -0.5]))
    moments = [np.array(x) for x in opt.inner_optimizer.variables]
    after_first = np.array(v)
    big = tf.constant([3e19, 3e19])
    assert np.isfinite(big.numpy()).all() and not np.isfinite(float(tf.norm(big)))
    step(big)
    np.testing.assert_array_equal(np.array(v), after_first)
    for before, now in zip(moments, opt.inner_optimizer.variables):
        np.testing.assert_array_equal(before, np.array(now))
    assert int(opt.iterations.numpy()) == 1
    assert int(opt.skipped_steps.numpy()) == 1
    assert float(clip.stats()["nonfinite_steps"]) == 1.0


@requires_horovod
def test_horovod_aggregator_options_survive_config():
    from dist_minimize.aggregation.horovod import DEFAULT_PACK_BELOW

    agg = dm.aggregation.HorovodAggregator(reduction="sum", bytes_per_pack=4096, pack_below=512)
    again = dm.aggregation.HorovodAggregator.from_config(agg.get_config())
    assert (again.reduction, again.bytes_per_pack, again.pack_below) == ("sum", 4096, 512)
    # A config written before `pack_below` existed loads with the default.
    old = {k: v for k, v in agg.get_config().items() if k != "pack_below"}
    assert dm.aggregation.HorovodAggregator.from_config(old).pack_below == DEFAULT_PACK_BELOW


def test_strategy_aggregator_options_survive_config_and_keras_file(tmp_path):
    """Defect: StrategyAggregator(options=...) was serialised as the bare name "strategy"."""
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=1024, timeout_seconds=30.0,
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    opt = dm.Optimizer(keras.optimizers.SGD(0.1),
                       aggregate_gradients=dm.aggregation.StrategyAggregator(options=options))
    again = dm.Optimizer.from_config(opt.get_config())
    [agg] = [t for t in again.transforms if isinstance(t, dm.aggregation.StrategyAggregator)]
    assert (agg.options.bytes_per_pack, agg.options.timeout_seconds, agg.options.implementation.name) == (
        1024, 30.0, "RING")
    model, _, _ = _fit_model(opt)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    [loaded] = [t for t in keras.models.load_model(path).optimizer.transforms
                if isinstance(t, dm.aggregation.StrategyAggregator)]
    assert loaded.options.implementation.name == "RING" and loaded.options.bytes_per_pack == 1024
    # Default options still serialise as the plain name.
    assert dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="strategy").get_config()[
        "aggregate_gradients"] == ["strategy"]
    with pytest.raises(TypeError, match="options=3"):
        dm.aggregation.StrategyAggregator(options=3)


WEIGHT_DECAY_OPTIMIZERS = ["SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam",
                           "Lion", "Adafactor", "Lamb"]  # Ftrl moves a variable to 0 on zero gradients


@pytest.mark.parametrize("name", WEIGHT_DECAY_OPTIMIZERS)
@pytest.mark.parametrize("wrapped", [False, True])
def test_exclude_from_weight_decay_reaches_the_update_rule(name, wrapped):
    """Defect: `exclude_from_weight_decay` on a dm.Optimizer was silently ignored (the inner
    optimizer decayed the excluded variables: 1.992 instead of 2.0). Keras's own
    test_weight_decay, with each optimizer wrapped."""
    var1, var2, var3 = (keras.Variable(2.0), keras.Variable(2.0, name="exclude"), keras.Variable(2.0))
    inner = getattr(keras.optimizers, name)(learning_rate=1.0, weight_decay=0.004)
    opt = dm.Optimizer(inner)
    if wrapped:
        opt = dm.GradientAccumulation(opt, 1)
    opt.exclude_from_weight_decay(var_list=[var3], var_names=["exclude"])
    grads = [tf.zeros(()) for _ in range(3)]
    opt.apply_gradients(zip(grads, [var1, var2, var3]))
    assert float(var1.numpy()) == pytest.approx(1.992, abs=1e-6)
    assert float(var2.numpy()) == 2.0
    assert float(var3.numpy()) == 2.0


class _MicrobatchGradients(dm.Optimizer):
    """Overrides get_gradients (e.g. per-example gradients for DP-SGD)."""

    def get_gradients(self, loss, variables, tape):
        return [(None if g is None else 2.0 * g, v) for g, v in super().get_gradients(loss, variables, tape)]


@pytest.mark.parametrize("wrapped", [False, True])
def test_fit_refuses_an_overridden_get_gradients_it_would_skip(wrapped):
    """Defect: Keras's fit never calls get_gradients, so an override was silently ignored."""
    opt = _MicrobatchGradients(keras.optimizers.SGD(0.1))
    if wrapped:
        opt = dm.LossScaleOptimizer(opt)
    x, y = P.make_data()
    model = P.make_model(keras)
    model.compile(loss="mse", optimizer=opt)
    before = P.weights(model)
    with pytest.raises(RuntimeError, match="_MicrobatchGradients overrides `get_gradients`.*minimize"):
        model.fit(x, y, batch_size=P.GLOBAL_BATCH, epochs=1, verbose=0)
    assert P.max_abs_diff(before, P.weights(model)) == 0.0
    # The same optimizer in a custom loop runs the override.
    v = tf.Variable([1.0])
    custom = _MicrobatchGradients(keras.optimizers.SGD(0.1), aggregate_gradients="none")
    custom.minimize(lambda: tf.reduce_sum(v), [v])
    assert float(v.numpy()[0]) == pytest.approx(1.0 - 0.1 * 2.0)


def test_fit_with_default_stages_still_trains():
    opt = dm.LossScaleOptimizer(dm.Optimizer(keras.optimizers.SGD(0.1)))
    model, _, _ = _fit_model(opt)
    assert int(opt.iterations.numpy()) == P.STEPS
