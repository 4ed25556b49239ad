"""NCCL all-reduce: MirroredStrategy / MultiWorkerMirroredStrategy over GPUs, and Horovod
built with NCCL. Asking for NCCL where it cannot run is an error, never a silent fallback."""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from dist_minimize import _compat, distribute
from dist_minimize.aggregation.base import Aggregator, GradsAndVars, refuse_unaggregated_job
from dist_minimize.aggregation.strategy import StrategyAggregator

# tf.distribute cross-device ops that run NCCL on GPUs: collective ops take NCCL as
# their communication implementation; NcclAllReduce is NCCL already.
_COLLECTIVE = "CollectiveAllReduce"
_NCCL = "NcclAllReduce"


def is_gpu(device: str) -> bool:
    """Whether a device string names a GPU."""
    return tf.DeviceSpec.from_string(device).device_type == "GPU"


def nccl_plan(devices: Sequence[str], cross_device_ops: str, built_with_cuda: bool | None = None) -> dict:
    """The NCCL all-reduce that would run on `devices`, or why it cannot.

    Args:
      devices: the replica devices of this worker (`strategy.extended.worker_devices`).
      cross_device_ops: class name of the strategy's cross-device ops.
      built_with_cuda: whether TensorFlow has CUDA (default: ask TensorFlow).

    Returns:
      `{"devices", "cross_device_ops", "options"}`; `options` is the
      `CommunicationOptions(implementation=NCCL)` passed to each all-reduce (None when the
      strategy's ops are `NcclAllReduce`, which needs none).

    Raises:
      ValueError: a replica device is not a GPU, TensorFlow has no CUDA, or the strategy's
        cross-device ops do not use NCCL; the message says what is missing.
    """
    devices = list(devices)
    not_gpu = [d for d in devices if not is_gpu(d)]
    if not devices or not_gpu:
        raise ValueError(
            "aggregate_gradients='nccl' needs every replica device to be a GPU; these are not: "
            f"{not_gpu or devices}. Use 'strategy' (or 'auto', which picks NCCL only on GPUs). "
            f"Received: devices={devices}")
    if built_with_cuda is None:
        built_with_cuda = tf.test.is_built_with_cuda()
    if not built_with_cuda:
        raise ValueError(
            "aggregate_gradients='nccl' needs TensorFlow built with CUDA (and so NCCL); this "
            "one is not (tensorflow-cpu?). Install tensorflow[and-cuda] (docker/gpu/Dockerfile).")
    if cross_device_ops == _COLLECTIVE:
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.NCCL)
    elif cross_device_ops == _NCCL:
        options = None
    else:
        raise ValueError(
            f"The strategy was created with cross_device_ops={cross_device_ops}, which does not use "
            "NCCL. Create it with the default (collective) ops or tf.distribute.NcclAllReduce(). "
            f"Received: cross_device_ops={cross_device_ops}")
    return {"devices": devices, "cross_device_ops": cross_device_ops, "options": options}


def check_horovod_nccl(hvd) -> None:
    """Raises unless Horovod was built with NCCL for GPU operations."""
    if not hvd.nccl_built():
        raise ValueError(
            "aggregate_gradients='nccl' under Horovod needs Horovod built with NCCL "
            "(HOROVOD_GPU_OPERATIONS=NCCL, as docker/gpu/Dockerfile builds it); this Horovod "
            "was built without it. Received: horovod.tensorflow.nccl_built()=0")


@keras.saving.register_keras_serializable(package="dist_minimize")
class NcclAggregator(Aggregator):
    """NCCL all-reduce of all gradients of the step, once per step.

    * Inside MirroredStrategy or MultiWorkerMirroredStrategy over GPUs: one batched
      replica-context all-reduce (SUM, like `StrategyAggregator`) with
      `CommunicationOptions(implementation=NCCL)` (or the strategy's `NcclAllReduce`).
    * Under Horovod (more than one process, no strategy): Horovod's grouped allreduce
      (AVERAGE), after checking that Horovod was built with NCCL, which it then uses for
      GPU tensors.

    Where NCCL cannot run (a CPU replica device, TensorFlow without CUDA, cross-device
    ops that are not NCCL, Horovod without NCCL) it raises a `ValueError` that says what
    is missing; it never falls back silently. One replica and no Horovod: identity.
    """

    name = "nccl"

    def __init__(self):
        self._strategy_agg = None
        self._horovod_agg = None

    @property
    def reduction(self):  # type: ignore[override]
        return "mean" if self._horovod_active() else "sum"

    @staticmethod
    def _horovod_active() -> bool:
        return distribute.strategy_replicas() == 1 and distribute.horovod_size() > 1

    def planned_collectives(self, grads_and_vars: GradsAndVars) -> int | None:
        """Under a strategy, `StrategyAggregator`'s plan; under Horovod, not checked."""
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            return StrategyAggregator().planned_collectives(grads_and_vars)
        return None

    def __call__(self, grads_and_vars: GradsAndVars) -> list:
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            strategy = tf.distribute.get_strategy()
            plan = nccl_plan(strategy.extended.worker_devices, _compat.cross_device_ops_name(strategy))
            if self._strategy_agg is None:
                self._strategy_agg = StrategyAggregator(options=plan["options"])
            return self._strategy_agg(grads_and_vars)
        if self._horovod_active():
            from dist_minimize.aggregation.horovod import HorovodAggregator

            check_horovod_nccl(distribute.horovod())
            if self._horovod_agg is None:
                self._horovod_agg = HorovodAggregator()
            return self._horovod_agg(grads_and_vars)
        refuse_unaggregated_job(self.name)
        return list(grads_and_vars)
