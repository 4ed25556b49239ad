"""One MultiWorkerMirroredStrategy worker of a parity run; writes its weights as JSON.

Usage: multiworker_worker.py OUT_JSON CASE [CASE ...], with TF_CONFIG set by the caller.
A CASE is "OPT/MODE[/CLIP]" (e.g. "adam/callable", "sgd-0.01/tape/some"; CLIP is a
clip mode of parity_lib.CLIPS, default "always"), or "sam/NAME/MODE" (parity_lib.SAM_CASES), "compress/CODEC" (dm.CompressedAggregation),
or "shard/OPT/MODE/CLIP[/WRAP]" and "shard_lso_inf/1" (shard_optimizer_state=True against
the same run unsharded: tests/distributed/test_sharded_state.py). Every worker holds its own
shard of each global batch; each trains the same model and writes the final weights.
Collectives time out (DM_COLLECTIVE_TIMEOUT seconds) so a lost peer fails fast.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tensorflow as tf  # noqa: E402

import parity_lib as P  # noqa: E402

out_path, cases = sys.argv[1], sys.argv[2:]
timeout = float(os.environ.get("DM_COLLECTIVE_TIMEOUT", "60"))
strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout))
task = strategy.cluster_resolver.task_id
workers = strategy.num_replicas_in_sync
assert workers == 2, workers


def local_dataset(input_context):
    x, y = P.make_data()
    xs, ys = P.shard_rows(x, y, input_context.input_pipeline_id, input_context.num_input_pipelines)
    per_replica = input_context.get_per_replica_batch_size(P.GLOBAL_BATCH)
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(per_replica)


results = {}
import dist_minimize as dm  # noqa: E402
import keras  # noqa: E402

for case in cases:
    opt_name, mode, *rest = case.split("/")
    clip = rest[0] if rest else "always"
    if opt_name == "lso_inf":
        # An inf planted at step 2 on worker `mode` only: every worker must skip it.
        bad = int(mode)
        dataset = strategy.distribute_datasets_from_function(local_dataset)
        got, opt = P.train_custom(strategy, lambda: P.lso_sgd(dm, keras), dataset, P.STEPS, P.GLOBAL_BATCH,
                                  multiplier=lambda i: float("inf") if (i == 2 and task == bad) else 1.0)
        results[case] = {"weights": [w.tolist() for w in got], "iterations": int(opt.iterations.numpy()),
                         "skipped": int(opt.skipped_steps.numpy()),
                         "loss_scale": float(opt.loss_scale.numpy()), "clipped_steps": P.clipped_steps(opt)}
        continue
    if opt_name == "compress":
        # CompressedAggregation(CODEC): worker k's gradient is its own (both the same for
        # fp16, whose 16-bit sum of two equal values is exact); weights, the residuals' sum
        # and the exact sum of the gradients.
        import numpy as np

        rng = np.random.default_rng(11)
        grads = [[rng.normal(size=(16, 12)).astype(np.float32) * np.float32(1 + 1e-3) for _ in range(2)]
                 for _ in range(4)]
        if mode == "fp16":
            grads = [[g[0], g[0]] for g in grads]
        with strategy.scope():
            w = tf.Variable(np.zeros((16, 12), np.float32))
            opt = dm.CompressedAggregation(dm.Optimizer(keras.optimizers.SGD(1.0)), mode)
            opt.build([w])

        @tf.function
        def compressed_step(values):
            def replica(g):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * g)
                opt.minimize(loss, [w], tape=tape)
            strategy.run(replica, args=(values,))

        for g in grads:
            compressed_step(strategy.experimental_distribute_values_from_function(
                lambda ctx, g=g: tf.constant(g[ctx.replica_id_in_sync_group])))
        results[case] = {"weights": [w.numpy().tolist()], "residual": opt.slot("residual", w).numpy().tolist(),
                         "exact": np.sum([g[0] + g[1] for g in grads], axis=0).tolist()}
        continue
    if opt_name == "accumulate":
        k = int(mode)

        def micro_dataset(ctx, k=k):
            x, y = P.make_data(P.STEPS * k)
            xs, ys = P.shard_rows(x, y, ctx.input_pipeline_id, ctx.num_input_pipelines)
            return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(ctx.get_per_replica_batch_size(P.GLOBAL_BATCH))

        dataset = strategy.distribute_datasets_from_function(micro_dataset)
        got, opt = P.train_custom(strategy, lambda k=k: P.accumulating_adam(dm, keras, k), dataset,
                                  P.STEPS * k, P.GLOBAL_BATCH)
        results[case] = {"weights": [w.tolist() for w in got], "iterations": int(opt.iterations.numpy()),
                         "clipped_steps": P.clipped_steps(opt)}
        continue
    if opt_name == "sam":
        dataset = strategy.distribute_datasets_from_function(local_dataset)
        got, opt, _ = P.train(strategy, "adam", rest[0], clip="some", dataset=dataset, wrap=mode)
        results[case] = {"weights": [w.tolist() for w in got], "iterations": int(opt.iterations.numpy())}
        continue
    if opt_name == "shard_lso_inf":
        # An inf planted at step 2 on worker 1 only, the state sharded or not: every worker skips it.
        for shard in (False, True):
            dataset = strategy.distribute_datasets_from_function(local_dataset)

            def make(shard=shard):
                return dm.LossScaleOptimizer(P.build_optimizer(dm, keras, "sgd", clip="some", shard=shard),
                                             initial_scale=64.0)
            got, opt = P.train_custom(strategy, make, dataset, P.STEPS, P.GLOBAL_BATCH,
                                      multiplier=lambda i: float("inf") if (i == 2 and task == 1) else 1.0)
            results[f"lso_inf/{'sharded' if shard else 'unsharded'}"] = {
                "weights": [w.tolist() for w in got], "skipped": int(opt.skipped_steps.numpy()),
                "iterations": int(opt.iterations.numpy())}
        continue
    if opt_name == "shard":
        # "shard/OPT/MODE/CLIP[/WRAP]": the case unsharded and with shard_optimizer_state=True
        # (tests/distributed/test_sharded_state.py), in the same workers.
        o, m, c, *wrap = case.split("/")[1:]
        m = "fit_integrated" if m == "fit" else m  # stock Keras fit cannot run under MWMS (test_parity.py)
        wrapper = P.SHARD_WRAPS.get(wrap[0], wrap[0]) if wrap else None
        runs = {}
        for shard in (False, True):
            dataset = strategy.distribute_datasets_from_function(local_dataset)
            got, opt, model = P.train(strategy, o, m, clip=c, dataset=dataset, wrap=wrapper, shard=shard)
            averaging = opt.find(dm.MovingAverage) or opt.find(dm.SWA)
            averaged = None
            if averaging is not None:  # every worker's averages, gathered into the model
                averaging.assign_average_vars()
                averaged = [w.tolist() for w in P.weights(model)]
            runs["sharded" if shard else "unsharded"] = {
                "weights": [w.tolist() for w in got], "slots": P.slots_by_variable(opt, model),
                "averaged": averaged, "state_bytes": dm.optimizer_state_bytes(opt),
                "clipped_steps": P.clipped_steps(opt), "iterations": int(opt.iterations.numpy()),
                "accumulated": P.accumulated_elements(dm, opt)}
        results[case[len("shard/"):]] = runs
        continue
    if mode == "fit_anchor":
        # Stock Keras model.fit under MultiWorkerMirroredStrategy: record how it fails.
        import traceback

        import keras

        keras.config.disable_traceback_filtering()
        dataset = strategy.distribute_datasets_from_function(local_dataset)
        try:
            P.train(strategy, opt_name, "fit", use_dm=False, dataset=dataset)
            results[case] = {"error": None}
        except Exception as e:  # noqa: BLE001 - the anchor records whatever Keras raises
            results[case] = {"error": f"{type(e).__name__}: {str(e)[:200]}",
                             "frames": [f.name for f in traceback.extract_tb(e.__traceback__)]}
        continue
    dataset = strategy.distribute_datasets_from_function(local_dataset)
    got, opt, _ = P.train_case(strategy, case, dataset=dataset)
    results[case] = {
        "weights": [w.tolist() for w in got],
        "iterations": int(opt.iterations.numpy()),
        "clipped_steps": P.clipped_steps(opt),
    }
with open(out_path, "w") as f:
    json.dump({"task": task, "results": results}, f)
print(f"worker {task} done", flush=True)
