"""What a local job exposes on the network, measured while it runs.

Each local launcher starts a short job (tests/workers/security_worker.py: set-up and
one collective, then a wait); the TCP sockets in LISTEN state of the whole process tree
are listed from /proc. Every one must be on loopback, except the ports
docs/security.md documents as unbindable (TensorFlow's gRPC server, Open MPI's out-of-band
listener), each of which the launcher must have named in an `[launch] exposed:` line.
Afterwards nothing of the job is left in its private temporary directories."""

import glob
import json
import os
import sys
import time

import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = pytest.mark.distributed
WORKER = os.path.join(proc.ROOT, "tests", "workers", "security_worker.py")
JOB_TIMEOUT = 120  # the launcher's own limit; pytest-timeout's is longer

# launcher, worker mode, processes that report ready, who may listen beyond loopback
CASES = [
    pytest.param("horovod-gloo", "horovod", 2, None, marks=requires_horovod, id="horovod-gloo"),
    pytest.param("horovod-mpi", "mpi", 2, "mpirun", marks=requires_horovod, id="horovod-mpi"),
    pytest.param("mpirun", "mpi", 2, "mpirun", marks=requires_horovod, id="mpirun"),
    pytest.param("multiworker", "multiworker", 2, "tf-workers", id="multiworker"),
    pytest.param("mirrored", "mirrored", 1, None, id="mirrored"),
]


def wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def job_dirs() -> set[str]:
    return set(glob.glob("/tmp/dist_minimize-job-*") + glob.glob("/dev/shm/dist_minimize-job-*"))


@pytest.mark.parametrize("name,mode,ready,unbindable", CASES)
def test_a_local_job_listens_on_loopback_only(tmp_path, name, mode, ready, unbindable):
    before = job_dirs()
    cmd = [sys.executable, os.path.join(proc.ROOT, "launch", "launch.py"), "--launcher", name, "-np", "2",
           "--timeout", str(JOB_TIMEOUT), "--", WORKER, mode, str(tmp_path)]
    log = tmp_path / "log.txt"
    with open(log, "w") as f, proc.started(cmd, proc.env(), f) as (p, pids):
        up = wait_for(lambda: len(glob.glob(str(tmp_path / "ready-*"))) == ready or p.poll() is not None,
                      JOB_TIMEOUT - 10)
        assert up and p.poll() is None, log.read_text()[-3000:]
        sockets = proc.listening_sockets(pids())
        exposed = [(pid, comm, a) for pid, comm, a in sockets if not proc.is_loopback(a)]
        lines = [f"[launch] exposed: {comm} (pid {pid}) listens on {a}" for pid, comm, a in exposed]
        # The launcher scans every second: give it the time to name each one.
        named = wait_for(lambda: all(x in log.read_text() for x in lines), 5)
        (tmp_path / "stop").touch()
        rc = p.wait(60)
    text = log.read_text()
    print(name, "listening:", sockets)  # the measured list, for the record (pytest -s)
    assert rc == 0, text[-3000:]
    assert sockets or name == "mirrored", "no listening socket found: is /proc readable?"
    if unbindable is None:
        assert exposed == [], (sockets, text[-2000:])
    elif unbindable == "mpirun":  # Open MPI's out-of-band listener only; the ranks have none
        assert exposed and {comm for _, comm, _ in exposed} == {"mpirun"}, sockets
    else:  # TensorFlow's gRPC server of each worker, on its TF_CONFIG port
        config = next(x for x in text.splitlines() if x.startswith("[launch] TF_CONFIG="))
        workers = json.loads(config.split("TF_CONFIG=", 1)[1].split("' ", 1)[0].strip("'"))["cluster"]["worker"]
        assert sorted(a.rsplit(":", 1)[1] for _, _, a in exposed) == sorted(w.rsplit(":", 1)[1] for w in workers)
    assert named, (lines, text[-3000:])
    assert job_dirs() <= before, job_dirs() - before  # the job's private temporary directories are gone
