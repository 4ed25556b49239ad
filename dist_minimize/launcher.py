"""Launching a training script on N processes or devices: horovodrun (Gloo or MPI),
plain mpirun, N MultiWorkerMirroredStrategy workers on this host, or one
MirroredStrategy process.

Every launch prints the exact command(s) it runs, returns the first non-zero exit
status of any worker (stopping the others), and can be bounded by a timeout. The CLI is
`launch/launch.py`.

Network exposure (docs/security.md): a job whose hosts are all this machine
(the default) listens on loopback wherever the tool allows it: horovodrun's servers
through `_compat_runner.py`, Open MPI without its TCP transport. What cannot be bound
(TensorFlow's gRPC server, Open MPI's out-of-band listener) is named in one
`[launch] exposed:` line per port as soon as it listens. A host list naming other
machines gets none of the loopback settings. Each job's temporary files go to a private
directory (mode 0700) that is removed when the job ends.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


# Host names that mean this machine and nothing else. A job on these only listens on
# loopback; any other name (this machine's own host name included) is a cluster host list
# and gets the tools' defaults, so that other machines can connect.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

# Open MPI settings of a local job (mpirun, horovodrun --mpi). Ranks talk through shared
# memory only: the TCP transport (and libfabric's, under other pml/btl choices) listens on
# every interface or on the machine's address whatever `btl_tcp_if_include` says
# (measured on Open MPI 4.1.4). horovodrun sets pml and btl itself: `_compat_runner.py`
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

COMPAT_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compat_runner.py")


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
    if launcher not in LAUNCHERS:
        raise ValueError(f"`launcher` must be one of {list(LAUNCHERS)}. Received: launcher={launcher!r}")
    if not isinstance(np, int) or np < 1:
        raise ValueError(f"`np` must be an integer >= 1. Received: np={np!r}")
    if not script:
        raise ValueError("`script` must name the training script (and its arguments). Received: []")
    program = [python, *script]
    slots = parse_hosts(hosts, hostfile, np)
    host_arg = ",".join(f"{h}:{n}" for h, n in slots)
    local = is_local(slots)
    env = {"TMPDIR": tmpdir} if tmpdir else {}
    mca = list(LOCAL_MPI_MCA) if local else []  # horovodrun --mpi's transport: _compat_runner.py
    if local and shm_dir:
        mca.append(("btl_vader_backing_directory", shm_dir))
    if launcher in ("horovod-gloo", "horovod-mpi"):
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
        return [(cmd + program, env)]
    if launcher == "mpirun":
        cmd = ["mpirun", "-np", str(np)]
        cmd += ["--hostfile", hostfile] if hostfile else ["-H", host_arg]
        cmd += ["--bind-to", "none", "--map-by", "slot"]
        if os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
        for k, v in (list(LOCAL_MPI_TRANSPORT) if local else []) + mca:
            cmd += ["--mca", k, v]
        for name in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", *FAIL_FAST_ENV, *env):
            if name in os.environ or name in FAIL_FAST_ENV or name in env:
                cmd += ["-x", name]
        return [(cmd + program, env)]
    if launcher == "mirrored":
        return [(program + ["--replicas", str(np)], env)]
    # multiworker: every worker runs on this host; other hosts start theirs with the same
    # TF_CONFIG cluster (see docs/launching.md).
    if not is_local(slots):
        raise ValueError("The multiworker launcher starts workers on this host only; on a cluster, "
                         "start one worker per host with the TF_CONFIG recipe. Received: "
                         f"hosts={host_arg}")
    ports = [port + i for i in range(np)] if port else free_ports(np)
    workers = [f"127.0.0.1:{p}" for p in ports]
    return [(list(program), {"TF_CONFIG": tf_config(workers, i), **env}) for i in range(np)]


# What TensorFlow's gRPC server reports when a worker's port is taken.
BIND_FAILURE = "Could not start gRPC server"
PORT_RETRIES = 3


def launch(launcher: str, np: int, script: Sequence[str], hosts: str | None = None,
           hostfile: str | None = None, port: int | None = None, timeout: float | None = None,
           python: str = sys.executable, out=None, child_output=None) -> int:
    """Runs `script` on `np` processes with `launcher`; returns the job's exit status.

    The first worker to exit non-zero sets the status and the others are stopped
    (SIGTERM, then SIGKILL after 10 s, to every process of the job, including those a
    launcher such as horovodrun or mpirun started). Past `timeout` seconds every process
    is killed and the status is 124. Any exception while the job runs (Ctrl-C, a test
    runner's timeout) also stops every process of the job before it propagates. The
    commands are printed first, exactly as run, to `out` (default: stdout); the
    workers' own output goes to `child_output` (a file) if given, else to this
    process's stdout. With the multiworker launcher and ports chosen here (no `port`),
    a worker that cannot bind its port (another process took it in between) makes the
    job start again on new ports, up to 3 times.
    """
    out = out if out is not None else sys.stdout
    attempts = PORT_RETRIES + 1 if (launcher == "multiworker" and port is None) else 1
    for attempt in range(attempts):
        status, bind_failed = _launch_once(launcher, np, script, hosts, hostfile, port, timeout,
                                           python, out, child_output)
        if status == 0 or not bind_failed or attempt == attempts - 1:
            return status
        print(f"[launch] a worker could not bind its port ({BIND_FAILURE}); another process took it. "
              "Retrying on new ports", file=out, flush=True)
    return status


def _job_dirs() -> tuple[str, str | None]:
    """A private (0700) temporary directory for the job's TMPDIR and, where /dev/shm is
    writable, one there for Open MPI's shared-memory segments (Open MPI 4.1.4 leaves its
    4 MiB `vader_segment.*` files in /dev/shm after a job that succeeded)."""
    tmpdir = tempfile.mkdtemp(prefix="dist_minimize-job-")
    shm = None
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        try:
            shm = tempfile.mkdtemp(prefix="dist_minimize-job-", dir="/dev/shm")
        except OSError:
            shm = None
    return tmpdir, shm


def _launch_once(launcher, np, script, hosts, hostfile, port, timeout, python, out, child_output):
    tmpdir, shm = _job_dirs()
    try:
        return _run_job(launcher, np, script, hosts, hostfile, port, timeout, python, out, child_output,
                        tmpdir, shm)
    finally:
        for d in (tmpdir, shm):
            if d:
                shutil.rmtree(d, ignore_errors=True)


def _run_job(launcher, np, script, hosts, hostfile, port, timeout, python, out, child_output, tmpdir, shm):
    steps = plan(launcher, np, script, hosts, hostfile, port, python, tmpdir=tmpdir, shm_dir=shm)
    base_env = dict(os.environ)
    for k, v in FAIL_FAST_ENV.items():
        base_env.setdefault(k, v)
    for cmd, extra in steps:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        print(f"[launch] {prefix + ' ' if prefix else ''}{shlex.join(cmd)}", file=out, flush=True)
    # multiworker: each worker's output is read as it comes (no pipe ever fills) and
    # forwarded, watching for a port that could not be bound.
    watch = launcher == "multiworker"
    sink = child_output if child_output is not None else sys.stdout
    procs, readers, seen = [], [], {"bind_failed": False}
    try:
        for cmd, extra in steps:
            if watch:
                redirect = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
            elif child_output:
                redirect = {"stdout": child_output, "stderr": subprocess.STDOUT}
            else:
                redirect = {}
            p = subprocess.Popen(cmd, env={**base_env, **extra}, start_new_session=True, **redirect)
            procs.append(p)
            if watch:
                readers.append(_forward(p.stdout, sink, seen))
        names = [os.path.basename(cmd[0]) if len(steps) == 1 else f"worker {i}"
                 for i, (cmd, _) in enumerate(steps)]
        status = _supervise(procs, names, timeout, out, UNBINDABLE.get(launcher))
    except BaseException:
        _stop(procs)
        raise
    finally:
        for t in readers:
            t.join(timeout=5)
    return status, seen["bind_failed"]


def _forward(stream, sink, seen):
    import threading

    def run():
        for raw in iter(stream.readline, b""):
            if BIND_FAILURE.encode() in raw:
                seen["bind_failed"] = True
            try:
                if hasattr(sink, "buffer"):
                    sink.buffer.write(raw)
                    sink.flush()
                elif "b" in getattr(sink, "mode", ""):
                    sink.write(raw)
                    sink.flush()
                else:
                    sink.write(raw.decode(errors="replace"))
                    sink.flush()
            except (OSError, ValueError):
                pass
        stream.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _supervise(procs: list, names: list, timeout: float | None, out, why: str | None = None) -> int:
    """Waits for the job; stops every process of it however this ends (BaseException
    included: pytest-timeout's `Failed`, KeyboardInterrupt, SystemExit). Every second,
    each port of the job listening beyond loopback is named once (`why`: the cause)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    tree: dict[int, str] = {}
    reported: set = set()
    next_scan = 0.0
    try:
        while True:
            if time.monotonic() >= next_scan:  # remember the job's processes while they run
                tree.update(_process_tree([p.pid for p in procs]))
                _report_exposed([p.pid for p in procs] + _alive(tree), reported, why, out)
                next_scan = time.monotonic() + 1.0
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, status = failed[0]
                others = "; stopping the others" if len(procs) > 1 else ""
                print(f"[launch] {names[i]} exited with status {status}{others}", file=out, flush=True)
                break
            if all(c == 0 for c in codes):
                _stop(procs, tree)  # only stray children of a launcher, if any, are left
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print(f"[launch] timed out after {timeout:.0f} s; killing every worker", file=out, flush=True)
                status = 124
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        status = 130
    except BaseException:
        _stop(procs, tree)
        raise
    _stop(procs, tree)
    return status if status > 0 else 128 + abs(status)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's local address ("0100007F:1F90") -> "127.0.0.1:8080" ("[::1]:8080")."""
    import ipaddress

    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is little-endian
    ip = ipaddress.ip_address(raw)
    if ip.version == 4:
        return f"{ip}:{int(port, 16)}"
    host = f"::ffff:{ip.ipv4_mapped}" if ip.ipv4_mapped else str(ip)
    return f"[{host}]:{int(port, 16)}"


def listening_sockets(pids: Sequence[int]) -> list[tuple[int, str, str]]:
    """[(pid, command name, "address:port")] of every TCP socket in LISTEN state held by
    one of `pids`, read from /proc (no ss or lsof needed); "0.0.0.0" and "[::]" mean
    every interface. Empty where /proc is not Linux's."""
    owners: dict[str, int] = {}
    for pid in pids:
        for inode in _socket_inodes(pid):
            owners.setdefault(inode, pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in owners:  # 0A: TCP_LISTEN
                pid = owners[fields[9]]
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        comm = f.read().strip()
                except OSError:
                    comm = "?"
                found.append((pid, comm, _address(fields[1])))
    return sorted(set(found))


def is_loopback(address: str) -> bool:
    """True for "127.x.y.z:port", "[::1]:port" and IPv4-mapped loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("::1", "::ffff:127.0.0.1") or host.startswith("127.") or host.startswith("::ffff:127.")


def _report_exposed(pids: Sequence[int], reported: set, why: str | None, out) -> None:
    """Prints one line per (process, port) of the job that listens beyond loopback."""
    exposed: dict[tuple[int, str, str], list[str]] = {}
    for pid, comm, address in listening_sockets(pids):
        if not is_loopback(address):
            host, port = address.rsplit(":", 1)
            exposed.setdefault((pid, comm, port), []).append(host)
    for (pid, comm, port), hosts in sorted(exposed.items()):
        if (pid, port) in reported:
            continue
        reported.add((pid, port))
        where = " and ".join(f"{h}:{port}" for h in sorted(hosts))
        scope = "every interface" if set(hosts) <= {"0.0.0.0", "[::]"} else "beyond loopback"
        print(f"[launch] exposed: {comm} (pid {pid}) listens on {where} ({scope}), with no "
              f"authentication{'; ' + why if why else ''}. See docs/security.md",
              file=out, flush=True)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_tree(pids: Sequence[int]) -> dict[int, str]:
    """{pid: start time} of every live process descended from `pids` (from /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    starts = {}
    for pid in entries:
        fields = _stat(pid)
        if fields:
            children.setdefault(int(fields[1]), []).append(pid)
            starts[pid] = fields[19]
    found: dict[int, str] = {}
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def _alive(tree: dict[int, str]) -> list[int]:
    """The processes of `tree` still running (same pid AND start time: not a reused pid)."""
    alive = []
    for pid, start in tree.items():
        fields = _stat(pid)
        if fields and fields[19] == start and fields[0] != "Z":
            alive.append(pid)
    return alive


def _stop(procs: list, tree: dict[int, str] | None = None, grace: float = 10.0) -> None:
    """SIGTERM to each worker's process group, SIGKILL after `grace` seconds; then
    SIGKILL to every process descended from a worker that is still alive, in whatever
    group or session (horovodrun and mpirun start ranks in groups of their own)."""
    tree = dict(tree or {})
    tree.update(_process_tree([p.pid for p in procs]))
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM)
    for pid in _alive(tree):
        _kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and (any(p.poll() is None for p in procs) or _alive(tree)):
        time.sleep(0.1)
    tree.update(_process_tree([p.pid for p in procs]))
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGKILL)
    for pid in _alive(tree):
        _kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def _kill(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
