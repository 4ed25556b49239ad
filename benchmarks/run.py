"""dist_minimize benchmarks: every comparison against its anchor in the same run, as ratios.

Usage (from the repository root):
  python benchmarks/run.py                      # full run (over an hour on 2 CPUs): RESULTS.md + results.png (+ sharding.png)
  python benchmarks/run.py --quick --only clip  # a smoke run of one section
  python benchmarks/run.py --out DIR --no-plot  # write elsewhere, without matplotlib

Sections (--only takes a comma-separated list): step, horovod, clip, aggregation,
growth, memory, wrappers, custom, guard, sam, sharding. Timings alternate A and B in one process (benchmarks/_timing.py);
the ratio is time(A) / time(B) per rep, reported as the median [min-max] over reps:
above 1 means A is slower. Absolute times are context only: these machines are shared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HERE = os.path.join(ROOT, "benchmarks")

SECTIONS = ("step", "horovod", "clip", "aggregation", "growth", "memory", "wrappers", "custom", "guard", "sam",
            "sharding")
STEP_TARGET, WRAPPER_TARGET, AGG_TARGET, MEMORY_TARGET = 1.03, 1.05, 0.9, 1.05
FOCUS_NOTE = ("The check and the A/A control: the two steps compared alone, each side three independently built "
              "copies (a build keeps its own speed for the life of the process: copies of one step differed by "
              "up to 6%), beside a second set of three copies of the anchor, every copy in 0.1 s blocks in each "
              "of 61 alternating turns (benchmarks/_timing.focused); the control's distance from 1 is this "
              "machine's noise on the same comparison.")


def fmt(r: dict) -> str:
    return f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"


def check(item: str, ratio: dict, target: float, higher_is_better: bool = False) -> dict:
    ok = ratio["median"] >= target if higher_is_better else ratio["median"] <= target
    return {"item": item, "measured": fmt(ratio), "target": ("≥ " if higher_is_better else "≤ ") + f"{target:g}",
            "ok": ok, "median": ratio["median"]}


class Context:
    """What the in-process sections share: the strategy on 2 logical CPUs and the run size."""

    def __init__(self, quick: bool):
        import tensorflow as tf

        self.tf = tf
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        self.strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        self.quick = quick
        self.reps = 3 if quick else 11
        self.steps = 3 if quick else 10
        # a timed block of about 0.4 s: shorter ones measured mostly the machine (an A/A
        # comparison of one step against itself spread 0.92-1.10 per rep at 0.4 s)
        self.block_seconds = 0.0 if quick else 0.4
        # the checked rows of sections 8-10: a focused comparison (see _timing.focused)
        self.focus = {"reps": 3, "block_seconds": 0.0} if quick else {}
        from benchmarks import _timing

        self.copies = 1 if quick else _timing.FOCUS_COPIES


def _focused(ctx, make_a, make_b):
    """`make_a()` against `make_b()` alone, with the A/A control (`make_b()` built again),
    `ctx.copies` builds of each side. Returns the comparison and, per side, its builds."""
    from benchmarks import _timing

    built = [[make() for _ in range(ctx.copies)] for make in (make_a, make_b, make_b)]
    return _timing.focused(*([s.run for s in side] for side in built), **ctx.focus), built


def _traces(sides) -> str:
    """The traces column of a focused row: each side's builds' trace counts."""
    return "/".join(",".join(str(b.traces) for b in side) for side in sides)


def _compare(ctx, makers: dict, steps: int | None = None, multiple: int = 1, calibrate: bool = True):
    from benchmarks import _timing

    built = {name: make() for name, make in makers.items()}
    t = _timing.alternate({n: s.run for n, s in built.items()}, reps=ctx.reps, steps=steps or ctx.steps,
                          block_seconds=ctx.block_seconds if calibrate else 0.0, multiple=multiple)
    return t, built


# -- section 1 ---------------------------------------------------------------------------

def _models(ctx):
    from benchmarks import _steps

    models = [("MLP 50 x Dense(128)", _steps.mlp(50, 128), 256),
              ("MLP 10 x Dense(256)", _steps.mlp(10, 256), 256),
              ("MLP 200 x Dense(32)", _steps.mlp(200, 32), 256),
              ("ResNet-like CNN (16x16x3, 7 conv)", _steps.resnet_cnn(), 64)]
    # --quick: one tiny model, so a smoke run costs seconds (its ratios measure nothing)
    return [("MLP 4 x Dense(32)", _steps.mlp(4, 32), 64)] if ctx.quick else models


def section_step(ctx):
    from benchmarks import _steps

    rows, checks, plot, graph_rows = [], [], [], []
    kinds = ("dm_clip", "hand_clip", "hand_clip_guard", "dm_clip_noguard", "keras_clip", "keras")
    for label, build, batch in _models(ctx):
        t, built = _compare(ctx, {k: (lambda k=k: _steps.make(k, ctx.strategy, build, batch)) for k in kinds})
        nvars = len(built["dm_clip"].model.trainable_variables)
        r = {k: t.ratio("dm_clip", k).as_dict() for k in kinds[1:]}
        noguard = t.ratio("dm_clip_noguard", "hand_clip").as_dict()
        guard = t.ratio("hand_clip_guard", "hand_clip").as_dict()
        rows.append([label, nvars, batch, f"{t.median_ms('dm_clip'):.1f}", f"{t.median_ms('hand_clip'):.1f}",
                     fmt(r["hand_clip"]), fmt(r["hand_clip_guard"]), fmt(noguard), fmt(guard),
                     fmt(r["keras_clip"]), fmt(r["keras"]), "/".join(str(built[k].traces) for k in kinds)])
        checks.append(check(f"1. MirroredStrategy {label}: dist_minimize / hand-written", r["hand_clip"], STEP_TARGET))
        checks.append(check(f"1. MirroredStrategy {label}: dist_minimize / hand-written with the same non-finite "
                            "guard", r["hand_clip_guard"], STEP_TARGET))
        plot.append((label, r))
        stats = {k: built[k].graph_stats() for k in kinds[:4]}
        graph_rows.append([label, nvars] + [f"{stats[k]['nodes']} / {_conds(stats[k])}" for k in kinds[:4]])
    return {
        "title": "1. MirroredStrategy, 2 logical CPUs: dist_minimize (Adam + cross-replica clip) against the anchors",
        "tables": [{"header": ["model", "variables", "global batch", "dm ms/step", "hand ms/step",
                               "dm / hand-written", "dm / hand-written + guard", "dm without guard / hand-written",
                               "hand + guard / hand (the guard's cost)", "dm / Keras global_clipnorm",
                               "dm / Keras no clip", "traces " + "/".join(kinds)], "rows": rows},
                   {"header": ["model", "variables", "graph nodes / cond inputs: dm", "hand-written",
                               "hand-written + guard", "dm without guard"], "rows": graph_rows}],
        "notes": ["hand-written: tape; one ReplicaContext.all_reduce(SUM) of all gradients; tf.clip_by_global_norm; "
                  "Adam.apply_gradients with its own all-reduce disabled. hand-written + guard: the same, with the "
                  "update in a tf.cond on the finite norm taken in the cross-replica context (a merge_call): the skip "
                  "that dist_minimize's default skip_nonfinite=True makes (without it one inf gradient writes NaN "
                  "into every weight), as a hand-written step would write it; dist_minimize takes it with one "
                  "unlowered cond per device. dm without guard: dist_minimize with skip_nonfinite=False. Keras "
                  "global_clipnorm clips each replica's gradients with its own norm before the all-reduce (fast, "
                  "not correct).",
                  "Second table: nodes of each traced step (its function and the functions it calls) and the "
                  "inputs of its conds (the guard's; '-': none; 'whole': TensorFlow runs that cond as one op, "
                  "dist_minimize's one per device). TensorFlow lowers a cond into a Switch and "
                  "an Identity per input before it runs the step, so a lowered guard adds about two executed nodes per "
                  "input on each device: per-replica gradients, and the handles of the weights and of Adam's slots "
                  "the update reads."],
        "checks": checks, "plot": {"step": plot}}


# -- section 3 ---------------------------------------------------------------------------

def section_clip(ctx):
    from benchmarks import _steps

    rows, checks = [], []
    kinds = ("dm_clip", "dm", "dm_clip_noguard", "dm_noguard", "keras")
    for label, build, batch in _models(ctx)[:2]:
        t, _ = _compare(ctx, {k: (lambda k=k: _steps.make(k, ctx.strategy, build, batch)) for k in kinds})
        clip = t.ratio("dm_clip", "dm").as_dict()
        guard_clip = t.ratio("dm_clip", "dm_clip_noguard").as_dict()
        guard = t.ratio("dm", "dm_noguard").as_dict()
        stock = t.ratio("dm", "keras").as_dict()
        rows.append([label, fmt(clip), fmt(guard_clip), fmt(guard), fmt(stock)])
        checks.append(check(f"3. clip overhead {label}: dm + clip / dm", clip, STEP_TARGET))
    return {
        "title": "3. Clipping overhead and the non-finite guard (MirroredStrategy, 2 logical CPUs)",
        "tables": [{"header": ["model", "dm + clip / dm", "guard cost with clip (on / off)",
                               "guard cost, no clip (on / off)", "dm no clip / Keras no clip"], "rows": rows}],
        "notes": ["guard = skip_nonfinite=True (default): with the clipper the finite flag comes from the norm "
                  "(no second pass over the gradients); without it, one all_finite pass. Either way the update "
                  "runs in one agreed, unlowered tf.cond per device."],
        "checks": checks}


# -- section 4 ---------------------------------------------------------------------------

AGG_ROUNDS = 5


class _StrategyAggregation:
    """`AGG_ROUNDS` chained calls of the strategy aggregator in one step (each round
    reduces the previous round's output), the outputs returned: a collective whose
    result nothing uses may be pruned from the graph, and the per-call cost of reading
    the inputs is shared by the rounds."""

    def __init__(self, strategy, count, size):
        import numpy as np
        import tensorflow as tf

        import dist_minimize as dm

        self.traces, self.bytes = 0, 4 * count * size
        with strategy.scope():
            variables = [tf.Variable(tf.zeros([size])) for _ in range(count)]
        agg = dm.aggregation.StrategyAggregator()

        def replica():
            gv = [(tf.identity(v), v) for v in variables]
            for _ in range(AGG_ROUNDS):
                gv = agg(gv)
            return [g for g, _ in gv]

        @tf.function
        def reduce():
            self.traces += 1
            return strategy.run(replica)

        self._fn, self._np, self._strategy = reduce, np, strategy

    def run(self, n):
        for _ in range(n):
            r = self._fn()
        self._np.asarray(self._strategy.experimental_local_results(r[-1])[0])


def _agg_row(entry):
    one, many = entry["ms"]["one"], entry["ms"]["many"]
    rounds = entry.get("rounds", 1)
    gbs = lambda ms: entry["bytes"] / (ms / rounds / 1e3) / 1e9  # noqa: E731
    return [entry["backend"], f"{entry['count']} x {entry['size']} float32", f"{entry['bytes'] / 1e6:.2f} MB",
            f"{many / rounds:.2f}", f"{one / rounds:.2f}", f"{gbs(many):.2f}", f"{gbs(one):.2f}", fmt(entry["ratio"])]


AGG_HEADER = ["backend", "tensors", "total", "many: ms/call", "one: ms/call", "many: GB/s", "one: GB/s",
              "throughput many / one"]


def section_aggregation(ctx):
    count, size = (200, 1024) if ctx.quick else (200, 4096)
    t, built = _compare(ctx, {"many": lambda: _StrategyAggregation(ctx.strategy, count, size),
                              "one": lambda: _StrategyAggregation(ctx.strategy, 1, count * size)},
                        steps=3 if ctx.quick else 20)
    entry = {"backend": "strategy (MirroredStrategy, 2 CPUs)", "count": count, "size": size,
             "bytes": built["one"].bytes, "ms": {k: t.median_ms(k) for k in built}, "rounds": AGG_ROUNDS,
             "ratio": t.ratio("one", "many").as_dict()}
    return {
        "title": "4. Aggregation: many small gradient tensors against one tensor of the same total size",
        "tables": [{"header": AGG_HEADER, "rows": [_agg_row(entry)]}],
        "notes": [f"Effective bytes/s = gradient bytes of one replica / time of one aggregator call; each timed "
                  f"step makes {AGG_ROUNDS} chained calls (each reduces the previous call's output) and returns "
                  "the result. (The first run of this suite let the step drop its results: Horovod's collectives "
                  "were then pruned from the graph, and its row measured reading 200 variables, nothing else.) "
                  "The Horovod rows are added by the horovod section."],
        "checks": [check("4. strategy backend: many-tensor / one-tensor throughput", entry["ratio"], AGG_TARGET, True)],
        "raw": entry}


# -- section 5 ---------------------------------------------------------------------------

def _rss_kb(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def section_growth(ctx):
    from benchmarks import _steps, _timing

    counts = [10, 30] if ctx.quick else [10, 100, 300, 1000]
    sweeps = [(n, 1024) for n in counts]
    if not ctx.quick:
        sweeps += [(100, 256), (100, 16384)]
    rows, plot, worst = [], [], 0.0
    for count, size in sweeps:
        build = _steps.many_variables(count, size)
        steps, traced = {}, {}
        for k in ("dm_clip", "hand_clip"):
            steps[k] = _steps.make(k, ctx.strategy, build, 64)
            start = time.perf_counter()
            steps[k].run(1)
            traced[k] = time.perf_counter() - start
        t = _timing.alternate({k: s.run for k, s in steps.items()}, reps=ctx.reps, steps=ctx.steps, warmup=2,
                              block_seconds=ctx.block_seconds)
        peaks = {}
        for k, s in steps.items():  # peak RSS over a few steps, above the RSS before them
            if _reset_peak():
                base = _rss_kb()
                s.run(ctx.steps)
                peaks[k] = (_rss_kb("VmHWM") - base) / 1024
        r = t.ratio("dm_clip", "hand_clip").as_dict()
        over = t.median_ms("dm_clip") - t.median_ms("hand_clip")
        rows.append([count, size, f"{4 * count * size / 1e6:.2f} MB", f"{t.median_ms('hand_clip'):.2f}",
                     f"{t.median_ms('dm_clip'):.2f}", fmt(r), f"{1e3 * over / count:+.1f}",
                     f"{traced['dm_clip']:.1f} / {traced['hand_clip']:.1f}",
                     " / ".join(f"{peaks[k]:.1f}" for k in peaks) if peaks else "n/a",
                     f"{steps['dm_clip'].traces}/{steps['hand_clip'].traces}"])
        if size == 1024:
            plot.append((count, t.median_ms("dm_clip"), t.median_ms("hand_clip")))
            worst = max(worst, r["median"])
        traces_ok = steps["dm_clip"].traces == 1 and steps["hand_clip"].traces == 1
    ratios = [row[5] for row in rows]
    first, last = rows[0], rows[len(counts) - 1]
    growth = {"median": float(last[5].split()[0]) / float(first[5].split()[0]), "min": math.nan, "max": math.nan}
    return {
        "title": "5. Cost growth with the number of variables and gradient bytes (MirroredStrategy, 2 CPUs, batch 64)",
        "tables": [{"header": ["variables", "floats each", "gradient bytes", "hand ms/step", "dm ms/step",
                               "dm / hand", "dm overhead µs per variable", "first call (trace) s dm / hand",
                               "peak RSS over steps MB dm / hand", "traces dm/hand"], "rows": rows}],
        "notes": ["A model of N weight vectors (loss: x * sum of squares), Adam, cross-replica clip on both sides. "
                  "The ratio staying flat as N grows 100x means dist_minimize's overhead grows no faster than the "
                  "step itself (linearly). Each step function is traced once (traces column).",
                  f"ratio at {counts[-1]} variables over the ratio at {counts[0]}: {growth['median']:.3f}"],
        "checks": [{"item": f"5. growth: dm / hand ratio at {counts[-1]} vars over at {counts[0]} vars (flat = linear)",
                    "measured": f"{growth['median']:.3f}", "target": "≤ 1.03", "ok": growth["median"] <= 1.03,
                    "median": growth["median"]},
                   {"item": "5. each step function traced once", "measured": "yes" if traces_ok else "no",
                    "target": "1 trace", "ok": traces_ok, "median": 1.0}],
        "plot": {"growth": plot}, "_ratios": ratios}


# -- section 7 ---------------------------------------------------------------------------

def section_wrappers(ctx):
    from benchmarks import _steps, _wrappers

    rows, checks, plot = [], [], []
    names = list(_wrappers.WRAPPERS)
    if ctx.quick:
        names = ["moving_average"]
    for name in names:
        build, batch = (_steps.mlp(4, 64), 64) if name == "dp_sgd" else (_steps.mlp(10, 256), 256)
        if ctx.quick:
            build, batch = _steps.mlp(4, 32), 64
        multiple = _wrappers.ACCUMULATION if name == "accumulation" and not ctx.quick else 1
        makers = {"dm": lambda: _wrappers.make_dm(name, ctx.strategy, build, batch),
                  "hand": lambda: _wrappers.make_hand(name, ctx.strategy, build, batch)}
        if name != "loss_scale":  # (its skip is the wrapper's purpose: the anchor has it too)
            makers["dm_noguard"] = lambda: _wrappers.make_dm(name, ctx.strategy, build, batch, guard=False)
        t, built = _compare(ctx, makers, multiple=multiple)
        r = t.ratio("dm", "hand").as_dict()
        noguard = fmt(t.ratio("dm_noguard", "hand").as_dict()) if "dm_noguard" in built else "(has it)"
        rows.append([name, _wrappers.WRAPPERS[name], "MLP 4 x Dense(64), batch 64" if name == "dp_sgd"
                     else "MLP 10 x Dense(256), batch 256", f"{t.median_ms('dm'):.1f}", f"{t.median_ms('hand'):.1f}",
                     fmt(r), noguard, "/".join(str(b.traces) for b in built.values())])
        checks.append(check(f"7. {name}: dist_minimize / hand-written", r, WRAPPER_TARGET))
        plot.append((name, r))
    return {
        "title": "7. Wrappers against their best hand-written equivalent (MirroredStrategy, 2 CPUs, Adam + clip)",
        "tables": [{"header": ["wrapper", "against", "model", "dm ms/step", "hand ms/step", "dm / hand",
                               "dm without guard / hand", "traces dm/hand/dm without guard"], "rows": rows}],
        "notes": ["Both sides clip by the cross-replica global norm (DP-SGD: per-example clipping only). The "
                  "hand-written sides skip nothing on a non-finite step (but loss_scale's, where the skip is the "
                  "point); 'dm without guard' is the same dist_minimize stack with skip_nonfinite=False."],
        "checks": checks, "plot": {"wrappers": plot}}


# -- section 8 ---------------------------------------------------------------------------

def _pair(ctx, make, kinds: tuple[str, str], name: str, target: float):
    """Rows and checks of a two-variant section: `make(kind, build, batch)` for each kind on
    an MLP of 20 and one of 100 variables, compared alone (`_focused`: with the A/A
    control); the check is kinds[0] / kinds[1] <= `target`."""
    from benchmarks import _steps

    models = [("MLP 10 x Dense(256), 20 variables", _steps.mlp(10, 256), 256),
              ("MLP 50 x Dense(128), 100 variables", _steps.mlp(50, 128), 256)]
    if ctx.quick:
        models = [("MLP 4 x Dense(32)", _steps.mlp(4, 32), 64)]
    rows, checks = [], []
    for label, build, batch in models:
        f, built = _focused(ctx, *(lambda k=k: make(k, build, batch) for k in kinds))
        r = f.ratio.as_dict()
        rows.append([label, f"{f.timings.median_ms('a'):.1f}", f"{f.timings.median_ms('b'):.1f}", fmt(r),
                     fmt(f.control.as_dict()), _traces(built)])
        checks.append(check(name.format(label), r, target))
    return rows, checks


CUSTOM_TARGET = 1.03


def section_custom(ctx):
    from benchmarks import _wrappers

    average = _wrappers.docs_wrapper()
    rows, checks = _pair(ctx, lambda kind, build, batch: _wrappers.make_average(kind, ctx.strategy, build, batch,
                                                                              average),
                         ("docs", "builtin"), "8. {}: a wrapper from the docs / the built-in one", CUSTOM_TARGET)
    return {
        "title": "8. A wrapper written from the docs against the built-in one (MirroredStrategy, 2 CPUs, Adam + clip)",
        "tables": [{"header": ["model", "docs' WeightAverage ms/step", "MovingAverage ms/step", "docs / built-in",
                               "A/A control: built-in / built-in", "traces docs/built-in/built-in"], "rows": rows}],
        "notes": ["The same moving average of the weights (decay 0.99) written twice: docs/writing-a-wrapper.md's "
                  "complete example, imported from the page, and dist_minimize.MovingAverage. Both take the "
                  "guarded update device by device (the update contract, not the class, decides).", FOCUS_NOTE],
        "checks": checks, "plot": {}}


# -- section 9 ---------------------------------------------------------------------------

def section_guard(ctx):
    """The non-finite guard's mechanism, measured on one device and under MirroredStrategy
    (Horovod: section 2): dist_minimize's default (one If kept whole per device), the same
    step with the guard lowered by TensorFlow (the mechanism before), a branch-free select
    (one device), and no guard, each against the hand-written step without a guard."""
    import tensorflow as tf

    from benchmarks import _steps

    models = [("MLP 10 x Dense(256)", _steps.mlp(10, 256), 256), ("MLP 50 x Dense(128)", _steps.mlp(50, 128), 256),
              ("MLP 200 x Dense(32)", _steps.mlp(200, 32), 256)]
    if ctx.quick:
        models = [("MLP 4 x Dense(32)", _steps.mlp(4, 32), 64)]
    backends = [("one device", tf.distribute.get_strategy(), True), ("MirroredStrategy 2 CPUs", ctx.strategy, False)]
    rows, checks = [], []
    for backend, strategy, one in backends:
        kinds = ["dm_clip", "hand_clip", "dm_clip_lowered", "dm_clip_noguard"] + (["hand_clip_select"] if one else [])
        for label, build, batch in models:
            t, built = _compare(ctx, {k: (lambda k=k: _steps.make(k, strategy, build, batch)) for k in kinds})
            nvars = len(built["dm_clip"].model.trainable_variables)
            r = {k: t.ratio(k, "hand_clip").as_dict() for k in kinds if k != "hand_clip"}
            f, _ = _focused(ctx, *(lambda k=k: _steps.make(k, strategy, build, batch) for k in ("dm_clip", "hand_clip")))
            rows.append([backend, label, nvars, f"{t.median_ms('hand_clip'):.1f}", fmt(f.ratio.as_dict()),
                         fmt(f.control.as_dict()), fmt(r["dm_clip"]), fmt(r["dm_clip_lowered"]),
                         fmt(r["dm_clip_noguard"]), fmt(r["hand_clip_select"]) if one else "-",
                         _conds(built["dm_clip"].graph_stats())])
            checks.append(check(f"9. {backend} {label}: dist_minimize (guarded) / hand-written without guard",
                                f.ratio.as_dict(), STEP_TARGET))
    return {
        "title": "9. The guard's mechanism: dist_minimize's guarded step against the hand-written step WITHOUT a guard",
        "tables": [{"header": ["backend", "model", "variables", "hand ms/step", "dm / hand, alone (the check)",
                               "A/A control: hand / hand", "dm (If kept whole)", "dm, guard lowered", "dm without guard", "branch-free select (hand)",
                               "dm's conds"], "rows": rows}],
        "notes": ["Each column: time / time of the hand-written step without a guard (tape, one all-reduce, "
                  "tf.clip_by_global_norm, Adam). dm: the default (skip_nonfinite=True), its update one If per "
                  "device that TensorFlow runs whole. dm, guard lowered: the same step traced with the If lowered "
                  "into a Switch and an Identity per input (the mechanism before, and what TensorFlow does with "
                  "any tf.cond). Branch-free select: the update always made, then every variable it wrote put "
                  "back by tf.where on the finite norm (no branch, no host synchronisation; one copy of the state "
                  "per step). Horovod: section 2.",
                  FOCUS_NOTE],
        "checks": checks, "plot": {}}


# -- section 10 --------------------------------------------------------------------------

SAM_TARGET = 1.05


def section_sam(ctx):
    from benchmarks import _wrappers

    rows, checks = _pair(ctx, lambda kind, build, batch: _wrappers.make_sam(kind, ctx.strategy, build, batch),
                         ("dm", "hand"), "10. MirroredStrategy {}: dm.SAM / hand-written SAM", SAM_TARGET)
    return {
        "title": "10. SAM: dm.SAM against the hand-written distributed SAM step (MirroredStrategy, 2 CPUs, Adam + clip)",
        "tables": [{"header": ["model", "dm.SAM ms/step", "hand-written ms/step", "dm / hand-written",
                               "A/A control: hand / hand", "traces dm/hand/hand"], "rows": rows}],
        "notes": ["Both: two forward and backward passes per step; the first gradient all-reduced, the weights "
                  "perturbed along it (rho 0.05) and put back from a copy (a merge_call each), the second "
                  "gradient all-reduced, clipped (global norm), applied by Adam. dm.SAM adds the non-finite "
                  "guard; the hand-written step has none. Horovod: section 2.", FOCUS_NOTE],
        "checks": checks, "plot": {}}


# -- subprocess sections -------------------------------------------------------------------

def _env():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_group(cmd, timeout):
    """Runs `cmd` in its own process group; on a timeout or any error the whole group is killed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        # horovodrun starts its ranks in sessions of their own: stop the whole tree.
        from dist_minimize import launcher
        launcher._stop([proc], grace=2.0)
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{out[-3000:]}")
    return out


def section_horovod(ctx_quick):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hvd.json")
        cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
               os.path.join(HERE, "horovod_worker.py"), out] + (["--quick"] if ctx_quick else [])
        # 3 models x 6 kinds, then 7 focused rows of 3 x 3 builds (SAM, section 8): ~40 min
        _run_group(cmd, timeout=300 if ctx_quick else 3600)
        with open(out) as f:
            res = json.load(f)
    rows, checks, custom, alone = [], [], [], []
    for e in res["steps"]:
        rows.append([e["model"], e["variables"], e["local_batch"], f"{e['ms']['dm_clip']:.1f}",
                     f"{e['ms']['hand_clip']:.1f}", fmt(e["ratio"]), fmt(e["ratio_guard"]), fmt(e["ratio_noguard"]),
                     fmt(e["ratio_lowered"]), fmt(e["ratio_select"]), "/".join(str(v) for v in e["traces"].values())])
        alone.append([e["model"], e["variables"], f"{e['alone']['ms']['dm_clip']:.1f}",
                      f"{e['alone']['ms']['hand_clip']:.1f}", fmt(e["alone"]["ratio"]), fmt(e["alone"]["control"])])
        checks.append(check(f"2. horovodrun -np 2 {e['model']}: dist_minimize (guarded) / hand-written without "
                            "guard", e["alone"]["ratio"], STEP_TARGET))
        checks.append(check(f"2. horovodrun -np 2 {e['model']}: dist_minimize / hand-written with the same "
                            "non-finite guard", e["ratio_guard"], STEP_TARGET))
    sam = []
    for e in res.get("sam", []):
        sam.append([e["model"], e["variables"], f"{e['ms']['dm_sam']:.1f}", f"{e['ms']['hand_sam']:.1f}",
                    fmt(e["ratio"]), fmt(e["control"]), "/".join(str(v) for v in e["traces"].values())])
        checks.append(check(f"10. horovodrun -np 2 {e['model']}: dm.SAM / hand-written SAM", e["ratio"], SAM_TARGET))
    for e in res["custom"]:
        custom.append([e["model"], e["variables"], f"{e['ms']['docs_avg']:.1f}", f"{e['ms']['builtin_avg']:.1f}",
                       fmt(e["ratio"]), fmt(e["control"]), "/".join(str(v) for v in e["traces"].values())])
        checks.append(check(f"8. horovodrun -np 2 {e['model']}: a wrapper from the docs / the built-in one",
                            e["ratio"], CUSTOM_TARGET))
    aggs = res["aggregation"]
    return {
        "title": "2. horovodrun -np 2 -H localhost:2 --gloo: dist_minimize (Horovod backend + clip) against the "
                 "hand-written Horovod step",
        "tables": [{"header": ["model", "variables", "batch per process", "dm ms/step", "hand ms/step",
                               "dm / hand-written", "dm / hand-written + guard", "dm without guard / hand-written",
                               "dm, guard lowered / hand-written", "hand + branch-free select / hand-written",
                               "traces dm/hand/hand+guard/dm without guard/dm lowered/hand select"], "rows": rows},
                   {"header": ["model (the check: compared alone)", "variables", "dm ms/step", "hand ms/step",
                               "dm (guarded) / hand-written without guard", "A/A control: hand / hand"],
                    "rows": alone},
                   {"header": ["model (section 8 under horovodrun)", "variables", "docs' WeightAverage ms/step",
                               "MovingAverage ms/step", "docs / built-in", "A/A control: built-in / built-in",
                               "traces docs/built-in/built-in"], "rows": custom},
                   {"header": ["model (section 10 under horovodrun)", "variables", "dm.SAM ms/step",
                               "hand-written SAM ms/step", "dm / hand-written", "A/A control: hand / hand",
                               "traces dm/hand/hand"], "rows": sam}],
        "notes": ["hand-written: tape; hvd.grouped_allreduce(grads, op=hvd.Average); tf.clip_by_global_norm; "
                  "Adam.apply_gradients. + guard: the update in a tf.cond on the finite norm (lowered by "
                  "TensorFlow, as any tf.cond). dm: the default guard, one If that TensorFlow runs whole; dm, "
                  "guard lowered: the same step traced with that If lowered (the mechanism before). Branch-free "
                  "select: the update always made, then every variable it wrote put back by tf.where on the "
                  "finite norm. 31 reps: two processes on two cores, each step waiting for the slower rank, "
                  "spread wider than in-process.",
                  "Second table: dm's default step against the hand-written step without guard, the two alone "
                  "(the check). Third: section 8's comparison (docs/writing-a-wrapper.md's WeightAverage against "
                  "MovingAverage, decay 0.99, over Adam + clip) in each Horovod process. Fourth: section 10's.",
                  FOCUS_NOTE],
        "checks": checks + [check("4. horovod backend (packed): many-tensor / one-tensor throughput",
                                  aggs[0]["ratio"], AGG_TARGET, True)],
        "horovod_aggregation": aggs}


def section_memory(quick):
    reps = 1 if quick else 3
    steps = "20" if quick else "200"
    peaks = {"dm": [], "keras": []}
    for rep in range(reps):
        for kind in (("dm", "keras") if rep % 2 == 0 else ("keras", "dm")):
            out = _run_group([sys.executable, os.path.join(HERE, "memory_worker.py"), kind, steps], timeout=300)
            line = [ln for ln in out.splitlines() if ln.startswith("{")][-1]
            peaks[kind].append(json.loads(line)["peak_rss_mb"])
    ratios = [d / k for d, k in zip(peaks["dm"], peaks["keras"])]
    r = {"median": sorted(ratios)[len(ratios) // 2], "min": min(ratios), "max": max(ratios)}
    return {
        "title": f"6. Peak RSS of a model.fit run ({steps} steps, fresh process each, MirroredStrategy 2 CPUs, "
                 "MLP 50 x Dense(128))",
        "tables": [{"header": ["dist_minimize peak RSS MB", "Keras global_clipnorm peak RSS MB", "dm / Keras"],
                    "rows": [[" / ".join(f"{p:.0f}" for p in peaks["dm"]),
                              " / ".join(f"{p:.0f}" for p in peaks["keras"]), fmt(r)]]}],
        "notes": ["VmHWM of each process at the end of fit; the two kinds alternate."],
        "checks": [check("6. peak RSS dist_minimize / stock Keras", r, MEMORY_TARGET)]}


# -- section 11 --------------------------------------------------------------------------

SHARD_TIME_TARGET = 1.05


def _sharding_job(np_, mode, quick):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "shard.json")
        _run_group([horovodrun, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable,
                    os.path.join(HERE, "sharding_worker.py"), out, mode] + (["--quick"] if quick else []),
                   timeout=300 if quick else 900)
        with open(out) as f:
            return json.load(f)


SHARD_COLLECTIVES = {"sharded": "all-reduce + slice (default)", "sharded-reducescatter": "reduce-scatter"}


def _transformer_encoder(layers=12, d=768, ff=3072, vocab=30522, heads=12):
    """A BERT-base-sized encoder (108.5M weights), built without data or downloads."""
    import keras
    x = keras.Input((128,), dtype="int32")
    h = keras.layers.Embedding(vocab, d)(x)
    for _ in range(layers):
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(heads, d // heads)(h, h))
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(d)(keras.layers.Dense(ff, activation="gelu")(h)))
    return keras.Model(x, h)


def partition_rows(quick):
    """The partition's balance and padding on a few models' trainable variables, computed
    (no run): for N = 2, 4, 8, the largest process's share of the weights over 1/N of
    them, and the zero padding the buckets send beyond the gradients' own size."""
    import keras
    from dist_minimize.sharding.shards import Partition
    from dist_minimize.step.stages import elements_of
    from dist_minimize.aggregation import sharded
    models = {"12 x Dense(2048)": lambda: keras.Sequential([keras.Input((2048,))]
                                                           + [keras.layers.Dense(2048) for _ in range(12)])}
    if not quick:
        models.update({"ResNet50": lambda: keras.applications.ResNet50(weights=None),
                       "MobileNetV2": lambda: keras.applications.MobileNetV2(weights=None),
                       "BERT-base-sized encoder": _transformer_encoder})
    rows = []
    for name, make in models.items():
        variables = make().trainable_variables
        elements = [elements_of(v) for v in variables]
        total = sum(elements)
        row = [name, f"{total / 1e6:.1f} M", len(variables), f"{max(elements) / 1e6:.2f} M"]
        for n in (2, 4, 8):
            partition = Partition.balanced(elements, n, 0)
            largest = max(partition.loads())
            sent = sum(width * n for _, _, width in sharded._buckets(partition.owner, variables, n))
            row.append(f"{largest / (total / n):.2f} / +{100 * (sent / total - 1):.0f}%")
        rows.append(row)
    return rows


def section_sharding(quick):
    """Optimizer state sharded over N Horovod processes against unsharded: state bytes and
    peak RSS per process at N = 2 and 4, step time and bytes sent per step at N = 2."""
    rows, checks, plot = [], [], []
    modes = ("unsharded", "sharded", "sharded-reducescatter")
    for np_ in (2, 4):
        ranks = {mode: _sharding_job(np_, f"memory-{mode}", quick) for mode in modes}
        plain = ranks["unsharded"]
        for mode in modes[1:]:
            shard = ranks[mode]
            state_ratio = max(s["state_bytes"] for s in shard) / plain[0]["state_bytes"]
            saved = [p["state_bytes"] - s["state_bytes"] for p, s in zip(plain, shard)]
            rss_saved = [1024 * (p["peak_rss_kb"] - s["peak_rss_kb"]) for p, s in zip(plain, shard)]
            rss_share = min(r / b for r, b in zip(rss_saved, saved))
            how = SHARD_COLLECTIVES[mode]
            rows.append([np_, how, f"{plain[0]['weights'] / 1e6:.1f} M", f"{plain[0]['state_bytes'] / 2**20:.1f}",
                         " / ".join(f"{s['state_bytes'] / 2**20:.1f}" for s in shard), f"{state_ratio:.3f}",
                         " / ".join(f"{p['peak_rss_kb'] / 1024:.0f}" for p in plain),
                         " / ".join(f"{s['peak_rss_kb'] / 1024:.0f}" for s in shard), f"{rss_share:.2f}"])
            if mode == "sharded":  # the default is what the targets hold
                one = {"median": state_ratio, "min": state_ratio, "max": state_ratio}
                checks.append(check(f"11. N={np_}: largest sharded state / unsharded state (target 1/N + 0.02)",
                                    one, 1 / np_ + 0.02))
                checks.append(check(f"11. N={np_}: peak RSS saved / state bytes saved, least over processes",
                                    {"median": rss_share, "min": rss_share, "max": rss_share}, 0.8, True))
                plot.append((np_, plain[0]["state_bytes"], max(s["state_bytes"] for s in shard),
                             max(p["peak_rss_kb"] for p in plain) * 1024, max(s["peak_rss_kb"] for s in shard) * 1024))
    timed_rows = []
    for mode in ("time", "time-reducescatter"):
        [timed] = _sharding_job(2, mode, quick)
        sent = timed["sent_per_step"]
        if mode == "time":
            checks.append(check("11. N=2: sharded / unsharded step time", timed["ratio"], SHARD_TIME_TARGET))
        timed_rows.append([2, timed["collective"], f"{timed['ms']['unsharded']:.0f}", f"{timed['ms']['sharded']:.0f}",
                           fmt(timed["ratio"]), fmt(timed["control"]),
                           f"{sent['unsharded'] / 1e6:.1f} / {sent['sharded'] / 1e6:.1f}",
                           f"{timed['gradient_bytes'] / 1e6:.1f}"])
    return {
        "title": "11. Sharded optimizer state (horovodrun --gloo, Adam + clip, 12 x Dense(2048): 50.4M weights)",
        "tables": [{"header": ["N", "sharded step's collective", "weights", "unsharded state MiB per process",
                               "sharded state MiB (each process)", "largest sharded / unsharded",
                               "peak RSS MiB unsharded (each)", "peak RSS MiB sharded (each)",
                               "RSS saved / state saved (least)"], "rows": rows},
                   {"header": ["model", "weights", "variables", "largest variable",
                               "N=2: largest share x N / padding", "N=4", "N=8"],
                    "rows": partition_rows(quick)},
                   {"header": ["N", "sharded step's collective", "unsharded ms/step", "sharded ms/step",
                               "sharded / unsharded", "A/A control",
                               "MB sent per process per step: unsharded / sharded", "gradient MB"],
                    "rows": timed_rows}],
        "notes": ["Each memory row: a job of N processes, 5 steps, against the unsharded job; the sharded step "
                  "receives its share of the gradients by an all-reduce of each bucket and a slice (the default "
                  "on CPUs) or by Horovod's reduce-scatter; state: "
                  "dm.optimizer_state_bytes (Adam's slots and counters, the clipper's statistics); peak RSS: "
                  "VmHWM of each process. The partition is by whole variables (the largest first, to the least "
                  "loaded process), so a share exceeds 1/N by at most the largest variable (4M weights here).",
                  "Step time: both optimizers in one job, alternating (61 turns of one step) beside an A/A "
                  "control. Bytes sent: the loopback interface's counter over 5 steps, divided by N (every "
                  "process of the job talks over it): an all-reduce against the sharded step's collective per bucket "
                  "and its all-gather. The check holds the default.",
                  "The partition (whole variables, the largest first to the least loaded process), computed on "
                  "each model's trainable variables: the largest process's share of the weights times N (1.00: "
                  "exactly 1/N), and the zero padding the buckets send beyond the gradients' size (each bucket's "
                  "segments are filled to the longest, for the reduce-scatter's equal split)."],
        "checks": checks, "plot": {"sharding": plot}}


# -- report --------------------------------------------------------------------------------

def markdown_table(header, rows):
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_info(argv):
    import keras
    import tensorflow as tf

    try:
        import horovod
        hvd_version = horovod.__version__
    except ImportError:
        hvd_version = "not installed"
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return [f"- command: `python benchmarks/run.py {shlex.join(argv)}`".replace(" `", " `").rstrip(),
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- machine: {platform.node() and 'Linux ' + platform.release()}, {os.cpu_count()} logical CPUs ({cpu}), "
            f"load average at start {os.getloadavg()[0]:.2f} (shared machine)",
            f"- versions: Python {platform.python_version()}, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"Horovod {hvd_version}"]


def write_plot(path, results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = next((r["plot"]["step"] for r in results if "step" in r.get("plot", {})), [])
    growth = next((r["plot"]["growth"] for r in results if "growth" in r.get("plot", {})), [])
    wrappers = next((r["plot"]["wrappers"] for r in results if "wrappers" in r.get("plot", {})), [])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for i, anchor in enumerate(("hand_clip", "hand_clip_guard", "keras_clip", "keras")):
        xs = [j + 0.2 * (i - 1.5) for j in range(len(step))]
        med = [r[anchor]["median"] for _, r in step]
        err = [[m - r[anchor]["min"] for m, (_, r) in zip(med, step)],
               [r[anchor]["max"] - m for m, (_, r) in zip(med, step)]]
        ax.bar(xs, med, 0.2, yerr=err, label={"hand_clip": "/ hand-written", "hand_clip_guard": "/ hand-written + guard",
                                               "keras_clip": "/ Keras global_clipnorm", "keras": "/ Keras no clip"}[anchor])
    ax.axhline(STEP_TARGET, color="k", ls="--", lw=0.8, label="target 1.03 (hand-written)")
    ax.set_xticks(range(len(step)), [s[0].replace(" x ", "x").replace("ResNet-like CNN", "CNN").split(" (")[0]
                                     for s in step], fontsize=8)
    ax.set_ylim(0.7, 1.3)
    ax.set_title("1. dist_minimize + clip, step-time ratio")
    ax.legend(fontsize=7)
    ax = axes[1]
    if growth:
        ax.loglog([g[0] for g in growth], [g[1] for g in growth], "o-", label="dist_minimize + clip")
        ax.loglog([g[0] for g in growth], [g[2] for g in growth], "s--", label="hand-written")
        ax.legend(fontsize=8)
    ax.set_xlabel("variables (1024 floats each)")
    ax.set_ylabel("ms / step")
    ax.set_title("5. step time against variables")
    ax = axes[2]
    if wrappers:
        med = [r["median"] for _, r in wrappers]
        ax.bar(range(len(wrappers)), med, yerr=[[m - r["min"] for m, (_, r) in zip(med, wrappers)],
                                                  [r["max"] - m for m, (_, r) in zip(med, wrappers)]])
        ax.set_xticks(range(len(wrappers)), [w for w, _ in wrappers], rotation=30, fontsize=8)
    ax.axhline(WRAPPER_TARGET, color="k", ls="--", lw=0.8)
    ax.set_ylim(0.7, 1.3)
    ax.set_title("7. wrapper / hand-written, step-time ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write_sharding_plot(path, sharding):
    """Section 11's figure (the section runs on its own): memory per process against N.
    `sharding`: [(N, unsharded state, sharded state, unsharded peak RSS, sharded peak RSS)]
    in bytes, the largest over the processes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    ns = [row[0] for row in sharding]
    for i, label in enumerate(("state, unsharded", "state, sharded", "peak RSS, unsharded", "peak RSS, sharded")):
        ax.plot(ns, [row[1 + i] / 2**20 for row in sharding], "o-" if "unsharded" in label else "s--", label=label)
    ax.set_xticks(ns)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.set_xlabel("processes N")
    ax.set_ylabel("MiB per process (the largest)")
    ax.set_title("11. sharded optimizer state: memory per process")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _conds(stats: dict) -> str:
    """'-', or each cond's inputs ('+'), marked 'whole' where TensorFlow does not lower it."""
    parts = [f"{n}" + ("" if lowered else " whole") for n, lowered in zip(stats["cond_inputs"], stats["cond_lowered"])]
    return " + ".join(parts) or "-"


def report(results, argv, header_notes):
    parts = ["# dist_minimize benchmark results", "",
             "Written by `benchmarks/run.py` from one run; every figure is a ratio of two variants timed in "
             "alternation in the same process (median [min-max] over reps; time(A) / time(B): above 1 means "
             "dist_minimize is slower), except where a table says otherwise. Absolute times are context only.", ""]
    parts += machine_info(argv) + [""] + header_notes
    checks = [c for r in results for c in r.get("checks", [])]
    parts += ["## Targets", "", markdown_table(["comparison", "measured", "target", "met"],
                                               [[c["item"], c["measured"], c["target"], "yes" if c["ok"] else "**no**"]
                                                for c in checks]), ""]
    for r in results:
        parts += [f"## {r['title']}", ""]
        for t in r["tables"]:
            parts += [markdown_table(t["header"], t["rows"]), ""]
        parts += [f"- {n}" for n in r.get("notes", [])] + [""]
    return "\n".join(parts)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: few reps, few steps, one model per section")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    p.add_argument("--out", default=HERE, help="where RESULTS.md (and results.png) go (default: benchmarks/)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--json", help="also write the raw results to this file")
    p.add_argument("--notes", default=None, help="a Markdown file whose text goes under the header of RESULTS.md")
    args = p.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    started = time.time()
    ctx = Context(args.quick) if set(only) & {"step", "clip", "aggregation", "growth", "wrappers", "custom", "guard", "sam"} else None
    results = []
    for name in SECTIONS:
        if name not in only:
            continue
        t0 = time.time()
        print(f"[bench] section {name} ...", flush=True)
        if name == "horovod":
            res = section_horovod(args.quick)
            agg = next((r for r in results if "raw" in r), None)
            rows = [_agg_row(a) for a in res["horovod_aggregation"]]
            if agg is not None:
                agg["tables"][0]["rows"].extend(rows)
            else:
                res["tables"].append({"header": AGG_HEADER, "rows": rows})
        elif name == "memory":
            res = section_memory(args.quick)
        elif name == "sharding":
            res = section_sharding(args.quick)
        else:
            res = globals()[f"section_{name}"](ctx)
        if name == "aggregation":  # a horovod run before it put its row in its own table: move it here
            hv = next((r for r in results if "horovod_aggregation" in r), None)
            if hv is not None:
                res["tables"][0]["rows"].extend(hv["tables"].pop()["rows"])
        res["seconds"] = time.time() - t0
        results.append(res)
        for t in res["tables"]:
            print(f"\n{res['title']}\n" + markdown_table(t["header"], t["rows"]), flush=True)
        print(f"[bench] section {name}: {res['seconds']:.0f} s", flush=True)
    notes = []
    if args.notes:
        with open(args.notes) as f:
            notes = [f.read().strip(), ""]
    notes += [f"- sections: {', '.join(only)}; total time {time.time() - started:.0f} s"
              + (" (--quick: a smoke run, not a measurement)" if args.quick else ""), ""]
    text = report(results, argv, notes)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write(text)
    plots = {k: v for r in results for k, v in r.get("plot", {}).items()}
    if not args.no_plot:
        figures = []
        if set(plots) & {"step", "growth", "wrappers"}:
            write_plot(os.path.join(args.out, "results.png"), results)
            figures.append("results")
        if plots.get("sharding"):
            write_sharding_plot(os.path.join(args.out, "sharding.png"), plots["sharding"])
            figures.append("sharding")
        with open(os.path.join(args.out, "RESULTS.md"), "a") as f:
            f.writelines(f"\n![{name}]({name}.png)\n" for name in figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    checks = [c for r in results for c in r.get("checks", [])]
    print("\nTargets\n" + markdown_table(["comparison", "measured", "target", "met"],
                                          [[c["item"], c["measured"], c["target"], "yes" if c["ok"] else "no"]
                                           for c in checks]))
    print(f"[bench] wrote {os.path.join(args.out, 'RESULTS.md')} in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
