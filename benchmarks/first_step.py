"""Time to first step on real architectures: dist_minimize against the hand-written step.

    python benchmarks/first_step.py --out benchmarks/FIRST_STEP.md [--samples 2]
        [--models resnet50,mobilenetv2,encoder] [--backends mirrored,horovod,multiworker]

The first step of a job (its trace and first run) is paid at every start and restart.
Each sample is a fresh process per backend (two processes under horovodrun -np 2 and
MultiWorkerMirroredStrategy, timed on rank 0) that first traces and runs an unrelated
small step (a process's first trace pays one-time costs), then, for each model, builds
and times every kind in turn, in the opposite order in the next sample. Per kind:
trace seconds (`get_concrete_function`), first run seconds, graph nodes per trainable
variable per replica (the step function and every function it calls), and the median
step time over 5 later steps. Synthetic data, `weights=None`: nothing is downloaded.

Kinds (custom loop, `tf.function` around the step; Adam, clip by global norm 1.0):
  hand        the hand-written correct step: one all-reduce of every gradient,
              `tf.clip_by_global_norm`, Adam with its own all-reduce switched off
  hand_guard  the same, the update under one agreed `tf.cond` on the finite norm
  dm          `dm.Optimizer(Adam, transform_gradients=dm.clip_by_global_norm(1.0))`
              (default non-finite guard)
and with `fit` (the first call, one step, traces; later calls of 5 steps; every backend):
  keras_fit   stock Keras `fit` with Adam (no clip); under Horovod, where Keras 3 has no
              integration, Adam whose `apply` first averages the gradients with one
              `hvd.grouped_allreduce` (what Horovod's DistributedOptimizer does)
  hand_fit    under MultiWorkerMirroredStrategy, where stock `fit` fails before any
              optimizer code runs (docs/pipeline.md): `fit` with the hand-written step as
              the model's `train_step` (logs as one-element vectors) and the model built
              from the worker's own batch (the same `_compat` call `dm.integrate` makes)
  dm_fit      the dm optimizer above, `model.compile(optimizer=...)` + `dm.integrate`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP_KINDS = ("hand", "hand_guard", "dm")
FIT_KINDS = ("keras_fit", "hand_fit", "dm_fit")
MODELS = ("resnet50", "mobilenetv2", "encoder")
GLOBAL_BATCH = 32
CLIP, LR = 1.0, 1e-3


# -- models (worker side) ------------------------------------------------------------------

def build_model(name: str):
    import keras

    keras.utils.set_random_seed(0)
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
                                           classifier_activation=None)
    if name == "mobilenetv2":
        return keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10,
                                              classifier_activation=None)
    if name == "encoder":  # 12 post-norm blocks, d=128, 4 heads, ff 512, sequence 32: 195 variables
        tokens = keras.Input((32,), dtype="int32")
        h = keras.layers.Embedding(1000, 128)(tokens)
        for _ in range(12):
            a = keras.layers.MultiHeadAttention(4, 32)(h, h)
            h = keras.layers.LayerNormalization()(h + a)
            f = keras.layers.Dense(128)(keras.layers.Dense(512, activation="gelu")(h))
            h = keras.layers.LayerNormalization()(h + f)
        return keras.Model(tokens, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
    raise ValueError(f"unknown model {name!r}")


def data(model, batch: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = model.input_shape[1:]
    if len(shape) == 1:
        x = rng.integers(0, 1000, size=(batch, *shape)).astype("int32")
    else:
        x = rng.normal(size=(batch, *shape)).astype("float32")
    return x, rng.integers(0, 10, size=(batch,)).astype("int32")


def per_example_loss(model, x, y):
    import keras

    return keras.losses.sparse_categorical_crossentropy(y, model(x, training=True), from_logits=True)


def graph_nodes(concrete) -> int:
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


# -- one process's timings (worker side) --------------------------------------------------

class Backend:
    """How the step is distributed in this process: `mirrored` (2 logical CPUs),
    `multiworker` (one replica per process) or `horovod`."""

    def __init__(self, name: str):
        import tensorflow as tf

        self.name = name
        if name == "mirrored":
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
            self.strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        elif name == "multiworker":
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        else:
            import horovod.tensorflow as hvd

            hvd.init()
            self.strategy = tf.distribute.get_strategy()  # the default: one replica per process
        self.replicas_here = 2 if name == "mirrored" else 1  # this process's replicas
        self.rank = 0
        if name == "multiworker":
            self.rank = self.strategy.cluster_resolver.task_id
        elif name == "horovod":
            self.rank = hvd.rank()

    def local_batch(self) -> int:
        """Rows this process feeds: the global batch where the strategy splits it, else its share."""
        return GLOBAL_BATCH // 2 if self.name == "horovod" else GLOBAL_BATCH


def loop_step(backend: Backend, model_name: str, kind: str):
    """(step function, its arguments, the model) for a custom-loop kind."""
    import keras
    import tensorflow as tf

    import dist_minimize as dm

    horovod = backend.name == "horovod"
    with backend.strategy.scope():
        model = build_model(model_name)
        variables = model.trainable_variables
        if kind in ("dm", "dm_whole"):
            opt = dm.Optimizer(keras.optimizers.Adam(LR), transform_gradients=dm.clip_by_global_norm(CLIP),
                               aggregate_gradients="horovod" if horovod else "auto")
        else:
            opt = keras.optimizers.Adam(LR)
            opt._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)  # the hand-written anchor
        opt.build(variables)
    x, y = data(model, backend.local_batch(), seed=backend.rank)
    if horovod:
        args = (tf.constant(x), tf.constant(y))
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        args = next(iter(backend.strategy.experimental_distribute_dataset(dataset)))

    def replica(x, y):
        with tf.GradientTape() as tape:
            if horovod:
                loss = tf.reduce_mean(per_example_loss(model, x, y))
            else:
                loss = tf.nn.compute_average_loss(per_example_loss(model, x, y), global_batch_size=GLOBAL_BATCH)
        if kind in ("dm", "dm_whole"):
            opt.minimize(loss, variables, tape=tape)
            return
        grads = tape.gradient(loss, variables)
        if horovod:
            import horovod.tensorflow as hvd

            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        else:
            grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
        grads, norm = tf.clip_by_global_norm(grads, CLIP)
        if kind == "hand":
            opt.apply_gradients(zip(grads, variables))
        elif horovod:
            tf.cond(tf.math.is_finite(norm), lambda: opt.apply_gradients(zip(grads, variables)), lambda: opt.iterations)
        else:  # a per-replica cond cannot hold Keras's update (a merge_call): one cond, cross-replica
            def cross(strategy, finite, grads):
                def apply():
                    strategy.extended.call_for_each_replica(lambda g: opt.apply_gradients(zip(g, variables)),
                                                            args=(grads,))
                tf.cond(strategy.experimental_local_results(finite)[0], apply, lambda: None)

            tf.distribute.get_replica_context().merge_call(cross, args=(tf.math.is_finite(norm), grads))

    @tf.function(jit_compile=False)
    def step(x, y):
        backend.strategy.run(replica, args=(x, y))

    if kind == "dm_whole":  # traced now, with the guarded update as run_if's one cond, not device by device
        from unittest import mock

        from dist_minimize import _per_device

        with mock.patch.object(_per_device, "possible", lambda top, grads_and_vars: False):
            step.get_concrete_function(*args)
    return step, args, model


def time_loop(backend: Backend, model_name: str, kind: str) -> dict:
    import numpy as np
    import tensorflow as tf

    step, args, model = loop_step(backend, model_name, kind)
    sync = model.trainable_variables[0]
    start = time.perf_counter()
    concrete = step.get_concrete_function(*args)
    traced = time.perf_counter()
    step(*args)
    np.asarray(tf.reduce_sum(sync))
    ran = time.perf_counter()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        step(*args)
        np.asarray(tf.reduce_sum(sync))
        times.append(time.perf_counter() - t)
    variables = len(model.trainable_variables)
    return {"trace_s": traced - start, "run_s": ran - traced, "first_s": ran - start,
            "nodes_per_var": graph_nodes(concrete) / variables / backend.replicas_here,
            "step_ms": 1e3 * statistics.median(times), "variables": variables}


def _HorovodAdam(learning_rate):
    """Keras's Adam that averages the gradients over the processes first (Horovod's way)."""
    import horovod.tensorflow as hvd
    import keras

    class HorovodAdam(keras.optimizers.Adam):
        def apply(self, grads, trainable_variables=None):
            return super().apply(hvd.grouped_allreduce(list(grads), op=hvd.Average), trainable_variables)

    return HorovodAdam(learning_rate)


def _hand_train_step(model, data):
    """The hand-written step as a model's `train_step` (MultiWorkerMirroredStrategy):
    one all-reduce, `tf.clip_by_global_norm`, Adam with its own all-reduce off; the loss
    log a one-element vector (Keras reduces logs along axis 0 there)."""
    import tensorflow as tf

    x, y = data
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(per_example_loss(model, x, y), global_batch_size=GLOBAL_BATCH)
    variables = model.trainable_variables
    grads = tape.gradient(loss, variables)
    grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
    grads, _ = tf.clip_by_global_norm(grads, CLIP)
    model.optimizer.apply_gradients(zip(grads, variables))
    return {"loss": tf.reshape(loss, [1])}


def time_fit(backend: Backend, model_name: str, kind: str) -> dict:
    import keras

    import dist_minimize as dm

    with backend.strategy.scope():
        model = build_model(model_name)
        if kind == "dm_fit":
            opt = dm.Optimizer(keras.optimizers.Adam(LR), transform_gradients=dm.clip_by_global_norm(CLIP),
                               aggregate_gradients="horovod" if backend.name == "horovod" else "auto")
        elif backend.name == "horovod":
            opt = _HorovodAdam(LR)
        else:
            opt = keras.optimizers.Adam(LR)
            if kind == "hand_fit":
                opt._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        if kind == "dm_fit":
            dm.integrate(model)
    import tensorflow as tf

    if kind == "hand_fit":
        import types

        from dist_minimize import _compat

        _compat.build_from_local_batch(model)
        model.train_step = types.MethodType(_hand_train_step, model)

    x, y = data(model, backend.local_batch(), seed=backend.rank)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)).repeat()
    options = tf.data.Options()  # every worker feeds the same rows (as the custom loop does)
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
    first = time.perf_counter() - start
    times = []
    for _ in range(3):
        t = time.perf_counter()
        model.fit(dataset, epochs=1, steps_per_epoch=5, verbose=0)
        times.append((time.perf_counter() - t) / 5)
    return {"first_s": first, "step_ms": 1e3 * statistics.median(times), "variables": len(model.trainable_variables)}


def worker(args) -> None:
    backend = Backend(args.backend)
    import keras
    import tensorflow as tf

    with backend.strategy.scope():
        small = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        small_opt = keras.optimizers.SGD(0.1)

    @tf.function(jit_compile=False)
    def warm_step():  # a process's first trace pays one-time costs: paid here, before any timed kind
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(small(tf.ones([2, 4])))
            grads = tape.gradient(loss, small.trainable_variables)
            if backend.name == "horovod":
                import horovod.tensorflow as hvd

                grads = hvd.grouped_allreduce(grads, op=hvd.Average)
            small_opt.apply_gradients(zip(grads, small.trainable_variables))
        backend.strategy.run(replica)

    warm_step()
    results = []
    for model_name in args.models.split(","):
        for kind in args.kinds.split(","):
            timer = time_fit if kind in FIT_KINDS else time_loop
            row = timer(backend, model_name, kind)
            results.append({"backend": args.backend, "model": model_name, "kind": kind, **row})
            print(f"[first_step] {args.backend} {model_name} {kind}: {row}", flush=True)
    if backend.rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f)


# -- the driver ------------------------------------------------------------------------------

def run_sample(backend: str, models: str, kinds: list, json_path: str, timeout: float) -> list:
    script = [os.path.abspath(__file__), "--worker", "--backend", backend, "--models", models,
              "--kinds", ",".join(kinds), "--json", json_path]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    if backend == "mirrored":
        subprocess.run([sys.executable, *script], check=True, timeout=timeout, env=env, cwd=ROOT)
    else:
        sys.path.insert(0, ROOT)
        from dist_minimize import launcher

        status = launcher.launch("horovod-gloo" if backend == "horovod" else "multiworker", 2, script,
                                 timeout=timeout)
        if status != 0:
            raise RuntimeError(f"the {backend} sample exited with {status}")
    with open(json_path) as f:
        return json.load(f)


def table(rows: list) -> list:
    by = {}
    for r in rows:
        by.setdefault((r["backend"], r["model"]), {}).setdefault(r["kind"], []).append(r)
    lines = ["| backend | model (variables) | first step s (trace + run), median of samples | dm / hand | "
             "dm / hand with guard | nodes per variable per replica: hand / hand_guard / dm | step ms: "
             "hand / hand_guard / dm | dm step / hand step |",
             "|---|---|---|---|---|---|---|---|"]
    for (backend, model), kinds in by.items():
        med = {k: statistics.median(r["first_s"] for r in v) for k, v in kinds.items()}
        step = {k: statistics.median(r["step_ms"] for r in v) for k, v in kinds.items()}
        nodes = {k: v[0].get("nodes_per_var") for k, v in kinds.items()}
        variables = next(iter(kinds.values()))[0]["variables"]
        if all(k in med for k in LOOP_KINDS):
            first = " / ".join(f"{k} {med[k]:.1f}" for k in LOOP_KINDS if k in med)
            lines.append(
                f"| {backend} | {model} ({variables}) | {first} | {med['dm'] / med['hand']:.2f} | "
                f"{med['dm'] / med['hand_guard']:.2f} | "
                + " / ".join(f"{nodes[k]:.0f}" for k in LOOP_KINDS if k in nodes) + " | "
                + " / ".join(f"{step[k]:.1f}" for k in LOOP_KINDS if k in step)
                + f" | {step['dm'] / step['hand']:.3f} |")
        if "dm_fit" in med:
            anchor = "keras_fit" if "keras_fit" in med else "hand_fit"
            against = "stock fit" if anchor == "keras_fit" else "fit with the hand-written train_step"
            lines.append(
                f"| {backend}, fit | {model} ({variables}) | {anchor} {med[anchor]:.1f} / dm_fit "
                f"{med['dm_fit']:.1f} | {med['dm_fit'] / med[anchor]:.2f} (against {against}) | - | - | "
                f"{step[anchor]:.1f} / - / {step['dm_fit']:.1f} | {step['dm_fit'] / step[anchor]:.3f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="mirrored")
    p.add_argument("--kinds", default=",".join(LOOP_KINDS))
    p.add_argument("--json")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--backends", default="mirrored,horovod,multiworker")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--fit", action="store_true", help="also fit's first step")
    p.add_argument("--fit-only", action="store_true", help="only fit's first step")
    p.add_argument("--out")
    p.add_argument("--timeout", type=float, default=3000)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            # stock Keras fit fails under MultiWorkerMirroredStrategy (docs/pipeline.md): there
            # dm's fit is measured against fit with the hand-written train_step
            fit_kinds = ["hand_fit", "dm_fit"] if backend == "multiworker" else ["keras_fit", "dm_fit"]
            groups = ([] if args.fit_only else [list(LOOP_KINDS)]) + (
                [fit_kinds] if args.fit or args.fit_only else [])
            for sample in range(args.samples):
                for kinds in groups:
                    order = kinds if sample % 2 == 0 else kinds[::-1]
                    rows += run_sample(backend, args.models, order, os.path.join(tmp, "out.json"), args.timeout)
    lines = table(rows)
    text = "\n".join(["# Time to first step on real architectures", "",
                      f"`python benchmarks/first_step.py {' '.join(argv or sys.argv[1:])}`, "
                      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.samples} sample(s), "
                      f"global batch {GLOBAL_BATCH}, Adam + clip by global norm (see the script's docstring)", "",
                      *lines, ""])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
