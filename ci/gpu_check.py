"""GPU check: parity and throughput of dist_minimize on every GPU this machine has.

Runs wherever TensorFlow for GPUs is installed (`pip install tensorflow[and-cuda]`, or the
docker/gpu image); without a GPU it says so and exits 0. Reports plainly what it ran and
what it could not run:

* parity: MirroredStrategy over the GPUs (NCCL all-reduce through
  aggregate_gradients="nccl") against one GPU on the same global batch, SGD and Adam with
  global-norm clipping active; max abs weight difference must be <= 1e-6 (TF32 is turned
  off so that float32 matmuls are exact float32). With one physical GPU it is split into
  2 logical GPUs; NCCL needs a distinct GPU per rank, so that case uses the strategy's
  HierarchicalCopyAllReduce and reports NCCL as not run.
* guarded update: dist_minimize makes its guarded update device by device, one If per
  device that TensorFlow keeps whole where every op of the update has a kernel for the
  device (`dist_minimize._compat.ops_without_kernel`). Adam and SWA(Lookahead(Adam))
  (whose schedules avoid int64 FloorMod) against one device (<= 1e-6), with the whole
  Ifs counted and any op without a kernel listed.
* throughput: steps/s of a 4x1024 MLP with dist_minimize (NCCL + clipping) against stock
  Keras (no clipping) in the same run; the ratio is reported, not judged.

Usage: python ci/gpu_check.py [--json OUT] [--steps 50] [--simulate-on-cpu]
(--simulate-on-cpu runs the same checks on 2 logical CPU devices with the strategy's
all-reduce, so the script's own logic is tested on machines without a GPU.)
Exit status: 0 when every check that ran passed (or no GPU), 1 when parity failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def plan(physical_gpus: int) -> dict:
    """What the check will run for a number of physical GPUs (no TensorFlow needed)."""
    if physical_gpus == 0:
        return {"run": False, "replicas": 0, "split": False, "nccl": False,
                "not_run": ["parity and throughput on GPUs: no GPU found"]}
    if physical_gpus == 1:
        return {"run": True, "replicas": 2, "split": True, "nccl": False,
                "not_run": ["NCCL all-reduce: one physical GPU (NCCL needs a distinct GPU per rank); "
                            "parity runs on 2 logical GPUs with HierarchicalCopyAllReduce"]}
    return {"run": True, "replicas": physical_gpus, "split": False, "nccl": True, "not_run": []}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--simulate-on-cpu", action="store_true")
    args = p.parse_args(argv)
    report = {"checks": {}, "not_run": []}

    def done(status: int) -> int:
        for line in report["not_run"]:
            print(f"[gpu-check] NOT RUN: {line}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return status

    try:
        import tensorflow as tf
    except ImportError as e:
        report["not_run"].append(f"everything: TensorFlow is not installed ({e})")
        return done(0)
    gpus = tf.config.list_physical_devices("GPU")
    report["gpus"] = [g.name for g in gpus]
    report["tensorflow"] = tf.__version__
    print(f"[gpu-check] TensorFlow {tf.__version__}, {len(gpus)} GPU(s): {report['gpus']}", flush=True)
    kind = "gpu"
    if args.simulate_on_cpu:
        kind, steps = "cpu", {"run": True, "replicas": 2, "split": True, "nccl": False,
                              "not_run": ["GPUs and NCCL: simulated on 2 logical CPU devices"]}
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    else:
        steps = plan(len(gpus))
    report["plan"] = steps
    report["not_run"] += steps["not_run"]
    if not steps["run"]:
        return done(0)
    if steps["split"] and kind == "gpu":
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=4096)] * 2)
    tf.config.experimental.enable_tensor_float_32_execution(False)

    import keras

    import dist_minimize as dm
    import parity_lib as P

    devices = [f"/{kind}:{i}" for i in range(steps["replicas"])]
    cross = None if steps["nccl"] or kind == "cpu" else tf.distribute.HierarchicalCopyAllReduce()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross)
    single = tf.distribute.OneDeviceStrategy(f"/{kind}:0")
    aggregate = "nccl" if steps["nccl"] else "strategy"
    ok = True
    for opt_name in ("sgd", "adam"):
        x, y = P.make_data()

        def run(strat, agg):
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH)
            with strat.scope():
                model = P.make_model(keras)
                opt = dm.Optimizer(P.make_inner(keras, opt_name), aggregate_gradients=agg,
                                   transform_gradients=dm.clip_by_global_norm(P.CLIP_NORM))
                model.compile(loss="mse", optimizer=opt)
            model.fit(ds, epochs=1, verbose=0, shuffle=False)
            return P.weights(model)

        diff = P.max_abs_diff(run(single, "none"), run(strategy, aggregate))
        passed = diff <= 1e-6
        ok &= passed
        report["checks"][f"parity/{opt_name}"] = {"max_abs_diff": diff, "passed": passed,
                                                  "replicas": steps["replicas"], "aggregate": aggregate}
        print(f"[gpu-check] parity {opt_name}: {steps['replicas']} replicas ({aggregate}) vs 1 {kind.upper()}: "
              f"max abs diff {diff:.3g} -> {'PASS' if passed else 'FAIL'}", flush=True)

    ok &= per_device_update(tf, keras, dm, P, kind, strategy, single, report)

    def throughput(use_dm: bool) -> float:
        import numpy as np

        per_replica = 256 if kind == "gpu" else 16
        batch = per_replica * steps["replicas"]
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * 4, 1024)).astype("float32")
        y = rng.normal(size=(batch * 4, 1)).astype("float32")
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
        with strategy.scope():
            model = keras.Sequential([keras.Input((1024,))] + [keras.layers.Dense(1024, activation="relu")
                                                               for _ in range(4 if kind == "gpu" else 1)]
                                     + [keras.layers.Dense(1)])
            opt = (dm.Optimizer(keras.optimizers.Adam(1e-4), aggregate_gradients=aggregate,
                                transform_gradients=dm.clip_by_global_norm(1.0))
                   if use_dm else keras.optimizers.Adam(1e-4))
            model.compile(loss="mse", optimizer=opt)
        model.fit(ds, steps_per_epoch=5, epochs=1, verbose=0)  # warm-up and tracing
        start = time.perf_counter()
        model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0)
        return args.steps / (time.perf_counter() - start)

    keras_sps, dm_sps = throughput(False), throughput(True)
    report["checks"]["throughput"] = {"keras_steps_per_s": keras_sps, "dist_minimize_steps_per_s": dm_sps,
                                      "ratio": dm_sps / keras_sps}
    print(f"[gpu-check] throughput: stock Keras {keras_sps:.1f} steps/s, dist_minimize ({aggregate} + clip) "
          f"{dm_sps:.1f} steps/s, ratio {dm_sps / keras_sps:.3f}", flush=True)
    return done(0 if ok else 1)


def per_device_update(tf, keras, dm, P, kind: str, strategy, single, report: dict) -> bool:
    """The guarded update made device by device on `kind` devices: parity against one
    device, and how many of its Ifs TensorFlow runs whole (one per device where every op
    of the update has a kernel there; the ops without one are listed)."""
    from dist_minimize import _compat

    stacks = {
        "adam": lambda: dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(0.5)),
        "swa+lookahead": lambda: dm.SWA(dm.Lookahead(
            dm.Optimizer(keras.optimizers.Adam(0.01), transform_gradients=dm.clip_by_global_norm(0.5)),
            sync_period=2), start_averaging=0, average_period=2),
    }
    ok = True
    for name, make in stacks.items():
        key = f"per_device/{name}"
        x, y = P.make_data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(P.GLOBAL_BATCH)
        want, _ = P.train_custom(single, make, ds, P.STEPS, P.GLOBAL_BATCH)
        got, opt = P.train_custom(strategy, make, ds, P.STEPS, P.GLOBAL_BATCH)
        variables = opt.trained_variables

        @tf.function
        def probe():
            strategy.run(lambda: opt.apply_gradients([(tf.zeros_like(v), v) for v in variables]))

        ifs = [op for op in probe.get_concrete_function().graph.get_operations() if op.type in ("If", "StatelessIf")]
        whole = [op for op in ifs if not op.get_attr("_lower_using_switch_merge")]
        missing = sorted({m for op in ifs if op not in whole for m in _compat.ops_without_kernel(op, kind.upper())})
        diff = P.max_abs_diff(want, got)
        passed = diff <= 1e-6
        ok &= passed
        report["checks"][key] = {"max_abs_diff": diff, "unlowered_ifs": len(whole), "ifs": len(ifs),
                                 "ops_without_kernel": missing, "passed": passed}
        print(f"[gpu-check] guarded update {name} on {kind.upper()}s: max abs diff {diff:.3g} -> "
              f"{'PASS' if passed else 'FAIL'}; {len(whole)} of {len(ifs)} If(s) whole (one per device "
              f"expected){'; ops without a kernel: ' + ', '.join(missing) if missing else ''}", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
