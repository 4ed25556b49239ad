"""Shared problem and reference for the parity tests (also used by worker scripts).

The problem is built so that replicas' gradient norms differ a lot: the second half of
the global batch has targets 100x larger than the first, so under 2 replicas, replica 1's
gradient norm is ~100x replica 0's. The global gradient norms of the 4 steps are about
37, 52-57, 71-73 and 44-45.

Clip modes (CLIPS): "always" clips every step (clip norm 0.5): a clipped step is
`clip * g / |g|`, blind to the gradient's scale, so it alone cannot catch a SUM/MEAN or
double-aggregation mistake. "never" keeps the clipper in the pipeline with a norm no step
reaches, and "some" clips 2 of the 4 steps; with SGD at learning rate 0.01 (optimizer
name "sgd-0.01") the weights stay O(1) and a gradient off by any factor moves them by
~0.1, far above the 1e-6 tolerance. CLIPPED_STEPS gives the number of clipped steps each
mode must report.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

GLOBAL_BATCH = 16
STEPS = 4
FEATURES = 5
CLIP_NORM = 0.5
CLIPS = {"always": CLIP_NORM, "never": 1e3, "some": 48.0}
CLIPPED_STEPS = {"always": STEPS, "never": 0, "some": 2}
# Horovod cases: "OPT/MODE" clips always; "_eager" runs the custom loop eagerly.
HOROVOD_MPI_CASES = (["sgd/fit", "sgd/callable", "adam/fit", "adam/callable"]
                     + [f"sgd-0.01/{m}/{c}" for c in ("never", "some") for m in ("fit", "callable")])
HOROVOD_CASES = HOROVOD_MPI_CASES + ["sgd/callable_eager", "adam/callable_eager"]
# "OPT/MODE/CLIP" cases run under MirroredStrategy (2 and 4 replicas).
MIRRORED_CASES = ([f"{o}/{m}/always" for o in ("sgd", "adam") for m in ("fit", "callable", "tape")]
                  + [f"sgd-0.01/{m}/{c}" for c in ("never", "some") for m in ("fit", "callable", "tape")]
                  + ["adam/fit_integrated/always", "sgd-0.01/fit_integrated/never", "sgd-0.01/fit_integrated/some"]
                  # Keras's weight decay and a learning-rate schedule (read from the
                  # iterations), made device by device by the guarded update.
                  + ["adamw/tape/never", "adamw/fit/some"])
# On 4 replicas (the replica count's effect, checked once: the default profile), each
# way of driving a step once, in cases where a wrong gradient scale shows: the clip
# firing on some steps (a step clipped or not does not see the gradient's scale), or not
# at all under Keras's weight decay and schedule; and the integrated fit clipped always.
# (The other pairings run on 2 replicas; 4 replicas on this machine's 2 cores cost about
# 8 s a case.) On the other TensorFlow profiles (ci/test.sh; DM_PROFILE), 2 replicas run
# those cases and SGD/Adam clipped always: each way of driving a step on that TensorFlow,
# the whole matrix once, on the default profile.
MIRRORED_FEW_CASES = ["sgd-0.01/fit/some", "sgd-0.01/callable/some", "adamw/tape/never", "adam/fit_integrated/always"]
MIRRORED_CASES_ON = {2: MIRRORED_CASES if os.environ.get("DM_PROFILE", "default") == "default"
                     else MIRRORED_FEW_CASES + ["sgd/tape/always", "adam/callable/always"],
                     4: MIRRORED_FEW_CASES}


# Weight wrappers as the parity tests build them around an optimizer.
WEIGHT_WRAPPERS = {
    "moving_average": lambda dm, o: dm.MovingAverage(o, average_decay=0.5, dynamic_decay=True),
    "swa": lambda dm, o: dm.SWA(o, start_averaging=1, average_period=2),
    "lookahead": lambda dm, o: dm.Lookahead(o, sync_period=2, slow_step_size=0.5),
    "weight_decay": lambda dm, o: dm.DecoupledWeightDecay(o, 0.05, exclude_from_weight_decay=["bias"]),
}
# Every wrapper at once, in the documented order (2 micro-steps per update).
WEIGHT_STACK = lambda dm, o: dm.LossScaleOptimizer(dm.GradientAccumulation(dm.MovingAverage(dm.SWA(  # noqa: E731
    dm.Lookahead(dm.DecoupledWeightDecay(o, 0.05), sync_period=1), average_period=1), 0.5), steps=2),
    initial_scale=8.0)

# DifferentialPrivacy: examples' gradient norms range from 0.08 to 650, so a clip of 2.0
# leaves some unclipped on every step and clips the rest. The loss is the vector of
# per-example losses; under fit, a reduction=None loss and dm.integrate. Microbatches are
# pairs of consecutive examples whatever the replica count (replicas hold consecutive
# slices of the global batch), so every replica count sees the same microbatches.
# "dp_noise" draws noise from a fixed seed: every replica count must draw the same noise
# (its standard deviation depends on the global microbatch count only).
DP_CLIP = 2.0
DP_NOISE = 0.5
PRIVACY_WRAPPERS = {
    "dp": lambda dm, o: dm.DifferentialPrivacy(o, l2_norm_clip=DP_CLIP, noise_multiplier=0.0),
    "dp_microbatches": lambda dm, o: dm.DifferentialPrivacy(
        o, l2_norm_clip=DP_CLIP, noise_multiplier=0.0,
        num_microbatches=GLOBAL_BATCH // (2 * dm.distribute.num_replicas())),
    "dp_noise": lambda dm, o: dm.DifferentialPrivacy(o, l2_norm_clip=DP_CLIP, noise_multiplier=DP_NOISE,
                                                     seed=5),
}
PROBE_SIZE, PROBE_LR = 20000, 0.5
# More stacks `train(wrap=...)` takes by name.
EXTRA_STACKS = {
    "stack": WEIGHT_STACK,
    "loss_scale": lambda dm, o: dm.LossScaleOptimizer(o, initial_scale=8.0, dynamic=True, growth_interval=1),
}
# SAM: the loss evaluated again at perturbed weights, in "callable" and
# "fit_integrated" modes; rho large enough that a perturbation from a replica's own
# gradient would show.
SAM_WRAPPERS = {
    "sam": lambda dm, o: dm.SAM(o, rho=0.5),
    "asam_stack": lambda dm, o: dm.MovingAverage(dm.DecoupledWeightDecay(
        dm.SAM(o, rho=0.5, adaptive=True), weight_decay=0.01), average_decay=0.5),
}
SAM_CASES = [f"sam/{name}/{mode}" for name in SAM_WRAPPERS for mode in ("callable", "fit_integrated")]
# Stacks built on first use (no `build` before the first traced step) in the process
# tests (MultiWorkerMirroredStrategy, horovodrun): "lazy:WRAP/MODE/CLIP" cases.
LAZY_CASES = ["lazy:stack/tape/some", "lazy:loss_scale/callable/some", "lazy:dp/tape/some"]


def privacy_noise(strategy, dataset=None, steps: int = 2) -> dict:
    """DP-SGD's noise as it reaches the weights: a probe variable of PROBE_SIZE elements
    that the loss does not depend on moves by -PROBE_LR * noise each step. Returns the
    per-step moves, and whether every replica's copy of the probe is identical."""
    import dist_minimize as dm
    import keras
    import tensorflow as tf

    x, y = make_data(steps)
    with strategy.scope():
        model = make_model(keras)
        probe = tf.Variable(tf.zeros([PROBE_SIZE]))
        opt = dm.DifferentialPrivacy(dm.Optimizer(keras.optimizers.SGD(PROBE_LR)), l2_norm_clip=DP_CLIP,
                                     noise_multiplier=DP_NOISE, seed=9)
        variables = model.trainable_variables + [probe]
        opt.build(variables)
    if dataset is None:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if not isinstance(dataset, tf.distribute.DistributedDataset):
        dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1) + 0.0 * tf.reduce_sum(probe)
        opt.minimize(loss, variables, tape=tape)

    @tf.function
    def step(batch):
        strategy.run(replica_step, args=batch)

    moves, agree = [], True
    it = iter(dataset)
    for _ in range(steps):
        before = np.array(probe)
        step(next(it))
        moves.append(np.array(probe) - before)
        copies = [np.array(c) for c in strategy.experimental_local_results(probe)]  # each replica's copy
        assert len(copies) == strategy.num_replicas_in_sync, len(copies)
        agree = agree and all(np.array_equal(c, copies[0]) for c in copies)
    return {"moves": moves, "agree": agree, "draws": int(opt.noise_draws.numpy())}


def make_data(steps: int = STEPS, global_batch: int = GLOBAL_BATCH, seed: int = 0):
    """x: (steps*global_batch, FEATURES), y: (steps*global_batch, 1), float32.

    Within each global batch, the second half has targets scaled by 100, so a replica
    holding it has gradients ~100x larger than a replica holding the first half.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch, FEATURES)).astype("float32")
    y = rng.normal(size=(steps * global_batch, 1)).astype("float32")
    half = global_batch // 2
    for s in range(steps):
        y[s * global_batch + half:(s + 1) * global_batch] *= 100.0
    return x, y


def make_model(keras, seed: int = 1):
    """A small MLP with deterministic initial weights."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])
    return model


# Every optimizer class the installed `keras.optimizers` exports is an update rule to
# wrap, except these (each with its own test).
NOT_UPDATE_RULES = {
    "Optimizer": "the abstract base class",
    "LossScaleOptimizer": "refused by dist_minimize.Optimizer (it decides skips per replica; "
                          "dist_minimize.LossScaleOptimizer replaces it)",
}
KERAS_RULE_LR = 0.01


def keras_rule_names(keras) -> list:
    """The names of every update-rule class `keras.optimizers` exports, read from the
    installed Keras (a class a later Keras adds is included without editing a test)."""
    names = []
    for name in sorted(dir(keras.optimizers)):
        cls = getattr(keras.optimizers, name)
        if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer) and name not in NOT_UPDATE_RULES:
            names.append(name)
    return names


def keras_rule(keras, name: str):
    """`keras.optimizers.<name>` at learning rate KERAS_RULE_LR (default settings
    otherwise). MultiOptimizer routes kernels to Adam and everything else to SGD: two
    different rules, the usual fine-tuning set-up."""
    cls = getattr(keras.optimizers, name)
    if name == "MultiOptimizer":
        return cls(keras.optimizers.OptimizerMap(keras.optimizers.SGD(KERAS_RULE_LR),
                                                 {".*/kernel": keras.optimizers.Adam(KERAS_RULE_LR)}))
    return cls(learning_rate=KERAS_RULE_LR)


def keras_rule_cases(keras) -> list:
    """Parity cases "keras.NAME/MODE/CLIP" for every exported update rule: a custom loop
    with CLIP "some" (the clipper fires on 2 of 4 steps, so a wrong gradient scale shows
    even for scale-invariant rules such as Adam), and `fit` with no clipper ("none"),
    which is also compared with stock Keras's `fit` on one device (fit ends with
    `finalize_variable_values`, which ScheduleFreeAdamW needs to give its weights)."""
    return [f"keras.{name}/{case}" for name in keras_rule_names(keras) for case in ("tape/some", "fit/none")]


def make_inner(keras, name: str):
    """"sgd" (0.1), "adam" (0.01), "momentum", or "NAME-LR" for that learning rate;
    "adamw": AdamW, weight decay 0.5, learning rate 0.01 halving every step;
    "keras.NAME": `keras_rule(keras, NAME)`."""
    if name.startswith("keras."):
        return keras_rule(keras, name[len("keras."):])
    base, _, lr = name.partition("-")
    if base == "adamw":
        schedule = keras.optimizers.schedules.ExponentialDecay(float(lr or 0.01), decay_steps=1, decay_rate=0.5)
        return keras.optimizers.AdamW(schedule, weight_decay=0.5)
    if base == "sgd":
        return keras.optimizers.SGD(float(lr or 0.1))
    if base == "adam":
        return keras.optimizers.Adam(float(lr or 0.01))
    if base == "momentum":
        return keras.optimizers.SGD(float(lr or 0.05), momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}")


def clip_mode(clip) -> str | None:
    """True -> "always", False/None/"none" -> None (no clipper), else a key of CLIPS."""
    if clip is True:
        return "always"
    if clip is False or clip is None or clip == "none":
        return None
    if clip not in CLIPS:
        raise ValueError(f"unknown clip mode {clip!r}")
    return clip


def weights(model) -> list:
    return [np.array(w) for w in model.get_weights()]


def max_abs_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def shard_rows(x, y, shard: int, num_shards: int, global_batch: int = GLOBAL_BATCH):
    """Rows of each global batch that replica/worker `shard` of `num_shards` holds."""
    per = global_batch // num_shards
    idx = [s * global_batch + shard * per + i
           for s in range(len(x) // global_batch) for i in range(per)]
    return x[idx], y[idx]


def build_optimizer(dm, keras, opt_name: str, use_dm: bool = True, clip="always",
                    aggregate="auto", unaggregated=None, shard: bool = False):
    """A dist_minimize optimizer with a global-norm clipper, or stock Keras global_clipnorm.

    unaggregated: optional `transform_unaggregated_gradients` (e.g. a recorder).
    shard: `shard_optimizer_state=True`."""
    inner = make_inner(keras, opt_name)
    mode = clip_mode(clip)
    if not use_dm:
        if mode is None:
            return inner
        config = inner.get_config()
        config["global_clipnorm"] = CLIPS[mode] if mode else None
        return type(inner).from_config(config)
    return dm.Optimizer(inner, aggregate_gradients=aggregate, transform_unaggregated_gradients=unaggregated,
                        transform_gradients=[dm.clip_by_global_norm(CLIPS[mode])] if mode else None,
                        **({"shard_optimizer_state": True} if shard else {}))


class MaxAbsRecorder:
    """A `transform_unaggregated_gradients` that records, per step, the largest absolute
    element of this replica's (or process's) gradients, in `values[step]`."""

    def __init__(self, steps: int = STEPS):
        import tensorflow as tf

        self.values = tf.Variable(tf.zeros([steps]), trainable=False)
        self.step = tf.Variable(0, trainable=False)

    def __call__(self, grads_and_vars):
        import tensorflow as tf

        m = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(tf.convert_to_tensor(g)))
                                    for g, _ in grads_and_vars if g is not None]))
        self.values.scatter_nd_update([[self.step]], [m])
        self.step.assign_add(1)
        return grads_and_vars


def clipped_steps(opt) -> int | None:
    """How many steps a dist_minimize optimizer's clipper clipped (None: no clipper)."""
    clipped = opt.gradient_stats().get("clipped_steps")
    return None if clipped is None else int(clipped)


def train(strategy, opt_name: str, mode: str, *, use_dm: bool = True, clip="always",
          dataset=None, eager: bool = False, steps: int = STEPS, loss_denominator: int = GLOBAL_BATCH,
          aggregate="auto", model_seed: int = 1, callbacks=(), unaggregated=None, wrap=None,
          build_first: bool = False, lazy: bool = False, shard: bool = False):
    """Trains `steps` steps under `strategy`; returns (weights, optimizer, model).

    mode: "fit" (model.compile + model.fit), "fit_integrated" (the same after
    `dm.integrate(model)`: every stage under fit), "callable" (custom loop with
    `minimize(loss_fn, vars)`), or "tape" (custom loop with a tensor loss and its tape).
    clip: a clip mode of CLIPS ("always", "never", "some"), True ("always") or False
      (no clipper); with use_dm=False, stock Keras `global_clipnorm` at that norm.
    dataset: the input; default: the global batches, split across replicas in order.
    wrap: a name of WEIGHT_WRAPPERS or PRIVACY_WRAPPERS to wrap the optimizer in (the
      latter train on per-example losses; use mode "fit_integrated" for fit), or a
      function (dm, optimizer) -> wrapped optimizer.
    loss_denominator: custom loops divide the sum of per-example losses by it (the
      global batch under tf.distribute or Horovod "sum"; the local batch for Horovod
      "mean").
    build_first: under fit, build the optimizer before `fit`.
    lazy: in a custom loop, do not build the optimizer before the first step (it builds
      on first use, inside the traced step).
    """
    import dist_minimize as dm
    import keras
    import tensorflow as tf

    x, y = make_data(steps)
    with strategy.scope():
        model = make_model(keras, seed=model_seed)
        opt = build_optimizer(dm, keras, opt_name, use_dm, clip, aggregate, unaggregated, shard)
        per_example = wrap in PRIVACY_WRAPPERS
        if callable(wrap):
            opt = wrap(dm, opt)
        elif wrap in EXTRA_STACKS:
            opt = EXTRA_STACKS[wrap](dm, opt)
        elif wrap in SAM_WRAPPERS:
            opt = SAM_WRAPPERS[wrap](dm, opt)
        elif wrap is not None:
            opt = (PRIVACY_WRAPPERS if per_example else WEIGHT_WRAPPERS)[wrap](dm, opt)
    if dataset is None:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    if mode in ("fit", "fit_integrated"):
        with strategy.scope():
            loss = keras.losses.MeanSquaredError(reduction=None) if per_example else "mse"
            model.compile(loss=loss, optimizer=opt, run_eagerly=eager)
            if build_first:
                opt.build(model.trainable_variables)
        if mode == "fit_integrated":
            dm.integrate(model)
        model.fit(dataset, epochs=1, verbose=0, shuffle=False, steps_per_epoch=steps,
                  callbacks=list(callbacks))
        return weights(model), opt, model

    if not lazy:
        with strategy.scope():
            opt.build(model.trainable_variables)
    if not isinstance(dataset, tf.distribute.DistributedDataset):
        dataset = strategy.experimental_distribute_dataset(dataset)

    def replica_step(xb, yb):
        def loss_fn():
            pred = model(xb, training=True)
            losses = tf.reduce_mean(tf.square(pred - yb), axis=-1)
            if per_example:
                return losses
            return tf.nn.compute_average_loss(losses, global_batch_size=loss_denominator)

        if mode == "callable":
            opt.minimize(loss_fn, model.trainable_variables)
        elif mode == "tape":
            with tf.GradientTape() as tape:
                loss = loss_fn()
            opt.minimize(loss, model.trainable_variables, tape=tape)
        else:
            raise ValueError(f"unknown mode {mode!r}")

    def step(batch):
        strategy.run(replica_step, args=batch)

    if not eager:
        step = tf.function(step)
    it = iter(dataset)
    for _ in range(steps):
        step(next(it))
    return weights(model), opt, model


def local_dataset(rank: int, size: int, steps: int = STEPS):
    """Process `rank`'s rows of every global batch, batched at the local batch size."""
    import tensorflow as tf

    x, y = make_data(steps)
    xs, ys = shard_rows(x, y, rank, size)
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(GLOBAL_BATCH // size)


def embedding_data(steps: int = STEPS):
    """Token ids (repeated across the batch) and targets; the second half-batch is 50x larger."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 6, size=(steps * GLOBAL_BATCH, 4)).astype("int32")
    y = rng.normal(size=(steps * GLOBAL_BATCH, 1)).astype("float32")
    for s in range(steps):
        y[s * GLOBAL_BATCH + GLOBAL_BATCH // 2:(s + 1) * GLOBAL_BATCH] *= 50.0
    return ids, y


def train_embedding(strategy, dataset, transforms=(), aggregate="auto", steps: int = STEPS):
    """An Embedding model (sparse gradients) trained with model.fit; returns its weights."""
    import dist_minimize as dm
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(6, 3),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        opt = dm.Optimizer(keras.optimizers.SGD(0.5), aggregate_gradients=aggregate,
                           transform_gradients=[*transforms, dm.clip_by_global_norm(0.5)])
        model.compile(loss="mse", optimizer=opt)
    model.fit(dataset, epochs=1, verbose=0, shuffle=False, steps_per_epoch=steps)
    return weights(model)


def train_custom(strategy, make_optimizer, dataset, steps: int, loss_denominator: int,
                 multiplier=None, model_seed: int = 1):
    """A tf.function custom loop whose optimizer `make_optimizer()` builds in scope.

    multiplier(step) -> float: this process's loss multiplier at each step (e.g. inf at
    one step on one worker, to plant a non-finite gradient there). Returns
    (weights, optimizer).
    """
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = make_model(keras, seed=model_seed)
        opt = make_optimizer()
        opt.build(model.trainable_variables)
    if not isinstance(dataset, tf.distribute.DistributedDataset):
        dataset = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def step(batch, mult):
        def replica_step(xb, yb):
            def loss_fn():
                per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                return tf.nn.compute_average_loss(per_example, global_batch_size=loss_denominator) * mult

            opt.minimize(loss_fn, model.trainable_variables)

        strategy.run(replica_step, args=batch)

    it = iter(dataset)
    for i in range(steps):
        step(next(it), tf.constant(multiplier(i) if multiplier else 1.0))
    return weights(model), opt


# shard_optimizer_state=True against the same run unsharded ("OPT/MODE/CLIP[/WRAP]"),
# in tests/workers/horovod_worker.py's "sharded" scenario.
SHARD_CASES = ["sgd/callable/some", "adam/callable/some", "adam/fit/some"]
# On `horovodrun -np 4` and `mpirun -np 2` (the test-time budget): fit runs on -np 2 (Gloo)
# and under MultiWorkerMirroredStrategy.
SHARD_FEW_CASES = ["sgd/callable/some", "adam/callable/some"]
# On `horovodrun -np 2` and MultiWorkerMirroredStrategy (the cases above run on every job):
# the clip not firing, and what sends collectives of its own or writes outside a step (SAM's
# all-reduce, loss scaling's agreed skip, the averages gathered after training, DP-SGD's
# noise by position, the full stack).
SHARD_MORE_CASES = ["adam/tape/never", "adam/callable/some/stack", "adam/callable/some/sam",
                    "adam/callable/some/average", "sgd/callable/some/swa", "adam/callable/some/full",
                    "sgd/fit_integrated/some/dp_noise", "adam/callable/some/accumulate_sharded"]
# Under MultiWorkerMirroredStrategy only (the test-time budget; no collective of their
# own): Lookahead, accumulation, and rules that need each tensor whole (a trust ratio per
# layer, factored moments, Newton-Schulz on a matrix, per-coordinate accumulators).
SHARD_MW_CASES = ["adam/fit/some/lookahead", "adam/callable/some/accumulate", "keras.Lamb/callable/some",
                  "keras.Adafactor/callable/some", "keras.Muon/callable/some", "keras.Ftrl/callable/some"]
SHARD_WRAPS = {
    "stack": lambda dm, opt: dm.LossScaleOptimizer(dm.DecoupledWeightDecay(opt, weight_decay=0.1),
                                                   initial_scale=64.0, growth_interval=2),
    "sam": lambda dm, opt: dm.SAM(opt, rho=0.05),
    # averages and slow weights: per-variable state of the share, gathered by assign_average_vars
    "average": lambda dm, opt: dm.MovingAverage(opt, average_decay=0.5),
    "swa": lambda dm, opt: dm.SWA(opt, start_averaging=1, average_period=1),
    "lookahead": lambda dm, opt: dm.Lookahead(opt, sync_period=2, slow_step_size=0.5),
    "accumulate": lambda dm, opt: dm.GradientAccumulation(opt, steps=2),
    # ZeRO stage 2 (sharded run) against plain accumulation (unsharded run)
    "accumulate_sharded": lambda dm, opt: dm.GradientAccumulation(opt, steps=2,
                                                                  shard_accumulators=opt.shard_optimizer_state),
    "full": lambda dm, opt: dm.LossScaleOptimizer(dm.MovingAverage(dm.Lookahead(dm.GradientAccumulation(
        dm.DecoupledWeightDecay(opt, weight_decay=0.1), steps=2), sync_period=2), average_decay=0.5),
        initial_scale=64.0, growth_interval=2),
}


def accumulated_elements(dm, opt) -> int:
    """Elements of the stack's gradient accumulators on this process (0 without any)."""
    accumulation = opt.find(dm.GradientAccumulation)
    if accumulation is None:
        return 0
    return int(sum(np.prod(v.shape) for v in accumulation.variables if v.path.endswith("_accumulated")))


def slots_by_variable(opt, model) -> dict:
    """The update rule's slots, keyed "INDEX:SLOT" by the index of the trained variable
    they belong to (Keras names a slot after its variable's path), as lists."""
    rule = opt.stack()[-1].inner_optimizer
    out = {}
    for i, v in enumerate(model.trainable_variables):
        prefix = v.path.replace("/", "_") + "_"
        for s in rule.variables:
            if s.name.startswith(prefix):
                out[f"{i}:{s.name[len(prefix):]}"] = np.asarray(s).tolist()
    return out


def lso_sgd(dm, keras):
    """LossScaleOptimizer(Optimizer(SGD, clip)) with initial scale 64."""
    return dm.LossScaleOptimizer(
        dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=dm.clip_by_global_norm(CLIP_NORM)),
        initial_scale=64.0)


def accumulating_adam(dm, keras, k: int):
    """GradientAccumulation(Optimizer(Adam, clip), k)."""
    return dm.GradientAccumulation(
        dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(CLIP_NORM)), k)


def reference_accumulation(k: int):
    """Single-device weights of Adam+clip on batches K times larger (the accumulation target)."""
    import dist_minimize as dm
    import keras
    import tensorflow as tf

    x, y = make_data(STEPS * k)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH * k)
    w, _ = train_custom(tf.distribute.get_strategy(),
                        lambda: dm.Optimizer(keras.optimizers.Adam(0.01), aggregate_gradients="none",
                                             transform_gradients=dm.clip_by_global_norm(CLIP_NORM)),
                        ds, STEPS, GLOBAL_BATCH * k)
    return w


def train_batches(model, opt, x, y, batches, step=None):
    """Single-device tf.function steps of mean squared error on the given global batches.

    Returns the traced step; pass it back as `step` to continue with the same function
    (no new trace)."""
    import tensorflow as tf

    if step is None:
        @tf.function
        def step(xb, yb):
            opt.minimize(lambda: tf.reduce_mean(tf.square(model(xb) - yb)), model.trainable_variables)

    for i in batches:
        sl = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        step(x[sl], y[sl])
    return step


def train_case(strategy, case: str, **kwargs):
    """`train` for a case "OPT/MODE[/CLIP]" or "lazy:WRAP/MODE/CLIP" (SGD 0.01 in the stack
    WRAP, built on first use); returns (weights, optimizer, model)."""
    opt_name, mode, *rest = case.split("/")
    clip = rest[0] if rest else "always"
    if opt_name.startswith("lazy:"):
        return train(strategy, "sgd-0.01", mode, clip=clip, wrap=opt_name[len("lazy:"):], lazy=True, **kwargs)
    return train(strategy, opt_name, mode, clip=clip, **kwargs)
