"""The main job with a fixed global batch of fixed micro-batches (`--micro-batch`,
`dist_minimize.elastic`): on 2 processes each takes one of the 2 micro-batches of an
update; on 1 process it accumulates both. The samples, their order and the sums are the
same (two operands, exact halvings), so the weights are the same bits (the printed
fingerprint). Horovod over Gloo."""

import os
import sys

import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = [pytest.mark.distributed, requires_horovod]


def run(tmp_path, np_: int, micro_batch: int, global_batch: int = 64) -> str:
    log = tmp_path / f"log-{np_}.txt"
    with open(log, "w") as f:
        rc = launcher.launch("horovod-gloo", np_, [
            os.path.join(proc.ROOT, "launch", "train.py"), "--epochs", "1", "--global-batch", str(global_batch),
            "--micro-batch", str(micro_batch), "--optimizer", "sgd", "--backend", "horovod"], timeout=proc.JOB_TIMEOUT,
            python=sys.executable, out=f, child_output=f)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    return text


def fingerprint(text: str) -> str:
    return text.split("[train] weights fingerprint ")[1].split()[0]


def test_two_processes_and_one_accumulating_train_the_same_bits(tmp_path):
    two = run(tmp_path, 2, 32)
    one = run(tmp_path, 1, 32)
    assert "[train] workers 2, micro-batches per update 1, global batch 64" in two
    assert "[train] workers 1, micro-batches per update 2, global batch 64" in one
    assert fingerprint(two) == fingerprint(one)
    assert float(one.split("[train] test accuracy ")[1].split()[0]) > 0.8


def test_a_worker_count_that_cannot_share_the_global_batch_is_refused_naming_the_admissible_ones(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("horovod-gloo", 2, [
            os.path.join(proc.ROOT, "launch", "train.py"), "--epochs", "1", "--global-batch", "48",
            "--micro-batch", "16"], timeout=proc.JOB_TIMEOUT, python=sys.executable, out=f, child_output=f)
    text = log.read_text()
    assert rc != 0
    assert "Admissible worker counts: [1, 3]" in text, text[-3000:]
