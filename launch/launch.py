"""Launches a training script: horovodrun (Gloo/MPI), mpirun, local multi-worker, or mirrored.

Examples:
  python launch/launch.py --launcher horovod-gloo -np 2 -- launch/train.py
  python launch/launch.py --launcher horovod-mpi -np 4 -H node1:2,node2:2 -- launch/train.py
  python launch/launch.py --launcher mpirun -np 2 --hostfile hosts.txt -- launch/train.py
  python launch/launch.py --launcher multiworker -np 2 --port 23456 -- launch/train.py
  python launch/launch.py --launcher mirrored -np 2 -- launch/train.py

Prints the exact command(s) it runs; exits with the first non-zero status of any
worker after stopping the others (124 on --timeout), naming the worker or rank and how it
ended. With --max-restarts N a failed job (exit status 42, "restart me", included) is
started again, whole, up to N times; with a `dist_minimize.Checkpointer` in the script
it resumes exactly where its last checkpoint left it (docs/fault-tolerance.md). SIGTERM
to the launcher stops every worker (SIGTERM first, so that they save).
"""

import argparse
import os
import sys

# The repository root, for a checkout where dist_minimize is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_minimize.launcher import LAUNCHERS, START_TIMEOUT, handle_sigterm, launch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, default="horovod-gloo")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=2,
                   help="processes (mirrored: replicas in one process)")
    p.add_argument("-H", "--hosts", default=None, help="host:slots,... (default localhost:NP)")
    p.add_argument("--hostfile", default=None, help="lines of 'host slots=N' or 'host:N'")
    p.add_argument("--port", type=int, default=None, help="multiworker: first port (default: free ports)")
    p.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="start the whole job again after a failure, up to this many times (default 0)")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT,
                   help=f"multiworker: seconds for every worker to listen on its port (default {START_TIMEOUT:g})")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    handle_sigterm()
    try:
        return launch(args.launcher, args.np, script, args.hosts, args.hostfile, args.port, args.timeout,
                      max_restarts=args.max_restarts, start_timeout=args.start_timeout)
    except ValueError as e:
        p.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
