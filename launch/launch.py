"""Launches a training script: horovodrun (Gloo/MPI), mpirun, local multi-worker, or mirrored.

Examples:
  python launch/launch.py --launcher horovod-gloo -np 2 -- launch/train.py
  python launch/launch.py --launcher horovod-mpi -np 4 -H node1:2,node2:2 -- launch/train.py
  python launch/launch.py --launcher mpirun -np 2 --hostfile hosts.txt -- launch/train.py
  python launch/launch.py --launcher multiworker -np 2 --port 23456 -- launch/train.py
  python launch/launch.py --launcher mirrored -np 2 -- launch/train.py

Prints the exact command(s) it runs; exits with the first non-zero status of any
worker after stopping the others (124 on --timeout).
"""

import argparse
import os
import sys

# The repository root, for a checkout where dist_minimize is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_minimize.launcher import LAUNCHERS, launch  # noqa: E402  (imports no TensorFlow)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, default="horovod-gloo")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=2,
                   help="processes (mirrored: replicas in one process)")
    p.add_argument("-H", "--hosts", default=None, help="host:slots,... (default localhost:NP)")
    p.add_argument("--hostfile", default=None, help="lines of 'host slots=N' or 'host:N'")
    p.add_argument("--port", type=int, default=None, help="multiworker: first port (default: free ports)")
    p.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    try:
        return launch(args.launcher, args.np, script, args.hosts, args.hostfile, args.port, args.timeout)
    except ValueError as e:
        p.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
