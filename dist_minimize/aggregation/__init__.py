"""Aggregation backends and their selection by name.

`get(identifier)` turns what `Optimizer(aggregate_gradients=...)` received into an
`Aggregator`:

* `"auto"` (default): chooses at each step, from the context the step runs in: inside a
  strategy of more than one replica, NCCL when every replica device is a GPU and the
  strategy's all-reduce can use NCCL, the strategy's own all-reduce otherwise; Horovod
  when `horovod.tensorflow` is imported and initialised with more than one process;
  otherwise the identity. The choice and its reason are logged once (logger
  `dist_minimize`). A job of several processes (horovodrun, mpirun, srun, PMI, a
  TF_CONFIG naming several workers) with neither a multi-replica strategy nor an
  initialised Horovod is an error that names the fix, never N independent models
  trained side by side. (`"none"` is the explicit statement that the caller
  aggregates elsewhere; it is not checked.)
* `"strategy"`: the tf.distribute all-reduce (`StrategyAggregator`).
* `"nccl"`: NCCL, or a clear error where it cannot run (`NcclAggregator`).
* `"horovod"`: Horovod's grouped allreduce (`HorovodAggregator`).
* `"none"`: no aggregation.
* an `Aggregator` instance, or any callable `grads_and_vars -> grads_and_vars`.
"""

from __future__ import annotations

import logging
from typing import Callable

import tensorflow as tf

from dist_minimize.aggregation.base import Aggregator, IdentityAggregator, refuse_unaggregated_job
from dist_minimize import _compat, distribute
from dist_minimize.aggregation.horovod import HorovodAggregator
from dist_minimize.aggregation.nccl import NcclAggregator, is_gpu, nccl_plan
from dist_minimize.aggregation.exactly_once import AggregationError
from dist_minimize.aggregation.strategy import StrategyAggregator

_BACKENDS = {
    "strategy": StrategyAggregator,
    "nccl": NcclAggregator,
    "horovod": HorovodAggregator,
    "none": IdentityAggregator,
}
logger = logging.getLogger("dist_minimize")


def auto_choice(num_replicas: int, devices, cross_device_ops: str, horovod_size: int,
                built_with_cuda: bool) -> tuple[str, str]:
    """What "auto" picks, and why: ("nccl" | "strategy" | "horovod" | "none", reason)."""
    if num_replicas > 1:
        if devices and all(is_gpu(d) for d in devices):
            try:
                nccl_plan(devices, cross_device_ops, built_with_cuda)
                return "nccl", f"all {len(devices)} local replica devices are GPUs"
            except ValueError as e:
                return "strategy", f"NCCL cannot run here: {e}"
        return "strategy", f"{num_replicas} replicas, not all on GPUs ({', '.join(devices)})"
    if horovod_size > 1:
        return "horovod", f"Horovod is initialised with {horovod_size} processes"
    return "none", "one replica, no Horovod job"
BACKEND_NAMES = ("auto",) + tuple(_BACKENDS)


class AutoAggregator(Aggregator):
    """Chooses the backend from the context each step runs in (see module docstring)."""

    name = "auto"

    def __init__(self):
        self._chosen: dict[str, Aggregator] = {}

    def select(self) -> Aggregator:
        """Returns the backend this step uses (logging the choice the first time).

        Raises:
          RuntimeError: this process is one of several in a job, but nothing here
            aggregates across them (see the module docstring).
        """
        strategy = tf.distribute.get_strategy()
        n = distribute.strategy_replicas()
        devices = list(strategy.extended.worker_devices) if n > 1 else []
        horovod_size = distribute.horovod_size()
        if n == 1 and horovod_size == 1:
            refuse_unaggregated_job("auto")
        name, reason = auto_choice(n, devices, _compat.cross_device_ops_name(strategy) if n > 1 else "none",
                                   horovod_size, tf.test.is_built_with_cuda())
        if name not in self._chosen:
            logger.info("aggregate_gradients='auto' chose %r: %s", name, reason)
            self._chosen[name] = _BACKENDS[name]()
        return self._chosen[name]

    @property
    def reduction(self):  # type: ignore[override]
        return self.select().reduction

    def planned_collectives(self, grads_and_vars):
        return self.select().planned_collectives(grads_and_vars)

    def __call__(self, grads_and_vars):
        return self.select()(grads_and_vars)


def get(identifier: str | Aggregator | Callable | None) -> Callable:
    """Returns the aggregator `identifier` names.

    Raises:
      ValueError: an unknown backend name.
      TypeError: neither a name nor a callable.
    """
    if identifier is None or identifier == "auto":
        return AutoAggregator()
    if isinstance(identifier, str):
        try:
            return _BACKENDS[identifier]()
        except KeyError:
            raise ValueError(
                f"`aggregate_gradients` must be one of {list(BACKEND_NAMES)}, an "
                f"`Aggregator`, or a callable. Received: aggregate_gradients={identifier!r}"
            ) from None
    if callable(identifier):
        return identifier
    raise TypeError(
        "`aggregate_gradients` must be a backend name, an `Aggregator` or a callable "
        f"grads_and_vars -> grads_and_vars. Received: aggregate_gradients={identifier!r} "
        f"of type {type(identifier).__name__}"
    )


__all__ = [
    "AggregationError",
    "Aggregator",
    "AutoAggregator",
    "HorovodAggregator",
    "IdentityAggregator",
    "NcclAggregator",
    "StrategyAggregator",
    "BACKEND_NAMES",
    "auto_choice",
    "get",
    "nccl_plan",
]
