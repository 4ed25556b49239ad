"""Runs every MirroredStrategy parity case for one replica count; prints JSON results.

Run in its own process because tf.distribute's collective group keys clash when
strategies of different sizes share a process. Usage: mirrored_worker.py N
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
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
keras_refs = {}
for key in P.MIRRORED_CASES:
    opt_name, mode, clip = key.split("/")
    ref, _, _ = P.train(default, opt_name, mode, clip=clip)
    if (opt_name, clip) not in keras_refs:
        # Independent reference: stock Keras (its own global_clipnorm) on one device, so a
        # bug shared by dist_minimize's reference and its distributed run cannot cancel.
        keras_refs[opt_name, clip], _, _ = P.train(default, opt_name, "fit", clip=clip, use_dm=False)
    calls["n"] = 0
    got, opt, _ = P.train(strategy, opt_name, mode, clip=clip, eager=(mode == "callable"))
    results[key] = {
        "diff": P.max_abs_diff(ref, got),
        "keras_diff": P.max_abs_diff(keras_refs[opt_name, clip], got),
        "all_reduce_calls": calls["n"],
        "iterations": int(opt.iterations.numpy()),
        "clipped_steps": P.clipped_steps(opt),
    }
for opt_name in ("sgd", "adam"):
    # Anchor: stock Keras global_clipnorm (clips per replica) must NOT match.
    ref, _, _ = P.train(default, opt_name, "fit", use_dm=False)
    got, _, _ = P.train(strategy, opt_name, "fit", use_dm=False)
    results[f"{opt_name}/keras_anchor"] = {"diff": P.max_abs_diff(ref, got)}

# DifferentialPrivacy (issue 10): SGD without a clipper (its steps see the gradient's
# scale); noise off, and noise on from a fixed seed (the same noise on 1, 2, 4 devices).
for wrap in P.PRIVACY_WRAPPERS:
    for mode in ("tape", "fit_integrated"):
        ref, _, _ = P.train(default, "sgd", mode, clip=False, wrap=wrap)
        got, opt, model = P.train(strategy, "sgd", mode, clip=False, wrap=wrap)
        copies_agree = all(
            all(np.array_equal(np.array(c), np.array(strategy.experimental_local_results(v.value)[0]))
                for c in strategy.experimental_local_results(v.value))
            for v in model.trainable_variables)
        results[f"dp/{wrap}/{mode}"] = {"diff": P.max_abs_diff(ref, got), "iterations": int(opt.iterations.numpy()),
                                        "draws": int(opt.noise_draws.numpy()), "copies_agree": copies_agree}
ref_noise = P.privacy_noise(default)
noise = P.privacy_noise(strategy)
results["dp/noise"] = {"std": [float(m.std()) for m in noise["moves"]], "mean": [float(m.mean()) for m in noise["moves"]],
                       "diff": max(float(np.max(np.abs(a - b))) for a, b in zip(noise["moves"], ref_noise["moves"])),
                       "step_corr": float(np.corrcoef(noise["moves"][0], noise["moves"][1])[0, 1]),
                       "agree": noise["agree"], "draws": noise["draws"]}

print("RESULTS " + json.dumps(results), flush=True)
