"""The main job (launch/train.py) under the multiworker launcher: trains, and its workers
end cleanly (no gRPC heartbeat error printed as they exit), with an honest exit status."""

import os
import sys

import pytest

import proc
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
