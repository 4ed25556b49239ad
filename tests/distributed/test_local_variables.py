"""Rank-local variables under Horovod (`register_local_var`,
`dm.horovod_keras.PartialDistributedOptimizer(local_layers=...)`): a local variable's
gradient is each rank's own divided by the rank count (Horovod's scaling), never
aggregated; the shared weights get the mean; the global-norm clip's factor counts every
rank's local gradients, so it is the same on every rank and the shared weights stay
bit-identical; an inf in one rank's local gradient skips the step on every rank; the
broadcast keeps each rank's local weights; a checkpoint restores each rank's own. Against
an independent reference computed in the job (tests/workers/local_worker.py): horovodrun
-np 2 and -np 3 (Gloo), and -np 2 with the optimizer state sharded (each head and its
momentum its own rank's, outside the partition of the shared kernel)."""

import json
import os

import numpy as np
import pytest

import jobs
import proc
from conftest import requires_horovod
from dist_minimize import launcher

pytestmark = pytest.mark.distributed

WORKER = "tests/workers/local_worker.py"
SIZES = [pytest.param((n, ""), marks=requires_horovod, id=f"np{n}") for n in (2, 3)] + [
    pytest.param((2, "sharded"), marks=requires_horovod, id="np2-sharded")]


def ranks(job, tmp_path_factory):
    np_, mode = job

    def start():
        out = tmp_path_factory.mktemp(f"local-{np_}-{mode}")
        log = out / "log.txt"
        with open(log, "w") as f:
            args = [os.path.join(proc.ROOT, WORKER), str(out)] + ([mode] if mode else [])
            rc = launcher.launch("horovod-gloo", np_, args, timeout=proc.JOB_TIMEOUT, out=f, child_output=f)
        assert rc == 0, log.read_text()[-5000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)]
    return jobs._once(("local", np_, mode), start)


@pytest.mark.parametrize("job", SIZES)
def test_local_gradients_are_each_ranks_own_scaled_and_the_clip_counts_them_all(job, tmp_path_factory):
    results = [r["steps"] for r in ranks(job, tmp_path_factory)]
    for r in results:
        assert max(r["errors"]) <= 1e-6, r["errors"]
        assert min(r["factors"]) < 1.0  # the clip fired: its factor is part of what is checked
    for r in results[1:]:
        assert r["shared"] == results[0]["shared"]  # bit-identical shared weights
        assert r["head"] != results[0]["head"]  # each rank's own head
        assert r["factors"] == results[0]["factors"]


@requires_horovod
def test_sharded_state_partitions_the_shared_kernel_and_keeps_each_ranks_local_state(tmp_path_factory):
    plain = [r["steps"] for r in ranks((2, ""), tmp_path_factory)]
    sharded = [r["steps"] for r in ranks((2, "sharded"), tmp_path_factory)]
    # the shared kernel's momentum (12 floats) on one rank only; each head's (3) on its own
    assert sorted(plain[0]["state_bytes"] - r["state_bytes"] for r in sharded) == [0, 48]


@pytest.mark.parametrize("job", SIZES)
def test_an_inf_in_one_ranks_local_gradient_skips_the_step_on_every_rank(job, tmp_path_factory):
    results = [r["inf_on_last_rank"] for r in ranks(job, tmp_path_factory)]
    for r in results:
        assert r["shared_unchanged"] and r["head_unchanged"]
        assert r["skipped"] == 1 and r["iterations"] == 3
    assert all(r["shared"] == results[0]["shared"] for r in results)
    for r in ranks(job, tmp_path_factory):  # without a clip, whose norm would carry the inf everywhere
        assert r["inf_on_last_rank_no_clip"] == {"unchanged": True, "skipped": 1}


@pytest.mark.parametrize("job", SIZES)
def test_the_broadcast_sends_the_shared_weights_and_keeps_each_ranks_local_ones(job, tmp_path_factory):
    results = [r["broadcast"] for r in ranks(job, tmp_path_factory)]
    for r in results:
        assert r["head_after"] == r["head_before"]
        assert r["shared"] == results[0]["shared"]
    assert results[0]["head_before"] != results[1]["head_before"]


@pytest.mark.parametrize("job", SIZES)
def test_a_checkpoint_restores_each_ranks_own_local_variables(job, tmp_path_factory):
    results = [r["checkpoint"] for r in ranks(job, tmp_path_factory)]
    for r in results:
        assert r["step"] == 4 and r["restored"] and r["state_restored"]
    assert results[0]["head"] != results[1]["head"]  # each its own, not rank 0's
