"""Process lifecycle: every job the launcher or a test starts ends, whatever ends its
wait (an exception such as pytest-timeout's, a timeout, a failing worker), and leaves no
process behind (ranks horovodrun and mpirun start in groups of their own included); no
worker blocks on a full pipe; a port taken between its choice and its bind starts the
job again on new ports. The launcher is the `name` parameter where several are checked."""

import os
import re
import signal
import sys
import time
import uuid

import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = pytest.mark.distributed
ROOT = proc.ROOT


class Interrupt(BaseException):
    """Stands for pytest-timeout's `Failed`: a BaseException raised in the main thread
    while the launcher waits for its job."""


def sleeper(tmp_path, marker: str):
    """A worker that reports it started, then sleeps; `marker` is in its command line."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "open(os.path.join(sys.argv[1], f'started-{os.getpid()}'), 'w').close()\n"
                      "print('worker started', flush=True)\n"
                      "time.sleep(600)\n")
    return [str(script), str(tmp_path), marker]


def wait_for(predicate, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("name", ["multiworker", pytest.param("horovod-gloo", marks=requires_horovod),
                                  pytest.param("horovod-mpi", marks=requires_horovod)])
def test_no_worker_survives_an_exception_in_the_supervisor(tmp_path, name):
    """An exception (a test runner's timeout, Ctrl-C) while the job runs stops every
    process of it, including ranks that horovodrun or mpirun started in their own
    process groups."""
    marker = f"dm-marker-{uuid.uuid4().hex}"
    log = tmp_path / "log.txt"
    started = lambda: len(list(tmp_path.glob("started-*"))) == 2  # noqa: E731
    with open(log, "w") as f:
        def fire_when_started(signum, frame):
            raise Interrupt()

        # Interrupt once both workers are up (or after 60 s).
        previous = signal.signal(signal.SIGALRM, fire_when_started)
        try:
            import threading

            def arm():
                wait_for(started, 60)
                signal.setitimer(signal.ITIMER_REAL, 0.5)

            threading.Thread(target=arm, daemon=True).start()
            with pytest.raises(Interrupt):
                launcher.launch(name, 2, sleeper(tmp_path, marker), timeout=120, out=f, child_output=f)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    assert started(), log.read_text()[-3000:]
    assert wait_for(lambda: not proc.survivors(marker), 5), proc.survivors(marker)


@pytest.mark.parametrize("name", ["multiworker", pytest.param("horovod-gloo", marks=requires_horovod)])
def test_no_worker_survives_a_timeout(tmp_path, name):
    marker = f"dm-marker-{uuid.uuid4().hex}"
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch(name, 2, sleeper(tmp_path, marker), timeout=10, out=f, child_output=f)
    assert rc == 124
    assert proc.survivors(marker) == [], log.read_text()[-3000:]


def test_run_all_kills_the_job_on_an_exception_and_leaves_no_process(tmp_path):
    marker = f"dm-marker-{uuid.uuid4().hex}"
    cmd = [sys.executable, *sleeper(tmp_path, marker)]

    def fire(signum, frame):
        raise Interrupt()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, 3)
    try:
        with pytest.raises(Interrupt):
            proc.run_all([cmd, cmd], [proc.env(), proc.env()], timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert proc.survivors(marker) == []


def test_a_worker_writing_more_than_a_pipe_buffer_does_not_block(tmp_path):
    """4 MiB of output (a pipe holds 64 KiB): the worker finishes at once, nothing is lost."""
    script = tmp_path / "loud.py"
    script.write_text("import sys\nsys.stdout.write('x' * (4 << 20) + '\\nEND\\n')\n")
    start = time.monotonic()
    [(rc, out)] = proc.run_all([[sys.executable, str(script)]], [proc.env()], timeout=60)
    assert rc == 0 and out.endswith("END\n") and len(out) > 4 << 20
    assert time.monotonic() - start < 30
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        assert launcher.launch("multiworker", 2, [str(script)], timeout=60, out=f, child_output=f) == 0
    assert log.read_text().count("END") == 2


def test_multiworker_launch_retries_when_a_port_was_taken(tmp_path):
    """A worker whose gRPC server cannot bind (another process took the port) makes the
    launcher start the job again on new ports."""
    script = tmp_path / "flaky.py"
    script.write_text(
        "import json, os, sys\n"
        "flag = os.path.join(sys.argv[1], 'failed-once')\n"
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "if i == 1 and not os.path.exists(flag):\n"
        "    open(flag, 'w').close()\n"
        "    print('tensorflow.python.framework.errors_impl.UnknownError: Could not start gRPC server', flush=True)\n"
        "    sys.exit(1)\n"
        "print('worker', i, 'ran on', os.environ['TF_CONFIG'], flush=True)\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("multiworker", 2, [str(script), str(tmp_path)], timeout=60, out=f, child_output=f)
    text = log.read_text()
    assert rc == 0, text
    assert "starting again on new ports" in text and text.count("worker 1 ran on") == 1
    # With the user's own --port there is nothing to choose again: the failure stands.
    (tmp_path / "failed-once").unlink()
    with open(log, "w") as f:
        port = proc.free_ports(1)[0]
        rc = launcher.launch("multiworker", 2, [str(script), str(tmp_path)], port=port, timeout=60,
                             out=f, child_output=f)
    assert rc == 1


def test_free_ports_avoid_the_ephemeral_range():
    lo, _ = launcher._ephemeral_range()
    ports = proc.free_ports(8)
    assert len(set(ports)) == 8
    if lo > 10001:
        assert all(10000 <= p < lo for p in ports), (ports, lo)


def test_supervisor_stops_the_others_and_forwards_the_failure(tmp_path, capsys):
    script = tmp_path / "w.py"
    script.write_text("import json, os, sys, time\n"
                      "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                      "time.sleep(0.5)\n"
                      "sys.exit(3) if i == 1 else time.sleep(600)\n")
    start = time.monotonic()
    rc = launcher.launch("multiworker", 2, [str(script)], python=sys.executable)
    assert rc == 3
    assert time.monotonic() - start < 30
    out = capsys.readouterr().out
    assert "TF_CONFIG=" in out and "[launch] failed: worker 1: exit status 3; the others were stopped" in out


def test_supervisor_timeout_kills_everything(tmp_path, capsys):
    script = tmp_path / "w.py"
    script.write_text("import time\ntime.sleep(600)\n")
    start = time.monotonic()
    assert launcher.launch("multiworker", 2, [str(script)], timeout=1, python=sys.executable) == 124
    assert time.monotonic() - start < 30
    assert "timed out" in capsys.readouterr().out


@pytest.mark.parametrize("launcher_name", [pytest.param("horovod-gloo", marks=requires_horovod),
                                           pytest.param("horovod-mpi", marks=requires_horovod)])
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_worker_ends_the_job_quickly(tmp_path, launcher_name, mode):
    log = tmp_path / "log.txt"
    start = time.monotonic()
    with open(log, "w") as f:
        rc = launcher.launch(launcher_name, 2, [os.path.join(proc.ROOT, "tests/workers/failing_worker.py"), mode],
                             timeout=120, out=f, child_output=f)
    elapsed = time.monotonic() - start
    text = log.read_text()
    assert rc not in (0, 124), text[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "[launch] failed: python: exit status" in text, text[-3000:]  # horovodrun's own status
    if launcher_name == "horovod-gloo" and mode == "kill":  # the rank horovodrun named, and how
        assert "(rank 1 failed first: exit status 137 (128 + SIGKILL))" in text, text[-3000:]
    if launcher_name == "horovod-gloo" and mode == "raise":
        # Rank 1's exception shuts Horovod down; rank 0's next collective then raises, and
        # either process may be the first to exit: horovodrun names whichever did.
        assert re.search(r"\(rank [01] failed first: exit status 1\)", text), text[-3000:]
    if mode == "raise":
        assert "planted failure on rank 1" in text
