"""Elastic launches, with small Python workers (no TensorFlow): host discovery (a script
or a host file read again) decides how many workers run; a failed worker restarts the
job on the slots discovery reports; a running job is resized when discovery's count
changes (SIGTERM, the workers exit, the job starts again on the new count); too few
slots wait a bounded time, then stop; a discovery that fails, hangs or prints garbage
gets a clear error in bounded time. The main job resized, with its weights compared:
tests/distributed/test_elastic_resize.py."""

import io
import os
import time

import pytest

from dist_minimize import launcher
from dist_minimize.launch.discovery import Discovery, DiscoveryError, parse_slots, take

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Prints its worker count, then works until SIGTERM (exit 42, as a saving worker does) or
# for SECONDS; a worker of the first attempt with index FAIL fails (exit 3) at once.
WORKER = """
import json, os, signal, sys, time
config = json.loads(os.environ["TF_CONFIG"])
index, count = config["task"]["index"], len(config["cluster"]["worker"])
attempt = int(os.environ["DM_RESTART_ATTEMPT"])
print(f"worker {index} of {count}, attempt {attempt}", flush=True)
if attempt == 0 and str(index) == os.environ.get("FAIL"):
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))
time.sleep(float(os.environ.get("SECONDS_", "0")))
"""


def files(tmp_path, slots: str):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(slots)
    return str(worker), hostfile


def run(worker, discovery, min_np=1, max_np=4, **kwargs):
    out = io.StringIO()
    kwargs.setdefault("timeout", 60)
    status = launcher.launch_elastic("multiworker", [worker], discovery, min_np, max_np, out=out,
                                     child_output=out, start_timeout=None, **kwargs)
    return status, out.getvalue()


def test_the_job_runs_on_the_slots_discovery_reports_up_to_max_np(tmp_path, monkeypatch):
    worker, hosts = files(tmp_path, "localhost:3\n")
    monkeypatch.setenv("SECONDS_", "0")
    status, text = run(worker, Discovery(hostfile=str(hosts)), max_np=2)
    assert status == 0, text
    assert "[launch] elastic: 0 -> 2 workers (start); hosts localhost:2" in text
    assert "worker 1 of 2, attempt 0" in text and "of 3" not in text


def test_a_failed_worker_restarts_the_job_on_the_slots_left(tmp_path, monkeypatch):
    """Worker 1 fails; the host file now holds one slot: the job starts again on 1."""
    worker, hosts = files(tmp_path, "localhost:2\n")
    monkeypatch.setenv("FAIL", "1")

    class Shrinking(Discovery):
        asks = 0

        def slots(self):
            Shrinking.asks += 1
            if Shrinking.asks > 1:
                hosts.write_text("localhost:1\n")
            return super().slots()
    status, text = run(worker, Shrinking(hostfile=str(hosts)), interval=600)
    assert status == 0, text
    assert "[launch] elastic: 2 -> 1 workers (after worker 1: exit status 3)" in text, text
    assert "worker 0 of 1, attempt 1" in text


def test_a_running_job_is_resized_when_discovery_changes(tmp_path, monkeypatch):
    """Started on 1 slot; the host file then says 2: within about `interval` seconds
    every worker gets SIGTERM, and the job starts again on 2, not counted as a failure."""
    worker, hosts = files(tmp_path, "localhost:1\n")
    monkeypatch.setenv("SECONDS_", "30")
    start = time.monotonic()

    class Growing(Discovery):
        def slots(self):
            if time.monotonic() - start > 2:
                hosts.write_text("localhost:2\n")
                monkeypatch.setenv("SECONDS_", "0")  # the second start finishes at once
            return super().slots()
    status, text = run(worker, Growing(hostfile=str(hosts)), interval=0.5, max_restarts=0)
    assert status == 0, text
    assert "[launch] elastic: the host file" in text and "reports 2 slot(s): every worker saves" in text, text
    assert "[launch] elastic: 1 -> 2 workers (the host file" in text, text
    assert "worker 1 of 2, attempt 1" in text
    assert time.monotonic() - start < 25  # resized, not waited out


def test_too_few_slots_wait_then_stop_with_a_clear_message(tmp_path):
    worker, hosts = files(tmp_path, "localhost:1\n")
    start = time.monotonic()
    status, text = run(worker, Discovery(hostfile=str(hosts)), min_np=2, interval=0.5, slots_timeout=2)
    assert status == 1 and time.monotonic() - start < 10, text
    assert "reports 1 slot(s), fewer than --min-np 2; waiting up to 2 s" in text
    assert "fewer than --min-np 2, for 2 s; stopping (the newest checkpoint stays in place" in text
    assert "worker 0" not in text  # nothing started


@pytest.mark.parametrize("command, message", [
    ("sh -c 'echo no cluster here >&2; exit 3'", "exited with status 3: no cluster here"),
    ("sleep 60", "did not finish within 1 s; it was killed"),
    ("echo 'localhost two'", "printed line 1 'localhost two': expected `host:slots`"),
    ("printf 'a:1\\na:2\\n'", "printed line 2 'a:2': 'a' is named twice"),
    ("/nonexistent/discover.sh", "cannot be started"),
], ids=["fails", "hangs", "garbage", "twice", "missing"])
def test_a_discovery_that_fails_ends_the_launch_with_its_reason_in_bounded_time(tmp_path, command, message):
    worker, _ = files(tmp_path, "")
    start = time.monotonic()
    status, text = run(worker, Discovery(script=command, timeout=1))
    assert status == 1 and time.monotonic() - start < 10, text
    assert "[launch] elastic: the host discovery script" in text and message in text, text
    assert "(the newest checkpoint stays in place)" in text


def test_slots_lines_and_the_hosts_taken():
    assert parse_slots("# cluster\nnode1:2\n\nnode2   # one slot\nnode3:0\n", "s") == [("node1", 2), ("node2", 1)]
    assert take([("node1", 2), ("node2", 4)], 3) == "node1:2,node2:1"
    with pytest.raises(DiscoveryError, match=r"s printed line 1 'node1:-1': expected `host:slots`"):
        parse_slots("node1:-1", "s")


def test_bad_elastic_arguments_are_named():
    d = Discovery(hostfile="/dev/null")
    with pytest.raises(ValueError, match=r"`min_np` must be <= `max_np`. Received: min_np=3, max_np=2"):
        launcher.launch_elastic("multiworker", ["x.py"], d, 3, 2)
    with pytest.raises(ValueError, match=r"An elastic launch runs on .*Received: launcher='mirrored'"):
        launcher.launch_elastic("mirrored", ["x.py"], d, 1, 2)
    with pytest.raises(ValueError, match=r"`interval` must be > 0 seconds. Received: interval=0"):
        launcher.launch_elastic("multiworker", ["x.py"], d, 1, 2, interval=0)
    with pytest.raises(ValueError, match=r"one of them. Received: script=None, hostfile=None"):
        Discovery()


def stub(tmp_path, name: str, output: str) -> dict:
    """An environment whose PATH starts with a `name` command printing `output`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\nprintf '{output}'\n")
    (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_the_slurm_example_reports_the_usable_nodes_of_the_allocation(tmp_path, monkeypatch):
    for k, v in stub(tmp_path, "sinfo", "node1 alloc\\nnode2 drain\\nnode3 mix\\nnode3 mix\\nnode4 down*\\n").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-4]")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    discovery = Discovery(script=os.path.join(ROOT, "launch", "discovery", "slurm_hosts.sh"))
    assert discovery.slots() == [("node1", 4), ("node3", 4)]


def test_the_kubernetes_example_reports_the_ready_worker_pods(tmp_path, monkeypatch):
    for k, v in stub(tmp_path, "kubectl", "10.0.0.1 True\\n10.0.0.2 False\\n10.0.0.3 True\\n").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DM_NAMESPACE", "training")
    discovery = Discovery(script=os.path.join(ROOT, "launch", "discovery", "k8s_pods.sh"))
    assert discovery.slots() == [("10.0.0.1", 1), ("10.0.0.3", 1)]


def test_the_job_runs_on_the_largest_count_it_accepts(tmp_path, monkeypatch):
    """3 slots, a job that accepts 1, 2 or 4 workers (G / b = 4): it starts on 2."""
    worker, hosts = files(tmp_path, "localhost:3\n")
    monkeypatch.setenv("SECONDS_", "0")
    status, text = run(worker, Discovery(hostfile=str(hosts)), worker_counts=[1, 2, 4])
    assert status == 0, text
    assert "[launch] elastic: 0 -> 2 workers (start); hosts localhost:2" in text


def test_discovery_output_that_is_no_slot_count_is_named():
    for text, why in (("a:\u00b2", "expected `host:slots`"), ("a,b:2", "expected `host:slots`")):
        with pytest.raises(DiscoveryError, match=why):
            parse_slots(text, "s")
