"""The main job (launch/train.py) under the multiworker launcher: trains, and its workers
end cleanly (no gRPC heartbeat error printed as they exit), with an honest exit status."""

import os
import sys

import pytest

import proc
from conftest import default_profile_only, requires_horovod
from dist_minimize import launcher

pytestmark = pytest.mark.distributed


def test_multiworker_main_job_trains_and_exits_cleanly(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("multiworker", 2, [os.path.join(proc.ROOT, "launch", "train.py"), "--epochs", "2"],
                             timeout=proc.JOB_TIMEOUT, python=sys.executable, out=f, child_output=f)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    accuracy = float(text.split("[train] test accuracy ")[1].split()[0])
    assert accuracy > 0.9, text[-3000:]
    for alarming in ("Additional GRPC error", "CoordinationService/Heartbeat", "UNAVAILABLE", "Traceback"):
        assert alarming not in text, text[-5000:]


def test_exit_worker_orders_the_exit_when_a_worker_is_late(tmp_path):
    """Worker 1 reaches the end 12 s after worker 0 (TensorFlow's heartbeat comes about
    every 10 s). Without an ordered exit, worker 0 (host of the coordination service)
    leaves first and worker 1's next heartbeat reports `Failed to send RPC to
    coordination service` / `CoordinationService/Heartbeat` (measured: 4 such lines)."""
    script = tmp_path / "late.py"
    script.write_text(
        "import time\n"
        "import tensorflow as tf\n"
        "from dist_minimize import cluster\n"
        "s = tf.distribute.MultiWorkerMirroredStrategy()\n"
        "total = s.reduce('SUM', s.run(lambda: tf.constant(1.0)), axis=None)\n"
        "task = s.cluster_resolver.task_id\n"
        "print(f'worker {task} sum {float(total)}', flush=True)\n"
        "if task == 1:\n"
        "    time.sleep(12)\n"
        "cluster.exit_worker(0)\n")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("multiworker", 2, [str(script)], timeout=120, python=sys.executable,
                             out=f, child_output=f)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    assert text.count("sum 2.0") == 2, text[-3000:]
    for alarming in ("Additional GRPC error", "coordination service", "Heartbeat", "UNAVAILABLE"):
        assert alarming not in text, text[-5000:]


WRAPPER_FLAGS = ["--epochs", "2", "--moving-average", "0.9", "--weight-decay", "0.0001",
                 "--dp-noise-multiplier", "1.1", "--dp-l2-norm-clip", "1.0", "--compression", "fp16"]


def check_wrapper_output(text: str) -> None:
    from dist_minimize import privacy

    assert "wrappers MovingAverage(0.9) > DifferentialPrivacy(l2_norm_clip=1.0, noise_multiplier=1.1) > " \
           "DecoupledWeightDecay(0.0001) > CompressedAggregation('fp16')" in text, text[-3000:]
    accuracy = float(text.split("[train] test accuracy ")[1].split()[0])
    averaged = float(text.split("[train] test accuracy with the moving average ")[1].split()[0])
    assert accuracy > 0.2 and averaged > 0.2, text[-3000:]  # DP-SGD, 2 epochs: far above chance (0.1)
    # 1437 training digits, global batch 64: 22 full batches per epoch, 44 steps.
    eps = privacy.epsilon(1.1, 64 / 1437, 44, 1e-5)
    assert f"[train] DP-SGD: epsilon {eps:.3f} at delta 1e-05" in text and "44 steps" in text, text[-3000:]


@pytest.mark.parametrize("launcher_name", ["mirrored", "horovod-gloo", "multiworker"])
def test_main_job_with_every_wrapper_flag(tmp_path, launcher_name):
    """The main job with a moving average, DP-SGD, decoupled weight decay and fp16
    compression with error feedback: trains, reports
    the accuracy with the averages and epsilon from dp-accounting for the steps it took."""
    if launcher_name == "horovod-gloo":
        pytest.importorskip("horovod.tensorflow")
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch(launcher_name, 2, [os.path.join(proc.ROOT, "launch", "train.py"), *WRAPPER_FLAGS],
                             timeout=proc.JOB_TIMEOUT, python=sys.executable, out=f, child_output=f)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    check_wrapper_output(text)
    assert "Traceback" not in text, text[-5000:]


@pytest.mark.parametrize("launcher_name", [pytest.param("horovod-gloo", marks=requires_horovod),
                                           pytest.param("multiworker", marks=default_profile_only)])
def test_main_job_shards_the_optimizer_state(tmp_path, launcher_name):
    """`--shard-optimizer-state` under horovodrun and MultiWorkerMirroredStrategy: each
    of the 2 processes prints its optimizer state bytes, together the unsharded job's
    (Adam's slots once, the counters on both), each at most half of the slots plus the
    largest kernel's (64 x 128 weights, 8 bytes each), and the job trains as well."""
    printed = {}
    for flags in ([], ["--shard-optimizer-state"]):
        log = tmp_path / f"log{len(flags)}.txt"
        with open(log, "w") as f:
            rc = launcher.launch(launcher_name, 2, [os.path.join(proc.ROOT, "launch", "train.py"), "--epochs", "1",
                                                    *flags], timeout=proc.JOB_TIMEOUT, python=sys.executable,
                                 out=f, child_output=f)
        text = log.read_text()
        assert rc == 0, text[-5000:]
        printed[bool(flags)] = [int(line.split("optimizer state bytes on this process: ")[1].split()[0])
                                for line in text.splitlines() if "optimizer state bytes on this process: " in line]
        assert len(printed[bool(flags)]) == 2, text[-3000:]
        assert float(text.split("[train] test accuracy ")[1].split()[0]) > 0.9
    plain, shares = printed[False], printed[True]
    assert plain[0] == plain[1]
    weights = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    counters = plain[0] - 8 * weights
    assert 0 < counters < 200
    assert sum(shares) == 8 * weights + 2 * counters
    assert max(shares) <= 8 * weights / 2 + 8 * 64 * 128 + counters
