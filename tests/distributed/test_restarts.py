"""A job that loses a worker finishes with the same weights: the main job
(launch/train.py, `MovingAverage(GradientAccumulation(Optimizer(Adam, clip), 2))`,
checkpoints every 4 batches) under `launch.py --max-restarts 1`, one process killed on
purpose at a known batch (SIGKILL inside an accumulation window, SIGKILL inside a
checkpoint write, SIGTERM), ends with exit status 0 and the weights and optimizer
fingerprints of the run never interrupted; the launcher names the failed worker or rank
and the signal; nothing is left behind outside the checkpoint directory.

Each job is bounded by the launcher's timeout (shorter than the test's)."""

import os
import re
import signal
import sys
import time

import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = pytest.mark.distributed

TRAIN = os.path.join(proc.ROOT, "launch", "train.py")
FLAGS = ["--epochs", "2", "--accumulate", "2", "--moving-average", "0.9", "--checkpoint-every", "4"]
LAUNCHERS = ["multiworker", pytest.param("horovod-gloo", marks=requires_horovod)]


def job(tmp_path, name, launcher_name, extra=(), max_restarts=1, checkpoint=True):
    """Runs the main job; returns (status, launcher output + workers' output, fingerprints)."""
    log = tmp_path / f"{name}.txt"
    ckpt = tmp_path / "ckpt" / launcher_name
    args = [TRAIN, *FLAGS, *(["--checkpoint-dir", str(ckpt)] if checkpoint else []), *extra]
    with open(log, "w") as f:
        rc = launcher.launch(launcher_name, 2, args, timeout=proc.JOB_TIMEOUT / 3, python=sys.executable,
                             out=f, child_output=f, max_restarts=max_restarts)
    text = log.read_text()
    prints = re.findall(r"\[train\] (weights|optimizer) fingerprint ([0-9a-f]{16})", text)
    return rc, text, dict(prints)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's fingerprints, per launcher (without a checkpoint directory:
    the same input stream, so the same result as with one)."""
    found = {}

    def get(launcher_name, extra=()):
        key = (launcher_name, *extra)
        if key not in found:
            rc, text, prints = job(tmp_path_factory.mktemp("reference"), "reference", launcher_name, extra,
                                   checkpoint=False)
            assert rc == 0 and len(prints) == 2, text[-4000:]
            found[key] = prints
        return found[key]
    return get


def assert_left_nothing(tmp_path, launcher_name):
    assert not proc.survivors(TRAIN)
    names = os.listdir(tmp_path / "ckpt" / launcher_name)
    assert names and all(n.startswith("ckpt-") for n in names), names  # no temporaries left


# (launcher, flags making one process fail, what the launcher must report, the update the
# restarted job resumes after: checkpoints every 4 batches, at update boundaries (every 2
# batches), named by updates)
KILLS = [
    ("multiworker", ["--fail-at", "7", "--fail-rank", "1"], "worker 1: killed by SIGKILL", 2),
    ("multiworker", ["--fail-at", "12", "--fail-rank", "0", "--fail-in-save"], "worker 0: killed by SIGKILL", 4),
    ("multiworker", ["--fail-at", "9", "--fail-rank", "1", "--fail-signal", "TERM"], "exit status 42", 5),
    ("horovod-gloo", ["--fail-at", "13", "--fail-rank", "0", "--fail-signal", "TERM"], "exit status 42", 7),
]
# SIGKILL under horovodrun with the optimizer state sharded (every process's share saved,
# restored on another number of processes): tests/distributed/test_elastic_resize.py.


@pytest.mark.parametrize("launcher_name, fail, report, resumed",
                         [pytest.param(*k, marks=requires_horovod) if k[0] != "multiworker" else k for k in KILLS],
                         ids=[f"{k[0]}-{'-'.join(a.lstrip('-') for a in k[1][1:])}" for k in KILLS])
def test_a_lost_worker_costs_time_not_the_result(tmp_path, reference, launcher_name, fail, report, resumed):
    """SIGKILL loses what came after the newest checkpoint; SIGTERM (to one worker) makes
    every worker save at the next update boundary, so the restart loses nothing."""
    rc, text, prints = job(tmp_path, "killed", launcher_name, fail)
    assert rc == 0, text[-6000:]
    assert "[train] --fail-at: SIG" in text, text[-4000:]
    restart = re.search(r"\[launch\] restart 1 of 1 after (.*): starting the whole job again", text)
    assert restart and report in restart.group(1), text[-4000:]
    assert f"[train] resumed after update {resumed} from" in text, text[-4000:]
    assert prints == reference(launcher_name), text[-4000:]
    assert_left_nothing(tmp_path, launcher_name)


def test_sigterm_to_the_launcher_saves_stops_and_a_rerun_resumes(tmp_path, reference):
    """The scheduler's SIGTERM to the launcher: every worker gets it, they agree on a step,
    save, and exit within seconds; the launcher exits 143 without restarting; the same
    command run again resumes from that save and ends identical."""
    ckpt = tmp_path / "ckpt" / "multiworker"
    log = tmp_path / "log.txt"
    cmd = proc.python("launch/launch.py", "--launcher", "multiworker", "-np", "2", "--max-restarts", "2",
                      "--timeout", str(proc.JOB_TIMEOUT / 3), "--", TRAIN, *FLAGS, "--checkpoint-dir", str(ckpt),
                      *LONGER)
    with open(log, "w") as f, proc.started(cmd, proc.env(), f) as (p, _):
        deadline = time.monotonic() + proc.JOB_TIMEOUT / 3
        while "Epoch 1/4" not in log.read_text() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        start = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
        took = time.monotonic() - start
    text = log.read_text()
    assert rc == 143 and took < 10, (rc, took, text[-4000:])
    assert "[launch] restart" not in text.split("[launch] SIGTERM")[1], text[-4000:]
    saved = checkpoint_step(ckpt)
    assert saved >= 11, (saved, text[-4000:])  # updates: after epoch 1 (22 batches of 2 per update)
    assert_left_nothing(tmp_path, "multiworker")
    rc, text, prints = job(tmp_path, "resumed", "multiworker", LONGER, max_restarts=0)
    assert rc == 0 and f"resumed after update {saved}" in text, text[-4000:]
    assert prints == reference("multiworker", LONGER)


LONGER = ("--epochs", "4")  # still training when the SIGTERM comes, after epoch 1


def checkpoint_step(directory) -> int:
    names = [n for n in os.listdir(directory) if n.startswith("ckpt-")]
    return max(int(n[5:]) for n in names)
