"""The main job: data-parallel training with dist_minimize and global-norm clipping.

Trains a small MLP on scikit-learn's handwritten digits (1,797 8x8 images shipped inside
the scikit-learn package: nothing is downloaded), clipping the AGGREGATED gradients to a
global norm, on one of:

* horovod:     one process per rank (start it with `launch/launch.py --launcher
               horovod-gloo|horovod-mpi|mpirun`); `model.fit` with Horovod averaging;
* mirrored:    `MirroredStrategy` over --replicas GPUs or logical CPU devices; `model.fit`;
* multiworker: `MultiWorkerMirroredStrategy`, one process per worker with TF_CONFIG
               (`launch/launch.py --launcher multiworker`); a custom loop, because Keras
               3's `fit` fails under this strategy (see docs/pipeline.md).

`--backend auto` (default) picks horovod under horovodrun/mpirun, multiworker when
TF_CONFIG is set, mirrored otherwise. Prints Keras progress (rank 0) and, per epoch, the
mean pre-clip global norm and the share of clipped steps; then the test accuracy.

Wrappers (issue 10), outermost first: `--moving-average D` keeps an exponential moving
average of the weights (the test accuracy is also reported with the averages),
`--dp-noise-multiplier S` trains with DP-SGD (per-example clipping to `--dp-l2-norm-clip`,
noise added once to the global sum; prints epsilon for `--dp-delta` at the end),
`--weight-decay W` decays every kernel (not the biases) before each update, and
`--accumulate K` averages K micro-batches per update (`dm.GradientAccumulation`),
`--compression fp16|bf16|powersgd:R` sends 16-bit gradients, or rank-R factors, with error feedback
(`dm.CompressedAggregation`), and
`--shard-optimizer-state` keeps on each process (horovodrun, mpirun, multiworker) only its
share of the optimizer state (docs/sharding.md). Every process prints `[train] optimizer state bytes on this
process: <n>`.

Fault tolerance (issue 25, docs/fault-tolerance.md): `--checkpoint-dir DIR` resumes from
the newest checkpoint in DIR and saves into it every `--checkpoint-every` batches and on
SIGTERM (then exits with 42, "restart me": `launch/launch.py --max-restarts N` starts the
job again). The run ends by printing `[train] weights fingerprint <hex>` and `[train]
optimizer fingerprint <hex>` (SHA-256 of the final values' bytes), equal for an
interrupted-and-resumed run and an uninterrupted one. `--fail-at STEP` (with
`--fail-rank`, `--fail-signal`, `--fail-in-save`) makes one process fail on purpose, in
the first attempt only, for the tests and the kill-point table.
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
    p.add_argument("--moving-average", type=float, default=None, metavar="DECAY",
                   help="dm.MovingAverage(average_decay=DECAY); evaluate with the averages too")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="dm.DecoupledWeightDecay(WD), biases excluded")
    p.add_argument("--dp-noise-multiplier", type=float, default=None, metavar="SIGMA",
                   help="DP-SGD: dm.DifferentialPrivacy with this noise multiplier (0: clipping only)")
    p.add_argument("--dp-l2-norm-clip", type=float, default=1.0, help="DP-SGD: per-example clipping norm")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="DP-SGD: the delta epsilon is reported for")
    p.add_argument("--dp-seed", type=int, default=None,
                   help="DP-SGD: the noise's seed, for reproducing a run (default: random; with a known seed, "
                        "whoever holds the data can recompute the noise)")
    p.add_argument("--accumulate", type=int, default=None, metavar="K",
                   help="dm.GradientAccumulation(steps=K): one update per K batches")
    p.add_argument("--micro-batch", type=int, default=None, metavar="B",
                   help="horovod, multiworker: the global batch in micro-batches of B samples, each of the N "
                        "workers accumulating G / (N * B) of them per update: the same training on any number of "
                        "workers (dist_minimize.elastic)")
    p.add_argument("--compression", default="none", metavar="{none,fp16,bf16,powersgd:R}",
                   help="aggregate 16-bit gradients, or rank-R factors, with error feedback (dm.CompressedAggregation)")
    p.add_argument("--shard-optimizer-state", action="store_true",
                   help="each process keeps the optimizer state of its share of the weights "
                        "(horovod-gloo, horovod-mpi, multiworker launchers)")
    p.add_argument("--checkpoint-dir", default=None, help="resume from / save checkpoints into this directory")
    p.add_argument("--checkpoint-every", type=int, default=5, help="batches between checkpoints (default 5)")
    p.add_argument("--weights-out", default=None, metavar="PATH",
                   help="write the final weights to PATH (.npz, numpy's format), from rank 0")
    p.add_argument("--fail-at", type=int, default=None, metavar="STEP",
                   help="(testing) after this many batches, --fail-rank fails with --fail-signal (first attempt only)")
    p.add_argument("--fail-rank", type=int, default=1, help="(testing) the rank or worker that fails")
    p.add_argument("--fail-signal", choices=["KILL", "TERM"], default="KILL", help="(testing) how it fails")
    p.add_argument("--fail-in-save", action="store_true",
                   help="(testing) fail inside the first checkpoint write at or after --fail-at, before its rename")
    args = p.parse_args(argv)
    if args.accumulate is not None and args.accumulate < 1:
        p.error(f"--accumulate must be >= 1. Received: --accumulate={args.accumulate}")
    if args.micro_batch is not None and args.accumulate is not None:
        p.error("--micro-batch sets the accumulation (G / (N * B) micro-batches per process): drop --accumulate. "
                f"Received: --micro-batch={args.micro_batch} --accumulate={args.accumulate}")
    if args.compression not in ("none", "fp16", "bf16") and not (
            args.compression.startswith("powersgd:") and args.compression[9:].isdigit() and int(args.compression[9:]) >= 1):
        p.error(f"--compression must be none, fp16, bf16 or powersgd:R with R >= 1. Received: --compression={args.compression}")
    if args.compression != "none" and args.shard_optimizer_state:
        p.error("--compression compresses an all-reduce; a sharded step reduce-scatters instead. Received: "
                f"--compression={args.compression} --shard-optimizer-state")
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every must be >= 1. Received: --checkpoint-every={args.checkpoint_every}")
    if args.replicas < 1:
        p.error(f"--replicas must be >= 1. Received: --replicas={args.replicas}")
    if not args.clip_norm > 0:
        p.error(f"--clip-norm must be > 0. Received: --clip-norm={args.clip_norm}")
    if args.moving_average is not None and not 0.0 <= args.moving_average <= 1.0:
        p.error(f"--moving-average must be in [0, 1]. Received: --moving-average={args.moving_average}")
    if args.weight_decay is not None and not args.weight_decay >= 0:
        p.error(f"--weight-decay must be >= 0. Received: --weight-decay={args.weight_decay}")
    if args.dp_noise_multiplier is not None and not args.dp_noise_multiplier >= 0:
        p.error(f"--dp-noise-multiplier must be >= 0. Received: --dp-noise-multiplier={args.dp_noise_multiplier}")
    if not args.dp_l2_norm_clip > 0:
        p.error(f"--dp-l2-norm-clip must be > 0. Received: --dp-l2-norm-clip={args.dp_l2_norm_clip}")
    if not 0 < args.dp_delta < 1:
        p.error(f"--dp-delta must be in (0, 1). Received: --dp-delta={args.dp_delta}")
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
    if info.size > 1 or info.launcher in ("horovod", "openmpi", "pmi"):  # horovodrun/mpirun, alone too
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
    optimizer = dm.Optimizer(inner, transform_gradients=dm.clip_by_global_norm(args.clip_norm),
                             shard_optimizer_state=args.shard_optimizer_state)
    if args.compression != "none":
        optimizer = dm.CompressedAggregation(optimizer, compression=args.compression)
    if args.accumulate is not None:
        optimizer = dm.GradientAccumulation(optimizer, steps=args.accumulate)
    if args.weight_decay is not None:
        optimizer = dm.DecoupledWeightDecay(optimizer, args.weight_decay, exclude_from_weight_decay=["bias"])
    if private(args):
        optimizer = dm.DifferentialPrivacy(optimizer, l2_norm_clip=args.dp_l2_norm_clip,
                                           noise_multiplier=args.dp_noise_multiplier, seed=args.dp_seed)
    if args.moving_average is not None:
        optimizer = dm.MovingAverage(optimizer, average_decay=args.moving_average)
    return model, optimizer


LOSS_ARGS = {"from_logits": True}


def private(args) -> bool:
    return args.dp_noise_multiplier is not None


def loss_object(keras, args, reduction="sum_over_batch_size"):
    """Per-example losses (reduction=None) for DP-SGD, else `reduction`."""
    return keras.losses.SparseCategoricalCrossentropy(reduction=None if private(args) else reduction, **LOSS_ARGS)


def describe_wrappers(args) -> str:
    parts = []
    if args.moving_average is not None:
        parts.append(f"MovingAverage({args.moving_average})")
    if private(args):
        parts.append(f"DifferentialPrivacy(l2_norm_clip={args.dp_l2_norm_clip}, "
                     f"noise_multiplier={args.dp_noise_multiplier})")
    if args.weight_decay is not None:
        parts.append(f"DecoupledWeightDecay({args.weight_decay})")
    if args.accumulate is not None:
        parts.append(f"GradientAccumulation({args.accumulate})")
    if args.compression != "none":
        parts.append(f"CompressedAggregation({args.compression!r})")
    sharded = "; optimizer state sharded across the processes" if args.shard_optimizer_state else ""
    return sharded + (("; wrappers " + " > ".join(parts)) if parts else "")


def report(args, model, optimizer, evaluate, steps: int, train_size: int, show: bool = True) -> None:
    """The extra lines the wrappers call for: accuracy with the averages, epsilon. Every
    process calls it (the averages of a sharded state are gathered); `show` prints."""
    import dist_minimize as dm

    if args.moving_average is not None:
        with optimizer.averaged_weights():
            accuracy = evaluate()
        if show:
            print(f"[train] test accuracy with the moving average {accuracy:.4f}", flush=True)
    if private(args) and show:
        if args.dp_noise_multiplier == 0:
            print("[train] DP-SGD with noise_multiplier 0: per-example clipping only, no privacy "
                  "guarantee (epsilon = inf)", flush=True)
        else:
            q = dm.privacy.sampling_rate(args.global_batch, train_size)
            eps = dm.privacy.epsilon(args.dp_noise_multiplier, q, steps, args.dp_delta)
            print(f"[train] DP-SGD: epsilon {eps:.3f} at delta {args.dp_delta:g} (noise multiplier "
                  f"{args.dp_noise_multiplier}, sampling rate {q:.4g}, {steps} steps; RDP accountant of "
                  "dp-accounting)", flush=True)


def fingerprint(values) -> str:
    """SHA-256 (first 16 hex digits) of the values' bytes, in order."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for v in values:
        h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
    return h.hexdigest()[:16]


def print_state_bytes(optimizer) -> None:
    """Every process's optimizer state bytes (a share of them with --shard-optimizer-state)."""
    import dist_minimize as dm

    print(f"[train] optimizer state bytes on this process: {dm.optimizer_state_bytes(optimizer)}", flush=True)


def print_fingerprints(model, optimizer, root: bool, weights_out: str | None = None) -> None:
    """The final weights' and optimizer variables' fingerprints (read on every worker:
    under MultiWorkerMirroredStrategy reading a replica-local variable is a collective);
    the weights into `weights_out` too (.npz), when given."""
    import numpy as np

    weights = fingerprint(model.get_weights())
    state = fingerprint([v.numpy() for v in optimizer.variables])
    if root:
        print(f"[train] weights fingerprint {weights}", flush=True)
        print(f"[train] optimizer fingerprint {state}", flush=True)
        if weights_out:
            np.savez(weights_out, *model.get_weights())


class Fault:
    """--fail-at: this process fails after `--fail-at` batches (or inside the first
    checkpoint write at or after it), in the launcher's first attempt only."""

    def __init__(self, args, rank: int):
        first = os.environ.get("DM_RESTART_ATTEMPT", "0") == "0"
        self.at = args.fail_at if (first and args.fail_at is not None and rank == args.fail_rank) else None
        self.sig = args.fail_signal
        self.in_save = args.fail_in_save

    def after_batch(self, step: int) -> None:
        if self.at is not None and step == self.at and not self.in_save:
            self.fire(f"after batch {step}")

    def fire(self, where: str) -> None:
        import signal

        print(f"[train] --fail-at: SIG{self.sig} to this process {where}", flush=True)
        os.kill(os.getpid(), getattr(signal, f"SIG{self.sig}"))

    def watch_saves(self, ckpt) -> None:
        if self.at is None or not self.in_save:
            return
        write = ckpt.write_files

        def write_then_fail(path):
            write(path)
            if ckpt.step >= self.at:
                self.fire(f"inside the checkpoint write of batch {ckpt.step}, before its rename")
        ckpt.write_files = write_then_fail

    def callback(self, ckpt):
        """For fit, before the Checkpointer's own callback (which counts the batch)."""
        import keras

        fault = self

        class FailAt(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                fault.after_batch(ckpt.step + 1)

        return FailAt()


def checkpointer(args, model, optimizer, rank: int):
    import dist_minimize as dm

    ckpt = dm.Checkpointer(args.checkpoint_dir, model, optimizer, every=args.checkpoint_every)
    found = dm.checkpoint.latest(args.checkpoint_dir)
    if found and rank == 0:
        print(f"[train] resumed after update {found[0]} from {found[1]}", flush=True)
    fault = Fault(args, rank)
    fault.watch_saves(ckpt)
    return ckpt, fault


def micro_batches_per_update(args, workers: int) -> int:
    """--micro-batch: the micro-batches each of `workers` accumulates per update (G / (N b)),
    said in the job's log; an N that cannot share G ends the job naming the admissible ones."""
    import dist_minimize as dm

    try:
        k = dm.elastic.accumulation_steps(args.global_batch, args.micro_batch, workers)
    except ValueError as e:
        raise SystemExit(f"--global-batch {args.global_batch} --micro-batch {args.micro_batch}: {e}")
    print(f"[train] workers {workers}, micro-batches per update {k}, global batch {args.global_batch}", flush=True)
    return k


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
        def train():
            return dm.horovod_keras.shard(tf.data.Dataset.from_tensor_slices((x_train, y_train))).batch(
                local_batch, drop_remainder=True)
        if args.micro_batch is not None:  # the same micro-batches, and sums, on any number of processes
            args.accumulate = micro_batches_per_update(args, size)
            local_batch = args.micro_batch

            def train():
                return dm.elastic.micro_batches(tf.data.Dataset.from_tensor_slices((x_train, y_train)),
                                                args.global_batch, args.micro_batch, size, rank, len(x_train))
        callbacks = [dm.horovod_keras.BroadcastVariablesCallback(), dm.horovod_keras.MetricAverageCallback()]
        verbose = dm.horovod_keras.verbosity(2)
        scope = None
        where = f"Horovod, {size} processes (this is rank {rank}), local batch {local_batch}"
    else:
        # DP-SGD's accounting assumes one batch size: no partial last batch then.
        # One seeded order for every epoch: under MirroredStrategy a reshuffling dataset is
        # not reproduced after a resume's skip (docs/fault-tolerance.md).
        def train():
            return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
                len(x_train), seed=args.seed, reshuffle_each_iteration=False).batch(
                    args.global_batch, drop_remainder=private(args))
        verbose = 2
        scope = strategy.scope()
        where = f"MirroredStrategy, {strategy.num_replicas_in_sync} replicas"
    if verbose:
        print(f"[train] {where}; global batch {args.global_batch}; "
              f"clip_by_global_norm({args.clip_norm}) after aggregation{describe_wrappers(args)}", flush=True)
    if scope is not None:
        with scope:
            model, optimizer = build_model(keras, args)
            model.compile(optimizer=optimizer, loss=loss_object(keras, args), metrics=["accuracy"])
    else:
        model, optimizer = build_model(keras, args)
        model.compile(optimizer=optimizer, loss=loss_object(keras, args), metrics=["accuracy"])
    # Every stage under fit, and XLA (Keras's default on GPU machines without a strategy,
    # which Horovod's collectives cannot run in) turned off with a logged reason.
    dm.integrate(model)
    callbacks.append(dm.callbacks.GradientStatsLogger())
    # Resumes from --checkpoint-dir, skipping the batches already trained; saves every
    # --checkpoint-every batches and on SIGTERM (then exits with 42).
    ckpt, fault = checkpointer(args, model, optimizer, rank if strategy is None else 0)
    ckpt.fit(train, epochs=args.epochs, verbose=verbose, shuffle=False, callbacks=callbacks + [fault.callback(ckpt)])
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.global_batch)

    def evaluate():
        return model.evaluate(test, verbose=0)[1]

    print_state_bytes(optimizer)
    print_fingerprints(model, optimizer, bool(verbose), args.weights_out)
    accuracy = evaluate()
    if verbose:
        print(f"[train] test accuracy {accuracy:.4f}", flush=True)
    steps = int(optimizer.iterations.numpy())
    report(args, model, optimizer, evaluate, steps, len(x_train), show=bool(verbose))
    return accuracy


def run_multiworker(args) -> float:
    """MultiWorkerMirroredStrategy: a custom loop (Keras 3's fit fails under it)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import dist_minimize as dm

    timeout = float(os.environ.get("DM_COLLECTIVE_TIMEOUT", "60"))
    strategy = dm.cluster.multi_worker_strategy(  # joined within DM_START_TIMEOUT seconds, or ended
        communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout))
    task = strategy.cluster_resolver.task_id
    n = strategy.num_replicas_in_sync
    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    if args.micro_batch is not None:  # the same micro-batches, and sums, on any number of workers
        workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
        if n != workers:
            raise SystemExit(f"--micro-batch under --backend multiworker takes one replica per worker. "
                             f"Received: {n} replicas on {workers} workers")
        args.accumulate = micro_batches_per_update(args, n)
        per_replica, loss_batch = args.micro_batch, args.micro_batch * n  # each micro-batch's mean / n
        steps = len(x_train) // args.global_batch * args.accumulate  # this worker's micro-batches an epoch
    elif args.global_batch % n:
        raise SystemExit(f"--global-batch must be divisible by the {n} replicas. "
                         f"Received: --global-batch={args.global_batch}")
    else:
        per_replica, loss_batch = args.global_batch // n, args.global_batch
        steps = len(x_train) // args.global_batch

    with strategy.scope():
        model, optimizer = build_model(keras, args)
        optimizer.build(model.trainable_variables)
        loss_obj = loss_object(keras, args, reduction="none")
    clip = optimizer.stack()[-1].transforms[-1]
    ckpt, fault = checkpointer(args, model, optimizer, task)
    start = ckpt.restore()  # batches already trained (0 without a checkpoint)
    if task == 0:
        print(f"[train] MultiWorkerMirroredStrategy, {n} workers; global batch {args.global_batch}; "
              f"clip_by_global_norm({args.clip_norm}) after aggregation; custom loop{describe_wrappers(args)}",
              flush=True)

    def dataset_fn(ctx):
        samples = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        if args.micro_batch is not None:
            ds = dm.elastic.micro_batches(samples, args.global_batch, args.micro_batch, ctx.num_input_pipelines,
                                          ctx.input_pipeline_id, len(x_train))
        else:
            ds = samples.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(per_replica, drop_remainder=True)
        # One stream over every epoch; a resumed run skips what was trained (one batch
        # per local replica and step).
        replicas_here = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        return ds.repeat().skip(start * replicas_here)

    @tf.function
    def step(batch):
        def replica_step(x, y):
            def loss_fn():
                per_example = loss_obj(y, model(x, training=True))
                if private(args):  # DifferentialPrivacy takes the per-example losses
                    return per_example
                return tf.nn.compute_average_loss(per_example, global_batch_size=loss_batch)
            value = loss_fn()
            optimizer.minimize(loss_fn, model.trainable_variables)
            if private(args):
                return tf.reduce_sum(value) / args.global_batch
            return value

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    it = iter(strategy.distribute_datasets_from_function(dataset_fn))
    before, losses = {k: float(v) for k, v in clip.stats().items()}, []
    for i in range(start, steps * args.epochs):
        losses.append(float(step(next(it))))
        fault.after_batch(i + 1)
        if ckpt.step_done():  # a stop (SIGTERM) agreed by every worker, and saved
            ckpt.exit()
        if (i + 1) % steps == 0:
            after = {k: float(v) for k, v in clip.stats().items()}
            d = {k: after[k] - before[k] for k in after}
            if task == 0:
                print(f"Epoch {(i + 1) // steps}/{args.epochs}: loss {np.mean(losses):.4f} - grad_norm "
                      f"{d['norm_sum'] / max(d['steps'], 1):.4g} - clipped_share "
                      f"{d['clipped_steps'] / max(d['steps'], 1):.4g}", flush=True)
            before, losses = after, []
    ckpt.finish()
    print_state_bytes(optimizer)
    print_fingerprints(model, optimizer, task == 0, args.weights_out)

    def evaluate():
        return float(np.mean(np.argmax(model(x_test, training=False), axis=-1) == y_test))

    accuracy = evaluate()
    if task == 0:
        print(f"[train] test accuracy {accuracy:.4f}", flush=True)
        report(args, model, optimizer, evaluate, steps * args.epochs, len(x_train))
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
    import signal

    args = parse_args(argv)
    # Held from before TensorFlow starts its threads until this worker has joined its
    # job (dm.cluster.multi_worker_strategy releases it), so that a SIGTERM meanwhile ends
    # the worker; released at once on the other backends (one sent meanwhile acts then).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    backend = resolve_backend(args.backend)
    if backend != "multiworker":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if backend == "horovod":
        run_fit(args)
    elif backend == "multiworker":
        run_multiworker(args)
        from dist_minimize import cluster

        # Every worker waits for the others, then they leave in an order that leaves no
        # heartbeat to a worker that is gone (which TensorFlow reports as a gRPC error).
        cluster.exit_worker(0)
    else:
        if args.micro_batch is not None:
            raise SystemExit("--micro-batch runs on the horovod and multiworker backends (horovod-gloo, horovod-mpi, "
                             "mpirun, multiworker). "
                             f"Received: --micro-batch={args.micro_batch} with --backend {backend}")
        run_fit(args, make_mirrored(args.replicas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
