"""The launcher's commands, without running anything: the host list (`-H` or a host
file), whether a job stays on this machine, free ports, TF_CONFIG, and `plan`, the
command(s) and environment of each launcher. Part of `dist_minimize.launcher`, which
re-exports every public name here; like it, this module needs no TensorFlow.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Sequence

LAUNCHERS = ("horovod-gloo", "horovod-mpi", "mpirun", "multiworker", "mirrored")

# Collectives that stall fail the job instead of hanging it (Horovod's stall inspector).
# Set by the launcher in every worker's environment (and passed on by mpirun's -x):
# the restart attempt (0 for the first start) and the start-up bound in seconds.
JOB_ENV = ("DM_RESTART_ATTEMPT", "DM_START_TIMEOUT")

FAIL_FAST_ENV = {
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "60",
    "DM_COLLECTIVE_TIMEOUT": "60",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def _read_hostfile(hostfile: str) -> list[str]:
    """A host file's lines (`host slots=N` or `host:N`, `#` comments) -> ["host:N" or "host"]."""
    entries: list[str] = []
    with open(hostfile) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                parts = line.split()
                slots = next((p.split("=")[1] for p in parts[1:] if p.startswith("slots=")), None)
                entries.append(f"{parts[0]}:{slots}" if slots else parts[0])
    return entries


def parse_hosts(hosts: str | None, hostfile: str | None, np: int) -> list[tuple[str, int]]:
    """`-H host:slots,...` or a host file (`host slots=N` or `host:N` lines) -> [(host, slots)].

    Default: `localhost` with `np` slots.

    Raises:
      ValueError: both or a malformed entry, naming it; fewer slots than `np`.
    """
    if hosts and hostfile:
        raise ValueError(f"Give `hosts` or `hostfile`, not both. Received: hosts={hosts!r}, "
                         f"hostfile={hostfile!r}")
    if hostfile:
        entries = _read_hostfile(hostfile)
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


# Host names that mean this machine and nothing else. A job on these only listens on
# loopback; any other name (this machine's own host name included) is a cluster host list
# and gets the tools' defaults, so that other machines can connect.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

# Open MPI settings of a local job (mpirun, horovodrun --mpi). Ranks talk through shared
# memory only: the TCP transport (and libfabric's, under other pml/btl choices) listens on
# every interface or on the machine's address whatever `btl_tcp_if_include` says
# (measured on Open MPI 4.1.4). horovodrun sets pml and btl itself: `horovod_runner.py`
# changes its choice. The out-of-band channel uses loopback, but still listens on 0.0.0.0
# and [::]: Open MPI has no bind-address setting for it (`oob_tcp_disable_ipv6_family`
# does not remove the [::] listener either).
LOCAL_MPI_TRANSPORT = (("pml", "ob1"), ("btl", "self,vader"))
LOCAL_MPI_MCA = (("oob_tcp_if_include", "lo"),)

# Why a port of a local job is not on loopback, by launcher (printed with the port).
_OOB = "Open MPI's out-of-band listener binds every interface; Open MPI has no setting to bind one address"
UNBINDABLE = {
    "multiworker": "TensorFlow's gRPC server binds every interface; TensorFlow has no setting to bind one address",
    "mpirun": _OOB,
    "horovod-mpi": _OOB,
}

COMPAT_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_runner.py")


def is_local(slots: Sequence[tuple[str, int]]) -> bool:
    """True when every host of `slots` ([(host, n)]) is a loopback name (LOOPBACK_HOSTS)."""
    return all(h in LOOPBACK_HOSTS or h.startswith("127.") for h, _ in slots)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct TCP ports free on `host` right now.

    Chosen at random below the kernel's ephemeral range (10000 up to its start), so that
    no outgoing connection and no `bind(port 0)` of another process can take one between
    this choice and the worker binding it; each is checked free by binding it. A port
    can still be taken by another process choosing ports explicitly: `launch` retries
    the multiworker launcher with new ports when a worker cannot bind its own.
    """
    import random

    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    ports: list[int] = []
    socks = []
    try:
        for _ in range(200 * n):
            if len(ports) == n:
                return ports
            if lo - 1 > 10000:
                candidate = rng.randrange(10000, lo)
            else:
                candidate = 0
            if candidate in ports:
                continue
            s = socket.socket()
            try:
                s.bind((host, candidate))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
        if len(ports) == n:
            return ports
        raise OSError(f"found only {len(ports)} of {n} free ports on {host}")
    finally:
        for s in socks:
            s.close()


def tf_config(workers: Sequence[str], index: int) -> str:
    """The TF_CONFIG of worker `index` in a cluster of `workers` ("host:port")."""
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}})


def plan(launcher: str, np: int, script: Sequence[str], hosts: str | None = None,
         hostfile: str | None = None, port: int | None = None,
         python: str = sys.executable, tmpdir: str | None = None,
         shm_dir: str | None = None) -> list[tuple[list[str], dict]]:
    """The commands (and extra environment of each) that `launch` would run.

    With hosts that are all this machine (`is_local`), every launcher listens on loopback
    where its tool allows it; other hosts get the tools' defaults. `tmpdir` becomes the
    workers' TMPDIR; `shm_dir`, Open MPI's shared-memory directory in a local job.

    Raises:
      ValueError: an unknown launcher, np < 1, an empty script, or bad hosts.
    """
    _check_plan(launcher, np, script)
    program = [python, *script]
    slots = parse_hosts(hosts, hostfile, np)
    host_arg = ",".join(f"{h}:{n}" for h, n in slots)
    local = is_local(slots)
    env = {"TMPDIR": tmpdir} if tmpdir else {}
    mca = list(LOCAL_MPI_MCA) if local else []  # horovodrun --mpi's transport: horovod_runner.py
    if local and shm_dir:
        mca.append(("btl_vader_backing_directory", shm_dir))
    if launcher in ("horovod-gloo", "horovod-mpi"):
        return [(_horovodrun(launcher, np, hostfile, host_arg, local, mca, python) + program, env)]
    if launcher == "mpirun":
        return [(_mpirun(np, hostfile, host_arg, local, mca, env) + program, env)]
    if launcher == "mirrored":
        return [(program + ["--replicas", str(np)], env)]
    return _multiworker(np, program, slots, host_arg, port, env)


def _check_plan(launcher: str, np: int, script: Sequence[str]) -> None:
    if launcher not in LAUNCHERS:
        raise ValueError(f"`launcher` must be one of {list(LAUNCHERS)}. Received: launcher={launcher!r}")
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"`np` must be an integer >= 1. Received: np={np!r}")
    if not script:
        raise ValueError("`script` must name the training script (and its arguments). Received: []")


def _horovodrun(launcher, np, hostfile, host_arg, local, mca, python) -> list[str]:
    """horovodrun's command line, up to the program."""
    if local:
        # horovodrun itself, with its rendezvous server bound to 127.0.0.1.
        cmd = [python, COMPAT_RUNNER, "-np", str(np)]
    else:
        binary = os.path.join(os.path.dirname(python), "horovodrun")
        cmd = [binary if os.path.exists(binary) else "horovodrun", "-np", str(np)]
    cmd += ["--hostfile", hostfile] if hostfile else ["-H", host_arg]
    cmd += ["--gloo" if launcher == "horovod-gloo" else "--mpi"]
    if launcher == "horovod-mpi" and mca:
        cmd += ["--mpi-args", " ".join(f"--mca {k} {v}" for k, v in mca)]
    return cmd


def _mpirun(np, hostfile, host_arg, local, mca, env) -> list[str]:
    """mpirun's command line, up to the program."""
    cmd = ["mpirun", "-np", str(np)]
    cmd += ["--hostfile", hostfile] if hostfile else ["-H", host_arg]
    cmd += ["--bind-to", "none", "--map-by", "slot"]
    if os.geteuid() == 0:
        cmd += ["--allow-run-as-root"]
    for k, v in (list(LOCAL_MPI_TRANSPORT) if local else []) + mca:
        cmd += ["--mca", k, v]
    for name in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", *FAIL_FAST_ENV, *JOB_ENV, *env):
        if name in os.environ or name in FAIL_FAST_ENV or name in JOB_ENV or name in env:
            cmd += ["-x", name]
    return cmd


def _multiworker(np, program, slots, host_arg, port, env) -> list[tuple[list[str], dict]]:
    """Every worker runs on this host; other hosts start theirs with the same TF_CONFIG
    cluster (see docs/launching.md)."""
    if not is_local(slots):
        raise ValueError("The multiworker launcher starts workers on this host only; on a cluster, "
                         "start one worker per host with the TF_CONFIG recipe. Received: "
                         f"hosts={host_arg}")
    ports = [port + i for i in range(np)] if port else free_ports(np)
    workers = [f"127.0.0.1:{p}" for p in ports]
    return [(list(program), {"TF_CONFIG": tf_config(workers, i), **env}) for i in range(np)]
