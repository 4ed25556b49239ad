"""The main job with a fixed global batch of fixed micro-batches (`--micro-batch`,
`dist_minimize.elastic`): a worker count that cannot share the global batch is refused,
naming the admissible ones. The same bits on 2 workers and on 1 (2 shrunk to 1, grown
back): tests/distributed/test_elastic_resize.py. Horovod over Gloo."""

import os
import sys

import pytest

import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = [pytest.mark.distributed, requires_horovod]


def test_a_worker_count_that_cannot_share_the_global_batch_is_refused_naming_the_admissible_ones(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        rc = launcher.launch("horovod-gloo", 2, [
            os.path.join(proc.ROOT, "launch", "train.py"), "--epochs", "1", "--global-batch", "48",
            "--micro-batch", "16"], timeout=proc.JOB_TIMEOUT, python=sys.executable, out=f, child_output=f)
    text = log.read_text()
    assert rc != 0
    assert "Admissible worker counts: [1, 3]" in text, text[-3000:]
