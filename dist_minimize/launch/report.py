"""What the launcher reads from a job's output and says about its end: each process's
output is forwarded as it comes (no pipe ever fills) while watching for a port that could
not be bound and for the rank horovodrun or mpirun names as the first to fail; exit
statuses in words. Part of `dist_minimize.launcher`; like it, this module needs no
TensorFlow.
"""

from __future__ import annotations

import re
import signal
import threading

# What TensorFlow's gRPC server reports when a worker's port is taken.
BIND_FAILURE = "Could not start gRPC server"


def _failure(name: str, status: int, seen: dict) -> str:
    """"worker 1: killed by SIGKILL"; for horovodrun/mpirun also the rank they named."""
    text = f"{name}: {describe_status(status)}"
    if "rank" in seen:
        rank, code = seen["rank"]
        text += f" (rank {rank} failed first: {describe_status(code)})"
    return text


def describe_status(code: int) -> str:
    """An exit status in words: "exit status 1", "killed by SIGKILL" (a negative
    Popen status), "exit status 137 (128 + SIGKILL)", "exit status 42 (stopped to be
    restarted)"."""
    def name(n):
        try:
            return signal.Signals(n).name
        except ValueError:
            return f"signal {n}"

    if code < 0:
        return f"killed by {name(-code)}"
    if code == 42:
        return "exit status 42 (stopped to be restarted: preempted, or a saved stop)"
    if 128 < code < 128 + 65:
        return f"exit status {code} (128 + {name(code - 128)})"
    return f"exit status {code}"


_RANK_LINES = (
    # horovodrun --gloo: "Process 1 exit with status code 137."
    re.compile(r"Process (\d+) exit with status code (-?\d+)"),
    # mpirun: "mpirun noticed that process rank 1 with PID 42 on node n exited on signal 9 (Killed)."
    re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)"),
)


def _forward(stream, sink, seen: dict, port: int | None):
    """A thread forwarding `stream` to `sink`, recording in `seen` the first port that could
    not be bound ("bind_failed") and the first failed rank a launcher names ("rank")."""
    def run():
        name = None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            if BIND_FAILURE in line and port is not None:
                seen.setdefault("bind_failed", port)
            for i, pattern in enumerate(_RANK_LINES):
                m = pattern.search(line)
                if m and "rank" not in seen:
                    code = int(m.group(2))
                    seen["rank"] = (int(m.group(1)), -code if i == 1 else code)
            # mpirun's summary: "Process name: [[21591,1],1]" then "Exit code: 42"
            m = re.search(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]", line)
            name = int(m.group(1)) if m else name
            m = re.search(r"Exit code:\s*(\d+)", line)
            if m and name is not None and "rank" not in seen:
                seen["rank"] = (name, int(m.group(1)))
            _write(sink, raw, line)
        stream.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _write(sink, raw: bytes, line: str) -> None:
    try:
        if hasattr(sink, "buffer"):
            sink.buffer.write(raw)
        elif "b" in getattr(sink, "mode", ""):
            sink.write(raw)
        else:
            sink.write(line)
        sink.flush()
    except (OSError, ValueError):
        pass
