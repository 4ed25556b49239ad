"""Horovod's two TF2 examples, ported (launch/examples/), run under the launcher with
horovodrun -np 2 (Gloo), shortened: the MNIST Keras example trains with Horovod's
callbacks (warmup included) and the synthetic benchmark reports its throughput."""

import os

import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = [pytest.mark.distributed, requires_horovod]


def run(tmp_path, script, *args) -> str:
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("horovod-gloo", 2, [os.path.join(proc.ROOT, "launch", "examples", script), *args],
                             timeout=proc.JOB_TIMEOUT, out=f, child_output=f)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    return text


def test_the_mnist_keras_example_trains_with_horovods_callbacks(tmp_path):
    text = run(tmp_path, "tensorflow2_keras_mnist.py", "--epochs", "1", "--steps-per-epoch", "4")
    line = next(x for x in text.splitlines() if "[mnist] final loss" in x)
    lr = float(line.split(" lr ")[1])
    # the warmup's rate at the last batch of epoch 0 of 3: 0.002 / 2 * ((1 / 4 * 3 + 1 / 4) * 1 / 3 + 1)
    assert abs(lr - 0.002 / 2 * ((3 / 4 + 1 / 4) / 3 + 1)) < 1e-9, line


def test_the_synthetic_benchmark_reports_its_throughput(tmp_path):
    text = run(tmp_path, "tensorflow2_synthetic_benchmark.py", "--model", "MobileNetV2", "--image-size", "32",
               "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2")
    assert "Total img/sec on 2 CPU(s):" in text and "Iter #1:" in text
