"""Launch plans, host parsing, the supervisor, and rank discovery from launcher variables."""

import json
import os
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
    assert cmd[:7] == ["py", launcher.COMPAT_RUNNER, "-np", "2", "-H", "localhost:2", "--mpi"]


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


def test_multiworker_plan_accepts_every_loopback_name():
    # The same hosts `is_local` calls this machine (Debian names the host 127.0.1.1).
    for hosts in ("127.0.1.1:3", "localhost:1,127.0.0.1:2"):
        steps = launcher.plan("multiworker", 3, ["t.py"], hosts=hosts, port=23456, python="py")
        assert len(steps) == 3, hosts


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


# A local job listens on loopback where its tool allows it; a host list that
# names other machines keeps the tools' defaults (they must reach each other).
MULTI_HOST = [{"hosts": "a:2,b:2"}, {"hosts": "localhost:2,node2:2"}, {"hostfile": "HOSTFILE"}]


def _plan(name, kwargs, tmp_path, **extra):
    kwargs = dict(kwargs)
    if kwargs.get("hostfile") == "HOSTFILE":
        (tmp_path / "hosts").write_text("node1 slots=2\nnode2 slots=2\n")
        kwargs["hostfile"] = str(tmp_path / "hosts")
    return launcher.plan(name, 4, ["t.py"], python="py", **kwargs, **extra)


@pytest.mark.parametrize("name", ["horovod-gloo", "horovod-mpi", "mpirun"])
@pytest.mark.parametrize("kwargs", [{}, {"hosts": "localhost:4"}, {"hosts": "127.0.0.1:2,localhost:2"}])
def test_local_plans_bind_loopback(name, kwargs, tmp_path):
    [(cmd, env)] = _plan(name, kwargs, tmp_path, tmpdir="/job/tmp", shm_dir="/dev/shm/job")
    assert env == {"TMPDIR": "/job/tmp"}
    text = " ".join(cmd)
    if name.startswith("horovod"):
        assert cmd[:2] == ["py", launcher.COMPAT_RUNNER]  # rendezvous on 127.0.0.1
    if name == "horovod-mpi":
        assert cmd[cmd.index("--mpi-args") + 1] == (
            "--mca oob_tcp_if_include lo --mca btl_vader_backing_directory /dev/shm/job")
    if name == "mpirun":
        assert "--mca pml ob1 --mca btl self,vader --mca oob_tcp_if_include lo" in text
        assert "--mca btl_vader_backing_directory /dev/shm/job" in text and "-x TMPDIR" in text
    if name == "horovod-gloo":
        assert "--mca" not in text and "--mpi-args" not in text


@pytest.mark.parametrize("name", ["horovod-gloo", "horovod-mpi", "mpirun"])
@pytest.mark.parametrize("kwargs", MULTI_HOST)
def test_multi_host_plans_get_no_loopback_settings(name, kwargs, tmp_path):
    [(cmd, env)] = _plan(name, kwargs, tmp_path, tmpdir="/job/tmp", shm_dir="/dev/shm/job")
    text = " ".join(cmd)
    assert launcher.COMPAT_RUNNER not in cmd and os.path.basename(cmd[0]) in ("horovodrun", "mpirun")
    assert "--mca" not in text and "--mpi-args" not in text and "_if_include" not in text
    assert "/dev/shm/job" not in text
    assert not launcher.is_local(launcher.parse_hosts(kwargs.get("hosts"), None, 4)) if "hosts" in kwargs else True


def test_is_local_means_loopback_names_only():
    assert launcher.is_local([("localhost", 2)]) and launcher.is_local([("127.0.0.1", 1), ("::1", 1)])
    assert not launcher.is_local([("localhost", 1), ("node2", 1)])
    assert not launcher.is_local([(__import__("socket").gethostname(), 2)])  # a host list, not loopback


def test_multiworker_and_mirrored_plans_pass_the_job_tmpdir():
    for cmd, env in launcher.plan("multiworker", 2, ["t.py"], port=23456, python="py", tmpdir="/job/tmp"):
        assert env["TMPDIR"] == "/job/tmp" and "TF_CONFIG" in env
    [(cmd, env)] = launcher.plan("mirrored", 2, ["t.py"], python="py", tmpdir="/job/tmp")
    assert env == {"TMPDIR": "/job/tmp"}


@pytest.mark.parametrize("hex_addr,want", [
    ("0100007F:1F90", "127.0.0.1:8080"), ("00000000:0050", "0.0.0.0:80"),
    ("00000000000000000000000001000000:1F90", "[::1]:8080"),
    ("00000000000000000000000000000000:1F90", "[::]:8080"),
    ("0000000000000000FFFF00000100007F:1F90", "[::ffff:127.0.0.1]:8080"),
])
def test_proc_net_tcp_addresses(hex_addr, want):
    assert launcher._address(hex_addr) == want
    assert launcher.is_loopback(want) == ("127.0.0.1" in want or "::1]" in want)


def test_listening_sockets_and_the_exposed_line():
    import io
    import os
    import socket

    loop, every = socket.socket(), socket.socket()
    try:
        loop.bind(("127.0.0.1", 0))
        every.bind(("0.0.0.0", 0))
        loop.listen()
        every.listen()
        found = {a for pid, _, a in launcher.listening_sockets([os.getpid()])}
        assert f"127.0.0.1:{loop.getsockname()[1]}" in found and f"0.0.0.0:{every.getsockname()[1]}" in found
        out, reported = io.StringIO(), set()
        for _ in range(2):  # the second scan prints nothing new
            launcher._report_exposed([os.getpid()], reported, "a cause", out)
        # (only this socket's line: other tests' servers may still listen in this process)
        [line] = [x for x in out.getvalue().splitlines() if f":{every.getsockname()[1]} " in x]
        assert not [x for x in out.getvalue().splitlines() if f":{loop.getsockname()[1]} " in x]
        assert f"listens on 0.0.0.0:{every.getsockname()[1]} (every interface)" in line
        assert "no authentication; a cause" in line and "docs/security.md" in line
    finally:
        loop.close()
        every.close()
