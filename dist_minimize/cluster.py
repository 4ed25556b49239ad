"""Where this process sits in the job: rank, size, local rank, local size.

The same answer under `horovodrun` (Gloo or MPI), plain `mpirun` (Open MPI), MPICH's
hydra, Slurm's `srun`, and a tf.distribute `TF_CONFIG`, read from the variables each
of them sets. Also: Horovod initialised from mpi4py communicators, and a check that
mpi4py and Horovod use the same MPI library.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from typing import Any, Mapping, Sequence

from dist_minimize import _compat


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in the job.

    Attributes:
      rank: global index of this process, 0..size-1.
      size: number of processes in the job.
      local_rank: index among the processes on this host.
      local_size: number of processes on this host.
      launcher: what set the variables: "horovod", "openmpi", "pmi", "slurm",
        "tf_config" or "single".
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str

    @property
    def is_root(self) -> bool:
        return self.rank == 0


# (launcher, rank, size, local rank, local size) variable names, in order of precedence:
# horovodrun --gloo sets HOROVOD_*, horovodrun --mpi and mpirun set OMPI_COMM_WORLD_*.
_SCHEMES = [
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
]


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"`{name}` must be an integer. Received: {name}={value!r}") from None
    if number < 0:
        raise ValueError(f"`{name}` must be >= 0. Received: {name}={value!r}")
    return number


def slurm_tasks_on_node(environ: Mapping[str, str]) -> int:
    """Tasks on this node from SLURM_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID."""
    spec = environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return int(environ.get("SLURM_NTASKS_PER_NODE", "1"))
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"`SLURM_TASKS_PER_NODE` is not in Slurm's format. Received: "
                             f"SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(environ.get("SLURM_NODEID", "0"))
    if node >= len(counts):
        raise ValueError(f"`SLURM_NODEID` is past the nodes in SLURM_TASKS_PER_NODE. Received: "
                         f"SLURM_NODEID={node}, SLURM_TASKS_PER_NODE={spec!r}")
    return counts[node]


def discover(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Returns this process's `ClusterInfo` from the launcher's environment variables.

    Raises:
      ValueError: a variable is malformed or inconsistent (rank >= size), naming it.
    """
    environ = os.environ if environ is None else environ
    # (No for/else here: traced steps call this, and AutoGraph cannot convert one.)
    found = [scheme for scheme in _SCHEMES if scheme[1] in environ and scheme[2] in environ]
    if found:
        launcher, rank, size, local_rank, local_size = found[0]
        lr = _int(environ, local_rank) if local_rank and local_rank in environ else 0
        if local_size and local_size in environ:
            ls = _int(environ, local_size)
        elif launcher == "slurm":
            ls = slurm_tasks_on_node(environ)
        else:
            ls = 1
        info = ClusterInfo(_int(environ, rank), _int(environ, size), lr, ls, launcher)
    else:
        info = _from_tf_config(environ) or ClusterInfo(0, 1, 0, 1, "single")
    if info.size < 1 or info.rank >= info.size or info.local_rank >= max(info.local_size, 1):
        raise ValueError(f"Inconsistent job environment ({info.launcher}): rank {info.rank}, "
                         f"size {info.size}, local rank {info.local_rank}, local size {info.local_size}")
    return info


def _from_tf_config(environ: Mapping[str, str]) -> ClusterInfo | None:
    raw = environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
        workers = config["cluster"].get("worker", []) + config["cluster"].get("chief", [])
        task = config["task"]
        index = int(task["index"]) + (len(config["cluster"].get("chief", [])) if task["type"] == "worker" else 0)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"`TF_CONFIG` must be JSON with cluster.worker and task.type/index "
                         f"({e}). Received: TF_CONFIG={raw!r}") from None
    return ClusterInfo(index, len(workers), 0, 1, "tf_config")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a Slurm host list ("node[01-03,07],gpu5") into host names, in order.

    Raises:
      ValueError: a malformed list, naming it.
    """
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", hostlist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"`SLURM_JOB_NODELIST` is not a Slurm host list. Received: {hostlist!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    if not hosts:
        raise ValueError(f"`SLURM_JOB_NODELIST` is empty. Received: {hostlist!r}")
    return hosts


def tf_config_from_slurm(environ: Mapping[str, str] | None = None, port: int = 23456) -> str:
    """TF_CONFIG for a MultiWorkerMirroredStrategy worker started by `srun`, one task per node.

    Workers are the job's nodes (SLURM_JOB_NODELIST, or SLURM_NODELIST) in order, each at
    `port`; this task's index is SLURM_PROCID.
    """
    environ = os.environ if environ is None else environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist or "SLURM_PROCID" not in environ:
        raise ValueError("Not inside a Slurm task: SLURM_JOB_NODELIST and SLURM_PROCID are needed. "
                         f"Received: SLURM_JOB_NODELIST={nodelist!r}, "
                         f"SLURM_PROCID={environ.get('SLURM_PROCID')!r}")
    hosts = expand_hostlist(nodelist)
    index = _int(environ, "SLURM_PROCID")
    if index >= len(hosts):
        raise ValueError(f"One MultiWorkerMirroredStrategy worker per node: SLURM_PROCID={index} but "
                         f"{len(hosts)} nodes. Use --ntasks-per-node=1. Received: SLURM_JOB_NODELIST={nodelist!r}")
    return json.dumps({"cluster": {"worker": [f"{h}:{port}" for h in hosts]},
                       "task": {"type": "worker", "index": index}})


def tf_config_from_statefulset(environ: Mapping[str, str] | None = None) -> str:
    """TF_CONFIG for a worker pod of a Kubernetes StatefulSet (launch/k8s/multiworker.yaml).

    The pod's ordinal comes from its HOSTNAME ("<set>-<ordinal>"); DM_WORKERS, DM_SERVICE
    (the headless service) and DM_PORT describe the cluster. Pods are
    "<set>-<i>.<service>:<port>".
    """
    environ = os.environ if environ is None else environ
    hostname = environ.get("HOSTNAME", "")
    name, _, ordinal = hostname.rpartition("-")
    if not name or not ordinal.isdigit():
        raise ValueError(f"`HOSTNAME` must be a StatefulSet pod name like 'dm-worker-0'. Received: "
                         f"HOSTNAME={hostname!r}")
    for var in ("DM_WORKERS", "DM_SERVICE"):
        if not environ.get(var):
            raise ValueError(f"`{var}` must be set in the pod spec. Received: {var}={environ.get(var)!r}")
    workers, port = _int(environ, "DM_WORKERS"), environ.get("DM_PORT", "23456")
    if int(ordinal) >= workers:
        raise ValueError(f"Pod ordinal {ordinal} is past DM_WORKERS={workers}. Received: HOSTNAME={hostname!r}")
    service = environ["DM_SERVICE"]
    return json.dumps({"cluster": {"worker": [f"{name}-{i}.{service}:{port}" for i in range(workers)]},
                       "task": {"type": "worker", "index": int(ordinal)}})


def init_horovod(comm: Any = None, process_set_comms: Sequence[Any] = ()) -> Any:
    """Initialises Horovod, optionally on an mpi4py communicator; returns `horovod.tensorflow`.

    Args:
      comm: an mpi4py communicator (e.g. `MPI.COMM_WORLD` or a `Split` of it) whose
        processes form the Horovod job; `None` for all launched processes.
      process_set_comms: mpi4py communicators, each turned into a Horovod `ProcessSet`
        registered at initialisation (see `hvd.ProcessSet`); every process must pass the
        same list, in the same order.

    Returns:
      The `horovod.tensorflow` module. The process sets built from `process_set_comms`
      are returned by `process_sets()`, in the same order.
    """
    hvd = _compat.import_horovod()
    sets = [hvd.ProcessSet(c) for c in process_set_comms]
    kwargs: dict = {}
    if comm is not None:
        kwargs["comm"] = comm
    if sets:
        kwargs["process_sets"] = sets
    hvd.init(**kwargs)
    _registered[:] = sets
    return hvd


_registered: list = []


def process_sets() -> list:
    """The process sets `init_horovod` built from mpi4py communicators, in order."""
    return list(_registered)


def _linked_mpi(path: str) -> str | None:
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        if "libmpi.so" in line and "=>" in line:
            return os.path.realpath(line.split("=>")[1].split("(")[0].strip())
    return None


def mpi_libraries() -> dict:
    """The MPI shared library that mpi4py and Horovod's MPI backend each link to."""
    import glob
    import importlib.util

    mpi = _compat.import_mpi4py()
    hvd_spec = importlib.util.find_spec("horovod.tensorflow")
    if hvd_spec is None or not hvd_spec.submodule_search_locations:
        raise _compat.MissingDependencyError(f"Horovod is not installed. {_compat.SETUP_HINT}")
    hvd_libs = glob.glob(os.path.join(hvd_spec.submodule_search_locations[0], "mpi_lib*.so"))
    return {
        "mpi4py": _linked_mpi(mpi.__file__),
        "horovod": _linked_mpi(hvd_libs[0]) if hvd_libs else None,
        "mpi4py_version": mpi.Get_library_version().strip().splitlines()[0],
    }


def check_same_mpi() -> str:
    """Raises unless mpi4py and Horovod link to the same MPI library; returns its path."""
    libs = mpi_libraries()
    if not libs["mpi4py"] or libs["mpi4py"] != libs["horovod"]:
        raise RuntimeError(
            "mpi4py and Horovod use different MPI libraries (mpi4py: "
            f"{libs['mpi4py']}, Horovod: {libs['horovod']}); rebuild mpi4py against "
            f"Horovod's MPI. {_compat.SETUP_HINT}")
    return libs["mpi4py"]


def exit_worker(code: int = 0, timeout: float = 60.0) -> None:
    """Ends this MultiWorkerMirroredStrategy worker's process cleanly; never returns.

    Call it on every worker as the last statement of a job that succeeded. A worker that
    simply returns leaves TensorFlow's coordination service to chance: the first worker
    hosts it, and if that one exits while another is still alive, the other's heartbeat
    fails and TensorFlow prints `Additional GRPC error information from remote target
    /job:worker/replica:0/task:0 while calling /tensorflow.CoordinationService/Heartbeat`,
    which reads as a failure although the job succeeded. Here every worker first waits
    for all the others at a barrier; then every worker but the first records that it is
    leaving and exits at once, and the first worker exits after it has seen all of them
    leave. Output is flushed before exiting; the exit status is `code`.

    Without a multi-worker cluster (no TF_CONFIG with several tasks) it only flushes and
    exits. Raises `RuntimeError` if the other workers do not reach the barrier within
    `timeout` seconds (a worker failed: the job must not look successful).
    """
    import sys
    import time

    info = _from_tf_config(os.environ)
    if info is not None and info.size > 1:
        client = _compat.coordination_client()
        ms = int(timeout * 1000)
        try:
            client.wait_at_barrier("dist_minimize/exit_worker", ms)
        except Exception as e:  # noqa: BLE001 - any failure here means a worker is missing
            raise RuntimeError(
                f"exit_worker: not every worker reached the end of the job within {timeout:.0f} s "
                f"(this is worker {info.rank} of {info.size}): {e}") from e
        if info.rank != 0:
            client.set_config_key_value(f"dist_minimize/exited/{info.rank}", "1")
        else:
            for task in range(1, info.size):
                client.get_config_key_value(f"dist_minimize/exited/{task}", ms)
            time.sleep(0.5)  # the others set their key just before exiting
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- joining a MultiWorkerMirroredStrategy job in bounded time ----------------------------

LOCAL_START_TIMEOUT = 30.0  # seconds, every worker on this machine
CLUSTER_START_TIMEOUT = 300.0  # seconds, workers on other hosts (images to pull, nodes to boot)


def start_timeout(environ: Mapping[str, str] | None = None) -> float | None:
    """How long a worker waits for its peers: `DM_START_TIMEOUT` seconds (0: no bound),
    else LOCAL_START_TIMEOUT when every worker of TF_CONFIG is on this machine and
    CLUSTER_START_TIMEOUT otherwise."""
    environ = os.environ if environ is None else environ
    raw = environ.get("DM_START_TIMEOUT", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ValueError(f"`DM_START_TIMEOUT` must be a number of seconds >= 0 (0: no bound). "
                             f"Received: DM_START_TIMEOUT={raw!r}")
        return value or None
    from dist_minimize.launch.plan import is_local

    hosts = [(w.rsplit(":", 1)[0].strip("[]"), 1) for w in _tf_config_workers(environ)]
    return LOCAL_START_TIMEOUT if is_local(hosts) else CLUSTER_START_TIMEOUT


def _tf_config_workers(environ: Mapping[str, str]) -> list[str]:
    _from_tf_config(environ)  # (its errors)
    config = json.loads(environ.get("TF_CONFIG") or "{}")
    return list(config.get("cluster", {}).get("worker", []))


def multi_worker_strategy(timeout: float | None | str = "auto", **kwargs: Any):
    """`tf.distribute.MultiWorkerMirroredStrategy(**kwargs)`, joined in bounded time.

    TensorFlow's constructor waits for every worker of TF_CONFIG to register (an hour by
    default), silently, holding Python's lock, and catches SIGTERM meanwhile (its
    preemption notifier), so neither a thread nor a signal handler of this process can
    act. Here a watcher process (dist_minimize/launch/join_watch.py, standard library
    only) ends this one if the strategy is not made within `timeout` seconds ("auto":
    `start_timeout()`; None: no bound), after printing which workers did not arrive
    (those whose address accepts no connection); and a SIGTERM sent meanwhile ends it
    within a second (srun's, Kubernetes' and the launcher's stops and restarts can
    act), provided the program blocked SIGTERM before importing TensorFlow, whose
    threads inherit the mask: `signal.pthread_sigmask(signal.SIG_BLOCK,
    {signal.SIGTERM})` first thing (the main job does); this call releases it once
    joined, and a SIGTERM held meanwhile acts then. Ended: by SIGKILL, since TensorFlow catches SIGTERM while it waits.
    """
    import signal
    import subprocess
    import sys

    import tensorflow as tf

    watcher = None
    try:  # however it ends, SIGTERM is released (the main job blocked it before TensorFlow started)
        if timeout == "auto":
            timeout = start_timeout()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise ValueError("`timeout` must be a number of seconds > 0, None or 'auto'. "
                             f"Received: timeout={timeout!r}")
        workers = _tf_config_workers(os.environ)
        if len(workers) > 1:
            me = _from_tf_config(os.environ)
            # Run as a file: as a module of this package it would import TensorFlow first (seconds).
            watch = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch", "join_watch.py")
            watcher = subprocess.Popen(
                [sys.executable, watch, str(os.getpid()), f"{timeout or 0:g}", str(me.rank if me is not None else 0),
                 *workers], stdin=subprocess.PIPE)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (this thread's; see above)
        return tf.distribute.MultiWorkerMirroredStrategy(**kwargs)
    finally:
        if watcher is not None:
            watcher.stdin.close()  # joined (or failed): the watcher ends
            watcher.wait()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
