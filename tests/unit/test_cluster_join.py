"""Joining a MultiWorkerMirroredStrategy job in bounded time (`dm.cluster.multi_worker_strategy`):
a worker whose peer never starts ends within the start-up timeout, naming the peer; a
SIGTERM during the wait ends it within seconds; the timeout's setting is checked. The
worker (tests/workers/join_worker.py) runs alone with a TF_CONFIG of two workers on
127.0.0.1, the peer's port free and never opened."""

import os
import signal
import subprocess
import sys
import time

import pytest

import proc
from dist_minimize import cluster
from dist_minimize.launch.plan import free_ports, tf_config

WORKER = os.path.join(proc.ROOT, "tests", "workers", "join_worker.py")


def start(index: int, start_timeout: str):
    ports = free_ports(2)
    workers = [f"127.0.0.1:{p}" for p in ports]
    env = {**os.environ, "TF_CONFIG": tf_config(workers, index), "DM_START_TIMEOUT": start_timeout,
           "PYTHONPATH": proc.ROOT}
    p = subprocess.Popen([sys.executable, WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    return p, workers


def wait_for_line(p, text: str, limit: float = 120.0) -> float:
    """Reads stdout until `text`; returns the time it came."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        line = p.stdout.readline()
        if text in line:
            return time.monotonic()
        if not line and p.poll() is not None:
            break
    raise AssertionError(f"no {text!r} from the worker (exit {p.poll()}): {p.stderr.read()[-3000:]}")


def finish(p, limit: float):
    try:
        return p.wait(timeout=limit)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        p.stdout.close()
        p.stderr.close()


@pytest.mark.parametrize("index", [0, 1], ids=["leader-waits-for-1", "worker-1-waits-for-leader"])
def test_a_worker_whose_peer_never_starts_exits_within_the_timeout_naming_it(index):
    p, workers = start(index, "4")
    joining = wait_for_line(p, "joining")
    try:
        rc = p.wait(timeout=60)
        elapsed = time.monotonic() - joining
        err = p.stderr.read()
    finally:
        finish(p, 5)
    assert rc == -signal.SIGKILL, err[-2000:]
    assert elapsed < 4 + 10, elapsed  # the timeout, the probe of the peer (1 s) and the exit
    peer = 1 - index
    assert f"not listening: worker(s) {peer} ({workers[peer]})" in err, err[-2000:]
    assert "within 4 s" in err and "DM_START_TIMEOUT" in err


def test_sigterm_during_the_wait_ends_the_worker_within_seconds():
    p, _ = start(0, "120")
    wait_for_line(p, "joining")
    time.sleep(1.0)  # inside TensorFlow's wait
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc = finish(p, 30)
    assert rc == -signal.SIGKILL  # by the watcher, which saw the SIGTERM pending
    assert time.monotonic() - sent < 5


def test_a_one_worker_job_joins_and_releases_sigterm():
    ports = free_ports(1)
    env = {**os.environ, "TF_CONFIG": tf_config([f"127.0.0.1:{ports[0]}"], 0), "PYTHONPATH": proc.ROOT}
    out = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "joined 1" in out.stdout and "sigterm blocked False" in out.stdout, out.stdout


def test_start_timeout_setting():
    local = {"TF_CONFIG": tf_config(["127.0.0.1:1", "localhost:2"], 0)}
    remote = {"TF_CONFIG": tf_config(["10.0.0.1:1", "10.0.0.2:2"], 0)}
    assert cluster.start_timeout(local) == cluster.LOCAL_START_TIMEOUT
    assert cluster.start_timeout(remote) == cluster.CLUSTER_START_TIMEOUT
    assert cluster.start_timeout({**remote, "DM_START_TIMEOUT": "12.5"}) == 12.5
    assert cluster.start_timeout({**remote, "DM_START_TIMEOUT": "0"}) is None
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match=f"DM_START_TIMEOUT={bad!r}"):
            cluster.start_timeout({**local, "DM_START_TIMEOUT": bad})
    with pytest.raises(ValueError, match="timeout=-3"):
        cluster.multi_worker_strategy(timeout=-3)
