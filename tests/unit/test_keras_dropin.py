"""A Keras optimizer configured with Keras's own settings, wrapped as it is.

`dist_minimize.Optimizer(keras_optimizer)` translates `clipnorm`, `clipvalue`,
`global_clipnorm`, `use_ema` (`ema_momentum`, `ema_overwrite_frequency`),
`gradient_accumulation_steps` and `loss_scale_factor` into dist_minimize features.
Each is held to two single-device references of Keras's rule over several steps: NumPy,
and stock Keras with the same setting (no dist_minimize code). Each reference is also
checked to tell the right rule from a plausible wrong one (clip not firing, clip order,
Keras's EMA off by one step, clipping each micro-step), so the comparison can fail.
Tolerance: float32 over <= 9 steps of O(1) values: 1e-5 (observed ~1e-7).
(The MirroredStrategy check, clipping after aggregation on 2 replicas, is in
tests/distributed/test_keras_dropin_mirrored.py.)
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import dist_minimize as dm

TOL = 1e-5
# Quadratic problem: loss = sum_i 0.5 * sum(A_i * (w_i - T_i)**2), gradient A_i * (w_i - T_i).
A = [np.array([1.0, 3.0, 0.5], "float32"), np.array([[2.0, 0.2], [1.5, 4.0]], "float32")]
T = [np.array([2.0, -1.0, 4.0], "float32"), np.array([[0.5, 1.0], [-2.0, 0.0]], "float32")]
W0 = [np.array([-3.0, 4.0, 1.0], "float32"), np.array([[3.0, -2.0], [2.0, 1.5]], "float32")]
LR = 0.2


def variables():
    return [tf.Variable(w) for w in W0]


def grads_of(ws, scale=1.0):
    return [scale * a * (w - t) for a, w, t in zip(A, ws, T)]


def loss_fn(vs, scale=1.0):
    return lambda: tf.add_n([tf.reduce_sum(0.5 * scale * a * tf.square(v - t)) for a, v, t in zip(A, vs, T)])


def run_dm(opt, steps, vs=None, scale=1.0):
    """minimize() on the quadratic; returns the weights after each step."""
    vs = vs or variables()
    out = []
    for _ in range(steps):
        opt.minimize(loss_fn(vs, scale), vs)
        out.append([v.numpy() for v in vs])
    return out


def run_stock(opt, steps, scale=1.0):
    """Stock Keras: its own tape and apply_gradients (Keras's rule, no dist_minimize)."""
    vs = variables()
    out = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(loss_fn(vs, scale)())
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
        out.append([v.numpy() for v in vs])
    return out


def diff(a, b):
    return max(float(np.max(np.abs(x - y))) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


# -- clipping: NumPy references of Keras's three rules ---------------------------------


def clip_rule(setting, c, gs):
    """Keras's `_clip_gradients` rule (returns the clipped gradients and whether it fired)."""
    if setting == "clipnorm":
        norms = [np.linalg.norm(g) for g in gs]
        return [g * c / max(n, c) for g, n in zip(gs, norms)], any(n > c for n in norms)
    if setting == "clipvalue":
        return [np.clip(g, -c, c) for g in gs], any(np.max(np.abs(g)) > c for g in gs)
    n = np.sqrt(sum(np.sum(g * g) for g in gs))
    return [g * c / max(n, c) for g in gs], n > c


def numpy_sgd(steps, transform=lambda gs: (gs, False), scale_first=1.0):
    ws = [w.copy() for w in W0]
    out, fired = [], []
    for _ in range(steps):
        gs, f = transform([scale_first * g for g in grads_of(ws)])
        fired.append(f)
        ws = [w - LR * g for w, g in zip(ws, gs)]
        out.append([w.copy() for w in ws])
    return out, fired


CLIPS = {"clipnorm": 4.0, "clipvalue": 4.0, "global_clipnorm": 6.0}
FACTORY = {"clipnorm": dm.clip_by_norm, "clipvalue": dm.clip_by_value, "global_clipnorm": dm.clip_by_global_norm}
STEPS = 8


@pytest.mark.parametrize("setting", sorted(CLIPS))
def test_keras_clipping_becomes_the_clipper_after_aggregation(setting):
    c = CLIPS[setting]
    opt = dm.Optimizer(keras.optimizers.SGD(LR, **{setting: c}))
    assert isinstance(opt, dm.Optimizer)
    [clipper] = [fn for fn in opt.transforms if isinstance(fn, type(FACTORY[setting](c)))]
    assert getattr(clipper, "clip_value" if setting == "clipvalue" else "clip_norm") == c
    assert getattr(opt, setting) == c  # reading the Keras attribute reports the stack's clip
    assert getattr(opt.inner_optimizer, setting) is None  # Keras's own copy is off

    ref, fired = numpy_sgd(STEPS, lambda gs: clip_rule(setting, c, gs))
    assert any(fired) and not all(fired), fired  # clipped steps and unclipped ones
    unclipped, _ = numpy_sgd(STEPS)
    assert diff(ref, unclipped) > 0.1  # the clip matters
    got = run_dm(opt, STEPS)
    assert diff(got, ref) <= TOL
    stock = run_stock(keras.optimizers.SGD(LR, **{setting: c}), STEPS)
    assert diff(got, stock) <= TOL


@pytest.mark.parametrize("setting", sorted(CLIPS))
def test_the_translated_clipper_runs_after_the_users_transforms(setting):
    """Keras clips the final gradients right before its update rule: a user transform in
    `transform_gradients` (here: times 10) runs first, the translated clipper last."""
    c = CLIPS[setting]

    def times_ten(gv):
        return [(g * 10.0, v) for g, v in gv]

    opt = dm.Optimizer(keras.optimizers.SGD(LR, **{setting: c}), transform_gradients=times_ten)
    assert opt.transforms[-1].__class__ is type(FACTORY[setting](c))
    ref, _ = numpy_sgd(STEPS, lambda gs: clip_rule(setting, c, gs), scale_first=10.0)
    wrong_order, _ = numpy_sgd(STEPS, lambda gs: ([10.0 * g for g in clip_rule(setting, c, gs)[0]], False))
    assert diff(ref, wrong_order) > 0.1
    assert diff(run_dm(opt, STEPS), ref) <= TOL


def test_keras_clipping_next_to_an_explicit_clipper_is_refused():
    with pytest.raises(ValueError, match=r"`global_clipnorm=1.0`.*ClipByGlobalNorm.*Keep one"):
        dm.Optimizer(keras.optimizers.SGD(LR, global_clipnorm=1.0), transform_gradients=dm.clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match=r"`clipvalue=0.5`.*ClipByNorm"):
        dm.Optimizer(keras.optimizers.SGD(LR, clipvalue=0.5), transform_gradients=[dm.clip_by_norm(2.0)])
    # A per-replica clipper (before aggregation) is the user's explicit choice: allowed.
    opt = dm.Optimizer(keras.optimizers.SGD(LR, clipnorm=1.0), transform_unaggregated_gradients=dm.clip_by_value(5.0))
    assert opt.clipnorm == 1.0


# -- use_ema ----------------------------------------------------------------------------


def numpy_ema(steps, momentum, frequency, first_step_is_weights=True, sgd_momentum=0.5):
    """Keras 3's rule (base_optimizer._backend_apply_gradients): after the n-th update
    (SGD with momentum here), the average is the weights if n == 1, else
    m * average + (1 - m) * w; if n % frequency == 0 the weights become the average.
    `first_step_is_weights=False` is the off-by-one variant (the average starts at the
    initial weights and moves from the first update on)."""
    ws = [w.copy() for w in W0]
    avg = [w.copy() for w in W0]
    vel = [np.zeros_like(w) for w in W0]
    out = []
    for n in range(1, steps + 1):
        gs = grads_of(ws)
        vel = [sgd_momentum * v - LR * g for v, g in zip(vel, gs)]
        ws = [w + v for w, v in zip(ws, vel)]
        m = 0.0 if (n == 1 and first_step_is_weights) else momentum
        avg = [m * a + (1 - m) * w for a, w in zip(avg, ws)]
        if frequency and n % frequency == 0:
            ws = [a.copy() for a in avg]
        out.append(([w.copy() for w in ws], [a.copy() for a in avg]))
    return out


@pytest.mark.parametrize("frequency", [None, 3])
def test_keras_use_ema_becomes_moving_average_with_keras_rule(frequency):
    def keras_opt():
        return keras.optimizers.SGD(LR, momentum=0.5, use_ema=True, ema_momentum=0.8,
                                    ema_overwrite_frequency=frequency)

    opt = dm.Optimizer.from_keras(keras_opt())
    assert isinstance(opt, dm.MovingAverage) and isinstance(opt.stack()[-1], dm.Optimizer)
    assert (opt.average_decay, opt.start_step, opt.overwrite_frequency, opt.assign_on_finalize) == (
        0.8, 1, frequency, True)
    assert (opt.use_ema, opt.ema_momentum, opt.ema_overwrite_frequency) == (True, 0.8, frequency)
    inner = opt.stack()[-1].inner_optimizer
    assert inner.use_ema is False and inner.ema_overwrite_frequency is None

    steps = 7
    ref = numpy_ema(steps, 0.8, frequency)
    off_by_one = numpy_ema(steps, 0.8, frequency, first_step_is_weights=False)
    assert diff([a for _, a in ref], [a for _, a in off_by_one]) > 1e-2  # the reference can tell

    vs = variables()
    stock = keras_opt()
    svs = variables()
    for n in range(steps):
        opt.minimize(loss_fn(vs), vs)
        with tf.GradientTape() as tape:
            loss = loss_fn(svs)()
        stock.apply_gradients(zip(tape.gradient(loss, svs), svs))
        w_ref, avg_ref = ref[n]
        assert diff([[v.numpy() for v in vs]], [w_ref]) <= TOL, n
        assert diff([[opt.average_of(v).numpy() for v in vs]], [avg_ref]) <= TOL, n
        assert diff([[v.numpy() for v in vs]], [[v.numpy() for v in svs]]) <= TOL, n  # stock Keras weights
    # Keras's fit ends with finalize_variable_values: the averages go into the weights.
    opt.finalize_variable_values(vs)
    stock.finalize_variable_values(svs)
    assert diff([[v.numpy() for v in vs]], [ref[-1][1]]) <= TOL
    assert diff([[v.numpy() for v in vs]], [[v.numpy() for v in svs]]) <= TOL
    # Inner optimizer: no averages of its own (Keras names them "..._average").
    assert not [v for v in inner.variables if "average" in v.name]


def small_model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def fit(optimizer, epochs=2, seed=3):
    model = small_model(seed)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = (3.0 * rng.normal(size=(24, 1))).astype("float32")
    model.compile(loss="mse", optimizer=optimizer)
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model


def test_use_ema_in_fit_ends_with_the_averages_like_keras():
    model = fit(dm.Optimizer.from_keras(keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.7)))
    stock = fit(keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.7))
    plain = fit(keras.optimizers.Adam(0.05))
    assert diff([model.get_weights()], [stock.get_weights()]) <= TOL
    assert diff([model.get_weights()], [plain.get_weights()]) > 1e-3  # the averaging is visible
    opt = model.optimizer
    assert diff([model.get_weights()], [[opt.average_of(v).numpy() for v in model.trainable_variables]]) <= TOL


# -- gradient_accumulation_steps ----------------------------------------------------------


def micro_targets(j):
    """Different targets per micro-step, so accumulation's mean matters."""
    return [t + (j % 3 - 1) * 3.0 for t in T]


def micro_loss(vs, j, scale=1.0):
    ts = micro_targets(j)
    return lambda: tf.add_n([tf.reduce_sum(0.5 * scale * a * tf.square(v - t)) for a, v, t in zip(A, vs, ts)])


def numpy_accumulation(k, micro_steps, c, clip_each_micro_step=False):
    ws = [w.copy() for w in W0]
    acc = [np.zeros_like(w) for w in W0]
    out, fired = [], []
    for j in range(micro_steps):
        gs = [a * (w - t) for a, w, t in zip(A, ws, micro_targets(j))]
        if clip_each_micro_step:
            gs, _ = clip_rule("global_clipnorm", c, gs)
        acc = [x + g for x, g in zip(acc, gs)]
        if (j + 1) % k == 0:
            mean = [x / k for x in acc]
            if not clip_each_micro_step:
                mean, f = clip_rule("global_clipnorm", c, mean)
                fired.append(f)
            ws = [w - LR * g for w, g in zip(ws, mean)]
            acc = [np.zeros_like(w) for w in W0]
        out.append([w.copy() for w in ws])
    return out, fired


def test_keras_gradient_accumulation_becomes_gradient_accumulation():
    k, micro_steps, c = 3, 12, 10.0

    def keras_opt():
        return keras.optimizers.SGD(LR, gradient_accumulation_steps=k, global_clipnorm=c)

    opt = dm.Optimizer.from_keras(keras_opt())
    assert isinstance(opt, dm.GradientAccumulation) and opt.steps == k
    assert (opt.gradient_accumulation_steps, opt.global_clipnorm) == (k, c)
    inner = opt.stack()[-1].inner_optimizer
    assert inner.gradient_accumulation_steps is None and inner.global_clipnorm is None

    ref, fired = numpy_accumulation(k, micro_steps, c)
    assert any(fired) and not all(fired), fired
    per_micro_step, _ = numpy_accumulation(k, micro_steps, c, clip_each_micro_step=True)
    assert diff(ref, per_micro_step) > 1e-2

    vs, svs, stock = variables(), variables(), keras_opt()
    for j in range(micro_steps):
        opt.minimize(micro_loss(vs, j), vs)
        with tf.GradientTape() as tape:
            loss = micro_loss(svs, j)()
        stock.apply_gradients(zip(tape.gradient(loss, svs), svs))
        assert diff([[v.numpy() for v in vs]], [ref[j]]) <= TOL, j
        assert diff([[v.numpy() for v in vs]], [[v.numpy() for v in svs]]) <= TOL, j
        assert int(opt.iterations.numpy()) == int(stock.iterations.numpy()) == (j + 1) // k
    assert not [v for v in inner.variables if "accumulator" in v.name]  # Keras's own accumulators: none


# -- loss_scale_factor --------------------------------------------------------------------


def test_keras_loss_scale_factor_becomes_a_fixed_loss_scale():
    s = 256.0

    def keras_opt():
        return keras.optimizers.SGD(LR, loss_scale_factor=s, clipnorm=2.0)

    opt = dm.Optimizer.from_keras(keras_opt())
    assert isinstance(opt, dm.LossScaleOptimizer) and (opt.initial_scale, opt.dynamic) == (s, False)
    assert opt.loss_scale_factor == s and opt.clipnorm == 2.0
    assert opt.stack()[-1].inner_optimizer.loss_scale_factor is None
    assert float(opt.scale_loss(2.0)) == 2.0 * s == float(keras_opt().scale_loss(2.0))
    # Keras unscales before clipping: the clip sees the true gradients.
    ref, fired = numpy_sgd(STEPS, lambda gs: clip_rule("clipnorm", 2.0, gs))
    assert any(fired)
    got = run_dm(opt, STEPS)
    assert diff(got, ref) <= TOL
    assert diff(got, run_stock(keras_opt(), STEPS)) <= TOL


# -- what the translation leaves: settings off, one log line, configs --------------------


def test_the_inner_optimizer_never_clips_averages_or_accumulates_itself():
    keras_opt = keras.optimizers.Adam(0.1, clipvalue=0.5, use_ema=True, ema_overwrite_frequency=2)
    opt = dm.Optimizer.from_keras(keras_opt)
    inner = opt.stack()[-1].inner_optimizer
    assert inner is keras_opt
    assert (inner.clipnorm, inner.clipvalue, inner.global_clipnorm, inner.use_ema,
            inner.gradient_accumulation_steps, inner.loss_scale_factor, inner.ema_overwrite_frequency) == (
        None, None, None, False, None, None, None)
    vs = variables()
    run_dm(opt, 2, vs)
    names = [v.name for v in inner.variables]
    assert len(names) == 2 + 2 * len(vs), names  # iteration, learning_rate, Adam's two slots per variable
    assert not [n for n in names if "average" in n or "accumulator" in n], names
    # Nor do the dist_minimize optimizers build Keras's averages or accumulators: the only
    # averages of the stack are the MovingAverage's, one per variable.
    assert len([v for v in opt.variables if "average" in v.name]) == len(vs)
    assert not [v for v in opt.variables if "accumulator" in v.name]


def test_the_translation_is_logged_once_per_optimizer(caplog):
    caplog.set_level(logging.INFO, logger="dist_minimize")
    opt = dm.Optimizer.from_keras(keras.optimizers.SGD(LR, clipnorm=1.0, use_ema=True, ema_momentum=0.9, name="my_sgd"))
    run_dm(opt, 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "dist_minimize" and "dist_minimize.Optimizer(" in r.getMessage()]
    assert len(lines) == 2, lines  # the wrapper settings (from_keras), then the clip (the Optimizer)
    assert lines[0].startswith("dist_minimize.Optimizer(SGD 'my_sgd'): use_ema=True, ema_momentum=0.9, "
                               "ema_overwrite_frequency=None -> dist_minimize.MovingAverage(")
    assert lines[1].startswith("dist_minimize.Optimizer(SGD 'my_sgd'): clipnorm=1.0 -> transform_gradients += "
                               "dist_minimize.clip_by_norm(1.0)")
    caplog.clear()
    dm.Optimizer(keras.optimizers.SGD(LR))  # nothing to translate: no line
    keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))  # already translated
    assert not [r for r in caplog.records if "dist_minimize.Optimizer(" in r.getMessage()]


CASES = {
    "clipnorm": lambda: keras.optimizers.SGD(LR, clipnorm=2.0),
    "clipvalue": lambda: keras.optimizers.Adam(0.05, clipvalue=1.0),
    "global_clipnorm": lambda: keras.optimizers.SGD(LR, global_clipnorm=3.0),
    "use_ema": lambda: keras.optimizers.SGD(LR, use_ema=True, ema_momentum=0.8, ema_overwrite_frequency=3),
    "gradient_accumulation_steps": lambda: keras.optimizers.SGD(LR, gradient_accumulation_steps=2, clipnorm=2.0),
    "loss_scale_factor": lambda: keras.optimizers.SGD(LR, loss_scale_factor=64.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_round_trips_to_the_same_stack(case):
    opt = dm.Optimizer.from_keras(CASES[case]())
    config = keras.saving.serialize_keras_object(opt)
    again = keras.saving.deserialize_keras_object(config)
    assert type(again) is type(opt)
    assert keras.saving.serialize_keras_object(again) == config
    for setting in ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
                    "ema_overwrite_frequency", "gradient_accumulation_steps", "loss_scale_factor"):
        assert getattr(again, setting) == getattr(opt, setting), setting
    assert diff(run_dm(again, 6), run_dm(opt, 6)) == 0.0


def test_a_model_file_keeps_the_translated_stack(tmp_path):
    model = fit(dm.Optimizer.from_keras(keras.optimizers.Adam(0.05, use_ema=True, clipnorm=1.0)), epochs=1)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.optimizer, dm.MovingAverage) and loaded.optimizer.clipnorm == 1.0
    for v, w in zip(loaded.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(loaded.optimizer.average_of(v).numpy(), model.optimizer.average_of(w).numpy())


def test_the_keras_settings_read_on_a_stack_cannot_be_assigned_except_the_clip_bounds():
    """The clip bounds may be set, as in tf-keras (tests/unit/test_keras_settings_validation.py);
    the wrapper settings read what the stack applies and refuse assignment."""
    opt = dm.Optimizer(keras.optimizers.SGD(LR, clipnorm=1.0))
    opt.clipnorm = None
    assert opt.clipnorm is None  # the clipper stays, switched off
    with pytest.raises(TypeError, match="ema_momentum"):
        opt.ema_momentum = 0.5
    plain = dm.Optimizer(keras.optimizers.SGD(LR))
    assert (plain.clipnorm, plain.use_ema, plain.ema_momentum, plain.gradient_accumulation_steps,
            plain.loss_scale_factor) == (None, False, 0.99, None, None)


def test_setting_a_per_replica_keras_setting_is_refused_naming_what_to_use():
    """`gradient_accumulation_steps`, `use_ema` and `loss_scale_factor` act per replica in
    Keras; set on a dist_minimize optimizer they are refused, naming the wrapper to use."""
    opt = dm.Optimizer(keras.optimizers.SGD(LR))
    with pytest.raises(TypeError, match=r"GradientAccumulation\(optimizer, steps=4\).*gradient_accumulation_steps=4"):
        opt.gradient_accumulation_steps = 4
    with pytest.raises(TypeError, match=r"MovingAverage\(optimizer.*use_ema=True"):
        opt.use_ema = True
    with pytest.raises(TypeError, match=r"auto_scale_loss=False.*loss_scale_factor=None"):
        opt.loss_scale_factor = None  # what Keras's LossScaleOptimizer does to what it wraps
    opt.use_ema = False  # Keras's "off", what the stack applies: nothing to refuse
    assert opt.use_ema is False and opt.gradient_accumulation_steps is None
