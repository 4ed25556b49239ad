"""The watcher of a worker joining a MultiWorkerMirroredStrategy job
(`dist_minimize.cluster.multi_worker_strategy`): a small process, without TensorFlow.

    python dist_minimize/launch/join_watch.py PID TIMEOUT INDEX WORKER...

(run as a file: it imports the standard library only, so it watches within milliseconds;
as a module of the package it would import TensorFlow first).

Waits up to TIMEOUT seconds (0: no bound) for its standard input to close (the worker
joined, failed or ended). Meanwhile, a SIGTERM pending on the worker (which blocks it
while it waits) ends the worker at once; at TIMEOUT, it prints which workers of the job
do not accept connections and ends the worker. Ended: SIGKILL, since TensorFlow catches
SIGTERM there (its preemption notifier) and a worker waiting in its constructor holds
Python's lock: nothing inside it could do this.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time


def reachable(address: str, seconds: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds):
            return True
    except (OSError, ValueError):
        return False


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits, blocked, on process `pid` (its /proc status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    pending = int(fields.get("ShdPnd", "0").strip(), 16) | int(fields.get("SigPnd", "0").strip(), 16)
    return bool(pending >> (signal.SIGTERM - 1) & 1)


def end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    pid, timeout, index, workers = int(argv[0]), float(argv[1]), int(argv[2]), argv[3:]
    deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sys.stdin], [], [], 0.2)
        if ready:
            return 0  # closed: the worker is past the wait
        if sigterm_pending(pid):
            print(f"[dist_minimize] worker {index}: SIGTERM while joining the job; ending it", file=sys.stderr,
                  flush=True)
            end(pid)
            return 1
    missing = [f"{i} ({w})" for i, w in enumerate(workers) if i != index and not reachable(w)]
    print(f"[dist_minimize] worker {index} of {len(workers)}: not every MultiWorkerMirroredStrategy worker joined "
          f"within {timeout:g} s (DM_START_TIMEOUT or `timeout`); "
          + (f"not listening: worker(s) {', '.join(missing)}" if missing else
             "every worker listens, but not all registered with worker 0's coordination service")
          + "; ending this worker", file=sys.stderr, flush=True)
    end(pid)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
