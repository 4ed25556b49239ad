"""Step time on the real models of benchmarks/first_step.py, focused: dist_minimize's step
against the hand-written one (and the hand-written one with a guard), alternating in one
process (benchmarks/_timing.py); under MirroredStrategy on 2 logical CPUs, or in each of
two processes (horovodrun --gloo -np 2, MultiWorkerMirroredStrategy on 127.0.0.1).

    python benchmarks/real_step_time.py MODEL [REPS [BLOCK_SECONDS]] [--backend B]

B: mirrored (default), horovod or multiworker. Under the two multi-process backends
every process must run the same steps (they meet in collectives), so a block is a fixed
number of steps (BLOCK_SECONDS is read as steps there).

Kinds: hand (one all-reduce, tf.clip_by_global_norm, Adam), hand_guard (the same with its
update in one agreed tf.cond), dm (dist_minimize, clip and the default guard: its update
one If per device), dm_whole (the same with the guarded update taken as `run_if`'s one
cond, not device by device: what the step costs without `dist_minimize/_per_device.py`).
Prints one JSON line (rank 0 under the multi-process backends): each kind's median ms
per step and the ratios as [median, min, max] over the reps.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KINDS = ("hand", "hand_guard", "dm", "dm_whole")
RATIOS = (("dm", "hand"), ("dm", "hand_guard"), ("hand_guard", "hand"), ("dm_whole", "hand"), ("dm_whole", "dm"))


def main(model_name: str, reps: int = 15, block: float = 1.5, backend_name: str = "mirrored") -> dict:
    import numpy as np
    import tensorflow as tf

    import _timing
    import first_step

    backend = first_step.Backend(backend_name)
    variants = {}
    for kind in KINDS:
        step, args, model = first_step.loop_step(backend, model_name, kind)
        sync = model.trainable_variables[0]

        def run(n, step=step, args=args, sync=sync):
            for _ in range(n):
                step(*args)
            np.asarray(tf.reduce_sum(sync))
        variants[kind] = run
    if backend_name == "mirrored":
        timings = _timing.alternate(variants, reps=reps, steps=1, warmup=2, block_seconds=block)
    else:
        timings = _timing.alternate(variants, reps=reps, steps=max(1, int(block)), warmup=2)
    out = {"model": model_name, "backend": backend_name, "reps": reps,
           "ms": {k: timings.median_ms(k) for k in variants}}
    for a, b in RATIOS:
        r = timings.ratio(a, b)
        out[f"{a}/{b}"] = [r.median, r.low, r.high]
    return out if backend.rank == 0 else {}


if __name__ == "__main__":
    argv = sys.argv[1:]
    backend_name = "mirrored"
    if "--backend" in argv:
        i = argv.index("--backend")
        backend_name = argv[i + 1]
        del argv[i:i + 2]
    if backend_name not in ("mirrored", "horovod", "multiworker"):
        sys.exit(f"--backend must be mirrored, horovod or multiworker; got {backend_name!r}")
    numbers = (int(argv[1]),) if len(argv) > 1 else ()
    numbers += (float(argv[2]),) if len(argv) > 2 else ()
    if backend_name != "mirrored" and "DM_REAL_STEP_WORKER" not in os.environ:
        from dist_minimize import launcher

        os.environ["DM_REAL_STEP_WORKER"] = "1"
        status = launcher.launch("horovod-gloo" if backend_name == "horovod" else "multiworker", 2,
                                 [os.path.abspath(__file__), *sys.argv[1:]], timeout=3000)
        sys.exit(status)
    result = main(argv[0], *numbers, backend_name=backend_name)
    if result:
        print(json.dumps(result), flush=True)
