"""Deployment files: Docker images (linted, built from the README's set-up), Slurm and
Kubernetes examples (their environment parsing), and the GPU check's CPU-side logic."""

import json
import os
import re
import sys

import pytest

from dist_minimize import cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def run_lines(dockerfile: str) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", dockerfile)
    return [line[4:].strip() for line in text.splitlines() if line.startswith("RUN ")]


def test_cpu_image_installs_only_through_the_readme_setup():
    readme = read("README.md").splitlines()
    assert "ci/main_job.sh" in readme[3] and "ci/test.sh" in readme[4]
    for script in ("ci/main_job.sh", "ci/test.sh"):
        assert 'bash "$ROOT/ci/setup.sh"' in read(script)
    dockerfile = read("docker", "cpu", "Dockerfile")
    assert "COPY . ." in dockerfile
    [run] = run_lines(dockerfile)
    assert run.startswith("bash ci/setup.sh")
    assert not re.search(r"\b(pip|apt-get)\b", run)  # nothing installed beside it


def test_gpu_image_uses_the_gpu_profile_of_the_same_setup():
    dockerfile = read("docker", "gpu", "Dockerfile")
    assert "DM_PROFILE=gpu" in dockerfile
    assert any(r.startswith("bash ci/setup.sh") for r in run_lines(dockerfile))
    assert re.search(r"FROM nvidia/cuda:12\.5\.\d+-cudnn-devel", dockerfile)  # TF 2.18's CUDA
    assert "libnccl-dev" in dockerfile
    assert "tensorflow[and-cuda]==2.18.1" in read("requirements", "pins-gpu.txt")
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in read("ci", "setup.sh")


@pytest.mark.parametrize("hostlist,want", [
    ("node1", ["node1"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("gpu[1,3-4],cpu7", ["gpu1", "gpu3", "gpu4", "cpu7"]),
    ("a[08-10]", ["a08", "a09", "a10"]),
])
def test_expand_slurm_hostlist(hostlist, want):
    assert cluster.expand_hostlist(hostlist) == want


def test_tf_config_from_slurm():
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    config = json.loads(cluster.tf_config_from_slurm(env, port=3000))
    assert config == {"cluster": {"worker": ["node1:3000", "node2:3000"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="SLURM_PROCID=2"):
        cluster.tf_config_from_slurm({**env, "SLURM_PROCID": "2"})
    with pytest.raises(ValueError, match="Not inside a Slurm task"):
        cluster.tf_config_from_slurm({})
    with pytest.raises(ValueError, match="node\\[a-b\\]"):
        cluster.expand_hostlist("node[a-b]")


def test_tf_config_from_statefulset_matches_the_manifest():
    import yaml

    docs = list(yaml.safe_load_all(read("launch", "k8s", "multiworker.yaml")))
    stateful = next(d for d in docs if d["kind"] == "StatefulSet")
    env = {e["name"]: e["value"] for e in stateful["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert int(env["DM_WORKERS"]) == stateful["spec"]["replicas"]
    name = stateful["metadata"]["name"]
    config = json.loads(cluster.tf_config_from_statefulset({**env, "HOSTNAME": f"{name}-1"}))
    assert config["task"] == {"type": "worker", "index": 1}
    assert config["cluster"]["worker"] == [f"{name}-0.{env['DM_SERVICE']}:23456", f"{name}-1.{env['DM_SERVICE']}:23456"]
    with pytest.raises(ValueError, match="HOSTNAME='laptop'"):
        cluster.tf_config_from_statefulset({**env, "HOSTNAME": "laptop"})
    with pytest.raises(ValueError, match="past DM_WORKERS=2"):
        cluster.tf_config_from_statefulset({**env, "HOSTNAME": f"{name}-5"})


def test_mpijob_manifest_runs_the_main_job_over_mpi():
    import yaml

    job = next(d for d in yaml.safe_load_all(read("launch", "k8s", "mpijob.yaml")) if d["kind"] == "MPIJob")
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "mpirun" and "/opt/dist_minimize/launch/train.py" in command
    # mpirun gives each worker OMPI_COMM_WORLD_*: discovery reads them.
    info = cluster.discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (info.rank, info.size, info.launcher) == (1, 2, "openmpi")


def test_gpu_check_plan():
    sys.path.insert(0, os.path.join(ROOT, "ci"))
    from gpu_check import plan

    assert plan(0)["run"] is False and "no GPU found" in plan(0)["not_run"][0]
    one = plan(1)
    assert one["split"] and one["replicas"] == 2 and not one["nccl"] and "NCCL" in one["not_run"][0]
    eight = plan(8)
    assert eight["nccl"] and eight["replicas"] == 8 and eight["not_run"] == []


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # only the form these manifests use
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("manifest", ["multiworker.yaml", "mpijob.yaml"])
def test_network_policy_admits_only_the_jobs_own_pods(manifest):
    """The job's ports have no authentication; each example manifest carries a
    NetworkPolicy that selects every pod of the job and admits ingress from those only."""
    import yaml

    docs = list(yaml.safe_load_all(read("launch", "k8s", manifest)))
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["spec"]["policyTypes"] == ["Ingress"]
    if manifest == "multiworker.yaml":
        stateful = next(d for d in docs if d["kind"] == "StatefulSet")
        templates = [stateful["spec"]["template"]]
        env = {e["name"]: e["value"] for e in templates[0]["spec"]["containers"][0]["env"]}
        ports = [{"protocol": "TCP", "port": int(env["DM_PORT"])}]
    else:
        job = next(d for d in docs if d["kind"] == "MPIJob")
        templates = [spec["template"] for spec in job["spec"]["mpiReplicaSpecs"].values()]
        ports = None  # ssh, then Open MPI's ports chosen at random: every port, from the job only
    for template in templates:
        assert _selects(policy["spec"]["podSelector"], template["metadata"]["labels"])
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector or ipBlock: the job's pods only
    for template in templates:
        assert _selects(peer["podSelector"], template["metadata"]["labels"])
    assert rule.get("ports") == ports
