"""Models and training steps for the in-process (MirroredStrategy) sections.

Every step is a `tf.function` around `strategy.run`, fed one fixed distributed batch
(no input pipeline in the timing). Each variant gets its own model built from the
same seed, so variants never share weights or optimizer state.

The anchors:
  hand_clip   the fastest correct hand-written step: tape; ONE `ReplicaContext.all_reduce`
              (SUM) of every gradient; `tf.clip_by_global_norm`; the Keras optimizer's
              `apply_gradients` with its own all-reduce disabled.
  hand_clip_guard  the same, with the guarantee dist_minimize's default gives: a step whose
              clipped gradients are not finite is skipped on every replica (the update in
              a `tf.cond` on the finite norm, taken once in the cross-replica context
              under MirroredStrategy, where a per-replica cond around Keras's update
              cannot run). Without it an inf gradient writes NaN into every weight.
  keras_clip  stock Keras 3 `Adam(global_clipnorm=...)`: clips each replica's gradients
              with that replica's norm BEFORE the all-reduce (fast, not correct).
  keras       stock Keras 3 Adam, no clipping.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import dist_minimize as dm

CLIP = 1.0
LR = 1e-3


# -- models ------------------------------------------------------------------------------

def mlp(depth: int, width: int) -> Callable[[], keras.Model]:
    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(depth)])
    return build


def resnet_cnn(size: int = 16, channels: int = 16, blocks: int = 3, classes: int = 10) -> Callable[[], keras.Model]:
    """A small ResNet-like CNN: stem conv, `blocks` residual blocks (conv-BN-free), pool, dense."""
    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((size, size, 3))
        h = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(inp)
        for _ in range(blocks):
            r = keras.layers.Conv2D(channels, 3, padding="same", activation="relu")(h)
            r = keras.layers.Conv2D(channels, 3, padding="same")(r)
            h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
        h = keras.layers.GlobalAveragePooling2D()(h)
        return keras.Model(inp, keras.layers.Dense(classes)(h))
    return build


def batch_for(model: keras.Model, global_batch: int, strategy) -> tuple:
    """One fixed distributed batch (x, y) for `model`; y: regression targets or labels."""
    rng = np.random.default_rng(0)
    shape = model.input_shape[1:]
    x = rng.normal(size=(global_batch, *shape)).astype("float32")
    out = model.output_shape[-1]
    if len(shape) == 3:  # the CNN: class labels
        y = rng.integers(0, out, size=(global_batch,)).astype("int32")
    else:
        y = rng.normal(size=(global_batch, out)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    return next(iter(strategy.experimental_distribute_dataset(ds)))


def per_example_loss(model, x, y):
    pred = model(x, training=True)
    if y.dtype.is_integer:
        return keras.losses.sparse_categorical_crossentropy(y, pred, from_logits=True)
    return tf.reduce_mean(tf.square(pred - y), axis=-1)


# -- steps -------------------------------------------------------------------------------

class Step:
    """A compiled training step over a fixed batch; `run(n)` runs n steps and waits."""

    def __init__(self, strategy, model, batch, replica_fn, after: Callable | None = None, sync_var=None):
        self.traces = 0
        self.model = model
        self._batch = batch
        self._sync = sync_var if sync_var is not None else model.trainable_variables[0]

        @tf.function
        def step(x, y):
            self.traces += 1
            strategy.run(replica_fn, args=(x, y))
            if after is not None:
                after()

        self._step = step

    def run(self, n: int) -> None:
        for _ in range(n):
            self._step(*self._batch)
        np.asarray(tf.reduce_sum(self._sync))  # wait for the last step

    def graph_stats(self) -> dict:
        """Size of the traced step (public graph API; the trace made by `run`, not a new one):
        `nodes` (the function and every function it calls, cond branches included) and
        `cond_inputs`, the inputs of each `If` in the step's own graph, and
        `cond_lowered`, whether TensorFlow lowers each into a Switch (and an Identity)
        per input when it runs the step (the default) or runs it whole."""
        graph = self._step.get_concrete_function(*self._batch).graph
        graph_def = graph.as_graph_def()
        nodes = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
        ifs = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        lowered = [op.node_def.attr["_lower_using_switch_merge"].b if "_lower_using_switch_merge" in op.node_def.attr
                   else True for op in ifs]
        return {"nodes": nodes, "cond_inputs": [len(op.inputs) for op in ifs], "cond_lowered": lowered}


def disabled_all_reduce(keras_opt):
    """The hand-written anchor's Keras optimizer: its own cross-replica sum switched off."""
    keras_opt._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
    return keras_opt


def hand_replica_fn(model, opt, global_batch, clip=CLIP, guard=False):
    variables = model.trainable_variables

    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example_loss(model, x, y), global_batch_size=global_batch)
        grads = tape.gradient(loss, variables)
        grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
        grads, norm = tf.clip_by_global_norm(grads, clip)
        if not guard:
            opt.apply_gradients(zip(grads, variables))
            return

        def cross(strategy, finite, grads):
            def apply():
                strategy.extended.call_for_each_replica(lambda g: opt.apply_gradients(zip(g, variables)), args=(grads,))
            tf.cond(strategy.experimental_local_results(finite)[0], apply, lambda: None)

        tf.distribute.get_replica_context().merge_call(cross, args=(tf.math.is_finite(norm), grads))
    return replica


def dm_replica_fn(model, opt, global_batch):
    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example_loss(model, x, y), global_batch_size=global_batch)
        opt.minimize(loss, model.trainable_variables, tape=tape)
    return replica


def keras_replica_fn(model, opt, global_batch):
    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example_loss(model, x, y), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return replica


@contextlib.contextmanager
def lowered_guard():
    """While tracing: dist_minimize's guard as TensorFlow's lowered cond (a Switch and an
    Identity per input), the mechanism it used before its `If` was kept whole."""
    from dist_minimize._compat import per_device

    saved = per_device.one_resource_device
    per_device.one_resource_device = lambda op: None
    try:
        yield
    finally:
        per_device.one_resource_device = saved


def select_replica_fn(model, opt, global_batch, clip=CLIP):
    """The branch-free guard (one device only): the update always made, then every
    variable it wrote (weights, slots, iterations) put back where the step is not
    finite, by a select; no branch, no host synchronisation, a copy of the state per step."""
    variables = model.trainable_variables

    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_loss(model, x, y))
        grads, norm = tf.clip_by_global_norm(tape.gradient(loss, variables), clip)
        finite = tf.math.is_finite(norm)
        state = list(variables) + [v for v in opt.variables]
        before = [tf.identity(v) for v in state]
        with tf.control_dependencies(before):
            opt.apply_gradients(zip(grads, variables))
        for v, old in zip(state, before):
            v.assign(tf.where(finite, tf.convert_to_tensor(v), old))
    return replica


def make(kind: str, strategy, build_model, global_batch: int) -> Step:
    """The step `kind` (see the module docstring and `KINDS`) for a fresh model."""
    if kind == "dm_clip_lowered":
        step = make("dm_clip", strategy, build_model, global_batch)
        with lowered_guard():
            step.run(1)  # traced now, with the guard lowered
        return step
    with strategy.scope():
        model = build_model()
        batch = batch_for(model, global_batch, strategy)
        if kind == "hand_clip_select":
            opt = keras.optimizers.Adam(LR)
            fn = select_replica_fn(model, opt, global_batch)
        elif kind in ("hand_clip", "hand_clip_guard"):
            opt = disabled_all_reduce(keras.optimizers.Adam(LR))
            fn = hand_replica_fn(model, opt, global_batch, guard=kind == "hand_clip_guard")
        elif kind in ("keras", "keras_clip"):
            opt = keras.optimizers.Adam(LR, global_clipnorm=CLIP if kind == "keras_clip" else None)
            fn = keras_replica_fn(model, opt, global_batch)
        elif kind.startswith("dm"):
            opt = dm.Optimizer(keras.optimizers.Adam(LR),
                               transform_gradients=dm.clip_by_global_norm(CLIP) if "clip" in kind else None,
                               skip_nonfinite="noguard" not in kind)
            fn = dm_replica_fn(model, opt, global_batch)
        else:
            raise ValueError(f"unknown step kind {kind!r}")
        opt.build(model.trainable_variables)
    return Step(strategy, model, batch, fn)


KINDS = {
    "dm_clip": "dist_minimize Adam + cross-replica clip_by_global_norm",
    "dm": "dist_minimize Adam, no clip",
    "dm_clip_noguard": "dist_minimize Adam + clip, skip_nonfinite=False",
    "dm_noguard": "dist_minimize Adam, no clip, skip_nonfinite=False",
    "hand_clip": "hand-written correct step (one all_reduce, tf.clip_by_global_norm, Adam)",
    "hand_clip_guard": "hand_clip + skip of a non-finite step, agreed on every replica",
    "hand_clip_select": "hand_clip + a branch-free skip: update always made, then undone by a select (one device)",
    "dm_clip_lowered": "dm_clip with its guard traced as a lowered cond",
    "keras_clip": "stock Keras 3 Adam(global_clipnorm) (per-replica clip: wrong)",
    "keras": "stock Keras 3 Adam, no clip",
}


class _ManyWeights(keras.layers.Layer):
    def __init__(self, count, size, **kwargs):
        super().__init__(**kwargs)
        self.count, self.size = count, size

    def build(self, input_shape):
        self.ws = [self.add_weight(shape=(self.size,), initializer=keras.initializers.RandomNormal(0.0, 0.01, seed=i),
                                   name=f"w{i}") for i in range(self.count)]

    def call(self, x):
        total = tf.add_n([tf.reduce_sum(tf.square(w)) for w in self.ws])
        return x * total


def many_variables(count: int, size: int) -> Callable[[], keras.Model]:
    """A model of `count` weight vectors of `size` float32 each (section 5: cost growth)."""
    def build():
        inp = keras.Input((1,))
        return keras.Model(inp, _ManyWeights(count, size)(inp))
    return build
