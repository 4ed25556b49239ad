"""Launches a training script: horovodrun (Gloo/MPI), mpirun, local multi-worker, or mirrored.

Examples:
  python launch/launch.py --launcher horovod-gloo -np 2 -- launch/train.py
  python launch/launch.py --launcher horovod-mpi -np 4 -H node1:2,node2:2 -- launch/train.py
  python launch/launch.py --launcher mpirun -np 2 --hostfile hosts.txt -- launch/train.py
  python launch/launch.py --launcher multiworker -np 2 --port 23456 -- launch/train.py
  python launch/launch.py --launcher mirrored -np 2 -- launch/train.py
  python launch/launch.py --launcher horovod-gloo --min-np 1 --max-np 4 \
      --host-discovery-script ./hosts.sh -- launch/train.py --micro-batch 16 --checkpoint-dir ckpt

Prints the exact command(s) it runs; exits with the first non-zero status of any
worker after stopping the others (124 on --timeout), naming the worker or rank and how it
ended. With --max-restarts N a failed job (exit status 42, "restart me", included) is
started again, whole, up to N times; with a `dist_minimize.Checkpointer` in the script
it resumes exactly where its last checkpoint left it (docs/fault-tolerance.md). SIGTERM
to the launcher stops every worker (SIGTERM first, so that they save).

Elastic (--min-np/--max-np with --host-discovery-script, or a --hostfile read again at
every ask): the job runs on as many workers as there are slots, between the two; it
starts again on another number when a worker fails or discovery (asked every
--discovery-interval seconds) reports another count, from the newest checkpoint. With the
main job's --micro-batch the training is the same on any number (docs/elastic.md).
"""

import argparse
import os
import sys

# The repository root, for a checkout where dist_minimize is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_minimize.launcher import (  # noqa: E402
    DISCOVERY_INTERVAL, LAUNCHERS, SLOTS_TIMEOUT, START_TIMEOUT, Discovery, handle_sigterm, launch, launch_elastic)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, default="horovod-gloo")
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                   help="processes (mirrored: replicas in one process; default 2)")
    p.add_argument("-H", "--hosts", default=None, help="host:slots,... (default localhost:NP)")
    p.add_argument("--hostfile", default=None, help="lines of 'host slots=N' or 'host:N'")
    p.add_argument("--port", type=int, default=None, help="multiworker: first port (default: free ports)")
    p.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="start the whole job again after a failure, up to this many times (default 0; "
                        "elastic: 10)")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT,
                   help=f"multiworker: seconds for every worker to listen on its port (default {START_TIMEOUT:g})")
    elastic = p.add_argument_group("elastic")
    elastic.add_argument("--min-np", type=int, default=None, help="the fewest workers the job runs on")
    elastic.add_argument("--max-np", type=int, default=None, help="the most workers the job runs on")
    elastic.add_argument("--host-discovery-script", default=None,
                         help="a command printing the available slots as `host:slots` lines")
    elastic.add_argument("--discovery-interval", type=float, default=DISCOVERY_INTERVAL,
                         help=f"seconds between asks while the job runs (default {DISCOVERY_INTERVAL:g})")
    elastic.add_argument("--worker-counts", default=None, metavar="N,N,...",
                         help="the worker counts the job accepts (default: any from --min-np to --max-np); "
                              "with --micro-batch B and --global-batch G: the divisors of G / B")
    elastic.add_argument("--slots-timeout", type=float, default=SLOTS_TIMEOUT,
                         help=f"seconds to wait for --min-np slots before stopping (default {SLOTS_TIMEOUT:g})")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = p.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    is_elastic = args.min_np is not None or args.max_np is not None or args.host_discovery_script is not None
    handle_sigterm()
    try:
        if not is_elastic:
            return launch(args.launcher, 2 if args.np is None else args.np, script, args.hosts, args.hostfile,
                          args.port, args.timeout, max_restarts=args.max_restarts or 0, start_timeout=args.start_timeout)
        given = [f"{flag} {value}" for flag, value in (("-np", args.np), ("-H", args.hosts), ("--port", args.port))
                 if value is not None]
        if given or args.min_np is None or args.max_np is None:
            p.error("An elastic launch takes --min-np and --max-np, and its hosts from --host-discovery-script "
                    "or --hostfile (read again at every ask); the count and the ports are its own. Received: "
                    f"--min-np {args.min_np} --max-np {args.max_np}{''.join(' ' + g for g in given)}")
        discovery = Discovery(args.host_discovery_script, args.hostfile)
        try:
            counts = None if args.worker_counts is None else [int(c) for c in args.worker_counts.split(",")]
        except ValueError:
            p.error(f"--worker-counts takes integers separated by commas. Received: {args.worker_counts!r}")
        return launch_elastic(args.launcher, script, discovery, args.min_np, args.max_np,
                              interval=args.discovery_interval, slots_timeout=args.slots_timeout,
                              max_restarts=10 if args.max_restarts is None else args.max_restarts, timeout=args.timeout,
                              start_timeout=args.start_timeout, worker_counts=counts)
    except ValueError as e:
        p.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
