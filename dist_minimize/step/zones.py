"""Zones of a step where collectives are watched (`dist_minimize.aggregation.exactly_once`): a
thread's stack of zones (`StepContext.zones`), and the error a forbidden collective raises. Low in the package so
that `distribute` can refuse its own collectives inside a forbidding zone too."""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf

from dist_minimize import _compat
from dist_minimize.step.context import CONTEXT

# Horovod's collective ops (op types in a traced graph).
HOROVOD_COLLECTIVES = frozenset((
    "HorovodAllreduce", "HorovodGroupedAllreduce", "HorovodAllgather", "HorovodGroupedAllgather",
    "HorovodBroadcast", "HorovodReducescatter", "HorovodGroupedReducescatter", "HorovodAlltoall"))


class AggregationError(RuntimeError):
    """A step would aggregate gradients more (or otherwise) than planned."""

    # Exception's own constructor: AutoGraph then re-raises this class from a traced
    # step (with its message), instead of a generic StagingError.
    __init__ = Exception.__init__


class ContractError(RuntimeError):
    """A wrapper broke a rule of the wrapper contract (docs/writing-a-wrapper.md)."""

    __init__ = Exception.__init__


class Zone:
    """One watched part of a step: what it is, its planned collectives, whether it forbids
    them, and the fix its error names."""

    def __init__(self, what: str, plan: int | None, forbid: bool, fix: str = ""):
        self.what, self.plan, self.forbid, self.fix = what, plan, forbid, fix
        self.events: list[str] = []


def active() -> bool:
    """Whether this thread is inside a zone."""
    return bool(CONTEXT.zones)


def record(event: str) -> None:
    """Records a collective in this thread's innermost zone (nothing outside zones).

    Raises:
      AggregationError: the innermost zone forbids collectives (its message and fix).
    """
    if not CONTEXT.zones:
        return
    zone = CONTEXT.zones[-1]
    zone.events.append(event)
    if zone.forbid:
        raise AggregationError(f"{zone.what} made a collective: {event}. {zone.fix}.")


@contextlib.contextmanager
def zone(what: str, plan: int | None, forbid: bool, fix: str = "") -> Iterator[Zone]:
    """A zone for the code inside: tf.distribute all-reduces are heard while it runs
    (`_compat.hearing_all_reduce`), and in graph mode the Horovod collective ops it
    created in the current graph are recorded when it ends."""
    entered = Zone(what, plan, forbid, fix)
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    first = len(graph.get_operations()) if graph is not None else 0
    CONTEXT.zones.append(entered)
    try:
        with _compat.hearing_all_reduce():
            yield entered
    finally:
        CONTEXT.zones.pop()
    if graph is not None and graph is tf.compat.v1.get_default_graph():
        for op in graph.get_operations()[first:]:
            if op.type in HOROVOD_COLLECTIVES:
                CONTEXT.zones.append(entered)
                try:
                    record(f"a Horovod {op.type} ({op.name})")
                finally:
                    CONTEXT.zones.pop()
