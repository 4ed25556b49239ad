"""A Horovod job in which rank 1 fails after 2 steps; rank 0 keeps calling collectives.

Usage: failing_worker.py raise|kill. The launcher must end the job with a non-zero
status in bounded time instead of leaving rank 0 waiting in its allreduce.
"""

import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dist_minimize as dm  # noqa: E402

mode = sys.argv[1]
hvd = dm.horovod_keras.init()
agg = dm.aggregation.HorovodAggregator()
v = tf.Variable([1.0])
for step in range(10_000):
    if hvd.rank() == 1 and step == 2:
        if mode == "raise":
            raise RuntimeError("planted failure on rank 1 at step 2")
        os.kill(os.getpid(), signal.SIGKILL)
    agg([(tf.constant([float(step)]), v)])
print("unreachable: rank 0 finished 10000 steps", flush=True)
