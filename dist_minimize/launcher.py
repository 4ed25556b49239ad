"""Launching a training script on N processes or devices: horovodrun (Gloo or MPI),
plain mpirun, N MultiWorkerMirroredStrategy workers on this host, or one
MirroredStrategy process.

Every launch prints the exact command(s) it runs, returns the first non-zero exit
status of any worker (stopping the others), and can be bounded by a timeout. The CLI is
`launch/launch.py`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

LAUNCHERS = ("horovod-gloo", "horovod-mpi", "mpirun", "multiworker", "mirrored")

# Collectives that stall fail the job instead of hanging it (Horovod's stall inspector).
FAIL_FAST_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",
    "DM_COLLECTIVE_TIMEOUT": "60",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def parse_hosts(hosts: str | None, hostfile: str | None, np: int) -> list[tuple[str, int]]:
    """`-H host:slots,...` or a host file (`host slots=N` or `host:N` lines) -> [(host, slots)].

    Default: `localhost` with `np` slots.

    Raises:
      ValueError: both or a malformed entry, naming it; fewer slots than `np`.
    """
    if hosts and hostfile:
        raise ValueError(f"Give `hosts` or `hostfile`, not both. Received: hosts={hosts!r}, "
                         f"hostfile={hostfile!r}")
    entries: list[str] = []
    if hostfile:
        with open(hostfile) as f:
            for line in f:
                line = line.split("#")[0].strip()
                if line:
                    parts = line.split()
                    slots = next((p.split("=")[1] for p in parts[1:] if p.startswith("slots=")), None)
                    entries.append(f"{parts[0]}:{slots}" if slots else parts[0])
    elif hosts:
        entries = [h.strip() for h in hosts.split(",") if h.strip()]
    else:
        return [("localhost", np)]
    parsed = []
    for entry in entries:
        host, _, slots = entry.partition(":")
        try:
            n = int(slots) if slots else 1
        except ValueError:
            n = 0
        if not host or n < 1:
            raise ValueError(f"Each host must be `name` or `name:slots` with slots >= 1. "
                             f"Received: {entry!r}")
        parsed.append((host, n))
    if sum(n for _, n in parsed) < np:
        raise ValueError(f"The hosts have {sum(n for _, n in parsed)} slots for np={np} processes. "
                         f"Received: hosts={','.join(f'{h}:{n}' for h, n in parsed)}")
    return parsed


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(workers: Sequence[str], index: int) -> str:
    """The TF_CONFIG of worker `index` in a cluster of `workers` ("host:port")."""
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


def plan(launcher: str, np: int, script: Sequence[str], hosts: str | None = None,
         hostfile: str | None = None, port: int | None = None,
         python: str = sys.executable) -> list[tuple[list[str], dict]]:
    """The commands (and extra environment of each) that `launch` would run.

    Raises:
      ValueError: an unknown launcher, np < 1, an empty script, or bad hosts.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"`launcher` must be one of {list(LAUNCHERS)}. Received: launcher={launcher!r}")
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"`np` must be an integer >= 1. Received: np={np!r}")
    if not script:
        raise ValueError("`script` must name the training script (and its arguments). Received: []")
    program = [python, *script]
    slots = parse_hosts(hosts, hostfile, np)
    host_arg = ",".join(f"{h}:{n}" for h, n in slots)
    if launcher in ("horovod-gloo", "horovod-mpi"):
        binary = os.path.join(os.path.dirname(python), "horovodrun")
        cmd = [binary if os.path.exists(binary) else "horovodrun", "-np", str(np)]
        cmd += ["--hostfile", hostfile] if hostfile else ["-H", host_arg]
        cmd += ["--gloo" if launcher == "horovod-gloo" else "--mpi"]
        return [(cmd + program, {})]
    if launcher == "mpirun":
        cmd = ["mpirun", "-np", str(np)]
        cmd += ["--hostfile", hostfile] if hostfile else ["-H", host_arg]
        cmd += ["--bind-to", "none", "--map-by", "slot"]
        if os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
        for name in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", *FAIL_FAST_ENV):
            if name in os.environ or name in FAIL_FAST_ENV:
                cmd += ["-x", name]
        return [(cmd + program, {})]
    if launcher == "mirrored":
        return [(program + ["--replicas", str(np)], {})]
    # multiworker: every worker runs on this host; other hosts start theirs with the same
    # TF_CONFIG cluster (see the README's recipe).
    if any(h not in ("localhost", "127.0.0.1") for h, _ in slots):
        raise ValueError("The multiworker launcher starts workers on this host only; on a cluster, "
                         "start one worker per host with the TF_CONFIG recipe. Received: "
                         f"hosts={host_arg}")
    ports = [port + i for i in range(np)] if port else free_ports(np)
    workers = [f"127.0.0.1:{p}" for p in ports]
    return [(list(program), {"TF_CONFIG": tf_config(workers, i)}) for i in range(np)]


def launch(launcher: str, np: int, script: Sequence[str], hosts: str | None = None,
           hostfile: str | None = None, port: int | None = None, timeout: float | None = None,
           python: str = sys.executable, out=None, child_output=None) -> int:
    """Runs `script` on `np` processes with `launcher`; returns the job's exit status.

    The first worker to exit non-zero sets the status and the others are stopped
    (SIGTERM, then SIGKILL after 10 s). Past `timeout` seconds every process is killed
    and the status is 124. The commands are printed first, exactly as run, to `out`
    (default: stdout); the workers' own output goes to `child_output` (a file) if given,
    else to this process's stdout/stderr.
    """
    out = out if out is not None else sys.stdout
    steps = plan(launcher, np, script, hosts, hostfile, port, python)
    base_env = dict(os.environ)
    for k, v in FAIL_FAST_ENV.items():
        base_env.setdefault(k, v)
    procs = []
    for cmd, extra in steps:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        print(f"[launch] {prefix + ' ' if prefix else ''}{shlex.join(cmd)}", file=out, flush=True)
    for cmd, extra in steps:
        redirect = {"stdout": child_output, "stderr": subprocess.STDOUT} if child_output else {}
        procs.append(subprocess.Popen(cmd, env={**base_env, **extra}, start_new_session=True, **redirect))
    names = [os.path.basename(cmd[0]) if len(steps) == 1 else f"worker {i}"
             for i, (cmd, _) in enumerate(steps)]
    return _supervise(procs, names, timeout, out)


def _supervise(procs: list, names: list, timeout: float | None, out) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, status = failed[0]
                others = "; stopping the others" if len(procs) > 1 else ""
                print(f"[launch] {names[i]} exited with status {status}{others}", file=out, flush=True)
                break
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"[launch] timed out after {timeout:.0f} s; killing every worker", file=out, flush=True)
                status = 124
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        status = 130
    _stop(procs)
    return status if status > 0 else 128 + abs(status)


def _stop(procs: list, grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGKILL)
        p.wait()


def _signal(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
