"""An elastic job trains the same model whatever happens to its workers: the main job
with a fixed global batch and micro-batch (`--micro-batch`, `dist_minimize.elastic`)
under `launch/launch.py --min-np 1 --max-np 2` and a host discovery script, checkpoints
every 4 batches, against runs never resized:

* started on 2, a worker SIGKILLed after batch 7, discovery then reporting 1 slot: the job
  finishes on 1 worker from the checkpoint of update 4 with the weights of the
  uninterrupted 2-worker run, bit for bit (G = 64, b = 32: two workers' halves or one
  worker's two micro-batches are the same two-operand sums);
* started on 1, discovery then reporting 2: the workers save at an update boundary and
  the job grows to 2, ending with the uninterrupted 2-worker run's weights and optimizer
  state;
* killed inside an accumulation window (b = 16: 2 micro-batches per worker and update on
  2 workers, 4 on 1), and 4 workers shrunk to 2: within 1e-6 of the uninterrupted run
  (the sums' order differs);
* too few slots after a failure (--min-np 2): the job stops with a clear message, and the
  checkpoint it leaves resumes on 1 worker, sharded optimizer state and DP-SGD (its noise
  and its accounting) included.

The first two under horovod-gloo and MultiWorkerMirroredStrategy, the others under
horovod-gloo; each job bounded by the launcher's timeout."""

import os
import re
import sys

import numpy as np
import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher
from dist_minimize.launch.discovery import Discovery

pytestmark = pytest.mark.distributed
LAUNCHERS = [pytest.param("horovod-gloo", marks=requires_horovod), "multiworker"]

TRAIN = os.path.join(proc.ROOT, "launch", "train.py")
FLAGS = ["--epochs", "2", "--global-batch", "64", "--checkpoint-every", "4"]
FINGERPRINTS = r"\[train\] (weights|optimizer) fingerprint ([0-9a-f]{16})"
EPSILON = r"\[train\] DP-SGD: epsilon [0-9.]+ at delta .*"


def discovery(tmp_path, before: int, after: int) -> Discovery:
    """Reports `before` slots until the job's first checkpoint exists, then `after`."""
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\nif ls {tmp_path}/ckpt/ckpt-* >/dev/null 2>&1; then echo localhost:{after}; "
                    f"else echo localhost:{before}; fi\n")
    path.chmod(0o755)
    return Discovery(script=str(path))


def elastic(tmp_path, name, disc, micro_batch=32, extra=(), min_np=1, interval=600.0, slots_timeout=600.0,
            launcher_name="horovod-gloo", max_np=2):
    log = tmp_path / f"{name}.txt"
    args = [TRAIN, *FLAGS, "--micro-batch", str(micro_batch), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--weights-out", str(tmp_path / f"{name}.npz"), *extra]
    with open(log, "w") as f:
        rc = launcher.launch_elastic(launcher_name, args, disc, min_np, max_np, interval=interval,
                                     slots_timeout=slots_timeout, max_restarts=1, timeout=proc.JOB_TIMEOUT / 3,
                                     python=sys.executable, out=f, child_output=f)
    return rc, log.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on `np_` workers: (fingerprints, weights)."""
    found = {}

    def get(np_, micro_batch=32, extra=(), launcher_name="horovod-gloo"):
        key = (launcher_name, np_, micro_batch, *extra)
        if key not in found:
            tmp = tmp_path_factory.mktemp("reference")
            log = tmp / "log.txt"
            with open(log, "w") as f:
                rc = launcher.launch(launcher_name, np_, [TRAIN, *FLAGS, "--micro-batch", str(micro_batch),
                                                           "--weights-out", str(tmp / "w.npz"), *extra],
                                     timeout=proc.JOB_TIMEOUT / 3, python=sys.executable, out=f, child_output=f)
            text = log.read_text()
            assert rc == 0, text[-4000:]
            found[key] = dict(re.findall(FINGERPRINTS, text)), weights(tmp / "w.npz"), re.findall(EPSILON, text)
        return found[key]
    return get


def weights(path) -> list:
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def last(text: str) -> dict:
    """The fingerprints the job's last start printed."""
    return dict(re.findall(FINGERPRINTS, text)[-2:])


@pytest.mark.parametrize("launcher_name", LAUNCHERS)
def test_a_lost_worker_shrinks_the_job_and_the_result_stays(tmp_path, reference, launcher_name):
    rc, text = elastic(tmp_path, "shrunk", discovery(tmp_path, 2, 1), extra=["--fail-at", "7", "--fail-rank", "1"],
                       launcher_name=launcher_name)
    assert rc == 0, text[-5000:]
    assert "[launch] elastic: 0 -> 2 workers (start)" in text
    assert re.search(r"\[launch\] elastic: 2 -> 1 workers \(after .*SIGKILL", text), text[-4000:]
    assert "[train] workers 1, micro-batches per update 2, global batch 64" in text
    assert "[train] resumed after update 4 from" in text, text[-4000:]
    assert last(text)["weights"] == reference(2, launcher_name=launcher_name)[0]["weights"]
    assert not proc.survivors(TRAIN)


@pytest.mark.parametrize("launcher_name", LAUNCHERS)
def test_new_slots_grow_the_job_at_a_checkpoint_and_the_result_stays(tmp_path, reference, launcher_name):
    rc, text = elastic(tmp_path, "grown", discovery(tmp_path, 1, 2), extra=["--epochs", "4"], interval=1.0,
                       launcher_name=launcher_name)
    assert rc == 0, text[-5000:]
    assert "reports 2 slot(s): every worker saves at its next update boundary and stops" in text, text[-4000:]
    assert "[launch] elastic: 1 -> 2 workers" in text
    resumed = re.search(r"\[train\] resumed after update (\d+) from", text)
    assert resumed and 0 < int(resumed.group(1)) < 4 * 22, text[-4000:]  # mid-training (22 updates an epoch)
    assert "[train] workers 2, micro-batches per update 1, global batch 64" in text
    assert last(text) == reference(2, extra=("--epochs", "4"), launcher_name=launcher_name)[0]


@requires_horovod
def test_a_loss_inside_an_accumulation_window_stays_within_rounding(tmp_path, reference):
    """b = 16: on 2 workers each accumulates 2 micro-batches per update; batch 7 is inside
    a window. On 1 worker the 4 micro-batches are summed in another order; the reference
    is the uninterrupted run of the same G and b (on 4 workers: another order again)."""
    rc, text = elastic(tmp_path, "window", discovery(tmp_path, 2, 1), micro_batch=16,
                       extra=["--fail-at", "7", "--fail-rank", "1"])
    assert rc == 0, text[-5000:]
    assert "[train] workers 2, micro-batches per update 2" in text and "[train] workers 1, micro-batches per update 4" \
        in text
    assert "[train] resumed after update 2 from" in text, text[-4000:]  # the save after batch 4
    expected = reference(4, micro_batch=16)[1]  # G and b as here: the same training (the four-worker test's)
    got = weights(tmp_path / "window.npz")
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)) <= 1e-6


@requires_horovod
def test_four_workers_shrunk_to_two_stay_within_rounding(tmp_path, reference):
    """b = 16: 1 micro-batch per worker and update on 4, 2 on 2 (the sums' order differs:
    (g0 + g2) + (g1 + g3) against the 4-operand all-reduce)."""
    rc, text = elastic(tmp_path, "four", discovery(tmp_path, 4, 2), micro_batch=16, max_np=4,
                       extra=["--fail-at", "7", "--fail-rank", "3"])
    assert rc == 0, text[-5000:]
    assert re.search(r"\[launch\] elastic: 4 -> 2 workers \(after .*SIGKILL", text), text[-4000:]
    assert "[train] workers 2, micro-batches per update 2" in text
    expected = reference(4, micro_batch=16)[1]
    got = weights(tmp_path / "four.npz")
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected)) <= 1e-6


@requires_horovod
def test_too_few_slots_stop_the_job_and_its_checkpoint_resumes_elsewhere(tmp_path, reference):
    """--min-np 2: after the loss discovery reports 1 slot; the job waits 2 s, stops with
    status 1 and a message; the same job with --min-np 1 resumes that checkpoint (sharded
    state, DP-SGD with a fixed noise seed: its seed and draw counter are state) on 1
    worker and ends as the uninterrupted run, with the same privacy accounting."""
    sharded = ["--shard-optimizer-state", "--dp-noise-multiplier", "1.0", "--dp-seed", "5"]
    rc, text = elastic(tmp_path, "stopped", discovery(tmp_path, 2, 1), extra=["--fail-at", "7", "--fail-rank", "1",
                                                                              *sharded],
                       min_np=2, interval=0.5, slots_timeout=2)
    assert rc == 1, text[-5000:]
    assert "reports 1 slot(s), fewer than --min-np 2, for 2 s; stopping (the newest checkpoint stays in place" in text
    rc, text = elastic(tmp_path, "resumed", discovery(tmp_path, 1, 1), extra=sharded)
    assert rc == 0, text[-5000:]
    assert "[train] resumed after update 4 from" in text, text[-4000:]
    dp = ("--dp-noise-multiplier", "1.0", "--dp-seed", "5")
    assert last(text)["weights"] == reference(2, extra=dp)[0]["weights"]
    assert reference(2, extra=dp)[2] and re.findall(EPSILON, text) == reference(2, extra=dp)[2]  # the same
    # updates at the same sampling rate: the same epsilon
    assert not proc.survivors(TRAIN)
