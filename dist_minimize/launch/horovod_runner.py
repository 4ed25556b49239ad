"""horovodrun with every server it starts bound to 127.0.0.1 (a local job only).

Like `_compat.py`, this module isolates a private Horovod internal; it is a second module
only because the launcher must not import TensorFlow, and `_compat.py` does (5-6 s and
~0.5 GB per launch). Its canary is in tests/unit/test_compat_canaries.py.

Horovod 0.28.1's launcher starts its Gloo rendezvous HTTP server (and, with remote
hosts or `run_func`, its driver and key-value services) through
`horovod.runner.util.network.find_port`, which binds `('', port)`: every interface, with
no option to change it (`--network-interfaces` and `HOROVOD_GLOO_IFACE` choose what the
workers use, not what the rendezvous server binds). For a job whose hosts are all this
machine, nothing needs to reach those servers from outside, so this entry point replaces
`find_port` with the same search bound to 127.0.0.1 and then runs horovodrun's own
command line. `dist_minimize.launcher` uses it only when every host is a loopback name.

Usage (what `launch/launch.py --launcher horovod-gloo` runs on one machine):
  python dist_minimize/launch/horovod_runner.py HOROVODRUN_ARGS...
"""

from __future__ import annotations

import os
import random
import sys

LOOPBACK = "127.0.0.1"


def find_port_on_loopback(server_factory):
    """`horovod.runner.util.network.find_port`, binding 127.0.0.1 instead of every interface."""
    min_port, max_port = 1024, 65536
    start = random.randrange(0, max_port - min_port)
    for offset in range(max_port - min_port):
        port = min_port + (start + offset) % (max_port - min_port)
        try:
            return server_factory((LOOPBACK, port)), port
        except OSError:
            continue
    raise OSError(f"horovodrun: no free port on {LOOPBACK}")


# horovodrun --mpi's Open MPI transport for a local job: shared memory only (its own
# choice, `-mca btl ^openib`, keeps the TCP transport, which listens on every interface).
LOCAL_BTL = "-mca btl self,vader"


def _changed(what: str) -> RuntimeError:
    return RuntimeError(f"Horovod changed: {what}, so horovodrun cannot be kept on loopback; "
                        "update dist_minimize/launch/horovod_runner.py")


def bind_horovodrun_to_loopback() -> None:
    """Makes horovodrun's rendezvous, driver and key-value servers bind 127.0.0.1, and
    its mpirun use shared memory instead of TCP between ranks."""
    from horovod.runner import mpi_run
    from horovod.runner.common.util import network as common_network
    from horovod.runner.http import http_server
    from horovod.runner.util import network

    for module in (network, http_server, common_network):
        if not hasattr(module, "find_port"):
            raise _changed(f"{module.__name__}.find_port is gone")
        module.find_port = find_port_on_loopback
    flags = getattr(mpi_run, "_OMPI_FLAGS", None)
    if not isinstance(flags, list) or not any(f.startswith("-mca btl ") for f in flags):
        raise _changed(f"horovod.runner.mpi_run._OMPI_FLAGS no longer sets `-mca btl` (it is {flags!r})")
    mpi_run._OMPI_FLAGS = [LOCAL_BTL if f.startswith("-mca btl ") else f for f in flags]


def main(argv: list[str]) -> int:
    from horovod.runner.launch import run_commandline

    bind_horovodrun_to_loopback()
    sys.argv = ["horovodrun", *argv]
    return run_commandline() or 0


if __name__ == "__main__":
    # Run as a file (no package import, so no TensorFlow): this directory must not
    # shadow top-level modules while Horovod's launcher imports its own.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv[1:]))
