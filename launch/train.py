"""The main job: data-parallel training with dist_minimize and global-norm clipping.

Trains a small MLP on scikit-learn's handwritten digits (1,797 8x8 images shipped inside
the scikit-learn package: nothing is downloaded), clipping the AGGREGATED gradients to a
global norm, on one of:

* horovod:     one process per rank (start it with `launch/launch.py --launcher
               horovod-gloo|horovod-mpi|mpirun`); `model.fit` with Horovod averaging;
* mirrored:    `MirroredStrategy` over --replicas GPUs or logical CPU devices; `model.fit`;
* multiworker: `MultiWorkerMirroredStrategy`, one process per worker with TF_CONFIG
               (`launch/launch.py --launcher multiworker`); a custom loop, because Keras
               3's `fit` fails under this strategy (see the README).

`--backend auto` (default) picks horovod under horovodrun/mpirun, multiworker when
TF_CONFIG is set, mirrored otherwise. Prints Keras progress (rank 0) and, per epoch, the
mean pre-clip global norm and the share of clipped steps; then the test accuracy.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["auto", "horovod", "mirrored", "multiworker"], default="auto")
    p.add_argument("--replicas", type=int, default=2, help="mirrored: replicas in this process")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be >= 1. Received: --replicas={args.replicas}")
    if not args.clip_norm > 0:
        p.error(f"--clip-norm must be > 0. Received: --clip-norm={args.clip_norm}")
    return args


def resolve_backend(backend: str) -> str:
    from dist_minimize import cluster

    if backend == "multiworker" and "TF_CONFIG" not in os.environ:
        # Started by srun (launch/slurm_multiworker.sbatch) or as a StatefulSet pod
        # (launch/k8s/multiworker.yaml): derive this worker's TF_CONFIG.
        if "SLURM_PROCID" in os.environ:
            os.environ["TF_CONFIG"] = cluster.tf_config_from_slurm(port=int(os.environ.get("DM_PORT", "23456")))
        elif "DM_SERVICE" in os.environ:
            os.environ["TF_CONFIG"] = cluster.tf_config_from_statefulset()
    if backend != "auto":
        return backend
    info = cluster.discover()
    if info.launcher == "tf_config":
        return "multiworker"
    if info.size > 1:
        return "horovod"
    return "mirrored"


def load_digits(seed: int):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model(keras, args):
    import dist_minimize as dm

    keras.utils.set_random_seed(args.seed)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    lr = args.learning_rate or (1e-2 if args.optimizer == "adam" else 0.2)
    inner = keras.optimizers.Adam(lr) if args.optimizer == "adam" else keras.optimizers.SGD(lr)
    optimizer = dm.Optimizer(inner, transform_gradients=dm.clip_by_global_norm(args.clip_norm))
    return model, optimizer


LOSS_ARGS = {"from_logits": True}


def run_fit(args, strategy=None) -> float:
    """Horovod (strategy None) or MirroredStrategy: model.fit."""
    import keras
    import tensorflow as tf

    import dist_minimize as dm

    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    callbacks = []
    if strategy is None:  # Horovod
        hvd = dm.horovod_keras.init()
        size, rank = hvd.size(), hvd.rank()
        if args.global_batch % size:
            raise SystemExit(f"--global-batch must be divisible by the {size} processes. "
                             f"Received: --global-batch={args.global_batch}")
        local_batch = args.global_batch // size
        # Equal, full local batches on every rank: the same number of steps everywhere (no
        # rank waits in an allreduce the others never call) and an exact global mean.
        train = dm.horovod_keras.shard(tf.data.Dataset.from_tensor_slices((x_train, y_train))).batch(
            local_batch, drop_remainder=True)
        callbacks = [dm.horovod_keras.BroadcastVariablesCallback(), dm.horovod_keras.MetricAverageCallback()]
        verbose = dm.horovod_keras.verbosity(2)
        scope = None
        where = f"Horovod, {size} processes (this is rank {rank}), local batch {local_batch}"
    else:
        train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
            len(x_train), seed=args.seed).batch(args.global_batch)
        verbose = 2
        scope = strategy.scope()
        where = f"MirroredStrategy, {strategy.num_replicas_in_sync} replicas"
    if verbose:
        print(f"[train] {where}; global batch {args.global_batch}; "
              f"clip_by_global_norm({args.clip_norm}) after aggregation", flush=True)
    if scope is not None:
        with scope:
            model, optimizer = build_model(keras, args)
            model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(**LOSS_ARGS),
                          metrics=["accuracy"])
    else:
        model, optimizer = build_model(keras, args)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(**LOSS_ARGS),
                      metrics=["accuracy"])
    # Every stage under fit, and XLA (Keras's default on GPU machines without a strategy,
    # which Horovod's collectives cannot run in) turned off with a logged reason.
    dm.integrate(model)
    callbacks.append(dm.callbacks.GradientStatsLogger())
    model.fit(train, epochs=args.epochs, verbose=verbose, shuffle=False, callbacks=callbacks)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.global_batch)
    _, accuracy = model.evaluate(test, verbose=0)
    if verbose:
        print(f"[train] test accuracy {accuracy:.4f}", flush=True)
    return accuracy


def run_multiworker(args) -> float:
    """MultiWorkerMirroredStrategy: a custom loop (Keras 3's fit fails under it)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import dist_minimize as dm

    timeout = float(os.environ.get("DM_COLLECTIVE_TIMEOUT", "60"))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout))
    task = strategy.cluster_resolver.task_id
    n = strategy.num_replicas_in_sync
    if args.global_batch % n:
        raise SystemExit(f"--global-batch must be divisible by the {n} replicas. "
                         f"Received: --global-batch={args.global_batch}")
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    steps = len(x_train) // args.global_batch

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(args.global_batch)
        ds = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shard(
            ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(per_replica, drop_remainder=True).repeat()

    with strategy.scope():
        model, optimizer = build_model(keras, args)
        optimizer.build(model.trainable_variables)
        loss_obj = keras.losses.SparseCategoricalCrossentropy(reduction="none", **LOSS_ARGS)
    clip = optimizer.transforms[-1]
    if task == 0:
        print(f"[train] MultiWorkerMirroredStrategy, {n} workers; global batch {args.global_batch}; "
              f"clip_by_global_norm({args.clip_norm}) after aggregation; custom loop", flush=True)

    @tf.function
    def step(batch):
        def replica_step(x, y):
            def loss_fn():
                return tf.nn.compute_average_loss(loss_obj(y, model(x, training=True)),
                                                  global_batch_size=args.global_batch)
            value = loss_fn()
            optimizer.minimize(loss_fn, model.trainable_variables)
            return value

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    it = iter(strategy.distribute_datasets_from_function(dataset_fn))
    for epoch in range(args.epochs):
        before = {k: float(v) for k, v in clip.stats().items()}
        losses = [float(step(next(it))) for _ in range(steps)]
        after = {k: float(v) for k, v in clip.stats().items()}
        d = {k: after[k] - before[k] for k in after}
        if task == 0:
            print(f"Epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses):.4f} - grad_norm "
                  f"{d['norm_sum'] / max(d['steps'], 1):.4g} - clipped_share "
                  f"{d['clipped_steps'] / max(d['steps'], 1):.4g}", flush=True)
    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == y_test))
    if task == 0:
        print(f"[train] test accuracy {accuracy:.4f}", flush=True)
    return accuracy


def make_mirrored(replicas: int):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= replicas:
        return tf.distribute.MirroredStrategy([f"/gpu:{i}" for i in range(replicas)])
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = resolve_backend(args.backend)
    if backend == "horovod":
        run_fit(args)
    elif backend == "multiworker":
        run_multiworker(args)
        from dist_minimize import cluster

        # Every worker waits for the others, then they leave in an order that leaves no
        # heartbeat to a worker that is gone (which TensorFlow reports as a gRPC error).
        cluster.exit_worker(0)
    else:
        run_fit(args, make_mirrored(args.replicas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
