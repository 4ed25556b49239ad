"""Checks that run tools on the repository in processes of their own: hadolint on the
Dockerfiles, `bash -n` on the launch scripts, ci/gpu_check.py on this CPU machine (and its
logic simulated on CPUs), and importing the package without Horovod."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import proc

pytestmark = pytest.mark.distributed
ROOT = proc.ROOT


@pytest.mark.parametrize("image", ["cpu", "gpu"])
def test_dockerfiles_pass_hadolint(image):
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hadolint) and os.environ.get("DM_PROFILE") == "gpu":
        pytest.skip("hadolint is not in requirements/pins-gpu.txt (the profiles default and tf221 lint)")
    out = subprocess.run([hadolint, os.path.join(ROOT, "docker", image, "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", ["slurm_horovod.sbatch", "slurm_multiworker.sbatch", "horovodrun_gloo.sh",
                                    "horovodrun_mpi.sh", "mpirun.sh", "multiworker_local.sh", "mirrored.sh"])
def test_launch_scripts_parse(script):
    out = subprocess.run(["bash", "-n", os.path.join(ROOT, "launch", script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


def test_gpu_check_exits_cleanly_without_a_gpu(tmp_path):
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU: ci/gpu_check.py runs its real checks here instead")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "ci", "gpu_check.py"), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NOT RUN: parity and throughput on GPUs: no GPU found" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["checks"] == {}


def test_gpu_check_logic_simulated_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "ci", "gpu_check.py"), "--simulate-on-cpu",
                          "--steps", "3", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert checks["parity/sgd"]["passed"] and checks["parity/adam"]["passed"]
    for stack in ("adam", "swa+lookahead"):  # one unlowered If per device, same weights as one device
        assert checks[f"per_device/{stack}"]["passed"] and checks[f"per_device/{stack}"]["unlowered_ifs"] == 2, checks
    assert checks["throughput"]["ratio"] > 0


def test_import_does_not_need_horovod():
    import dist_minimize as dm

    code = ("import sys; sys.modules['horovod'] = None; sys.modules['horovod.tensorflow'] = None\n"
            "import dist_minimize as dm\n"
            "assert 'mpi4py' not in sys.modules\n"
            "dm.Optimizer(__import__('keras').optimizers.SGD(0.1))\n"
            "try:\n    dm.Optimizer(__import__('keras').optimizers.SGD(0.1), aggregate_gradients='horovod')\n"
            "except dm.MissingDependencyError as e:\n    print('OK', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(dm.__file__))})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK" in out.stdout and "ci/setup.sh" in out.stdout
