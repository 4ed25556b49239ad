"""Starting worker processes for tests: bounded in time, children always killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

from dist_minimize import launcher
from dist_minimize.launcher import free_ports  # noqa: F401  (re-exported for the tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_timeout() -> float:
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return float(tomllib.load(f)["tool"]["pytest"]["ini_options"]["timeout"])


# pytest-timeout's limit per test (pyproject.toml), and the limit of every job a test
# starts: shorter, so a stuck job is killed by its own supervisor (which reports its
# output) before pytest-timeout fires; if pytest-timeout fires first anyway, the
# supervisors stop every process of the job on the way out.
TEST_TIMEOUT = _test_timeout()
JOB_TIMEOUT = TEST_TIMEOUT - 60


def tf_config(ports: list[int], index: int) -> str:
    return launcher.tf_config([f"127.0.0.1:{p}" for p in ports], index)


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([ROOT, e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def kill_all(procs: list, tree: dict) -> None:
    """Kills each process's group and every process descended from one (`tree`, as
    remembered while they ran, plus what is alive now), then reaps the processes."""
    tree.update(launcher._process_tree([p.pid for p in procs]))
    for p in procs:  # (the group too when its leader has exited: what it started may live on)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in launcher._alive(tree):
        launcher._kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def run_all(commands: list[list[str]], envs: list[dict], timeout: float) -> list[tuple[int, str]]:
    """Runs the commands together; returns [(returncode, output)].

    If one exits non-zero, the others are killed; past `timeout` seconds all are
    killed and the returncode is -9. Each process gets its own process group, and
    every process descended from one is killed with it, whatever ends the wait (an
    exception included). Output goes to temporary files, not pipes, so a worker that
    writes a lot never blocks.
    """
    logs = [tempfile.TemporaryFile() for _ in commands]
    procs = []
    tree: dict[int, str] = {}
    try:
        for cmd, e, log in zip(commands, envs, logs):
            procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            tree.update(launcher._process_tree([p.pid for p in procs]))
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        kill_all(procs, tree)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode(errors="replace"))
        log.close()
    return [(p.returncode, o) for p, o in zip(procs, outputs)]


def survivors(marker: str) -> list[str]:
    """Command lines of live processes (not zombies) whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            fields = launcher._stat(int(entry))
        except OSError:
            continue
        if marker in cmdline and fields and fields[0] != "Z":
            found.append(f"{entry}: {cmdline}")
    return found


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, script), *args]


def listening_sockets(pids) -> list[tuple[int, str, str]]:
    """[(pid, command, "address:port")] of the TCP sockets in LISTEN state that `pids` hold."""
    return launcher.listening_sockets(pids)


def is_loopback(address: str) -> bool:
    return launcher.is_loopback(address)


@contextlib.contextmanager
def started(cmd: list[str], env: dict, log):
    """Starts `cmd` in a process group of its own, output to the file `log`; yields
    (process, pids) where `pids()` lists it and every process descended from it. On the
    way out, whatever ends the block, every one of them is killed."""
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tree: dict[int, str] = {}

    def pids() -> list[int]:
        tree.update(launcher._process_tree([p.pid]))
        return [p.pid, *launcher._alive(tree)]

    try:
        yield p, pids
    finally:
        kill_all([p], tree)
