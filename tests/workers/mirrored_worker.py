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

import dist_minimize as dm  # noqa: E402
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


def copies_agree(variables) -> bool:
    """Every replica holds the same value of each (non replica-local) variable."""
    for v in variables:
        if "accumulated" in v.name:  # GradientAccumulation's sums are replica-local by design
            continue
        copies = [np.array(c) for c in strategy.experimental_local_results(v.value)]
        assert len(copies) == N, (v.path, len(copies))  # (each replica's copy, not one value)
        if not all(np.array_equal(c, copies[0]) for c in copies[1:]):
            return False
    return True


results = {}
keras_refs = {}
for key in P.MIRRORED_CASES_ON[N]:
    opt_name, mode, clip = key.split("/")
    ref, _, _ = P.train(default, opt_name, mode, clip=clip)
    if (opt_name, clip) not in keras_refs:
        # Independent reference: stock Keras (its own global_clipnorm) on one device, so a
        # bug shared by dist_minimize's reference and its distributed run cannot cancel.
        keras_refs[opt_name, clip], _, _ = P.train(default, opt_name, "fit", clip=clip, use_dm=False)
    calls["n"] = 0
    got, opt, model = P.train(strategy, opt_name, mode, clip=clip, eager=(mode == "callable"))
    results[key] = {
        "diff": P.max_abs_diff(ref, got),
        "keras_diff": P.max_abs_diff(keras_refs[opt_name, clip], got),
        "all_reduce_calls": calls["n"],
        "iterations": int(opt.iterations.numpy()),
        "clipped_steps": P.clipped_steps(opt),
        "copies_agree": copies_agree(list(opt.variables) + list(model.trainable_variables)),
    }
for opt_name in ("sgd", "adam"):
    # Anchor: stock Keras global_clipnorm (clips per replica) must NOT match.
    ref, _, _ = P.train(default, opt_name, "fit", use_dm=False)
    got, _, _ = P.train(strategy, opt_name, "fit", use_dm=False)
    results[f"{opt_name}/keras_anchor"] = {"diff": P.max_abs_diff(ref, got)}

# Weight wrappers, alone and all stacked: SGD with the clip firing on some
# steps (an unclipped SGD step is proportional to the gradient's scale). Weights, every
# optimizer variable (averages, slow weights, counts) and the clipped-step count are
# compared with one device. On 4 replicas each alone in a custom loop and the stack in fit
# and a custom loop; on 2 only the stack (the test-time budget; each wrapper alone in fit
# runs under horovodrun, tests/distributed/test_wrapper_parity.py).
for name in [*P.WEIGHT_WRAPPERS, "stack"] if N == 4 else ["stack"]:
    wrap = P.WEIGHT_STACK if name == "stack" else name
    for mode in ("fit", "tape") if name == "stack" else ("tape",):
        ref, ref_opt, _ = P.train(default, "sgd-0.01", mode, clip="some", wrap=wrap)
        got, opt, model = P.train(strategy, "sgd-0.01", mode, clip="some", wrap=wrap)
        state, ref_state = [np.array(v) for v in opt.variables], [np.array(v) for v in ref_opt.variables]
        results[f"wrap/{name}/{mode}"] = {
            "diff": P.max_abs_diff(ref, got),
            "state_diff": (max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(state, ref_state))
                           if len(state) == len(ref_state) else None),
            "iterations": int(opt.iterations.numpy()), "clipped_steps": P.clipped_steps(opt),
            "ref_clipped_steps": P.clipped_steps(ref_opt),
            "num_averaged": int(opt.find(dm.SWA).num_averaged.numpy()) if name in ("swa", "stack") else None,
            "copies_agree": copies_agree(list(opt.variables) + list(model.trainable_variables))}

# DifferentialPrivacy: SGD without a clipper (its steps see the gradient's
# scale); noise off, and noise on from a fixed seed (the same noise on 1, 2, 4 devices).
# SAM: the perturbation from the aggregated gradient, N replicas = one device.
for case in P.SAM_CASES:
    _, name, mode = case.split("/")
    ref, _, _ = P.train(default, "adam", mode, clip="some", wrap=name)
    got, opt, model = P.train(strategy, "adam", mode, clip="some", wrap=name)
    results[case] = {"diff": P.max_abs_diff(ref, got), "iterations": int(opt.iterations.numpy()),
                     "copies_agree": copies_agree(model.trainable_variables)}
for wrap in P.PRIVACY_WRAPPERS:
    for mode in ("tape", "fit_integrated"):
        ref, _, _ = P.train(default, "sgd", mode, clip=False, wrap=wrap)
        got, opt, model = P.train(strategy, "sgd", mode, clip=False, wrap=wrap)
        results[f"dp/{wrap}/{mode}"] = {"diff": P.max_abs_diff(ref, got), "iterations": int(opt.iterations.numpy()),
                                        "draws": int(opt.noise_draws.numpy()),
                                        "copies_agree": copies_agree(model.trainable_variables)}
ref_noise = P.privacy_noise(default)
noise = P.privacy_noise(strategy)
results["dp/noise"] = {"std": [float(m.std()) for m in noise["moves"]], "mean": [float(m.mean()) for m in noise["moves"]],
                       "diff": max(float(np.max(np.abs(a - b))) for a, b in zip(noise["moves"], ref_noise["moves"])),
                       "step_corr": float(np.corrcoef(noise["moves"][0], noise["moves"][1])[0, 1]),
                       "agree": noise["agree"], "draws": noise["draws"]}

print("RESULTS " + json.dumps(results), flush=True)
