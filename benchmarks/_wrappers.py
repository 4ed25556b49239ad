"""Section 7: each dist_minimize wrapper against its best hand-written equivalent.

Both sides run under the same MirroredStrategy, on the same model and batch, with the
same update rule (Adam) and, except for DP-SGD, the same cross-replica global-norm
clip. The hand-written side is `_steps.hand_replica_fn` plus the wrapper's logic
written directly, the way one would in a custom loop (cross-replica updates of
averages after `strategy.run`, a Python schedule for accumulation, ...).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import dist_minimize as dm
from benchmarks import _steps
from benchmarks._steps import CLIP, LR

ACCUMULATION = 4
EMA_DECAY = 0.99
SWA_PERIOD = 10
LOOKAHEAD_PERIOD, LOOKAHEAD_ALPHA = 6, 0.5
WEIGHT_DECAY = 1e-2
DP_CLIP, DP_NOISE = 1.0, 1.1

WRAPPERS = {
    "loss_scale": "LossScaleOptimizer (dynamic) vs scaled loss, unscale, finite check, agreed skip, scale update",
    "accumulation": f"GradientAccumulation({ACCUMULATION}) vs replica-local accumulators + Python-scheduled apply step",
    "moving_average": f"MovingAverage({EMA_DECAY}) vs EMA assign after apply_gradients",
    "swa": f"SWA(period {SWA_PERIOD}) vs running mean assign every {SWA_PERIOD} steps",
    "lookahead": f"Lookahead({LOOKAHEAD_PERIOD}, {LOOKAHEAD_ALPHA}) vs slow/fast sync every {LOOKAHEAD_PERIOD} steps",
    "weight_decay": "DecoupledWeightDecay(Adam) vs Keras AdamW (own all-reduce disabled)",
    "dp_sgd": "DifferentialPrivacy vs hand-written vectorised per-example clip (tape.jacobian) + noise",
}


def make_dm(name: str, strategy, build_model, global_batch: int, guard: bool = True) -> _steps.Step:
    """The wrapper `name` around dist_minimize Adam + clip; `guard=False`: skip_nonfinite=False
    (for the loss-scale wrapper, whose skip is its purpose, the guard stays)."""
    def _dm_base():
        return dm.Optimizer(keras.optimizers.Adam(LR), transform_gradients=dm.clip_by_global_norm(CLIP),
                            skip_nonfinite=guard or name == "loss_scale")

    with strategy.scope():
        model = build_model()
        batch = _steps.batch_for(model, global_batch, strategy)
        if name == "loss_scale":
            opt = dm.LossScaleOptimizer(_dm_base())
        elif name == "accumulation":
            opt = dm.GradientAccumulation(_dm_base(), steps=ACCUMULATION)
        elif name == "moving_average":
            opt = dm.MovingAverage(_dm_base(), average_decay=EMA_DECAY)
        elif name == "swa":
            opt = dm.SWA(_dm_base(), average_period=SWA_PERIOD)
        elif name == "lookahead":
            opt = dm.Lookahead(_dm_base(), sync_period=LOOKAHEAD_PERIOD, slow_step_size=LOOKAHEAD_ALPHA)
        elif name == "weight_decay":
            opt = dm.DecoupledWeightDecay(_dm_base(), WEIGHT_DECAY, scale_by_learning_rate=True)
        elif name == "dp_sgd":
            opt = dm.DifferentialPrivacy(dm.Optimizer(keras.optimizers.Adam(LR), skip_nonfinite=guard),
                                         l2_norm_clip=DP_CLIP,
                                         noise_multiplier=DP_NOISE, seed=0)
        else:
            raise ValueError(name)
        opt.build(model.trainable_variables)

    def replica(x, y):
        with tf.GradientTape() as tape:
            per_example = _steps.per_example_loss(model, x, y)
            loss = per_example if name == "dp_sgd" else tf.nn.compute_average_loss(
                per_example, global_batch_size=global_batch)
        opt.minimize(loss, model.trainable_variables, tape=tape)

    return _steps.Step(strategy, model, batch, replica)


def _mirrored_copies(variables, initial="zeros"):
    return [tf.Variable(tf.zeros_like(v) if initial == "zeros" else tf.identity(v), trainable=False)
            for v in variables]


class _AccumulationStep:
    """Hand-written accumulation: a micro-step function and a boundary function."""

    def __init__(self, strategy, model, batch, opt, global_batch):
        self.traces = 0
        self.model, self._batch, self._calls = model, batch, 0
        variables = model.trainable_variables
        with strategy.scope():
            self._acc = [tf.Variable(tf.zeros_like(v), trainable=False,
                                     synchronization=tf.VariableSynchronization.ON_READ,
                                     aggregation=tf.VariableAggregation.SUM) for v in variables]

        def grads_of(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(_steps.per_example_loss(model, x, y), global_batch_size=global_batch)
            return tape.gradient(loss, variables)

        def micro(x, y):
            for a, g in zip(self._acc, grads_of(x, y)):
                a.assign_add(g)

        def boundary(x, y):
            grads = [a + g for a, g in zip(self._acc, grads_of(x, y))]
            grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
            grads = [g / ACCUMULATION for g in grads]
            grads, _ = tf.clip_by_global_norm(grads, CLIP)
            opt.apply_gradients(zip(grads, variables))
            for a in self._acc:
                a.assign(tf.zeros_like(a))

        @tf.function
        def micro_step(x, y):
            self.traces += 1
            strategy.run(micro, args=(x, y))

        @tf.function
        def boundary_step(x, y):
            self.traces += 1
            strategy.run(boundary, args=(x, y))

        self._micro, self._boundary = micro_step, boundary_step

    def run(self, n):
        for _ in range(n):
            self._calls += 1
            (self._boundary if self._calls % ACCUMULATION == 0 else self._micro)(*self._batch)
        np.asarray(tf.reduce_sum(self.model.trainable_variables[0]))


def _loss_scale_replica(model, opt, global_batch, scale, good_steps, growth_interval=2000):
    variables = model.trainable_variables

    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(_steps.per_example_loss(model, x, y), global_batch_size=global_batch)
            scaled = loss * scale
        grads = tape.gradient(scaled, variables)
        grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
        inv = 1.0 / scale
        grads = [g * inv for g in grads]
        grads, norm = tf.clip_by_global_norm(grads, CLIP)
        finite = tf.math.is_finite(norm)

        # The skip must be the same on every replica; under MirroredStrategy a branch
        # around an update is taken in the cross-replica context (a merge_call).
        def cross(strategy, finite, grads):
            def apply():
                strategy.extended.call_for_each_replica(
                    lambda g: opt.apply_gradients(zip(g, variables)), args=(grads,))
                grow = good_steps + 1 >= growth_interval
                scale.assign(tf.where(grow, scale * 2.0, scale))
                good_steps.assign(tf.where(grow, tf.zeros_like(good_steps), good_steps + 1))

            def skip():
                scale.assign(tf.maximum(scale / 2.0, 1.0))
                good_steps.assign(tf.zeros_like(good_steps))

            tf.cond(strategy.experimental_local_results(finite)[0], apply, skip)

        tf.distribute.get_replica_context().merge_call(cross, args=(finite, grads))

    return replica


def _dp_replica(model, opt, global_batch):
    variables = model.trainable_variables

    def replica(x, y):
        with tf.GradientTape() as tape:
            per_example = _steps.per_example_loss(model, x, y)
        jac = tape.jacobian(per_example, variables, experimental_use_pfor=True)
        n = tf.shape(per_example)[0]
        sq = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(j), [n, -1]), axis=1) for j in jac])
        factor = tf.minimum(1.0, DP_CLIP / tf.maximum(tf.sqrt(sq), 1e-12))
        clipped = [tf.tensordot(factor, j, axes=1) for j in jac]
        summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, clipped)
        seed = tf.stack([tf.constant(0, tf.int64), tf.cast(opt.iterations, tf.int64)])
        noisy = [(g + DP_NOISE * DP_CLIP * tf.random.stateless_normal(tf.shape(g), tf.random.experimental.stateless_fold_in(seed, i)))
                 / global_batch for i, g in enumerate(summed)]
        opt.apply_gradients(zip(noisy, variables))

    return replica


def make_hand(name: str, strategy, build_model, global_batch: int):
    with strategy.scope():
        model = build_model()
        batch = _steps.batch_for(model, global_batch, strategy)
        variables = model.trainable_variables
        if name == "weight_decay":
            opt = _steps.disabled_all_reduce(keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY))
        else:
            opt = _steps.disabled_all_reduce(keras.optimizers.Adam(LR))
        opt.build(variables)
        after = None
        if name == "accumulation":
            return _AccumulationStep(strategy, model, batch, opt, global_batch)
        if name == "loss_scale":
            scale = tf.Variable(2.0 ** 15, trainable=False)
            good = tf.Variable(0, dtype=tf.int64, trainable=False)
            return _steps.Step(strategy, model, batch, _loss_scale_replica(model, opt, global_batch, scale, good))
        if name == "dp_sgd":
            return _steps.Step(strategy, model, batch, _dp_replica(model, opt, global_batch))
        replica = _steps.hand_replica_fn(model, opt, global_batch)
        if name == "moving_average":
            averages = _mirrored_copies(variables, initial="value")

            def after():
                for a, v in zip(averages, variables):
                    a.assign_sub((1.0 - EMA_DECAY) * (a - v))
        elif name == "swa":
            averages = _mirrored_copies(variables)
            count = tf.Variable(0.0, trainable=False)

            def after():
                def average():
                    for a, v in zip(averages, variables):
                        a.assign_add((v - a) / (count + 1.0))
                    count.assign_add(1.0)
                tf.cond(opt.iterations % SWA_PERIOD == 0, average, lambda: None)
        elif name == "lookahead":
            slow = _mirrored_copies(variables, initial="value")

            def after():
                def sync():
                    for s, v in zip(slow, variables):
                        s.assign_add(LOOKAHEAD_ALPHA * (v - s))
                        v.assign(s)
                tf.cond(opt.iterations % LOOKAHEAD_PERIOD == 0, sync, lambda: None)
        elif name != "weight_decay":
            raise ValueError(name)
    return _steps.Step(strategy, model, batch, replica, after=after)


def docs_wrapper():
    """`WeightAverage`, the complete example of docs/writing-a-wrapper.md, imported from the
    page itself: a wrapper written from the docs, outside the package."""
    import atexit
    import importlib.util
    import os
    import re
    import shutil
    import tempfile

    doc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "writing-a-wrapper.md")
    text = open(doc).read()
    code = re.search(r"```python\n(.*?)```", text[text.index("## A complete example"):], re.S).group(1)
    folder = tempfile.mkdtemp(prefix="dm-bench-")
    atexit.register(shutil.rmtree, folder, True)  # kept while the process traces (AutoGraph reads it)
    path = os.path.join(folder, "docs_wrapper_example.py")
    with open(path, "w") as f:
        f.write(code)  # AutoGraph reads the source from the file
    spec = importlib.util.spec_from_file_location("docs_wrapper_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.WeightAverage


def make_average(kind: str, strategy, build_model, global_batch: int, average_class=None) -> _steps.Step:
    """Adam + clip under a moving average of the weights: the built-in `MovingAverage`
    ("builtin") or `average_class` written from the docs ("docs"), same decay."""
    with strategy.scope():
        model = build_model()
        batch = _steps.batch_for(model, global_batch, strategy)
        base = dm.Optimizer(keras.optimizers.Adam(LR), transform_gradients=dm.clip_by_global_norm(CLIP))
        opt = dm.MovingAverage(base, average_decay=EMA_DECAY) if kind == "builtin" else average_class(
            base, decay=EMA_DECAY)
        opt.build(model.trainable_variables)

    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(_steps.per_example_loss(model, x, y), global_batch_size=global_batch)
        opt.minimize(loss, model.trainable_variables, tape=tape)

    return _steps.Step(strategy, model, batch, replica)


SAM_RHO = 0.05


def make_sam(kind: str, strategy, build_model, global_batch: int) -> _steps.Step:
    """SAM over Adam + clip: `dm.SAM` ("dm") or the hand-written distributed SAM step
    ("hand": two forward and backward passes, two all-reduces, the perturbation written
    and put back through merge_call, no guard)."""
    with strategy.scope():
        model = build_model()
        batch = _steps.batch_for(model, global_batch, strategy)
        if kind == "dm":
            opt = dm.SAM(dm.Optimizer(keras.optimizers.Adam(LR), transform_gradients=dm.clip_by_global_norm(CLIP)),
                         rho=SAM_RHO)
        else:
            opt = _steps.disabled_all_reduce(keras.optimizers.Adam(LR))
        opt.build(model.trainable_variables)
    variables = model.trainable_variables

    def replica(x, y):
        def loss_fn():
            return tf.nn.compute_average_loss(_steps.per_example_loss(model, x, y), global_batch_size=global_batch)

        if kind == "dm":
            opt.minimize(loss_fn, variables)
            return
        ctx = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            loss = loss_fn()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tape.gradient(loss, variables))
        norm = tf.linalg.global_norm(grads)
        saved = [tf.identity(v) for v in variables]
        hand_write(variables, [w + SAM_RHO * g / (norm + 1e-12) for w, g in zip(saved, grads)])
        with tf.GradientTape() as again:
            loss = loss_fn()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, again.gradient(loss, variables))
        hand_write(variables, saved)
        grads, _ = tf.clip_by_global_norm(grads, CLIP)
        opt.apply_gradients(zip(grads, variables))

    return _steps.Step(strategy, model, batch, replica)


def hand_write(variables, values):
    """Each replica's value into its own copy of each variable (merge_call + update)."""
    ctx = tf.distribute.get_replica_context()
    if not tf.distribute.has_strategy() or ctx is None or ctx.num_replicas_in_sync == 1:
        for v, x in zip(variables, values):
            v.assign(x)
        return

    def cross(strategy, values):
        for v, x in zip(variables, values):
            strategy.extended.update(v.value, lambda copy, val: copy.assign(val), args=(x,), group=False)

    ctx.merge_call(cross, args=(values,))
