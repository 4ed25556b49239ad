"""Compressed aggregation (`dm.CompressedAggregation`): the bytes each process sends per
step, the step time against the uncompressed step (on this machine's loopback, and on a
slow link), and the main job's task trained with each compression (loss against steps).

Usage (from the repository root, as root: the slow link is a network namespace of its own
whose loopback a token bucket limits, made and removed here):
  python benchmarks/compression.py           # writes benchmarks/COMPRESSION.md and compression.png
  python benchmarks/compression.py --quick   # a smoke run, written to /tmp
The plot needs matplotlib (`pip install -r requirements/bench.txt -c requirements/lock-default.txt`).

Every measurement is a `horovodrun --gloo` job of this file (`--worker OUT`): Adam + the
global-norm clip, Horovod's average; bytes sent are the loopback interface's counter over
STEPS steps divided by N (every process of the job talks over it); step times alternate
the compressed step with the uncompressed one beside an A/A control
(benchmarks/_timing.focused).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HERE = os.path.join(ROOT, "benchmarks")

CODECS = ["none", "fp16", "powersgd:4", "powersgd:1"]
STEPS = 5
SLOW_RATE = "500mbit"  # the slow link: about 62 MB/s shared by the job's processes


# -- the worker (one process of a horovodrun job) ----------------------------------------


def _models(keras, quick, size):
    models = {"4 x Dense(1024)": (lambda: keras.Sequential([keras.Input((1024,))]
                                                           + [keras.layers.Dense(1024) for _ in range(4)]), (1024,), None)}
    if not quick and size == 2:
        models["MobileNetV2 (32x32, 10 classes)"] = (
            lambda: keras.applications.MobileNetV2(input_shape=(32, 32, 3), classes=10, weights=None), (32, 32, 3), 10)
    return models


def _run(keras, tf, dm, np, hvd, make, shape, classes, codec):
    from benchmarks._steps import CLIP, LR

    keras.utils.set_random_seed(0)
    model = make()
    opt = dm.Optimizer(keras.optimizers.Adam(LR), aggregate_gradients=dm.aggregation.HorovodAggregator(),
                       transform_gradients=dm.clip_by_global_norm(CLIP))
    opt = opt if codec == "none" else dm.CompressedAggregation(opt, codec)
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.normal(size=(8, *shape)).astype("float32"))
    y = (tf.constant(rng.integers(0, classes, size=(8,)).astype("int32")) if classes
         else tf.constant(rng.normal(size=(8, *shape)).astype("float32")))
    variables = model.trainable_variables

    @tf.function(jit_compile=False)
    def step():
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = (tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, out)) if classes
                    else tf.reduce_mean(tf.square(out - y)))
        opt.minimize(loss, variables, tape=tape)

    def run(n):
        for _ in range(n):
            step()
        np.asarray(tf.reduce_sum(variables[0]))

    return run, 4 * int(sum(np.prod(v.shape) for v in variables))


def _convergence(keras, tf, dm, np, hvd, codec, epochs):
    """The main job's task (launch/train.py: digits, its model, Adam + clip 1.0, global
    batch 64), each process its share of each batch: the global loss at every step and
    the test accuracy."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    import train

    args = train.parse_args(["--compression", codec, "--epochs", str(epochs)])
    (x, y), (xt, yt) = train.load_digits(args.seed)
    model, opt = train.build_model(keras, args)
    opt.build(model.trainable_variables)
    local = args.global_batch // hvd.size()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        opt.minimize(loss, model.trainable_variables, tape=tape)
        return hvd.allreduce(loss)

    losses = []
    for _ in range(epochs):
        for start in range(0, len(x) - args.global_batch + 1, args.global_batch):
            s = start + hvd.rank() * local
            losses.append(float(step(tf.constant(x[s:s + local]), tf.constant(y[s:s + local]))))
    accuracy = float(np.mean(np.argmax(model(xt).numpy(), axis=1) == yt))
    return losses, accuracy


def worker(out_path, mode, quick):
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    import dist_minimize as dm
    from benchmarks import _timing
    from benchmarks._timing import loopback_sent

    hvd.init()
    size = hvd.size()
    codecs = CODECS if mode != "slow" else CODECS[:3]
    result = {"np": size, "mode": mode, "models": {}}
    agree = lambda n: int(hvd.broadcast_object(n, root_rank=0))  # noqa: E731
    for name, (make, shape, classes) in _models(keras, quick or mode == "slow", size).items():
        runs = {codec: _run(keras, tf, dm, np, hvd, make, shape, classes, codec) for codec in codecs}
        control, gradient_bytes = _run(keras, tf, dm, np, hvd, make, shape, classes, "none")
        row = {"gradient_bytes": gradient_bytes, "sent": {}, "ratio": {}, "control": {}, "ms": {}}
        for codec, (run, _) in runs.items():
            run(1)
            before = loopback_sent()
            run(STEPS)
            row["sent"][codec] = (loopback_sent() - before) / size / STEPS
        for codec, (run, _) in runs.items():
            if codec == "none":
                continue
            f = _timing.focused(run, runs["none"][0], control, reps=3 if quick else 21, block_seconds=0.0, agree=agree)
            row["ratio"][codec], row["control"][codec] = f.ratio.as_dict(), f.control.as_dict()
            row["ms"][codec], row["ms"]["none"] = f.timings.median_ms("a"), f.timings.median_ms("b")
        result["models"][name] = row
    if mode == "loopback" and size == 2:
        result["convergence"] = {codec: _convergence(keras, tf, dm, np, hvd, codec, 1 if quick else 5)
                                 for codec in CODECS}
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


# -- the driver ------------------------------------------------------------------------


def _job(np_, mode, quick, netns=None):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
               os.path.abspath(__file__), "--worker", out, "--mode", mode] + (["--quick"] if quick else [])
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        subprocess.run(cmd, check=True, timeout=900 if quick else 3600, cwd=ROOT)
        with open(out) as f:
            return json.load(f)


def _slow_link(quick):
    """The N=2 job in a network namespace whose loopback sends at most SLOW_RATE."""
    ns = f"dm-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                        SLOW_RATE, "burst", "256kb", "latency", "100ms"], check=True)
        return _job(2, "slow", quick, netns=ns)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _fmt(r):
    return f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"


def write(out_dir, jobs, seconds):
    lines = ["# Compressed aggregation: bytes, step time, convergence", "",
             f"- command: `python benchmarks/compression.py`; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{seconds:.0f} s; horovodrun --gloo on this machine (2 CPUs); Adam + clip; Horovod's average", "",
             "| link | N | model | gradient MB | compression | MB sent per process per step | sent / gradient | "
             "ring all-reduce minimum 2(N-1)/N x gradient MB | step time / uncompressed | A/A control | ms per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for link, job in jobs:
        n = job["np"]
        for name, row in job["models"].items():
            g = row["gradient_bytes"]
            for codec, sent in row["sent"].items():
                ratio = _fmt(row["ratio"][codec]) if codec in row["ratio"] else "1"
                control = _fmt(row["control"][codec]) if codec in row["control"] else "-"
                lines.append(f"| {link} | {n} | {name} | {g / 1e6:.1f} | {codec} | {sent / 1e6:.2f} | {sent / g:.3f} | "
                             f"{2 * (n - 1) / n * g / 1e6:.2f} | {ratio} | {control} | {row['ms'].get(codec, 0):.0f} |")
    conv = next((job["convergence"] for _, job in jobs if "convergence" in job), None)
    if conv:
        lines += ["", "The main job's task (launch/train.py's digits model, global batch 64, 5 epochs, N=2):", "",
                  "| compression | final loss (mean of the last 10 steps) | test accuracy | vs none |", "|---|---|---|---|"]
        base = conv["none"][1]
        for codec, (losses, acc) in conv.items():
            lines.append(f"| {codec} | {sum(losses[-10:]) / 10:.4f} | {acc:.4f} | {acc - base:+.4f} |")
        lines += ["", "![compression](compression.png)"]
        _plot(os.path.join(out_dir, "compression.png"), conv)
    lines += ["", "- Bytes: the loopback counter also carries Horovod's own coordination; the ring minimum is "
              "what an uncompressed ring all-reduce must send. The slow link: the job in a network namespace "
              f"whose loopback a token bucket holds to {SLOW_RATE} (both processes together).",
              "- Where it pays: on the loopback of 2 CPUs a step is bound by computation, so a compressed step "
              "pays its own work (fp16: the casts and the 16-bit sums, which Gloo makes on the CPU; PowerSGD: two "
              "products and a QR per matrix); on the slow link the bytes dominate. A model whose matrices have "
              "one column (depthwise kernels) or are vectors sends those whole.", ""]
    with open(os.path.join(out_dir, "COMPRESSION.md"), "w") as f:
        f.write("\n".join(lines))


def _plot(path, conv):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for codec, (losses, acc) in conv.items():
        ax.plot(range(1, len(losses) + 1), losses, label=f"{codec} (test accuracy {acc:.3f})", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_title("Compressed aggregation with error feedback, horovodrun -np 2")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="loopback", choices=["loopback", "slow"], help=argparse.SUPPRESS)
    p.add_argument("--no-slow-link", action="store_true", help="skip the slow link (needs root and iproute2)")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.mode, args.quick)
    start = time.time()
    jobs = [("loopback", _job(2, "loopback", args.quick)), ("loopback", _job(4, "loopback", args.quick))]
    if not args.no_slow_link:
        jobs.append((f"{SLOW_RATE} (namespace)", _slow_link(args.quick)))
    out_dir = tempfile.mkdtemp(prefix="dm-compression-") if args.quick else HERE
    write(out_dir, jobs, time.time() - start)
    print(f"wrote {os.path.join(out_dir, 'COMPRESSION.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
