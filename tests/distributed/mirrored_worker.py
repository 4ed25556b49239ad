"""Runs every MirroredStrategy parity case for one replica count; prints JSON results.

Run in its own process because tf.distribute's collective group keys clash when
strategies of different sizes share a process. Usage: mirrored_worker.py N
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tensorflow as tf  # noqa: E402

N = int(sys.argv[1])
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * N)

from tensorflow.python.distribute import distribute_lib  # noqa: E402

import parity_lib as P  # noqa: E402

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(N)])
default = tf.distribute.get_strategy()

# Count every replica-context all-reduce (the only way gradients cross replicas here).
calls = {"n": 0}
_orig = distribute_lib.ReplicaContextBase.all_reduce


def counting_all_reduce(self, *args, **kwargs):
    calls["n"] += 1
    return _orig(self, *args, **kwargs)


distribute_lib.ReplicaContextBase.all_reduce = counting_all_reduce

results = {}
for opt_name in ("sgd", "adam"):
    for mode in ("fit", "callable", "tape"):
        ref, _, _ = P.train(default, opt_name, mode)
        calls["n"] = 0
        got, opt, _ = P.train(strategy, opt_name, mode, eager=(mode == "callable"))
        results[f"{opt_name}/{mode}"] = {
            "diff": P.max_abs_diff(ref, got),
            "all_reduce_calls": calls["n"],
            "iterations": int(opt.iterations.numpy()),
            "clipped_steps": float(opt.gradient_stats()["clipped_steps"]),
        }
    # Anchor: stock Keras global_clipnorm (clips per replica) must NOT match.
    ref, _, _ = P.train(default, opt_name, "fit", use_dm=False)
    got, _, _ = P.train(strategy, opt_name, "fit", use_dm=False)
    results[f"{opt_name}/keras_anchor"] = {"diff": P.max_abs_diff(ref, got)}

print("RESULTS " + json.dumps(results), flush=True)
