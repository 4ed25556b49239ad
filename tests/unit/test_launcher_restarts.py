"""The launcher's restarts and failure reports, with small Python workers (no TensorFlow):
--max-restarts starts the whole job again after a failure (a signal, an exit status, 42)
and says which worker failed and how; a start-up bound names the workers that never
listened; a taken port is named; SIGTERM to the launcher stops every worker first.
The same with the real main job under multiworker and horovod-gloo, killed at known
steps: tests/distributed/test_restarts.py."""

import io
import os
import signal
import subprocess
import time

import pytest

import proc
from dist_minimize import launcher
from dist_minimize.launch.report import _forward

# A worker that fails in the first attempt (DM_RESTART_ATTEMPT=0) as argv[1] says:
# "kill" (SIGKILL to itself), "exit42", or "ok"; worker WORKER_INDEX only (default: all).
WORKER = """
import json, os, signal, sys, time
attempt = int(os.environ["DM_RESTART_ATTEMPT"])
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if "TF_CONFIG" in os.environ else 0
print(f"worker {index} attempt {attempt}", flush=True)
if attempt == 0 and index == int(os.environ.get("FAILING", index)):
    time.sleep(0.5)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "exit42":
        sys.exit(42)
"""


def script(tmp_path, text=WORKER):
    path = tmp_path / "worker.py"
    path.write_text(text)
    return str(path)


def run(tmp_path, launcher_name, np, args, **kwargs):
    out = io.StringIO()
    log = tmp_path / "workers.txt"
    with open(log, "w") as f:
        rc = launcher.launch(launcher_name, np, [script(tmp_path, kwargs.pop("text", WORKER)), *args],
                             timeout=60, out=out, child_output=f, **kwargs)
    return rc, out.getvalue(), log.read_text()


@pytest.mark.parametrize("code, words", [
    (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (1, "exit status 1"),
    (137, "exit status 137 (128 + SIGKILL)"), (42, "exit status 42 (stopped to be restarted"),
])
def test_exit_statuses_in_words(code, words):
    assert launcher.describe_status(code).startswith(words)


@pytest.mark.parametrize("lines, rank", [
    ([b"Process 1 exit with status code 137.\n"], (1, 137)),  # horovodrun --gloo
    ([b"mpirun noticed that process rank 1 with PID 4242 on node n1 exited on signal 9 (Killed).\n"], (1, -9)),
    ([b"The first process to do so was:\n", b"\n", b"  Process name: [[21591,1],1]\n", b"  Exit code:    42\n"],
     (1, 42)),  # mpirun's summary
])
def test_the_rank_a_launcher_names_is_read_from_its_output(lines, rank):
    seen, sink = {}, io.BytesIO()
    sink.mode = "wb"
    _forward(io.BytesIO(b"".join([b"other output\n", *lines])), sink, seen, None).join(5)
    assert seen["rank"] == rank
    assert sink.getvalue().endswith(lines[-1])  # everything forwarded
    assert launcher._failure("horovodrun", 1, seen).startswith(f"horovodrun: exit status 1 (rank {rank[0]} failed first")


@pytest.mark.parametrize("mode, how", [("kill", "worker 1: killed by SIGKILL"),
                                       ("exit42", "worker 1: exit status 42")])
def test_max_restarts_starts_the_whole_job_again(tmp_path, monkeypatch, mode, how):
    monkeypatch.setenv("FAILING", "1")
    rc, out, workers = run(tmp_path, "multiworker", 2, [mode], max_restarts=1)
    assert rc == 0, out + workers
    assert f"[launch] failed: {how}" in out and f"[launch] restart 1 of 1 after {how}" in out, out
    assert sorted(line for line in workers.splitlines() if line.startswith("worker")) == [
        "worker 0 attempt 0", "worker 0 attempt 1", "worker 1 attempt 0", "worker 1 attempt 1"]


def test_without_restarts_the_failure_is_the_status(tmp_path):
    rc, out, _ = run(tmp_path, "mirrored", 1, ["exit42"])
    assert rc == 42
    assert "[launch] failed: python" in out and "exit status 42" in out and "[launch] restart" not in out, out


def test_restarts_are_bounded(tmp_path):
    always = "import sys\nprint('failing', flush=True)\nsys.exit(3)\n"
    rc, out, workers = run(tmp_path, "mirrored", 1, [], text=always, max_restarts=2)
    assert rc == 3 and workers.count("failing") == 3
    assert "restart 1 of 2" in out and "restart 2 of 2" in out and "restart 3" not in out, out


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_max_restarts_is_named(value):
    with pytest.raises(ValueError, match=f"`max_restarts` must be an integer >= 0. Received: max_restarts={value}"):
        launcher.launch("mirrored", 1, ["t.py"], max_restarts=value)


LISTEN_IF_0 = """
import json, os, socket, time
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
if index == 0:
    s = socket.socket()
    s.bind(("127.0.0.1", int(config["cluster"]["worker"][0].rsplit(":", 1)[1])))
    s.listen()
time.sleep(30)
"""


def test_a_worker_that_never_listens_is_named_within_the_start_timeout(tmp_path):
    start = time.monotonic()
    rc, out, _ = run(tmp_path, "multiworker", 2, [], text=LISTEN_IF_0, start_timeout=3)
    took = time.monotonic() - start
    assert rc == 1 and took < 15, (took, out)
    assert "[launch] not every worker started within 3 s: worker 1 (nothing listens on 127.0.0.1:" in out, out
    assert "worker 0 (" not in out.split("not every worker started")[1], out
    assert not proc.survivors(str(tmp_path))


BIND_FAILS = "import sys\nprint('E Could not start gRPC server', flush=True)\nsys.exit(1)\n"


def test_a_taken_port_is_named(tmp_path):
    rc, out, _ = run(tmp_path, "multiworker", 1, [], text=BIND_FAILS, port=23999, max_restarts=2)
    assert rc == 1
    assert "[launch] port 23999 is taken by another process; choose another --port" in out, out
    assert "[launch] restart" not in out  # a given port that is taken does not free itself


def test_chosen_ports_that_are_taken_are_chosen_again(tmp_path):
    rc, out, _ = run(tmp_path, "multiworker", 1, [], text=BIND_FAILS)
    assert rc == 1
    assert out.count("was taken by another process after it was chosen") == launcher.PORT_RETRIES, out


TRAPS_TERM = """
import signal, sys, time
def on_term(*_):
    print("worker saved on SIGTERM", flush=True)
    sys.exit(42)
signal.signal(signal.SIGTERM, on_term)
print("worker ready", flush=True)
time.sleep(60)
"""


def test_sigterm_to_the_launcher_reaches_every_worker_first(tmp_path):
    log = tmp_path / "log.txt"
    cmd = proc.python("launch/launch.py", "--launcher", "multiworker", "-np", "2", "--max-restarts", "3",
                      "--", script(tmp_path, TRAPS_TERM))
    with open(log, "w") as f, proc.started(cmd, proc.env(), f) as (p, pids):
        deadline = time.monotonic() + 30
        while log.read_text().count("worker ready") < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        start = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=20)
        took = time.monotonic() - start
    text = log.read_text()
    assert rc == 143 and took < 5, (rc, took, text)
    assert text.count("worker saved on SIGTERM") == 2 and "[launch] restart" not in text, text
    assert not proc.survivors(str(tmp_path))


def test_workers_are_told_the_attempt_and_the_start_bound(tmp_path):
    show = "import os\nprint('env', os.environ['DM_RESTART_ATTEMPT'], os.environ['DM_START_TIMEOUT'], flush=True)\n"
    rc, _, workers = run(tmp_path, "mirrored", 1, [], text=show, start_timeout=12)
    assert rc == 0 and "env 0 12" in workers


def test_mpirun_passes_the_job_environment():
    [(cmd, _)] = launcher.plan("mpirun", 2, ["t.py"])
    text = " ".join(cmd)
    assert "-x DM_RESTART_ATTEMPT" in text and "-x DM_START_TIMEOUT" in text


def test_launch_cli_help_names_the_options():
    out = subprocess.run(proc.python("launch/launch.py", "--help"), capture_output=True, text=True, timeout=60)
    assert "--max-restarts" in out.stdout and "--start-timeout" in out.stdout

