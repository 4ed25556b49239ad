"""Launching a training script on N processes or devices: horovodrun (Gloo or MPI),
plain mpirun, N MultiWorkerMirroredStrategy workers on this host, or one
MirroredStrategy process.

Every launch prints the exact command(s) it runs, returns the first non-zero exit
status of any worker (stopping the others), and can be bounded by a timeout. The CLI is
`launch/launch.py`.

Network exposure (docs/security.md): a job whose hosts are all this machine
(the default) listens on loopback wherever the tool allows it: horovodrun's servers
through `horovod_runner.py`, Open MPI without its TCP transport. What cannot be bound
(TensorFlow's gRPC server, Open MPI's out-of-band listener) is named in one
`[launch] exposed:` line per port as soon as it listens. A host list naming other
machines gets none of the loopback settings. Each job's temporary files go to a private
directory (mode 0700) that is removed when the job ends.

Layout: this module runs and supervises a job (`launch`); `launch/plan.py` computes the
commands (`plan`, `parse_hosts`, `free_ports`, ...) and `launch/procs.py` reads /proc
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
import time
from typing import Sequence

from dist_minimize.launch.plan import (  # noqa: F401  (re-exported, the private ones too)
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
from dist_minimize.launch.discovery import Discovery, DiscoveryError, take
from dist_minimize.launch.report import BIND_FAILURE, _failure, _forward, describe_status  # noqa: F401
from dist_minimize.launch.procs import (  # noqa: F401  (re-exported, the private ones too)
    _address,
    _alive,
    _job_dirs,
    _wait_ports_free,
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
    "LOOPBACK_HOSTS", "PORT_RETRIES", "START_TIMEOUT", "Terminated", "UNBINDABLE", "describe_status",
    "Discovery", "DiscoveryError", "ELASTIC_LAUNCHERS", "free_ports", "handle_sigterm", "is_local", "is_loopback",
    "launch", "launch_elastic",
    "listening_sockets", "parse_hosts", "plan", "tf_config",
]


PORT_RETRIES = 3
START_TIMEOUT = 45.0  # seconds for every multiworker worker to listen on its port


class Terminated(Exception):
    """Raised in the launcher by SIGTERM (`handle_sigterm`): the job is stopped, not restarted."""


def handle_sigterm() -> None:
    """Makes SIGTERM to the launcher stop the job like Ctrl-C: every worker gets SIGTERM
    (so that a checkpointing worker saves), then SIGKILL after 10 s; exit status 143."""
    import signal

    def raise_terminated(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, raise_terminated)


def launch(launcher: str, np: int, script: Sequence[str], hosts: str | None = None,
           hostfile: str | None = None, port: int | None = None, timeout: float | None = None,
           python: str = sys.executable, out=None, child_output=None, max_restarts: int = 0,
           start_timeout: float | None = START_TIMEOUT) -> int:
    """Runs `script` on `np` processes with `launcher`; returns the job's exit status.

    The first worker to fail (a non-zero exit status or a signal) sets the status and
    the others are stopped (SIGTERM, then SIGKILL after 10 s, to every process of the job,
    including those a launcher such as horovodrun or mpirun started); the failure is
    reported with the worker or rank and how it ended (exit status or signal name). With
    `max_restarts` N > 0, a failed job (exit status 42, "preempted, restart me",
    included) is started again, whole and with the same arguments, up to N times; each
    worker finds the attempt number in `DM_RESTART_ATTEMPT` (0 first). Past `timeout`
    seconds every process is killed and the status is 124 (no restart); an interrupt
    (Ctrl-C: 130, SIGTERM after `handle_sigterm`: 143) stops every process and is not
    restarted either; any other exception also stops every process before it
    propagates. The commands are printed first, exactly as run, to `out` (default:
    stdout); the workers' own output goes to `child_output` (a file) if given, else to
    this process's stdout. With the multiworker launcher: ports chosen here (no `port`)
    that a worker cannot bind (another process took one in between) make the job start
    again on new ports, up to 3 times, and a worker whose port is not listening after
    `start_timeout` seconds fails the job, named.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"`max_restarts` must be an integer >= 0. Received: max_restarts={max_restarts!r}")
    if start_timeout is not None and not start_timeout > 0:
        raise ValueError(f"`start_timeout` must be > 0 seconds. Received: start_timeout={start_timeout!r}")
    out = out if out is not None else sys.stdout
    job = (launcher, np, script, hosts, hostfile, port, timeout, python, out, child_output, start_timeout)
    for attempt in range(max_restarts + 1):
        status, failure = _attempt(job, attempt)
        if status == 0 or failure is None or attempt == max_restarts:
            return status
        print(f"[launch] restart {attempt + 1} of {max_restarts} after {failure}: starting the whole job again",
              file=out, flush=True)
        if port:
            _wait_ports_free(port, np, out)
    return status


ELASTIC_LAUNCHERS = ("horovod-gloo", "horovod-mpi", "mpirun", "multiworker")
DISCOVERY_INTERVAL = 10.0  # seconds between two asks of a running job's discovery
SLOTS_TIMEOUT = 600.0  # seconds an elastic job waits for --min-np slots before it stops


def launch_elastic(launcher: str, script: Sequence[str], discovery: Discovery, min_np: int, max_np: int,
                   interval: float = DISCOVERY_INTERVAL, slots_timeout: float = SLOTS_TIMEOUT,
                   max_restarts: int = 10, timeout: float | None = None, python: str = sys.executable, out=None,
                   child_output=None, start_timeout: float | None = START_TIMEOUT,
                   worker_counts: Sequence[int] | None = None) -> int:
    """Runs `script` on as many workers as `discovery` has slots for, between `min_np`
    and `max_np`, starting the whole job again on another number when that changes.

    The job starts on the largest count of `worker_counts` (default: any) between
    `min_np` and min(`max_np`, the slots discovery reports): with `--micro-batch`,
    `dist_minimize.elastic.admissible_sizes(G, b)`. While it runs,
    discovery is asked every `interval` seconds; when its count (up to `max_np`, at least
    `min_np`) differs from the job's, every worker gets SIGTERM, saves at its next update
    boundary (`dist_minimize.Checkpointer`) and exits, and the job starts again on the new
    count from that checkpoint. When a worker fails, the others are stopped, discovery is
    asked, and the job starts again (up to `max_restarts` failures). With fewer than
    `min_np` slots the launcher asks every `interval` seconds, up to `slots_timeout`, then
    stops with status 1, the newest checkpoint left in place. Each start logs the old and
    new worker counts and why. A script that trains the same on any count: a fixed
    global batch and micro-batch (`dist_minimize.elastic`, the main job's `--micro-batch`).
    Other arguments: as `launch`, whose supervision each start gets. Returns the job's
    exit status; a discovery that fails when the launcher must size the job ends it with
    status 1, its reason printed.
    """
    if launcher not in ELASTIC_LAUNCHERS:
        raise ValueError(f"An elastic launch runs on {', '.join(ELASTIC_LAUNCHERS)}. Received: launcher={launcher!r}")
    for name, value in (("min_np", min_np), ("max_np", max_np)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}")
    if min_np > max_np:
        raise ValueError(f"`min_np` must be <= `max_np`. Received: min_np={min_np}, max_np={max_np}")
    for name, value in (("interval", interval), ("slots_timeout", slots_timeout)):
        if not value > 0:
            raise ValueError(f"`{name}` must be > 0 seconds. Received: {name}={value!r}")
    if worker_counts is not None and not any(min_np <= n <= max_np for n in worker_counts):
        raise ValueError(f"No count of `worker_counts` lies between min_np={min_np} and max_np={max_np}. "
                         f"Received: worker_counts={list(worker_counts)!r}")
    out = out if out is not None else sys.stdout

    def choose(total: int) -> int | None:
        """The most workers `total` slots can run, or None below `min_np`."""
        return next((n for n in range(min(max_np, total), min_np - 1, -1)
                     if worker_counts is None or n in worker_counts), None)

    workers, why, failures, attempt = None, "start", 0, 0
    while True:
        try:
            slots = _wait_for_slots(discovery, choose, min_np, interval, slots_timeout, out)
        except DiscoveryError as e:
            print(f"[launch] elastic: {e}; stopping (the newest checkpoint stays in place)", file=out, flush=True)
            return 1
        except Terminated:
            print("[launch] SIGTERM while waiting for slots: stopping", file=out, flush=True)
            return 143
        except KeyboardInterrupt:
            return 130
        if slots is None:
            return 1
        n = choose(sum(k for _, k in slots))
        hosts = take(slots, n)
        print(f"[launch] elastic: {workers if workers is not None else 0} -> {n} workers ({why}); hosts {hosts}",
              file=out, flush=True)
        watch = _ResizeWatch(discovery, n, choose, interval, out)
        job = (launcher, n, script, hosts, None, None, timeout, python, out, child_output, start_timeout)
        status, failure = _attempt(job, attempt, watch)
        attempt += 1
        workers = n
        if watch.reason is not None:
            why = watch.reason
            continue
        if status == 0 or failure is None:
            return status
        failures += 1
        if failures > max_restarts:
            print(f"[launch] elastic: {failures} failures, more than --max-restarts {max_restarts}; stopping",
                  file=out, flush=True)
            return status
        why = f"after {failure}"


def _wait_for_slots(discovery: Discovery, choose, min_np: int, interval: float, bound: float, out):
    """Discovery's slots once `choose` finds a worker count for them (asking every
    `interval` seconds), or None after `bound` seconds without one (said in `out`)."""
    deadline = time.monotonic() + bound
    said = False
    while True:
        slots = discovery.slots()
        total = sum(k for _, k in slots)
        if choose(total) is not None:
            return slots
        if time.monotonic() >= deadline:
            print(f"[launch] elastic: {discovery} reports {total} slot(s), fewer than --min-np {min_np}, for "
                  f"{bound:g} s; stopping (the newest checkpoint stays in place: run the same command again "
                  "when slots return)", file=out, flush=True)
            return None
        if not said:
            print(f"[launch] elastic: {discovery} reports {total} slot(s), fewer than --min-np {min_np}; waiting up "
                  f"to {bound:g} s", file=out, flush=True)
            said = True
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


class _ResizeWatch:
    """Asked by `_supervise` every second: every `interval` seconds it asks discovery, and
    returns a reason to resize when the count `choose` allows differs from `workers`.
    `_supervise` sets `reason` when it acts on one."""

    def __init__(self, discovery: Discovery, workers: int, choose, interval: float, out):
        self.discovery, self.workers, self.choose = discovery, workers, choose
        self.interval, self.out = interval, out
        self.next_ask = time.monotonic() + interval
        self.reason: str | None = None
        self._last_error: str | None = None

    def __call__(self) -> str | None:
        if time.monotonic() < self.next_ask:
            return None
        self.next_ask = time.monotonic() + self.interval
        try:
            total = sum(k for _, k in self.discovery.slots())
        except DiscoveryError as e:  # a running job keeps running; said once per new reason
            if str(e) != self._last_error:
                print(f"[launch] elastic: {e}; keeping {self.workers} workers", file=self.out, flush=True)
                self._last_error = str(e)
            return None
        self._last_error = None
        n = self.choose(total)
        if n is not None and n != self.workers:
            return f"{self.discovery} reports {total} slot(s)"
        return None


def _attempt(job, attempt: int, watch=None):
    """One start of the job (with new ports while a chosen port is taken): (status, failure)."""
    launcher, port, out = job[0], job[5], job[8]
    tries = PORT_RETRIES + 1 if (launcher == "multiworker" and port is None) else 1
    for i in range(tries):
        status, failure, seen = _launch_once(job, attempt, watch)
        taken = seen.get("bind_failed")
        if status == 0 or taken is None:
            break
        if port is not None:
            print(f"[launch] port {taken} is taken by another process; choose another --port, or leave --port "
                  "out and the launcher picks free ports", file=out, flush=True)
            return status, None
        if i < tries - 1:
            print(f"[launch] port {taken} was taken by another process after it was chosen ({BIND_FAILURE}); "
                  "starting again on new ports", file=out, flush=True)
    return status, failure


def _launch_once(job, attempt: int, watch=None):
    tmpdir, shm = _job_dirs()
    try:
        return _run_job(job, attempt, tmpdir, shm, watch)
    finally:
        for d in (tmpdir, shm):
            if d:
                shutil.rmtree(d, ignore_errors=True)


def _run_job(job, attempt, tmpdir, shm, watch=None):
    """Starts and supervises one attempt: (status, failure description or None, what the
    workers' output said: a port taken, the rank a launcher reported failed). `watch`:
    see `_supervise`."""
    launcher, np, script, hosts, hostfile, port, timeout, python, out, child_output, start_timeout = job
    steps = plan(launcher, np, script, hosts, hostfile, port, python, tmpdir=tmpdir, shm_dir=shm)
    base_env = dict(os.environ)
    for k, v in FAIL_FAST_ENV.items():
        base_env.setdefault(k, v)
    base_env["DM_RESTART_ATTEMPT"] = str(attempt)
    base_env["DM_START_TIMEOUT"] = f"{start_timeout or 0:g}"
    for cmd, extra in steps:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
        print(f"[launch] {prefix + ' ' if prefix else ''}{shlex.join(cmd)}", file=out, flush=True)
    # Each process's output is read as it comes (no pipe ever fills) and forwarded,
    # watching for a port that could not be bound and for the rank a launcher names.
    sink = child_output if child_output is not None else sys.stdout
    ports = [_tf_config_port(extra) for _, extra in steps]
    procs, readers, seen = [], [], {}
    try:
        for i, (cmd, extra) in enumerate(steps):
            p = subprocess.Popen(cmd, env={**base_env, **extra}, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs.append(p)
            readers.append(_forward(p.stdout, sink, seen, ports[i]))
        names = [os.path.basename(cmd[0]) if len(steps) == 1 else f"worker {i}"
                 for i, (cmd, _) in enumerate(steps)]
        starting = ({i: p for i, p in enumerate(ports) if p} if launcher == "multiworker" and start_timeout
                    else {})
        status, failed = _supervise(procs, names, timeout, out, UNBINDABLE.get(launcher), starting, start_timeout,
                                    watch)
    except BaseException:
        _stop(procs)
        raise
    finally:
        for t in readers:
            t.join(timeout=5)
    failure = None if failed is None else _failure(names[failed], status, seen)
    if failure is not None:
        others = "; the others were stopped" if len(procs) > 1 else ""
        print(f"[launch] failed: {failure}{others}", file=out, flush=True)
    # A worker killed by a signal (Popen's negative status) ends the job with 128 + signal.
    return (status if status >= 0 else 128 - status), failure, seen


def _tf_config_port(extra: dict) -> int | None:
    import json

    if "TF_CONFIG" not in extra:
        return None
    config = json.loads(extra["TF_CONFIG"])
    return int(config["cluster"]["worker"][config["task"]["index"]].rsplit(":", 1)[1])


def _supervise(procs: list, names: list, timeout: float | None, out, why: str | None = None,
               starting: dict | None = None, start_timeout: float | None = None, watch=None):
    """Waits for the job; stops every process of it however this ends (BaseException
    included: pytest-timeout's `Failed`, KeyboardInterrupt, SystemExit). Every second,
    each port of the job listening beyond loopback is named once (`why`: the cause), the
    workers of `starting` ({index: port}) that listen are crossed off (one still missing
    after `start_timeout` seconds fails the job), and `watch()` is asked whether the job
    should stop for a resize (a reason, or None): then every worker gets SIGTERM, saves
    at its next update boundary and exits. Returns (status, as Popen gives it: negative
    for a signal; the index of the failed worker, or None when nothing failed, the job
    was stopped for a resize, interrupted or timed out)."""
    begin = time.monotonic()
    deadline = None if timeout is None else begin + timeout
    starting = dict(starting or {})
    status, failed = 0, None
    tree: dict[int, str] = {}
    reported: set = set()
    next_scan = 0.0
    try:
        while True:
            if time.monotonic() >= next_scan:  # remember the job's processes while they run
                tree.update(_process_tree([p.pid for p in procs]))
                _report_exposed([p.pid for p in procs] + _alive(tree), reported, why, out)
                missing = _not_listening(procs, starting)
                if missing and time.monotonic() - begin > start_timeout:
                    text = ", ".join(f"worker {i} (nothing listens on 127.0.0.1:{starting[i]})" for i in missing)
                    print(f"[launch] not every worker started within {start_timeout:g} s: {text}; stopping the job",
                          file=out, flush=True)
                    status, failed = 1, missing[0]
                    break
                reason = watch() if watch is not None else None
                # (a job ending by itself, or failing, meanwhile is not resized: the loop sees it)
                if reason is not None and all(p.poll() is None for p in procs):
                    watch.reason = reason
                    print(f"[launch] elastic: {reason}: every worker saves at its next update boundary and stops",
                          file=out, flush=True)
                    status = 0
                    break
                next_scan = time.monotonic() + 1.0
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed, status = bad[0]
                break
            if all(c == 0 for c in codes):
                _stop(procs, tree)  # only stray children of a launcher, if any, are left
                return 0, None
            if deadline is not None and time.monotonic() > deadline:
                print(f"[launch] timed out after {timeout:.0f} s; killing every worker", file=out, flush=True)
                status = 124
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        status = 130
    except Terminated:
        print("[launch] SIGTERM: stopping every worker (SIGTERM, SIGKILL after 10 s)", file=out, flush=True)
        status = 143
    except BaseException:
        _stop(procs, tree)
        raise
    _stop(procs, tree)
    return status, failed


def _not_listening(procs: list, starting: dict) -> list[int]:
    """Crosses off the workers of `starting` whose port now listens; the others, sorted."""
    for i in list(starting):
        pids = [procs[i].pid, *_process_tree([procs[i].pid])]
        if any(address.endswith(f":{starting[i]}") for _, _, address in listening_sockets(pids)):
            del starting[i]
    return sorted(starting)
