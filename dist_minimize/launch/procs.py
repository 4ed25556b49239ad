"""The launcher's view of a running job, read from Linux's /proc (no ss, lsof or psutil
needed): the TCP ports its processes listen on (and the `[launch] exposed:` line for each
one beyond loopback), the tree of processes descended from its workers, and stopping all
of them; and a job's private temporary directories and waiting for its ports to free. Part of `dist_minimize.launcher`, which re-exports `listening_sockets` and
`is_loopback`; like it, this module needs no TensorFlow.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from typing import Sequence


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
    _send(procs, tree, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and (any(p.poll() is None for p in procs) or _alive(tree)):
        time.sleep(0.1)
    _send(procs, tree, signal.SIGKILL)
    for p in procs:
        p.wait()


def _send(procs: list, tree: dict[int, str], sig) -> None:
    """`sig` to each running worker's process group, then to every descendant still
    alive (`tree` first gains the descendants started since it was last read)."""
    tree.update(_process_tree([p.pid for p in procs]))
    for p in procs:
        if p.poll() is None:
            _signal(p, sig)
    for pid in _alive(tree):
        _kill(pid, sig)


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


def _wait_ports_free(port: int, np: int, out, bound: float = 60.0) -> None:
    """Waits until the multiworker ports port..port+np-1 can be bound again."""
    import socket

    deadline = time.monotonic() + bound
    for p in range(port, port + np):
        while True:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        print(f"[launch] port {p} still busy after {bound:.0f} s; starting anyway", file=out,
                              flush=True)
                        return
            time.sleep(0.5)


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
