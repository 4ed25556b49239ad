"""NCCL backend: selection by "auto", the errors where NCCL cannot run, and the exact
collective options that would be used on GPUs (this machine has none)."""

import logging

import keras
import pytest
import tensorflow as tf

import dist_minimize as dm
from conftest import mirrored_strategy
from dist_minimize.aggregation import auto_choice, nccl_plan

GPUS = ["/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1"]
CPUS = ["/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]
NCCL = tf.distribute.experimental.CommunicationImplementation.NCCL


def test_collective_ops_on_gpus_get_nccl_options():
    plan = nccl_plan(GPUS, "CollectiveAllReduce", built_with_cuda=True)
    assert plan["options"].implementation == NCCL
    assert plan["devices"] == GPUS


def test_nccl_all_reduce_needs_no_options():
    assert nccl_plan(GPUS, "NcclAllReduce", built_with_cuda=True)["options"] is None


@pytest.mark.parametrize("devices,ops,cuda,needle", [
    (CPUS, "CollectiveAllReduce", True, "needs every replica device to be a GPU"),
    ([GPUS[0], CPUS[1]], "CollectiveAllReduce", True, "device:CPU:1"),
    (GPUS, "HierarchicalCopyAllReduce", True, "cross_device_ops=HierarchicalCopyAllReduce"),
    (GPUS, "ReductionToOneDevice", True, "does not use NCCL"),
    (GPUS, "CollectiveAllReduce", False, "TensorFlow built with CUDA"),
])
def test_nccl_refused_where_it_cannot_run(devices, ops, cuda, needle):
    with pytest.raises(ValueError) as info:
        nccl_plan(devices, ops, built_with_cuda=cuda)
    assert needle in str(info.value)


@pytest.mark.parametrize("args,want", [
    ((2, GPUS, "CollectiveAllReduce", 1, True), "nccl"),
    ((2, GPUS, "NcclAllReduce", 1, True), "nccl"),
    ((2, CPUS, "CollectiveAllReduce", 1, True), "strategy"),
    ((2, GPUS, "HierarchicalCopyAllReduce", 1, True), "strategy"),
    ((2, GPUS, "CollectiveAllReduce", 1, False), "strategy"),
    ((1, [], "none", 4, True), "horovod"),
    ((1, [], "none", 1, True), "none"),
])
def test_auto_choice(args, want):
    name, reason = auto_choice(*args)
    assert name == want and reason


def test_nccl_on_cpu_replicas_raises_at_the_first_step():
    strategy = mirrored_strategy()
    with strategy.scope():
        v = tf.Variable([1.0])
        opt = dm.Optimizer(keras.optimizers.SGD(0.1), aggregate_gradients="nccl")
        opt.build([v])
    with pytest.raises(ValueError, match="needs every replica device to be a GPU"):
        strategy.run(lambda: opt.apply_gradients([(tf.constant([1.0]), v)]))


def test_auto_logs_its_choice_once(caplog):
    strategy = mirrored_strategy()
    with strategy.scope():
        v = tf.Variable([1.0])
        opt = dm.Optimizer(keras.optimizers.SGD(0.1))
        opt.build([v])
    with caplog.at_level(logging.INFO, logger="dist_minimize"):
        for _ in range(3):
            strategy.run(lambda: opt.apply_gradients([(tf.constant([1.0]), v)]))
    messages = [r.getMessage() for r in caplog.records if r.name == "dist_minimize"]
    assert len(messages) == 1
    assert "chose 'strategy'" in messages[0] and "not all on GPUs" in messages[0]
