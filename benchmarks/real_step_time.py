"""Step time on the real models of benchmarks/first_step.py, focused: dist_minimize's step
against the hand-written one (and the hand-written one with a guard), under
MirroredStrategy on 2 logical CPUs, alternating in one process (benchmarks/_timing.py).

    python benchmarks/real_step_time.py encoder [REPS [BLOCK_SECONDS]]

Prints one JSON line: each kind's median ms per step, and the ratios dm / hand,
dm / hand_guard and hand_guard / hand as [median, min, max] over the reps.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import _timing  # noqa: E402
import first_step  # noqa: E402


def main(model_name: str, reps: int = 15, block_seconds: float = 1.5) -> dict:
    backend = first_step.Backend("mirrored")
    variants = {}
    for kind in first_step.LOOP_KINDS:
        step, args, model = first_step.loop_step(backend, model_name, kind)
        sync = model.trainable_variables[0]

        def run(n, step=step, args=args, sync=sync):
            for _ in range(n):
                step(*args)
            np.asarray(tf.reduce_sum(sync))
        variants[kind] = run
    timings = _timing.alternate(variants, reps=reps, steps=1, warmup=2, block_seconds=block_seconds)
    out = {"model": model_name, "reps": reps, "ms": {k: timings.median_ms(k) for k in variants}}
    for a, b in (("dm", "hand"), ("dm", "hand_guard"), ("hand_guard", "hand")):
        r = timings.ratio(a, b)
        out[f"{a}/{b}"] = [r.median, r.low, r.high]
    return out


if __name__ == "__main__":
    argv = sys.argv[1:]
    print(json.dumps(main(argv[0], *(int(argv[1]),) if len(argv) > 1 else (),
                          *(float(argv[2]),) if len(argv) > 2 else ())))
