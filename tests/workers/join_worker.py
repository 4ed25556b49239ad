"""A MultiWorkerMirroredStrategy worker that joins through `dm.cluster.multi_worker_strategy`
(tests/unit/test_cluster_join.py): prints `joining` just before the wait, `joined` after."""

import os
import signal
import sys

# SIGTERM held from before TensorFlow starts its threads (they inherit the mask), as
# launch/train.py does: multi_worker_strategy's watcher then sees one sent while joining.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402,F401  (imported before the marker: the wait is what is timed)

import dist_minimize as dm  # noqa: E402

print("joining", flush=True)
strategy = dm.cluster.multi_worker_strategy()
print("joined", strategy.num_replicas_in_sync, flush=True)
print("sigterm blocked", signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
