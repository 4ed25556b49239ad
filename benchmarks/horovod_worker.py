"""The Horovod sections (2 and 4's Horovod half), one process per rank under horovodrun.

Launched by `benchmarks/run.py` as
`horovodrun -np 2 -H localhost:2 --gloo python benchmarks/horovod_worker.py OUT.json`;
rank 0 writes the timings to OUT.json. Every rank runs the same alternating schedule,
so the collectives keep the ranks in step.
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
from benchmarks import _steps, _timing, _wrappers  # noqa: E402
from benchmarks._wrappers import EMA_DECAY  # noqa: E402
from benchmarks._steps import CLIP, LR  # noqa: E402
from dist_minimize.aggregation.horovod import DEFAULT_BYTES_PER_PACK  # noqa: E402


class HvdStep:
    def __init__(self, kind, build_model, local_batch, average_class=None):
        self.traces = 0
        model = build_model()
        rng = np.random.default_rng(hvd.rank())
        x = tf.constant(rng.normal(size=(local_batch, *model.input_shape[1:])).astype("float32"))
        y = tf.constant(rng.normal(size=(local_batch, model.output_shape[-1])).astype("float32"))
        variables = model.trainable_variables
        uses_dm = kind.startswith("dm") or kind.endswith("_avg")
        self.variables = variables
        if uses_dm:
            opt = dm.Optimizer(keras.optimizers.Adam(LR), aggregate_gradients="horovod",
                               transform_gradients=dm.clip_by_global_norm(CLIP),
                               skip_nonfinite=kind != "dm_clip_noguard")
            if kind == "dm_sam":
                opt = dm.SAM(opt, rho=_wrappers.SAM_RHO)
            elif kind == "builtin_avg":
                opt = dm.MovingAverage(opt, average_decay=EMA_DECAY)
            elif kind == "docs_avg":
                opt = average_class(opt, decay=EMA_DECAY)
        else:
            opt = _steps.disabled_all_reduce(keras.optimizers.Adam(LR))
        opt.build(variables)

        @tf.function(jit_compile=False)
        def step():
            self.traces += 1

            def loss_fn():
                return tf.reduce_mean(_steps.per_example_loss(model, x, y))

            with tf.GradientTape() as tape:
                loss = loss_fn()
            if uses_dm:
                opt.minimize(loss, variables, tape=tape, loss_fn=loss_fn)
            elif kind == "hand_sam":  # two passes, two grouped allreduces, the perturbation put back
                grads = hvd.grouped_allreduce(tape.gradient(loss, variables), op=hvd.Average)
                norm = tf.linalg.global_norm(grads)
                saved = [tf.identity(v) for v in variables]
                for v, w, g in zip(variables, saved, grads):
                    v.assign(w + _wrappers.SAM_RHO * g / (norm + 1e-12))
                with tf.GradientTape() as again:
                    second = loss_fn()
                grads = hvd.grouped_allreduce(again.gradient(second, variables), op=hvd.Average)
                for v, w in zip(variables, saved):
                    v.assign(w)
                grads, _ = tf.clip_by_global_norm(grads, CLIP)
                opt.apply_gradients(zip(grads, variables))
            else:
                grads = hvd.grouped_allreduce(tape.gradient(loss, variables), op=hvd.Average)
                grads, norm = tf.clip_by_global_norm(grads, CLIP)
                if kind == "hand_clip_guard":  # skip a non-finite step (the norm is the same on every rank)
                    tf.cond(tf.math.is_finite(norm), lambda: opt.apply_gradients(zip(grads, variables)),
                            lambda: opt.iterations)
                elif kind == "hand_clip_select":  # branch-free: update, then put back where not finite
                    state = list(variables) + list(opt.variables)
                    before = [tf.identity(v) for v in state]
                    with tf.control_dependencies(before):
                        opt.apply_gradients(zip(grads, variables))
                    finite = tf.math.is_finite(norm)
                    for v, old in zip(state, before):
                        v.assign(tf.where(finite, tf.convert_to_tensor(v), old))
                else:
                    opt.apply_gradients(zip(grads, variables))

        self._step, self._var = step, variables[0]
        if kind == "dm_clip_lowered":
            with _steps.lowered_guard():
                self.run(1)  # traced now, with the guard lowered

    def run(self, n):
        for _ in range(n):
            self._step()
        np.asarray(tf.reduce_sum(self._var))


class HvdAggregation:
    """`ROUNDS` chained `HorovodAggregator` calls on `count` tensors of `size` float32
    each, the outputs returned (see `run.py`'s `_StrategyAggregation`: a result nothing
    uses lets TensorFlow prune Horovod's collective from the graph)."""

    ROUNDS = 5

    def __init__(self, count, size, bytes_per_pack=DEFAULT_BYTES_PER_PACK):
        self.traces = 0
        self.bytes = 4 * count * size
        self._vars = [tf.Variable(tf.fill([size], float(i + hvd.rank()))) for i in range(count)]
        agg = dm.aggregation.HorovodAggregator(bytes_per_pack=bytes_per_pack)

        @tf.function(jit_compile=False)
        def reduce():
            self.traces += 1
            gv = [(tf.identity(v), v) for v in self._vars]
            for _ in range(self.ROUNDS):
                gv = agg(gv)
            return [g for g, _ in gv]

        self._fn = reduce

    def run(self, n):
        for _ in range(n):
            r = self._fn()
        np.asarray(r[-1])


def main(argv):
    out_path = argv[0]
    quick = "--quick" in argv
    hvd.init()
    reps, steps = (3, 3) if quick else (31, 10)  # two processes on two cores: noisier, more reps
    block = 0.0 if quick else 0.4  # seconds per timed block, as in run.py

    def agree(n):  # rank 0's calibrated step count on every rank (they run collectives together)
        return int(hvd.broadcast_object(n, root_rank=0))
    models = {"MLP 50 x Dense(128)": _steps.mlp(50, 128)}
    if not quick:
        models["MLP 10 x Dense(256)"] = _steps.mlp(10, 256)
        models["MLP 200 x Dense(32)"] = _steps.mlp(200, 32)
    results = {"np": hvd.size(), "steps": [], "aggregation": [], "custom": []}
    kinds = ("dm_clip", "hand_clip", "hand_clip_guard", "dm_clip_noguard", "dm_clip_lowered", "hand_clip_select")
    focus = {"reps": 3, "block_seconds": 0.0} if quick else {}

    copies = 1 if quick else _timing.FOCUS_COPIES

    def focused(kinds, build, *args):  # kinds[0] against kinds[1] alone, with the A/A control
        sides = {side: [HvdStep(k, build, 128, *args) for _ in range(copies)]
                 for side, k in (("a", kinds[0]), ("b", kinds[1]), ("b_again", kinds[1]))}
        f = _timing.focused(*([s.run for s in sides[side]] for side in ("a", "b", "b_again")), agree=agree, **focus)
        return {"ratio": f.ratio.as_dict(), "control": f.control.as_dict(),
                "ms": {kinds[0]: f.timings.median_ms("a"), kinds[1]: f.timings.median_ms("b")},
                "traces": {side: ",".join(str(s.traces) for s in steps) for side, steps in sides.items()}}

    for label, build in models.items():
        variants = {k: HvdStep(k, build, 128) for k in kinds}
        t = _timing.alternate({k: v.run for k, v in variants.items()}, reps=reps, steps=steps,
                              block_seconds=block, agree=agree)
        alone = focused(("dm_clip", "hand_clip"), build)
        results["steps"].append({
            "model": label, "local_batch": 128, "variables": len(variants["dm_clip"].variables),
            "ms": {k: t.median_ms(k) for k in variants},
            "ratio": t.ratio("dm_clip", "hand_clip").as_dict(),
            "ratio_guard": t.ratio("dm_clip", "hand_clip_guard").as_dict(),
            "ratio_noguard": t.ratio("dm_clip_noguard", "hand_clip").as_dict(),
            "ratio_lowered": t.ratio("dm_clip_lowered", "hand_clip").as_dict(),
            "ratio_select": t.ratio("hand_clip_select", "hand_clip").as_dict(),
            "alone": alone,
            "traces": {k: v.traces for k, v in variants.items()}})
    average = _wrappers.docs_wrapper()
    custom = {"MLP 10 x Dense(256)": _steps.mlp(10, 256)}
    if not quick:
        custom["MLP 50 x Dense(128)"] = _steps.mlp(50, 128)
    for label, build in custom.items():  # section 10 under horovodrun
        results.setdefault("sam", []).append({"model": label, "variables": len(build().trainable_variables),
                                              **focused(("dm_sam", "hand_sam"), build)})
    for label, build in custom.items():  # section 8 under horovodrun
        results["custom"].append({"model": label, "variables": len(build().trainable_variables),
                                  **focused(("docs_avg", "builtin_avg"), build, average)})
    count, size = (200, 1024) if quick else (200, 4096)
    variants = {"many": HvdAggregation(count, size), "one": HvdAggregation(1, count * size),
                "many_unpacked": HvdAggregation(count, size, bytes_per_pack=0)}
    t = _timing.alternate({k: v.run for k, v in variants.items()}, reps=reps, steps=3,
                          block_seconds=block, agree=agree)
    for label, many in (("horovod (Gloo), packed (default)", "many"),
                        ("horovod (Gloo), bytes_per_pack=0 (before)", "many_unpacked")):
        results["aggregation"].append({
            "backend": label, "count": count, "size": size, "bytes": variants["one"].bytes,
            "ms": {"many": t.median_ms(many), "one": t.median_ms("one")}, "rounds": HvdAggregation.ROUNDS,
            "ratio": t.ratio("one", many).as_dict(),  # time(one)/time(many) = throughput(many)/throughput(one)
            "traces": {k: v.traces for k, v in variants.items()}})
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
