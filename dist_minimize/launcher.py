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

Layout: this module runs and supervises a job (`launch`); `launch_plan.py` computes the
commands (`plan`, `parse_hosts`, `free_ports`, ...) and `launch_procs.py` reads /proc
(listening sockets, the job's process tree) and stops processes. Every name this module
defined before they were split off is still importable from here. None of them imports
TensorFlow: `import dist_minimize.launcher` and `launch/launch.py` start at once (see
`dist_minimize/__init__.py`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from dist_minimize.launch_plan import (  # noqa: F401  (re-exported, the private ones too)
    COMPAT_RUNNER,
    FAIL_FAST_ENV,
    LAUNCHERS,
    LOCAL_MPI_MCA,
    LOCAL_MPI_TRANSPORT,
    LOOPBACK_HOSTS,
    UNBINDABLE,
    _OOB,
    _ephemeral_range,
    free_ports,
    is_local,
    parse_hosts,
    plan,
    tf_config,
)
from dist_minimize.launch_procs import (  # noqa: F401  (re-exported, the private ones too)
    _address,
    _alive,
    _kill,
    _process_tree,
    _report_exposed,
    _signal,
    _socket_inodes,
    _stat,
    _stop,
    is_loopback,
    listening_sockets,
)

__all__ = [
    "BIND_FAILURE", "COMPAT_RUNNER", "FAIL_FAST_ENV", "LAUNCHERS", "LOCAL_MPI_MCA", "LOCAL_MPI_TRANSPORT",
    "LOOPBACK_HOSTS", "PORT_RETRIES", "UNBINDABLE", "free_ports", "is_local", "is_loopback", "launch",
    "listening_sockets", "parse_hosts", "plan", "tf_config",
]


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
