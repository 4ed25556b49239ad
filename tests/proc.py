"""Starting worker processes for tests: bounded in time, children always killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dist_minimize import launcher
from dist_minimize.launcher import free_ports  # noqa: F401  (re-exported for the tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tf_config(ports: list[int], index: int) -> str:
    return launcher.tf_config([f"127.0.0.1:{p}" for p in ports], index)


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([ROOT, e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run_all(commands: list[list[str]], envs: list[dict], timeout: float) -> list[tuple[int, str]]:
    """Runs the commands together; returns [(returncode, output)].

    If one exits non-zero, the others are killed; past `timeout` seconds all are
    killed and the returncode is -9. Each process gets its own process group, so its
    children die with it.
    """
    procs = [
        subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, text=True)
        for cmd, e in zip(commands, envs)
    ]
    outputs = [""] * len(procs)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for i, p in enumerate(procs):
            out, _ = p.communicate()
            outputs[i] = out
    return [(p.returncode, o) for p, o in zip(procs, outputs)]


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, script), *args]
