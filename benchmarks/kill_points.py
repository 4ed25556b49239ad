"""The kill-point table: the main job (2 processes, `MovingAverage(GradientAccumulation(
Optimizer(Adam, clip), 2))`, checkpoints every 4 batches, 4 epochs = 88 batches) under
`launch.py --max-restarts 1`, one process failed on purpose at a known batch, against the
same job never interrupted: exit status, seconds lost, and whether the final weights' and
optimizer fingerprints are equal.

  .venv/bin/python benchmarks/kill_points.py [--out benchmarks/KILL_POINTS.md] [--launchers multiworker,horovod-gloo]

Not part of the test run (tests/distributed/test_restarts.py checks a subset of these
points); about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from dist_minimize import launcher  # noqa: E402

TRAIN = os.path.join(ROOT, "launch", "train.py")
FLAGS = ["--epochs", "4", "--accumulate", "2", "--moving-average", "0.9", "--checkpoint-every", "4"]
# (where, flags): batch 7 is inside an accumulation window, 12 a checkpoint's write,
# 45 the first batch of epoch 3 (mid-window), 9 / 13 a SIGTERM inside a window.
POINTS = [
    ("batch 7, inside a window, rank 1", ["--fail-at", "7", "--fail-rank", "1"]),
    ("batch 45, epoch 3, rank 0", ["--fail-at", "45", "--fail-rank", "0"]),
    ("inside the write of the checkpoint at batch 12, rank 0", ["--fail-at", "12", "--fail-rank", "0", "--fail-in-save"]),
    ("batch 9, inside a window, rank 1", ["--fail-at", "9", "--fail-rank", "1", "--fail-signal", "TERM"]),
    ("batch 13, inside a window, rank 0", ["--fail-at", "13", "--fail-rank", "0", "--fail-signal", "TERM"]),
]


def run(launcher_name: str, extra: list[str], directory: str | None, log_path: str):
    args = [TRAIN, *FLAGS, *(["--checkpoint-dir", directory] if directory else []), *extra]
    start = time.monotonic()
    with open(log_path, "w") as f:
        rc = launcher.launch(launcher_name, 2, args, timeout=600, out=f, child_output=f, max_restarts=1)
    took = time.monotonic() - start
    with open(log_path) as f:
        text = f.read()
    prints = dict(re.findall(r"\[train\] (weights|optimizer) fingerprint ([0-9a-f]{16})", text))
    resumed = re.search(r"\[train\] resumed after update (\d+)", text)
    restart = re.search(r"\[launch\] restart 1 of 1 after (.*): starting", text)
    return rc, took, prints, (int(resumed.group(1)) if resumed else None), (restart.group(1) if restart else "-")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "KILL_POINTS.md"))
    p.add_argument("--launchers", default="multiworker,horovod-gloo")
    args = p.parse_args(argv)
    rows = []
    work = tempfile.mkdtemp(prefix="dm-kill-points-")
    try:
        for name in args.launchers.split(","):
            rc, ref_time, ref, _, _ = run(name, [], None, os.path.join(work, f"{name}-reference.txt"))
            if rc != 0 or len(ref) != 2:
                raise SystemExit(f"the uninterrupted {name} job failed (status {rc}); see {work}")
            print(f"[kill-points] {name} uninterrupted: {ref_time:.1f} s, {ref['weights']}", flush=True)
            for where, flags in POINTS:
                directory = os.path.join(work, "ckpt")
                shutil.rmtree(directory, ignore_errors=True)
                signal_name = "SIG" + (flags[flags.index("--fail-signal") + 1] if "--fail-signal" in flags else "KILL")
                rc, took, prints, resumed, report = run(name, flags, directory, os.path.join(work, "point.txt"))
                row = [name, where, signal_name, str(rc), f"{took - ref_time:+.1f}",
                       str(resumed if resumed is not None else "-"), report,
                       "yes" if prints == ref else f"NO ({prints})"]
                print("[kill-points] " + " | ".join(row), flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = ["launcher", "failure point", "signal", "job exit status", "seconds lost",
              "resumed after update", "what the launcher reported", "fingerprints equal"]
    lines = ["# Kill points", "", __doc__.split("\n\n")[0].replace("\n", " "), "",
             f"Command: `python benchmarks/kill_points.py` ({time.strftime('%Y-%m-%d')}); "
             "seconds lost: the job's wall time minus the uninterrupted job's (both include start-up).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r[3] == "0" and r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
