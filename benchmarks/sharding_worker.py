"""Section 11: optimizer state sharded across Horovod processes, one job per measurement.

Launched by `benchmarks/run.py` as
`horovodrun -np N -H localhost:N --gloo python benchmarks/sharding_worker.py OUT.json MODE`:

  memory-sharded, memory-unsharded  one process per rank, one optimizer: Adam + clip,
      sharded or not, on a model of about 50M float32 weights (Adam's state about 400 MB);
      STEPS steps; each rank reports its optimizer-state bytes and its peak RSS (VmHWM)
  memory-sharded-reducescatter  the same, the sharded step taking Horovod's reduce-scatter
      (HorovodAggregator(shard_collective="reducescatter"); the default on CPUs is an
      all-reduce and a slice)
  time, time-reducescatter  both optimizers on one model each, alternating (benchmarks/_timing.focused):
      sharded / unsharded step time, and the bytes each process sent per step, read from
      the loopback interface's counter (every process of the job talks over it: its
      growth divided by N), for each
Rank 0 writes OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import dist_minimize as dm  # noqa: E402
from benchmarks import _timing  # noqa: E402
from benchmarks._timing import loopback_sent  # noqa: E402
from benchmarks._steps import CLIP, LR  # noqa: E402
from benchmarks.memory_worker import status_kb  # noqa: E402

WIDTH, DEPTH, BATCH = 2048, 12, 8  # 12 x Dense(2048): 50.4M weights, Adam's state 403 MB
STEPS = 5


class Run:
    def __init__(self, shard: bool, width: int, depth: int, collective: str = "auto"):
        keras.utils.set_random_seed(0)
        self.model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(depth)])
        self.backend = dm.aggregation.HorovodAggregator(shard_collective=collective)
        self.opt = dm.Optimizer(keras.optimizers.Adam(LR), aggregate_gradients=self.backend,
                                transform_gradients=dm.clip_by_global_norm(CLIP), shard_optimizer_state=shard)
        self.opt.build(self.model.trainable_variables)
        rng = np.random.default_rng(hvd.rank())
        x = tf.constant(rng.normal(size=(BATCH, width)).astype("float32"))
        y = tf.constant(rng.normal(size=(BATCH, width)).astype("float32"))
        variables = self.model.trainable_variables

        @tf.function(jit_compile=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self.model(x, training=True) - y))
            self.opt.minimize(loss, variables, tape=tape)

        self._step, self._var = step, variables[0]

    def run(self, n):
        for _ in range(n):
            self._step()
        np.asarray(tf.reduce_sum(self._var))


def main(argv):
    out_path, mode = argv[0], argv[1]
    quick = "--quick" in argv
    width, depth = (256, 4) if quick else (WIDTH, DEPTH)
    hvd.init()
    size = hvd.size()
    result = {"np": size, "mode": mode}
    collective = "reducescatter" if mode.endswith("reducescatter") else "auto"
    if mode.startswith("memory"):
        run = Run(mode.startswith("memory-sharded"), width, depth, collective)
        run.run(STEPS)
        result.update(weights=int(sum(np.prod(v.shape) for v in run.model.trainable_variables)),
                      state_bytes=dm.optimizer_state_bytes(run.opt), peak_rss_kb=status_kb("VmHWM"))
        per_rank = hvd.allgather_object(result)
    else:
        sharded = Run(True, width, depth, collective)
        plain, plain_again = Run(False, width, depth), Run(False, width, depth)
        sent = {}
        for name, r in (("sharded", sharded), ("unsharded", plain)):
            r.run(1)
            before = loopback_sent()
            r.run(STEPS)
            sent[name] = (loopback_sent() - before) / size / STEPS
        f = _timing.focused(sharded.run, plain.run, plain_again.run, reps=3 if quick else 61, block_seconds=0.0,
                            agree=lambda n: int(hvd.broadcast_object(n, root_rank=0)))
        result.update(collective=sharded.backend.collective_for_shards(), ratio=f.ratio.as_dict(), control=f.control.as_dict(), ms={
            "sharded": f.timings.median_ms("a"), "unsharded": f.timings.median_ms("b")},
            sent_per_step=sent, gradient_bytes=4 * int(sum(np.prod(v.shape) for v in plain.model.trainable_variables)))
        per_rank = [result]
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(per_rank, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
