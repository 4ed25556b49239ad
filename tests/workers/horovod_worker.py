"""One rank of a Horovod test job (run under horovodrun or mpirun); writes JSON results.

Usage: horovod_worker.py OUT_DIR SCENARIO
  parity   (np=2)  parity cases, allreduce counting, sum, fp16, predivide, sparse,
                   broadcast, metric averaging, CompressedAggregation
  keras_rules (np=2)  every update rule keras.optimizers exports, tape/some and fit/none
  mpi      (np=2, MPI)  Horovod initialised from an mpi4py sub-communicator; Adasum;
                   mpi4py/Horovod library check
  three    (np=3, MPI)  Adasum refused on 3 processes; a process set built from an mpi4py
                   communicator (ranks 0, 1) trains with parity while rank 2 stays out
  sharded  (np=2, 4)  each case of parity_lib.SHARD_FEW_CASES unsharded and with
                   shard_optimizer_state=True; an inf on one rank skipped by every rank
  sharded_more  (np=2) the same for parity_lib.SHARD_CASES and SHARD_MORE_CASES
Each rank writes OUT_DIR/rank{R}.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402
import parity_lib as P  # noqa: E402

out_dir, scenario = sys.argv[1], sys.argv[2]
results = {}
default = tf.distribute.get_strategy()


def lists(ws):
    return [w.tolist() for w in ws]


class CountingHorovod:
    """Counts EXECUTED grouped_allreduce / allreduce calls made through the Horovod module.

    Each call also increments a variable when it runs (eagerly, or as part of a traced
    step), so retracing does not inflate the count and every executed step counts.
    """

    def __init__(self, hvd):
        self.hvd = hvd
        self.counts = {name: tf.Variable(0, dtype=tf.int64) for name in ("grouped_allreduce", "allreduce")}
        for name, var in self.counts.items():
            original = getattr(hvd, name)

            def counted(*a, _var=var, _orig=original, **k):
                out = _orig(*a, **k)
                with tf.control_dependencies(tf.nest.flatten(out)):
                    _var.assign_add(1)
                return out

            setattr(hvd, name, counted)

    def take(self):
        c = {k: int(v.numpy()) for k, v in self.counts.items()}
        for v in self.counts.values():
            v.assign(0)
        return c


if scenario == "parity":
    hvd = dm.horovod_keras.init()
    rank, size = hvd.rank(), hvd.size()
    counter = CountingHorovod(hvd)
    local = P.GLOBAL_BATCH // size
    results["helpers"] = {
        "discover": dm.cluster.discover().__dict__,
        "shard": [int(e) for e in dm.horovod_keras.shard(tf.data.Dataset.range(8))],
        "verbosity": dm.horovod_keras.verbosity(2),
        "root_only": len(dm.horovod_keras.root_only([keras.callbacks.History()])),
        "is_root": dm.horovod_keras.is_root(),
    }
    for key in P.HOROVOD_CASES:
        opt_name, mode, clip = (key.split("/") + ["always"])[:3]
        w, opt, _ = P.train(default, opt_name, mode.split("_")[0], eager=mode.endswith("_eager"), clip=clip,
                            dataset=P.local_dataset(rank, size), loss_denominator=local)
        results[key] = {"weights": lists(w), "calls": counter.take(), "iterations": int(opt.iterations.numpy()),
                        "clipped_steps": P.clipped_steps(opt)}
    for bad in range(size):
        # An inf planted at step 2 on rank `bad` only: every rank must skip it.
        w, opt = P.train_custom(default, lambda: P.lso_sgd(dm, keras), P.local_dataset(rank, size), P.STEPS, local,
                                multiplier=lambda i, bad=bad: float("inf") if (i == 2 and rank == bad) else 1.0)
        results[f"lso_inf/{bad}"] = {"weights": lists(w), "skipped": int(opt.skipped_steps.numpy()),
                                     "iterations": int(opt.iterations.numpy()),
                                     "loss_scale": float(opt.loss_scale.numpy()),
                                     "clipped_steps": P.clipped_steps(opt)}
    counter.take()
    for k in (2, 4):
        x, y = P.make_data(P.STEPS * k)
        xs, ys = P.shard_rows(x, y, rank, size)
        ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(local)
        w, opt = P.train_custom(default, lambda k=k: P.accumulating_adam(dm, keras, k), ds, P.STEPS * k, local)
        results[f"accumulate/{k}"] = {"weights": lists(w), "iterations": int(opt.iterations.numpy()),
                                      "calls": counter.take(), "clipped_steps": P.clipped_steps(opt)}
    # The weight wrappers: Adam with the clip firing on some steps.
    for name in P.WEIGHT_WRAPPERS:
        for mode in ("fit", "tape"):
            w, opt, _ = P.train(default, "adam", mode, clip="some", dataset=P.local_dataset(rank, size),
                                loss_denominator=local, wrap=name)
            results[f"wrap/{name}/{mode}"] = {"weights": lists(w), "state": [np.array(v).tolist() for v in opt.variables],
                                              "iterations": int(opt.iterations.numpy())}
    # DifferentialPrivacy: SGD without a clipper; noise off and noise on from a
    # fixed seed (the same noise as one device); unseeded, rank 0's seed reaches every rank.
    for name in P.PRIVACY_WRAPPERS:
        for mode in ("fit_integrated", "tape"):
            w, opt, _ = P.train(default, "sgd", mode, clip=False, dataset=P.local_dataset(rank, size), wrap=name)
            results[f"dp/{name}/{mode}"] = {"weights": lists(w), "iterations": int(opt.iterations.numpy()),
                                            "draws": int(opt.noise_draws.numpy())}
    # SAM: the loss evaluated again at weights perturbed along the aggregated gradient.
    counter.take()
    for case in P.SAM_CASES:
        _, name, mode = case.split("/")
        w, opt, _ = P.train(default, "adam", mode, clip="some", dataset=P.local_dataset(rank, size),
                            loss_denominator=local, wrap=name)
        results[case] = {"weights": lists(w), "iterations": int(opt.iterations.numpy()), "calls": counter.take()}
    noise = P.privacy_noise(default, dataset=P.local_dataset(rank, size))
    results["dp/noise"] = {"std": [float(m.std()) for m in noise["moves"]],
                           "head": [m[:500].tolist() for m in noise["moves"]]}
    P.PRIVACY_WRAPPERS["dp_unseeded"] = lambda dm, o: dm.DifferentialPrivacy(o, l2_norm_clip=P.DP_CLIP,
                                                                             noise_multiplier=P.DP_NOISE)
    w, opt, _ = P.train(default, "sgd", "tape", clip=False, dataset=P.local_dataset(rank, size), wrap="dp_unseeded")
    results["dp/unseeded"] = {"weights": lists(w), "seed": str(int(opt.noise_seed.numpy()))}
    counter.take()

    # Accumulation resumed mid-window from a checkpoint that rank 0 alone wrote (defect:
    # it held rank 0's partial sums only). After 6 of 16 micro-steps (window of 4), rank 0
    # writes the model and optimizer; every rank restores them into a fresh model and
    # optimizer and runs the remaining 10 micro-steps. With share_accumulators() before
    # the write the result is the uninterrupted one; without it, it is not.
    k, split = 4, 6
    x, y = P.make_data(P.STEPS * k)
    xs, ys = P.shard_rows(x, y, rank, size)
    batches = list(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(local))

    def accumulation_run(batches_, model=None, opt=None):
        model = model if model is not None else P.make_model(keras)
        opt = opt if opt is not None else P.accumulating_adam(dm, keras, k)
        opt.build(model.trainable_variables)

        @tf.function
        def step(xb, yb):
            def loss_fn():
                per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
                return tf.nn.compute_average_loss(per_example, global_batch_size=local)
            opt.minimize(loss_fn, model.trainable_variables)

        for xb, yb in batches_:
            step(xb, yb)
        return model, opt

    for share in (True, False):
        model, opt = accumulation_run(batches[:split])
        if share:
            opt.share_accumulators()
        path = os.path.join(out_dir, f"accumulation_share={share}")
        if rank == 0:
            tf.train.Checkpoint(model=model, optimizer=opt).write(path)
        hvd.allreduce(tf.constant(0), name=f"dm_test_barrier_{share}")  # the file exists for every rank
        fresh_model, fresh_opt = P.make_model(keras, seed=5), P.accumulating_adam(dm, keras, k)
        fresh_opt.build(fresh_model.trainable_variables)
        tf.train.Checkpoint(model=fresh_model, optimizer=fresh_opt).read(path).assert_existing_objects_matched()
        model, opt = accumulation_run(batches[split:], fresh_model, fresh_opt)
        results[f"accumulate_resumed/share={share}"] = {
            "weights": lists(P.weights(model)), "iterations": int(opt.iterations.numpy())}
    counter.take()

    # Accumulation through model.fit (micro-batches of the local batch size).
    x, y = P.make_data(P.STEPS * 2)
    xs, ys = P.shard_rows(x, y, rank, size)
    model = P.make_model(keras)
    acc_opt = P.accumulating_adam(dm, keras, 2)
    model.compile(loss="mse", optimizer=acc_opt)
    model.fit(xs, ys, batch_size=local, epochs=1, verbose=0, shuffle=False)
    results["accumulate_fit/2"] = {"weights": lists(P.weights(model)), "iterations": int(acc_opt.iterations.numpy()),
                                   "clipped_steps": P.clipped_steps(acc_opt)}

    # Consistency check: passes while in sync; a divergence planted on rank 1 is caught
    # by every rank at the same step.
    v = tf.Variable([1.0, 2.0], name="w")
    check_opt = dm.Optimizer(keras.optimizers.SGD(0.1), transform_gradients=dm.check_consistency(2))
    check_opt.build([v])
    check_step = tf.function(lambda: check_opt.apply_gradients([(tf.constant([1.0, 1.0]), v)]))
    check_step()
    check_step()
    if rank == 1:
        v.assign_add([0.0, 0.25])
    check_step()
    try:
        check_step()
        results["consistency"] = {"error": None}
    except tf.errors.InvalidArgumentError as e:
        results["consistency"] = {"error": e.message}
    try:
        dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="nccl").apply_gradients(
            [(tf.constant([1.0]), tf.Variable([0.0]))])
        results["nccl_error"] = None
    except ValueError as e:
        results["nccl_error"] = str(e)
    # Backend options, each on SGD with the clip never firing (an unclipped step is
    # proportional to the aggregated gradient, so a wrong scale shows).
    sum_agg = dm.aggregation.HorovodAggregator(reduction="sum")
    w, _, _ = P.train(default, "sgd-0.01", "callable", dataset=P.local_dataset(rank, size), clip="never",
                      loss_denominator=P.GLOBAL_BATCH, aggregate=sum_agg)
    results["sum"] = {"weights": lists(w)}
    fp16 = dm.aggregation.HorovodAggregator(compression="fp16")
    recorder = P.MaxAbsRecorder()
    w, _, _ = P.train(default, "sgd-0.01", "callable", dataset=P.local_dataset(rank, size), clip="never",
                      loss_denominator=local, aggregate=fp16, unaggregated=recorder)
    results["fp16"] = {"weights": lists(w), "local_max_abs": recorder.values.numpy().tolist()}
    # A factor that differs from the process count, so dropping the pre- or the
    # post-scaling (1/4 before the sum, 4/2 after it) changes the result.
    pre = dm.aggregation.HorovodAggregator(gradient_predivide_factor=4.0)
    w, _, _ = P.train(default, "sgd-0.01", "callable", dataset=P.local_dataset(rank, size), clip="never",
                      loss_denominator=local, aggregate=pre)
    results["predivide"] = {"weights": lists(w)}
    # Packing: off, in buffers of 64 bytes (several per step), and the 160-byte kernel sent
    # alone beside the packed rest (pack_below); the default packs all.
    for label, options in (("unpacked", {"bytes_per_pack": 0}), ("pack64", {"bytes_per_pack": 64}),
                           ("pack_below", {"pack_below": 100})):
        agg = dm.aggregation.HorovodAggregator(**options)
        w, _, _ = P.train(default, "sgd-0.01", "callable", dataset=P.local_dataset(rank, size), clip="never",
                          loss_denominator=local, aggregate=agg)
        results[label] = {"weights": lists(w)}
    ids, y = P.embedding_data()
    ids_l, y_l = P.shard_rows(ids, y, rank, size)
    for dense in (False, True):
        ds = tf.data.Dataset.from_tensor_slices((ids_l, y_l)).batch(local)
        agg = dm.aggregation.HorovodAggregator(sparse_as_dense=dense)
        results[f"embedding/dense={dense}"] = {"weights": lists(P.train_embedding(default, ds, aggregate=agg))}

    # Broadcast: each rank starts from different weights (seed 1 + rank); the callback
    # must put rank 0's on every rank before the first step.
    seen = {}

    class FirstBatchWeights(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                seen["w"] = lists(P.weights(self.model))

    w, _, model = P.train(default, "adam", "fit", dataset=P.local_dataset(rank, size),
                          model_seed=1 + rank,
                          callbacks=[dm.horovod_keras.BroadcastVariablesCallback(), FirstBatchWeights()])
    results["broadcast"] = {"first_step_weights": seen["w"], "weights": lists(w),
                            "rank0_initial": lists(P.weights(P.make_model(keras, seed=1)))}

    # Metric averaging: each rank logs its rank; the average over 2 ranks is 0.5.
    recorded = {}

    class LogRank(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["rank_value"] = float(rank)
            recorded["local_loss"] = float(logs["loss"])

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            recorded["rank_value"] = logs["rank_value"]
            recorded["loss"] = logs["loss"]

    P.train(default, "sgd", "fit", dataset=P.local_dataset(rank, size),
            callbacks=[LogRank(), dm.horovod_keras.MetricAverageCallback(), Record()])
    losses = hvd.allgather(tf.constant([recorded["local_loss"]])).numpy().tolist()
    results["metric_average"] = {**recorded, "all_local_losses": losses}

    # XLA, Keras's default on a GPU machine without a strategy (the Horovod case): the
    # Horovod backend refuses it at the first trace, naming the fix, on every rank (no
    # rank is left in a collective); dm.integrate turns it off and trains as without.
    def xla_fit(integrate):
        model = P.make_model(keras)
        opt = P.build_optimizer(dm, keras, "sgd-0.01", True, "some", "auto", None)
        model.compile(loss="mse", optimizer=opt, jit_compile=True)
        if integrate:
            dm.integrate(model)
        model.fit(P.local_dataset(rank, size), epochs=1, verbose=0, shuffle=False, steps_per_epoch=P.STEPS)
        return model, opt

    try:
        xla_fit(False)
        results["xla_plain"] = {"error": None}
    except RuntimeError as e:
        results["xla_plain"] = {"error": str(e)}
    model, opt = xla_fit(True)
    results["xla_integrated"] = {"weights": lists(P.weights(model)), "jit_compile": model.jit_compile,
                                 "clipped_steps": P.clipped_steps(opt), "iterations": int(opt.iterations.numpy())}

    # CompressedAggregation (fp16, error feedback): rank r's gradient is g_t * (1 + r) in
    # "different", g_t on both in "same"; then a Checkpointer's save evens the residuals out.
    rng = np.random.default_rng(7)
    comp_grads = [rng.normal(size=(32, 1)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(4)]
    results["compression"] = {"grads": [g.ravel().tolist() for g in comp_grads]}
    for label, factor, codec, units in (("same", 1.0, "fp16", 1), ("different", 1.0 + rank, "fp16", 1),
                                        ("powersgd", 1.0 + rank, "powersgd:1", 4)):
        comp_model = keras.Sequential([keras.Input((32,)),
                                       keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros")])
        comp_opt = dm.CompressedAggregation(dm.Optimizer(keras.optimizers.SGD(1.0)), codec)
        kernel = comp_model.trainable_variables[0]
        comp_opt.build([kernel])

        @tf.function
        def comp_step(g):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(kernel * g)
            comp_opt.minimize(loss, [kernel], tape=tape)

        for g in comp_grads:  # (32, units), rank 2 where units = 4: g [1 2 3 4] + roll(g) [1 -1 1 -1]
            full = g * np.arange(1, units + 1) + (np.roll(g, 1) * (-1.0) ** np.arange(units) if units > 1 else 0)
            comp_step(tf.constant((full * factor).astype(np.float32)))
        entry = {"w": kernel.numpy().ravel().tolist(),
                 "residual": comp_opt.slot("residual", kernel).numpy().ravel().tolist()}
        if label == "different":
            dm.Checkpointer(os.path.join(out_dir, "ckpt"), comp_model, comp_opt, every=10 ** 6).save()
            entry["residual_saved"] = comp_opt.slot("residual", kernel).numpy().ravel().tolist()
        results["compression"][label] = entry
elif scenario in ("sharded", "sharded_more"):
    # Buckets of at most 128 bytes: the model's variables (40, 8, 8, 1 floats) then travel
    # in several reduce-scatters and all-gathers per step, as a large model's do.
    from dist_minimize.aggregation import sharded as sharded_collectives
    sharded_collectives.BUCKET_BYTES = 128
    hvd = dm.horovod_keras.init()
    rank, size = hvd.rank(), hvd.size()
    local = P.GLOBAL_BATCH // size
    # Each collective a sharded step can take, on each controller: the default ("auto":
    # an all-reduce and a slice on CPUs) on Gloo -np 2, Horovod's reduce-scatter on -np 4
    # and under MPI.
    collective = "reducescatter" if size == 4 or "OMPI_COMM_WORLD_RANK" in os.environ else "auto"
    backend = dm.aggregation.HorovodAggregator(shard_collective=collective)
    results["shard_collective"] = backend.collective_for_shards()
    for case in (P.SHARD_CASES + P.SHARD_MORE_CASES) if scenario == "sharded_more" else P.SHARD_FEW_CASES:
        opt_name, mode, clip, *wrap = case.split("/")
        runs = {}
        wrapper = P.SHARD_WRAPS.get(wrap[0], wrap[0]) if wrap else None  # or a name P.train knows
        for shard in (False, True):
            w, opt, model = P.train(default, opt_name, mode, clip=clip, dataset=P.local_dataset(rank, size),
                                    loss_denominator=local, wrap=wrapper, shard=shard,
                                    aggregate=backend if shard else "auto")
            averaged = None
            averaging = opt.find(dm.MovingAverage) or opt.find(dm.SWA)
            if averaging is not None:  # every process's averages, gathered into the model
                averaging.assign_average_vars()
                averaged = lists(P.weights(model))
            runs["sharded" if shard else "unsharded"] = {
                "weights": lists(w), "slots": P.slots_by_variable(opt, model), "averaged": averaged,
                "state_bytes": dm.optimizer_state_bytes(opt), "clipped_steps": P.clipped_steps(opt),
                "accumulated": P.accumulated_elements(dm, opt),
                "iterations": int(opt.iterations.numpy())}
        results[case] = runs
    for shard in (False, True):
        # An inf planted at step 2 on the last rank only: every rank must skip it.
        def make(shard=shard):
            return dm.LossScaleOptimizer(P.build_optimizer(dm, keras, "sgd", clip="some", shard=shard),
                                         initial_scale=64.0)
        w, opt = P.train_custom(default, make, P.local_dataset(rank, size), P.STEPS, local,
                                multiplier=lambda i: float("inf") if (i == 2 and rank == size - 1) else 1.0)
        results[f"lso_inf/{'sharded' if shard else 'unsharded'}"] = {
            "weights": lists(w), "skipped": int(opt.skipped_steps.numpy()), "iterations": int(opt.iterations.numpy())}

elif scenario == "keras_rules":
    # Every update rule keras.optimizers exports (tests/distributed/test_keras_parity.py).
    hvd = dm.horovod_keras.init()
    rank, size = hvd.rank(), hvd.size()
    for key in P.keras_rule_cases(keras) + P.LAZY_CASES:
        w, opt, _ = P.train_case(default, key, dataset=P.local_dataset(rank, size),
                                 loss_denominator=P.GLOBAL_BATCH // size)
        results[key] = {"weights": lists(w), "iterations": int(opt.iterations.numpy()),
                        "clipped_steps": P.clipped_steps(opt)}

    # What would aggregate twice is refused at the first trace, before any collective runs.
    class TwiceHorovod(dm.aggregation.HorovodAggregator):
        def __call__(self, grads_and_vars):
            return super().__call__(super().__call__(grads_and_vars))

    class AllReducingSGD(keras.optimizers.SGD):
        def apply(self, grads, trainable_variables=None):
            return super().apply([hvd.allreduce(g) for g in grads], trainable_variables)

    refusals = {"twice_backend": lambda dm_, o: dm_.Optimizer(keras.optimizers.SGD(0.1),
                                                                aggregate_gradients=TwiceHorovod()),
                "allreducing_rule": lambda dm_, o: dm_.Optimizer(AllReducingSGD(0.1))}
    for key, make in refusals.items():
        try:
            P.train(default, "sgd", "callable", wrap=make, dataset=P.local_dataset(rank, size),
                    loss_denominator=P.GLOBAL_BATCH // size)
            results[key] = None
        except dm.aggregation.exactly_once.AggregationError as e:
            results[key] = str(e)
elif scenario == "mpi":
    from mpi4py import MPI

    sub = MPI.COMM_WORLD.Split(color=0, key=MPI.COMM_WORLD.Get_rank())
    hvd = dm.cluster.init_horovod(comm=sub)
    rank, size = hvd.rank(), hvd.size()
    results["init"] = {"hvd_rank": rank, "hvd_size": size, "mpi_rank": MPI.COMM_WORLD.Get_rank(),
                       "mpi_enabled": bool(hvd.mpi_enabled()),
                       "same_mpi": dm.cluster.check_same_mpi()}
    results["discover"] = dm.cluster.discover().__dict__
    for key in P.HOROVOD_MPI_CASES:
        opt_name, mode, clip = (key.split("/") + ["always"])[:3]
        w, opt, _ = P.train(default, opt_name, mode, dataset=P.local_dataset(rank, size), clip=clip,
                            loss_denominator=P.GLOBAL_BATCH // size)
        results[key] = {"weights": lists(w), "clipped_steps": P.clipped_steps(opt)}
    a = tf.constant([1.0, 2.0, -1.0]) if rank == 0 else tf.constant([0.5, -1.0, 3.0])
    agg = dm.aggregation.HorovodAggregator(reduction="adasum")
    [(g, _)] = agg([(a, tf.Variable(tf.zeros(3)))])
    results["adasum"] = {"local": a.numpy().tolist(), "result": g.numpy().tolist()}
    sparse = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    try:
        agg([(sparse, tf.Variable(tf.zeros([3, 2])))])
        results["adasum_sparse_error"] = None
    except ValueError as e:
        results["adasum_sparse_error"] = str(e)

elif scenario == "three":
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    pair = world.Split(color=0 if world.Get_rank() < 2 else 1, key=world.Get_rank())
    hvd = dm.cluster.init_horovod(comm=world, process_set_comms=[pair])
    rank, size = hvd.rank(), hvd.size()
    try:
        dm.aggregation.HorovodAggregator(reduction="adasum")([(tf.ones(2), tf.Variable(tf.zeros(2)))])
        results["adasum_error"] = None
    except ValueError as e:
        results["adasum_error"] = str(e)
    [pset] = dm.cluster.process_sets()
    results["process_set"] = {"ranks": list(pset.ranks), "size": pset.size()}
    if rank < 2:
        agg = dm.aggregation.HorovodAggregator(process_set=pset)
        w, _, _ = P.train(default, "adam", "callable", dataset=P.local_dataset(rank, 2),
                          loss_denominator=P.GLOBAL_BATCH // 2, aggregate=agg)
        results["process_set"]["weights"] = lists(w)
    hvd.join()
else:
    raise SystemExit(f"unknown scenario {scenario!r}")

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
print(f"rank {rank} done", flush=True)
