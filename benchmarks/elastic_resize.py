"""The resize table: the main job under `launch/launch.py --min-np/--max-np` with a host
discovery script, resized by a lost worker (SIGKILL) or by discovery, against the run
never resized on the starting count, on a fixed global batch and micro-batch.

    python benchmarks/elastic_resize.py [--out benchmarks/ELASTIC.md] [--only NAME,...]

Each row: the launcher, the resize, where the job was when it happened, the elastic
run's exit status, the seconds it took beyond the uninterrupted run's, and whether the
final weights are the same bits (the fingerprint) or their largest difference.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(ROOT, "launch", "train.py")
LAUNCH = os.path.join(ROOT, "launch", "launch.py")
FINGERPRINT = r"\[train\] weights fingerprint ([0-9a-f]{16})"

KILL = ["--fail-at", "7", "--fail-rank", "1"]
# name, launcher, (before, after) slots, G, b, epochs, fault flags, when, discovery interval
SCENARIOS = [
    ("gloo-2to1-kill", "horovod-gloo", (2, 1), 64, 32, 2, KILL,
     "SIGKILL to rank 1 after batch 7 (1 micro-batch per worker: no window)", 600),
    ("gloo-2to1-kill-window", "horovod-gloo", (2, 1), 64, 16, 2, KILL,
     "SIGKILL to rank 1 after batch 7 (inside a window of 2)", 600),
    ("gloo-2to1-discovery", "horovod-gloo", (2, 1), 64, 32, 4, [],
     "discovery reports 1 slot once a checkpoint exists", 1),
    ("gloo-1to2-discovery", "horovod-gloo", (1, 2), 64, 32, 4, [],
     "discovery reports 2 slots once a checkpoint exists", 1),
    ("gloo-4to2-kill", "horovod-gloo", (4, 2), 64, 16, 2, ["--fail-at", "7", "--fail-rank", "3"],
     "SIGKILL to rank 3 after batch 7", 600),
    ("gloo-4to3-kill", "horovod-gloo", (4, 3), 96, 8, 2, ["--fail-at", "10", "--fail-rank", "3"],
     "SIGKILL to rank 3 after batch 10 (inside a window of 3)", 600),
    ("multiworker-2to1-kill", "multiworker", (2, 1), 64, 32, 2, KILL, "SIGKILL to worker 1 after batch 7", 600),
    ("multiworker-1to2-discovery", "multiworker", (1, 2), 64, 32, 4, [],
     "discovery reports 2 slots once a checkpoint exists", 1),
]


def run(cmd: list[str], log: str, timeout: float = 900) -> tuple[int, float, str]:
    start = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).returncode
    with open(log) as f:
        return rc, time.monotonic() - start, f.read()


def weights(path: str) -> list:
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def scenario(work: str, name, launcher, slots, g, b, epochs, fault, where, interval) -> str:
    before, after = slots
    flags = ["--epochs", str(epochs), "--global-batch", str(g), "--micro-batch", str(b), "--checkpoint-every", "4"]
    rc, ref_s, text = run([sys.executable, LAUNCH, "--launcher", launcher, "-np", str(before), "--", TRAIN, *flags,
                           "--weights-out", f"{work}/{name}-ref.npz"], f"{work}/{name}-ref.log")
    if rc != 0:
        return f"| {launcher} | {before} -> {after} | {where} | reference failed ({rc}) | - | - |"
    script = f"{work}/{name}.sh"
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\nif ls {work}/{name}-ckpt/ckpt-* >/dev/null 2>&1; then echo localhost:{after}; "
                f"else echo localhost:{before}; fi\n")
    os.chmod(script, 0o755)
    rc, took, text = run([sys.executable, LAUNCH, "--launcher", launcher, "--min-np", "1",
                          "--max-np", str(max(before, after)), "--host-discovery-script", script, "--discovery-interval", str(interval), "--", TRAIN,
                          *flags, *fault, "--checkpoint-dir", f"{work}/{name}-ckpt",
                          "--weights-out", f"{work}/{name}.npz"], f"{work}/{name}.log")
    shutil.copy(f"{work}/{name}.log", os.path.join(tempfile.gettempdir(), f"elastic-{name}.log"))
    resized = re.findall(r"\[launch\] elastic: (\d+) -> (\d+) workers", text)
    resumed = re.findall(r"\[train\] resumed after update (\d+)", text)
    same = re.findall(FINGERPRINT, text)[-1:] == re.findall(FINGERPRINT, open(f"{work}/{name}-ref.log").read())[-1:]
    if same:
        result = "same bits"
    elif os.path.exists(f"{work}/{name}.npz"):
        diff = max(float(np.max(np.abs(x - y))) for x, y in zip(weights(f"{work}/{name}.npz"),
                                                                weights(f"{work}/{name}-ref.npz")))
        result = f"max abs difference {diff:.2e}"
    else:
        result = "no weights"
    path = " -> ".join([resized[0][0]] + [n for _, n in resized]) if resized else "-"
    return (f"| {launcher} | {before} -> {after} (G {g}, b {b}) | {where} | {rc} | {path} | "
            f"{', '.join(resumed) or '-'} | {took - ref_s:+.1f} (uninterrupted {ref_s:.1f}) | {result} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "ELASTIC.md"))
    p.add_argument("--only", default=None)
    args = p.parse_args(argv)
    chosen = [s for s in SCENARIOS if args.only is None or s[0] in args.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for s in chosen:
            rows.append(scenario(work, *s))
            print(rows[-1], flush=True)
    head = ("| launcher | resize | when | exit status | workers (starts) | resumed after update | seconds lost | "
            "final weights against the uninterrupted run |\n|---|---|---|---|---|---|---|---|")
    with open(args.out, "w") as f:
        f.write("# Elastic resizes: the main job against the run never resized\n\n"
                f"`python benchmarks/elastic_resize.py` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, TensorFlow "
                "2.18.1, Horovod 0.28.1; the main job, 2 epochs of the digits data (4 where discovery resizes, so "
                "that the resize falls inside training), checkpoints every 4 batches, `--min-np 1`). Seconds lost: "
                "the elastic run's wall time minus the uninterrupted run's (start-ups, the work after the "
                "newest checkpoint done again, the discovery interval).\n\n" + head + "\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
