"""Launch plans, host parsing, the supervisor, and rank discovery from launcher variables."""

import json
import sys
import time

import pytest

from conftest import requires_horovod
from dist_minimize import cluster, launcher


def test_horovodrun_plans_print_exact_commands():
    [(cmd, env)] = launcher.plan("horovod-gloo", 4, ["train.py", "--epochs", "2"], hosts="a:2,b:2",
                                 python="/venv/bin/python")
    assert cmd[1:] == ["-np", "4", "-H", "a:2,b:2", "--gloo", "/venv/bin/python", "train.py", "--epochs", "2"]
    [(cmd, _)] = launcher.plan("horovod-mpi", 2, ["t.py"], python="py")
    assert cmd[1:6] == ["-np", "2", "-H", "localhost:2", "--mpi"]


def test_mpirun_plan_exports_env_and_uses_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n# comment\nnode2:2\n")
    [(cmd, _)] = launcher.plan("mpirun", 4, ["t.py"], hostfile=str(hostfile), python="py")
    assert cmd[:5] == ["mpirun", "-np", "4", "--hostfile", str(hostfile)]
    assert "-x" in cmd and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in cmd
    assert launcher.parse_hosts(None, str(hostfile), 4) == [("node1", 2), ("node2", 2)]


def test_multiworker_plan_writes_tf_config_per_worker():
    steps = launcher.plan("multiworker", 3, ["t.py"], port=23456, python="py")
    assert len(steps) == 3
    for i, (cmd, env) in enumerate(steps):
        config = json.loads(env["TF_CONFIG"])
        assert config["task"] == {"type": "worker", "index": i}
        assert config["cluster"]["worker"] == ["127.0.0.1:23456", "127.0.0.1:23457", "127.0.0.1:23458"]
        assert cluster.discover({"TF_CONFIG": env["TF_CONFIG"]}).rank == i


def test_mirrored_plan_is_one_process():
    [(cmd, env)] = launcher.plan("mirrored", 4, ["t.py"], python="py")
    assert cmd == ["py", "t.py", "--replicas", "4"] and env == {}


@pytest.mark.parametrize("kwargs,needle", [
    ({"launcher": "slurm", "np": 2}, "launcher='slurm'"),
    ({"launcher": "mpirun", "np": 0}, "np=0"),
    ({"launcher": "mpirun", "np": 2, "script": []}, "`script`"),
    ({"launcher": "mpirun", "np": 4, "hosts": "a:1,b:1"}, "2 slots for np=4"),
    ({"launcher": "mpirun", "np": 2, "hosts": "a:x"}, "'a:x'"),
    ({"launcher": "multiworker", "np": 2, "hosts": "node1:2"}, "this host only"),
])
def test_bad_launch_arguments(kwargs, needle):
    kwargs.setdefault("script", ["t.py"])
    with pytest.raises(ValueError, match=None) as info:
        launcher.plan(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize("env,want", [
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"},
     (1, 4, 1, 2, "horovod")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2, "openmpi")),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, (2, 3, 0, 1, "pmi")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
      "SLURM_TASKS_PER_NODE": "2(x3),2"}, (5, 8, 1, 2, "slurm")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
      "SLURM_TASKS_PER_NODE": "2,1"}, (0, 3, 0, 1, "slurm")),
    ({"TF_CONFIG": json.dumps({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]},
                               "task": {"type": "worker", "index": 1}})}, (2, 3, 0, 1, "tf_config")),
    ({}, (0, 1, 0, 1, "single")),
])
def test_discover(env, want):
    info = cluster.discover(env)
    assert (info.rank, info.size, info.local_rank, info.local_size, info.launcher) == want


@pytest.mark.parametrize("env,needle", [
    ({"HOROVOD_RANK": "x", "HOROVOD_SIZE": "2"}, "HOROVOD_RANK='x'"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "rank 2, size 2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "two"}, "SLURM_TASKS_PER_NODE='two'"),
    ({"TF_CONFIG": "{not json"}, "TF_CONFIG="),
])
def test_discover_bad_environment(env, needle):
    with pytest.raises(ValueError) as info:
        cluster.discover(env)
    assert needle in str(info.value)


@requires_horovod
def test_mpi4py_and_horovod_link_the_same_mpi():
    path = cluster.check_same_mpi()
    assert "libmpi.so" in path
