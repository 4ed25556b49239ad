"""Aggregation backends and their selection by name.

`get(identifier)` turns what `Optimizer(aggregate_gradients=...)` received into an
`Aggregator`:

* `"auto"` (default): chooses at each step, from the context the step runs in: the
  tf.distribute all-reduce inside a strategy of more than one replica; Horovod when
  `horovod.tensorflow` is imported and initialised with more than one process; otherwise
  the identity.
* `"strategy"`: the tf.distribute all-reduce (`StrategyAggregator`).
* `"horovod"`: Horovod's grouped allreduce (`HorovodAggregator`).
* `"none"`: no aggregation.
* an `Aggregator` instance, or any callable `grads_and_vars -> grads_and_vars`.
"""

from __future__ import annotations

import sys
from typing import Callable

import tensorflow as tf

from dist_minimize.aggregation.base import Aggregator, IdentityAggregator
from dist_minimize.aggregation.horovod import HorovodAggregator
from dist_minimize.aggregation.strategy import StrategyAggregator

_BACKENDS = {
    "strategy": StrategyAggregator,
    "horovod": HorovodAggregator,
    "none": IdentityAggregator,
}
BACKEND_NAMES = ("auto",) + tuple(_BACKENDS)


class AutoAggregator(Aggregator):
    """Chooses the backend from the context each step runs in (see module docstring)."""

    name = "auto"

    def __init__(self):
        self._strategy = StrategyAggregator()
        self._identity = IdentityAggregator()
        self._horovod: HorovodAggregator | None = None

    def select(self) -> Aggregator:
        """Returns the backend this step uses."""
        if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            return self._strategy
        hvd = sys.modules.get("horovod.tensorflow")
        if hvd is not None and _horovod_size(hvd) > 1:
            if self._horovod is None:
                self._horovod = HorovodAggregator()
            return self._horovod
        return self._identity

    @property
    def reduction(self):  # type: ignore[override]
        return self.select().reduction

    def __call__(self, grads_and_vars):
        return self.select()(grads_and_vars)


def _horovod_size(hvd) -> int:
    try:
        return hvd.size() if hvd.is_initialized() else 1
    except (ValueError, AttributeError):
        return 1


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
    "Aggregator",
    "AutoAggregator",
    "HorovodAggregator",
    "IdentityAggregator",
    "StrategyAggregator",
    "BACKEND_NAMES",
    "get",
]
